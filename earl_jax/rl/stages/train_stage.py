"""The train stage: PPO epochs of length-grouped policy-gradient updates on the experience batch.

    params, opt_state, metrics = train_stage(run, params, opt_state, experience, dispatcher, ...)

The weights and optimizer state arrive on the train layout (the dispatcher moved them); the experience stage's batch
(`ExperienceResult.batch`) is moved to the train layout's row sharding here. `ppo_mini_batches` optimizer steps a pass,
each on whole GRPO groups; a mini-batch without a scored token makes none (`train/updates` counts the steps). The
same function is what the trainer runs and what the selector's profiler (rl/job/measure.py) times.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from earl_jax.distributed import global_to_host
from earl_jax.parallel.dispatch import Dispatcher
from earl_jax.parallel.planner import StageRun
from earl_jax.rl.algorithm.losses import LossConfig
from earl_jax.rl.algorithm.packing import grouped_update, length_order, micro_batch_plan, mini_batch_rows, rearrange
from earl_jax.rl.stages.experience_stage import ExperienceResult


@dataclasses.dataclass
class TrainState:
    """What training changes: the weights (float32 masters) and AdamW's state; the frozen reference for the KL term."""

    params: Any
    opt_state: Any
    ref_params: Any | None = None

    @classmethod
    def start(cls, policy, params: Any, optimizer: optax.GradientTransformation, *, reference: bool) -> "TrainState":
        """Fresh AdamW state on the train layout; with `reference`, a frozen copy of the weights for the KL term."""
        opt_state = policy.weights.opt_state_for(policy.planner.stage_run("train"), params,
                                                 jax.jit(optimizer.init)(params))
        state = cls(params, opt_state)
        if reference:
            state.rebase_reference()
        return state

    def rebase_reference(self) -> None:
        """The KL term's reference becomes a frozen copy of the current weights (the train stage donates, so
        overwrites, their buffers): at the start, and again after a warm-up changed them."""
        self.ref_params = jax.tree.map(jnp.copy, self.params)


def train_stage(run: StageRun, params: Any, opt_state: Any, experience: ExperienceResult, dispatcher: Dispatcher, *,
                graphdef, loss: LossConfig, optimizer: optax.GradientTransformation, epochs: int, mini_batches: int,
                choice_tokens: tuple[int, ...] = ()) -> tuple[Any, Any, dict[str, float]]:
    """`epochs` passes of `mini_batches` updates on `experience.batch`. Donates `params` and `opt_state`. Metrics: the
    mean over the last epoch's updates, and the batch's dispatch seconds."""
    t0 = time.perf_counter()
    batch, lengths, arranged = experience.batch, experience.lengths, experience.arranged
    batch = dispatcher(batch, jax.tree.map(lambda x: run.row_sharding(x.ndim), batch))
    parts = []  # (mini-batch, its micro-batch plan): each in this layout's arrangement (as many shards)
    for rows in mini_batch_rows(len(lengths), mini_batches, run.batch_shards):
        if not lengths[rows].any():  # no scored token (a partial rollout's carried groups): Adam's momentum alone
            continue  # would move the weights, and the step would cost a full update
        perm = rows[length_order(lengths[rows], run.batch_shards)]
        part = rearrange(run, batch, np.argsort(arranged)[perm])
        parts.append((part, micro_batch_plan(run, lengths[perm], part.tokens.shape[1])))
    if not parts:
        raise ValueError("the train stage got a batch without one scored token")
    jax.block_until_ready([part for part, _ in parts])
    dispatch_s = time.perf_counter() - t0
    for _ in range(epochs):
        updates = []
        for part, (micro, widths, deferred) in parts:
            try:
                params, opt_state, metrics = grouped_update(
                    run, params, opt_state, part, widths, micro, graphdef=graphdef, loss="policy", loss_cfg=loss,
                    optimizer=optimizer, token_weighted=loss.aggregation == "token_mean", choice_tokens=choice_tokens,
                    deferred=deferred)
                jax.block_until_ready(metrics)
            except Exception as e:
                if any(x.is_deleted() for x in jax.tree.leaves(params)):  # donated buffers are gone
                    raise RuntimeError("the train stage failed after donating the weights; resume from the last "
                                       "checkpoint (--resume)") from e
                raise
            updates.append(global_to_host(metrics))
    metrics = {k: float(np.mean([u[k] for u in updates])) for k in updates[0]}
    metrics["dispatch_s"], metrics["updates"] = dispatch_s, float(len(parts) * epochs)
    return params, opt_state, metrics
