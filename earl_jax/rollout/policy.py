"""The model as an agent-loop `Policy`: one sampler state of slots, one jitted sampler call per turn."""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import numpy as np
from flax import nnx

from earl_jax.distributed import global_to_host
from earl_jax.rollout.agent_loop import Decoded
from earl_jax.rollout.sampler import Sampler, SamplingConfig


class SamplerPolicy:
    def __init__(self, sampler: Sampler, params: nnx.State, sampling: SamplingConfig, stop_tokens: Sequence[int],
                 max_new_tokens: int):
        self.sampler, self.params, self.sampling = sampler, params, sampling
        self.stop_tokens, self.max_new_tokens = tuple(stop_tokens), max_new_tokens

    def reset(self, batch: int, max_len: int) -> None:
        self.state = self.sampler.init_state(batch, max_len)
        self.lengths = np.zeros(batch, np.int64)

    def extend(self, tokens: np.ndarray, counts: np.ndarray) -> None:
        counts = np.asarray(counts, np.int32)
        if not counts.any():
            return
        self.state = self.sampler.ensure_capacity(self.state, int((self.lengths + counts).max()))
        self.state = self.sampler.extend(self.params, self.state, tokens, counts)  # it pads to its length bucket
        self.lengths += counts

    def generate(self, budgets: np.ndarray, rng: jax.Array, row_ids: np.ndarray) -> Callable[[], Decoded]:
        self.state = self.sampler.ensure_capacity(self.state, int((self.lengths + budgets).max()))
        self.state, gen = self.sampler.generate(
            self.params, self.state, rng, max_new_tokens=self.max_new_tokens, budget=budgets,
            stop_tokens=self.stop_tokens, sampling=self.sampling, row_ids=row_ids)

        def fetch() -> Decoded:
            # global_to_host: over several processes the rows live on other hosts too (device_get on one)
            tokens, logprobs, counts, stopped = global_to_host((gen.tokens, gen.logprobs, gen.num_tokens, gen.stopped))
            self.lengths += counts
            return Decoded(tokens, logprobs, counts, stopped)

        return fetch

    def take_rows(self, rows: np.ndarray, batch: int) -> None:
        self.state = self.sampler.take_rows(self.state, rows, batch)
        self.lengths = np.concatenate([self.lengths[rows], np.zeros(batch - len(rows), np.int64)])
