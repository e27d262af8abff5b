"""The experience stage: old-policy (and reference) log-probs by length-grouped micro-batches, then advantages.

The behaviour policy's log-probs are recomputed here (`--loss.behaviour recompute`, the default: what the trainer
scores is then exactly its own numerics) or taken from the sampler (`sampler`: kept with the trajectory, no forward
pass); recomputing, the gap to the sampler's is reported as `experience/logprob_gap_max` / `_mean`.

    batch, metrics, arranged = experience_stage(run, params, ref_params, arrays, spans, widths, ...)

Rows are sorted by length and dealt over the batch shards (rl/packing.py), so each micro-batch holds similar lengths
and runs at its own width bucket; the results equal the padded computation. The same function is what the trainer
runs and what the selector's profiler (rl/measure.py) times.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jaxtyping import Int

from earl_jax.parallel.planner import StageRun
from earl_jax.rl.losses import LossConfig
from earl_jax.rl.packing import batch_width, grouped_logprobs, length_order, length_split, limit_new_widths, rearrange
from earl_jax.rl.stages import ExperienceBatch, advantage_step
from earl_jax.rollout.agent_loop import Trajectories
from earl_jax.rollout.compile_ahead import CompileAhead
from earl_jax.rollout.process_split import allgather_rows


def pad_cols(x: np.ndarray, width: int) -> np.ndarray:
    return np.pad(x, ((0, 0), (0, width - x.shape[1])))


def batch_arrays(traj: Trajectories, constrained: bool) -> dict[str, np.ndarray]:
    """The rows the experience stage computes on: the batch's, or this process's share (`traj.local_rows`)."""
    width = batch_width(traj.tokens.shape[1])
    groups = traj.group_ids if traj.local_rows is None else traj.group_ids[traj.local_rows]
    arrays = {"tokens": pad_cols(traj.tokens, width), "loss_mask": pad_cols(traj.loss_mask, width),
              "rewards": pad_cols(traj.rewards, width), "sampler_logp": pad_cols(traj.logprobs, width),
              "group_ids": groups}
    if constrained:  # free-text runs neither move nor keep the (all-zero) legal-move bitmasks
        arrays["choices"] = pad_cols(traj.choices, width)
    return arrays


class WidthBudget:
    """Which micro-batch shapes (rows, width) each stage program runs at this iteration.

    Without compile-ahead (the CPU): `packing.length_split`, then at most `new_per_iteration` widths its programs have
    not run at yet (the rest run padded to a wider one: same results, fewer compiles at once).

    With compile-ahead (`ahead`, accelerators): the shapes a run meets are bounded and compiled before they are
    needed. The rows are the plan's micro-batch (no finer split: each row count is a family of programs, 15-30 s each
    for a 1.5B model); a micro-batch runs at the narrowest width already compiled (or compiling) that holds it, and
    the narrower widths it wanted compile in the background for the next iterations. A new program compiles in the
    foreground only when the batch is wider than every compiled width (a new context bucket): once, the widest."""

    def __init__(self, new_per_iteration: int, enabled: bool, ahead: CompileAhead | None):
        self.new_per_iteration, self.enabled, self.ahead = new_per_iteration, enabled, ahead
        # widths each (stage, mesh, rows, shards, chunk) program has run at (or, compiling ahead, was submitted at)
        self.run_at: dict[tuple, set[int]] = {}
        self.widest = 0  # the widest batch so far (compiling ahead, batches are padded to it)

    def pad_batch(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Compiling ahead, a batch is padded to the widest batch of the run so far: the programs that take the whole
        batch (cutting micro-batches, writing log-probs back, advantages, the plan itself) keep one shape, and a
        micro-batch can run at any compiled width up to it. Padding columns change no result (causal attention)."""
        if self.ahead is None:
            return arrays
        self.widest = max(self.widest, arrays["tokens"].shape[1])
        return {k: pad_cols(v, self.widest) if v.ndim == 2 else v for k, v in arrays.items()}

    def split(self, run: StageRun, arranged_lengths: Int[np.ndarray, " n"], shape: tuple[int, ...]):
        """(micro-batches, width per micro-batch, the compile-ahead queue and deferred widths or None)."""
        micro, wanted = length_split(run, arranged_lengths, shape[1], self.enabled and self.ahead is None)
        key = (run.stage, str(run.layout.mesh), micro.rows, micro.shards, run.layout.logprob_chunk)
        seen = self.run_at.setdefault(key, set())
        if self.ahead is None:
            widths = limit_new_widths(wanted, seen, self.new_per_iteration)
            seen.update(widths)
            return micro, widths, None
        if seen and max(seen) >= max(wanted):  # every micro-batch fits a width compiled or compiling: no new program
            widths = [min(a for a in seen if a >= w) for w in wanted]
        else:  # wider than anything compiled: one new program, the widest
            widths = limit_new_widths(wanted, seen, 1)
        deferred = sorted(set(wanted) - set(widths) - seen)
        seen.update(widths, deferred)  # the deferred ones compile now, in the background
        return micro, widths, (self.ahead, deferred)


def experience_stage(run: StageRun, params: Any, ref_params: Any | None, arrays: dict[str, np.ndarray],
                     lengths: Int[np.ndarray, " n"], widths: WidthBudget, *, graphdef, loss: LossConfig,
                     num_groups: int, choice_tokens: tuple[int, ...] = (), rows: slice | None = None
                     ) -> tuple[ExperienceBatch, dict, np.ndarray]:
    """Old (and reference) log-probs, then advantages, for the rows `arrays` hold (weights already on `run`'s
    layout). Returns the batch with its rows arranged by `packing.length_order` and that arrangement. `lengths`:
    each row's scored span (`packing.scored_spans`); `rows`: `arrays` hold only these rows of the batch (a split
    rollout's share on this process)."""
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
    if loss.behaviour == "sampler" and sampled is None:
        raise ValueError("--loss.behaviour sampler needs the rollout's log-probs (arrays['sampler_logp'])")
    if loss.behaviour == "sampler" and ref_params is None:  # nothing to score: no forward pass at all
        old = ref_logp = sampled
    else:
        micro, width_list, ahead = widths.split(run, lengths[perm], x["tokens"].shape)
        first = params if loss.behaviour == "recompute" else ref_params
        scored = grouped_logprobs(run, first, x["tokens"], width_list, micro, ahead=ahead, **kw)
        if loss.behaviour == "sampler":
            old, ref_logp = sampled, scored
        else:
            old = scored
            ref_logp = old if ref_params is None else grouped_logprobs(run, ref_params, x["tokens"], width_list,
                                                                       micro, **kw)
    fn = run.jit("advantages", advantage_step, num_groups=num_groups, loss_cfg=loss)
    out = fn(old, ref_logp, x["tokens"], x["loss_mask"], x["rewards"], x["group_ids"], x.get("choices"),
             sampled if loss.behaviour == "recompute" else None)  # the gap is 0 by definition otherwise
    return (*jax.block_until_ready(out), perm)  # an OOM must surface inside the planner's fallback
