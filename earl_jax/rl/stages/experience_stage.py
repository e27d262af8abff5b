"""The experience stage: old-policy (and reference) log-probs by length-grouped micro-batches, then advantages.

The behaviour policy's log-probs are recomputed here (`--loss.behaviour recompute`, the default: what the trainer
scores is then exactly its own numerics) or taken from the sampler (`sampler`: kept with the trajectory, no forward
pass); recomputing, the gap to the sampler's is reported as `experience/logprob_gap_max` / `_mean`.

    batch = rollout_batch(trajectories, constrained, version)               # the rollout's hand-off: RolloutBatch
    result = experience_stage(run, params, ref_params, batch, spans, ...)   # the train's: ExperienceResult

Rows are sorted by length and dealt over the batch shards (rl/algorithm/packing.py), so each micro-batch holds similar
lengths
and runs at the width bucket the planner's program service chooses (parallel/shapes.py); the results equal the padded
computation. The same function is what the trainer
runs and what the selector's profiler (rl/job/measure.py) times.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any

import jax
import numpy as np
from jaxtyping import Array, Bool, Float, Int, jaxtyped

from earl_jax.parallel.planner import StageRun
from earl_jax.rl.algorithm.losses import BEHAVIOUR_LOSSES, LossConfig
from earl_jax.rl.algorithm.micro_steps import ExperienceBatch, advantage_step
from earl_jax.rl.algorithm.packing import batch_width, grouped_logprobs, length_order, micro_batch_plan, rearrange
from earl_jax.rollout.agent_loop import Trajectories
from earl_jax.rollout.process_split import allgather_rows


def pad_cols(x: np.ndarray, width: int) -> np.ndarray:
    return np.pad(x, ((0, 0), (0, width - x.shape[1])))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    """The rollout's hand-off to the experience stage, on the host: the rows it computes on (the batch's, or this
    process's share of a split rollout), every [n, t] column right-padded to one width. `check` holds the fields to
    their annotations (one n, one t), as `experience_stage` does on entry."""

    tokens: Int[np.ndarray, "n t"]
    loss_mask: Bool[np.ndarray, "n t"]  # the policy's answer tokens: the scored ones
    rewards: Float[np.ndarray, "n t"]  # each reward at the token that earned it
    group_ids: Int[np.ndarray, " n"]  # each row's group (the games an estimator compares)
    sampler_logp: Float[np.ndarray, "n t"] | None = None  # the sampler's log-prob of each sampled token
    choices: Int[np.ndarray, "n t"] | None = None  # legal-move bitmask of a constrained move token; None: free text
    # the policy version (train iterations done) of the weights that sampled each scored token (where loss_mask is
    # set); kept on the host: what the staleness bound and its metrics read (rl/stages/staleness.py)
    versions: Int[np.ndarray, "n t"] | None = None

    def check(self) -> RolloutBatch:
        check_fields(self)
        return self

    def columns(self) -> dict[str, np.ndarray]:
        """The arrays the stages compute on by field name, the absent ones and the host's `versions` left out (what
        `StageRun.put_rows` places)."""
        return {f.name: v for f in dataclasses.fields(self)
                if (v := getattr(self, f.name)) is not None and f.name != "versions"}


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_fields(obj: Any) -> None:
    """Each field of the dataclass `obj` against its jaxtyping annotation, the axis names shared by all fields; a
    mismatch raises one line naming the field and every field's dtype and shape."""
    hints = _hints(type(obj))
    with jaxtyped("context"):
        for f in dataclasses.fields(obj):
            if not isinstance(getattr(obj, f.name), hints[f.name]):
                held = ", ".join(f"{g.name} {_describe(getattr(obj, g.name))}" for g in dataclasses.fields(obj))
                raise TypeError(f"{type(obj).__name__}.{f.name} is not {_name(hints[f.name])} ({held})")


def _name(hint: Any) -> str:
    """Float[ndarray, 'n t'] | None, as the annotation reads."""
    if hint is type(None):
        return "None"
    args = typing.get_args(hint)
    return " | ".join(map(_name, args)) if args else getattr(hint, "__name__", str(hint))


def _describe(x: Any) -> str:
    return f"{x.dtype}{list(x.shape)}" if hasattr(x, "shape") else repr(x)


def rollout_batch(traj: Trajectories, constrained: bool, version: int | None = None) -> RolloutBatch:
    """The rows the experience stage computes on: the batch's, or this process's share (`traj.local_rows`).
    `version`: the policy version of the weights that sampled them (None: not recorded)."""
    width = batch_width(traj.tokens.shape[1])
    groups = traj.group_ids if traj.local_rows is None else traj.group_ids[traj.local_rows]
    mask = pad_cols(traj.loss_mask, width)
    versions = None if version is None else np.where(mask, version, -1).astype(np.int32)
    # free-text runs neither move nor keep the (all-zero) legal-move bitmasks
    return RolloutBatch(pad_cols(traj.tokens, width), mask, pad_cols(traj.rewards, width), groups,
                        pad_cols(traj.logprobs, width), pad_cols(traj.choices, width) if constrained else None,
                        versions)


@dataclasses.dataclass(frozen=True)
class ExperienceResult:
    """The experience stage's hand-off to the train stage."""

    batch: ExperienceBatch  # on the experience layout, its rows in the order `arranged`
    metrics: dict[str, Array]  # the advantage step's (filtered_frac, logprob_gap_max / _mean)
    arranged: Int[np.ndarray, " n"]  # batch row i is the rollout's row arranged[i] (`packing.length_order`)
    lengths: Int[np.ndarray, " n"]  # each rollout row's scored span, in the rollout's order


def experience_stage(run: StageRun, params: Any, ref_params: Any | None, batch: RolloutBatch,
                     lengths: Int[np.ndarray, " n"], *, graphdef, loss: LossConfig,
                     num_groups: int, choice_tokens: tuple[int, ...] = (), rows: slice | None = None
                     ) -> ExperienceResult:
    """Old (and reference) log-probs, then advantages, for the rows `batch` holds (weights already on `run`'s
    layout); the result's batch has its rows arranged by `packing.length_order`. `lengths`: each row's scored span
    (`packing.scored_spans`); `rows`: `batch` holds only these rows of the whole (a split rollout's share on this
    process)."""
    arrays = batch.check().columns()
    perm = length_order(lengths, run.batch_shards)
    if rows is not None and run.process_rows(len(lengths)) == rows:
        # each process places its own rows; the arrangement then moves rows device to device
        x = rearrange(run, run.put_process_rows(arrays, len(lengths)), perm)
    else:
        if rows is not None:  # this layout splits rows otherwise (a tensor axis across processes): gather them
            arrays = allgather_rows(arrays)
        x = run.put_rows({k: v[perm] for k, v in arrays.items()})
    kw = dict(graphdef=graphdef, choices=x.get("choices"), choice_tokens=choice_tokens)
    sampled = x.get("sampler_logp")
    if (loss.behaviour == "sampler" or loss.policy_loss in BEHAVIOUR_LOSSES) and sampled is None:
        raise ValueError(f"--loss.behaviour {loss.behaviour} with --loss.policy-loss {loss.policy_loss} needs the "
                         "rollout's log-probs (RolloutBatch.sampler_logp)")
    if loss.behaviour == "sampler" and ref_params is None:  # nothing to score: no forward pass at all
        old = ref_logp = sampled
    else:
        micro, widths, deferred = micro_batch_plan(run, lengths[perm], x["tokens"].shape[1])
        first = params if loss.behaviour == "recompute" else ref_params
        scored = grouped_logprobs(run, first, x["tokens"], widths, micro, deferred=deferred, **kw)
        if loss.behaviour == "sampler":
            old, ref_logp = sampled, scored
        else:
            old = scored
            ref_logp = old if ref_params is None else grouped_logprobs(run, ref_params, x["tokens"], widths, micro,
                                                                       **kw)
    fn = run.jit("advantages", advantage_step, num_groups=num_groups, loss_cfg=loss)
    out = fn(old, ref_logp, x["tokens"], x["loss_mask"], x["rewards"], x["group_ids"], x.get("choices"),
             sampled if loss.behaviour == "recompute" else None,  # the gap is 0 by definition otherwise
             sampled if loss.policy_loss in BEHAVIOUR_LOSSES else None)
    scored_batch, metrics = jax.block_until_ready(out)  # an OOM must surface inside the planner's fallback
    return ExperienceResult(scored_batch, metrics, perm, lengths)
