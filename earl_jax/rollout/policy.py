"""The model as an agent-loop `Policy`: host token lists in, one jitted sampler call per turn."""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from flax import nnx

from earl_jax.distributed import global_to_host
from earl_jax.rollout.sampler import Sampler, SamplingConfig


class SamplerPolicy:
    def __init__(self, sampler: Sampler, params: nnx.State, sampling: SamplingConfig, stop_tokens: Sequence[int],
                 max_new_tokens: int):
        self.sampler, self.params, self.sampling = sampler, params, sampling
        self.stop_tokens, self.max_new_tokens = tuple(stop_tokens), max_new_tokens

    def reset(self, batch: int, max_len: int) -> None:
        self.state = self.sampler.init_state(batch, max_len)
        self.lengths = np.zeros(batch, np.int64)

    def extend(self, new_tokens: Sequence[Sequence[int]]) -> None:
        num_new = np.array([len(t) for t in new_tokens], np.int32)
        if not num_new.any():
            return
        toks = np.zeros((len(new_tokens), int(num_new.max())), np.int32)  # the sampler pads to its bucket
        for i, t in enumerate(new_tokens):
            toks[i, :len(t)] = t
        self.state = self.sampler.ensure_capacity(self.state, int((self.lengths + num_new).max()))
        self.state = self.sampler.extend(self.params, self.state, toks, num_new)
        self.lengths += num_new

    def generate(self, budgets: np.ndarray, rng: jax.Array):
        self.state = self.sampler.ensure_capacity(self.state, int((self.lengths + budgets).max()))
        self.state, gen = self.sampler.generate(
            self.params, self.state, rng, max_new_tokens=self.max_new_tokens, budget=budgets,
            stop_tokens=self.stop_tokens, sampling=self.sampling)
        # global_to_host: over several processes the rows live on other hosts too (device_get on one)
        tokens, logprobs, counts, stopped = global_to_host((gen.tokens, gen.logprobs, gen.num_tokens, gen.stopped))
        self.lengths += counts
        return [(tokens[i, :counts[i]].tolist(), logprobs[i, :counts[i]].tolist(), bool(stopped[i]))
                for i in range(len(budgets))]
