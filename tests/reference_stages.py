"""The padded reference the tests compare the product's stages against: experience and train as ONE program each,
every micro-batch at the batch's full width (a `fori_loop` over the same micro-batch steps the product runs).

The product (rl/stages/experience_stage.py, rl/stages/train_stage.py through rl/algorithm/packing.py) runs each
micro-batch at its own width as its own
program; tests check it computes the same numbers as this padded computation (test_packing, test_plan_contract).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from earl_jax.rl.algorithm.losses import LossConfig
from earl_jax.rl.algorithm.micro_steps import (
    ExperienceBatch,
    advantage_step,
    apply_step,
    micro_batch,
    micro_grad,
    micro_logprobs,
    put_micro,
    take_micro,
    zero_acc,
)


def experience_stage(params: nnx.State, ref_params: nnx.State | None, tokens: Int[Array, "n t"],
                     loss_mask: Bool[Array, "n t"], rewards: Float[Array, "n t"], group_ids: Int[Array, " n"],
                     choices: Int[Array, "n t"] | None = None, *, graphdef: nnx.GraphDef, num_groups: int,
                     loss_cfg: LossConfig, micro_batches: int, shards: int, chunk: int,
                     choice_tokens: tuple[int, ...] = ()) -> tuple[ExperienceBatch, dict[str, Array]]:
    """Old-policy (and reference) log-probs, every micro-batch at the full width, then `advantage_step`."""
    width = tokens.shape[1]

    def step(p, j, out):
        tok, ch = micro_batch((tokens, choices), j, micro_batches, shards, width)
        logp = micro_logprobs(p, tok, ch, graphdef=graphdef, chunk=chunk, choice_tokens=choice_tokens)
        return put_micro(out, logp, j, micro_batches=micro_batches, shards=shards)

    def logprobs(p):
        return jax.lax.fori_loop(0, micro_batches, lambda j, o: step(p, j, o), jnp.zeros(tokens.shape, jnp.float32))

    old_logp = logprobs(params)
    ref_logp = logprobs(ref_params) if ref_params is not None else old_logp
    return advantage_step(old_logp, ref_logp, tokens, loss_mask, rewards, group_ids, choices, num_groups=num_groups,
                          loss_cfg=loss_cfg)


def train_stage(params: nnx.State, opt_state: Any, batch: ExperienceBatch, *, graphdef: nnx.GraphDef,
                optimizer: optax.GradientTransformation, loss_cfg: LossConfig, micro_batches: int, shards: int = 1,
                chunk: int, choice_tokens: tuple[int, ...] = ()) -> tuple[nnx.State, Any, dict[str, Array]]:
    """One optimizer step of the policy loss accumulated over `micro_batches` micro-batches at the full width."""
    kw = dict(graphdef=graphdef, loss="policy", loss_cfg=loss_cfg, chunk=chunk, choice_tokens=choice_tokens)
    token_weighted = loss_cfg.aggregation == "token_mean"

    def step(j, acc):
        mb, w = take_micro(batch, j, micro_batches=micro_batches, shards=shards, width=batch.tokens.shape[1],
                           token_weighted=token_weighted)
        return micro_grad(params, acc, mb, w, **kw)

    acc = jax.lax.fori_loop(0, micro_batches, step, zero_acc(params, batch, **kw))
    return apply_step(params, opt_state, acc, optimizer=optimizer)
