"""A multi-process rollout where each process plays its own share of the games.

In one SPMD rollout over a mesh that spans processes every process steps *every* game on its host (the
decode program's inputs are global arrays, so each process holds the whole batch) and the device work is
sharded: the host work, which decides the speed of a small model's rollout, is repeated on every process
instead of split. This module splits it, the way veRL's or tunix's rollout workers each run their own
environments: when the rollout mesh's data axis runs across processes and every process's devices hold
whole copies of the weights (their block of the mesh is a complete model replica), process p plays games
[p n/P, (p+1) n/P) alone, on its own block of the mesh, with no collective during the rollout. Then one small
all-gather (`gather_trajectories`) gives every process the whole batch's per-row fields (outcomes,
lengths, spans, group ids) and statistics, while each process keeps its rows' token columns: the experience
stage puts them on its mesh from their own process and arranges the batch device to device, so no process
receives another's tokens over the hosts (a layout whose rows do not split by process gathers them instead).

A game's samples come from fold_in(fold_in(rng, turn), game id) with its id in the whole batch
(`play_games(game_offset=...)`) and its start from its seed, so the games are the ones one process would
play, up to the decode programs' numerics on the smaller mesh (the same on CPU: the two-process test
compares them exactly).

Measured (4 x H100, one process per GPU, tiny model, 2048 games): a
process's own 512 games take ~0.16 s, but in the first ~15 iterations one process often runs 1-6 s and the
others wait in the gather: it is compiling, for a batch size, cache length or width its games reach first
(`time/compile_s`, `compile/slowest`), not collecting garbage (`--run.gc-every 1` left those iterations slow). In the
iterations that compiled nothing the split rollout took 0.23 s against 0.36 s on one GPU (1.54x), a third of it
the gather. With the token columns left on their process: 0.198 s against 0.325 s (1.64x), the whole
iteration 1.48x one GPU's, against 1.11x / 1.18x with the columns all-gathered in the same command; the unsplit
rollout measured 0.83x / 1.42x one GPU's, in an earlier command (not side by side). So it is on by default
(`--rollout.split-processes false` turns it off).

Not split (the SPMD rollout, with host work repeated): a data axis within one process, weights sharded
over the data axis, a batch that does not divide into processes, and league games (the frozen snapshot's
games are assigned over the whole env).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from earl_jax.distributed import gather_ints
from earl_jax.envs.outcomes import NO_WINNER, WINNERS
from earl_jax.rollout.agent_loop import RolloutStats, Trajectories, episode_stats
from earl_jax.rollout.buckets import scored_spans

__all__ = ["ProcessBlock", "process_block", "RowView", "gather_trajectories", "allgather_rows"]


@dataclasses.dataclass(frozen=True)
class ProcessBlock:
    """This process's part of a split rollout: its block of the mesh, its weights there, its games."""

    mesh: Mesh
    params: Any
    games: slice


def _spec_axes(spec) -> set[str]:
    out: set[str] = set()
    for entry in spec:
        if entry is not None:
            out.update((entry,) if isinstance(entry, str) else entry)
    return out


def process_block(mesh: Mesh, params: Any, games: int) -> ProcessBlock | None:
    """Split the rollout by process, or None (the SPMD rollout): see the module docstring for when."""
    n_proc = jax.process_count()
    if n_proc < 2 or games % n_proc:
        return None
    owner = np.vectorize(lambda d: d.process_index)(mesh.devices).reshape(mesh.devices.shape[0], -1)
    if not (owner == owner[:, :1]).all():  # a slice of the data axis spans processes (e.g. tensor across hosts)
        return None
    mine = owner[:, 0] == jax.process_index()
    if np.bincount(owner[:, 0], minlength=n_proc).tolist() != [mine.sum()] * n_proc:
        return None
    data_axis = mesh.axis_names[0]
    for x in jax.tree.leaves(params):
        if not (isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh
                and data_axis not in _spec_axes(x.sharding.spec)):
            return None
    local = Mesh(mesh.devices[mine], mesh.axis_names)

    def view(x: jax.Array) -> jax.Array:  # the same buffers, as an array of the process's block
        return jax.make_array_from_single_device_arrays(x.shape, NamedSharding(local, x.sharding.spec),
                                                        [s.data for s in x.addressable_shards])

    per = games // n_proc
    start = jax.process_index() * per
    return ProcessBlock(local, jax.tree.map(view, params), slice(start, start + per))


class RowView:
    """Rows [start, stop) of a vector env, as a vector env of its own (what `play_games` steps)."""

    def __init__(self, env: Any, rows: slice):
        self.env, self.start, self.num_games = env, rows.start, rows.stop - rows.start

    def __getattr__(self, name: str) -> Any:  # num_actions, accepts_moves, ...
        return getattr(self.env, name)

    def reset(self, seeds: Sequence[int | None], rows: Sequence[int] | None = None, **kw):
        rows = np.arange(self.num_games) if rows is None else np.asarray(rows)
        return self.env.reset(seeds, rows=rows + self.start, **kw)

    def step(self, rows: Sequence[int], answers: Sequence[str] | None = None, **kw):
        return self.env.step(np.asarray(rows) + self.start, answers, **kw)


_COLS = ("tokens", "loss_mask", "logprobs", "choices", "rewards")
_ROWS = ("lengths", "returns", "num_turns", "truncated", "group_ids", "invalid")
# per-process times (seconds), gathered as int32 microseconds
_TIMES = ("env_s", "wait_s", "rollout_s")


def _round_up(x: int, k: int) -> int:
    return -(-x // k) * k


def allgather_rows(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every process's rows of each array (the same shapes on every process), concatenated in process order (a
    collective). Bools travel as int8: a collective over booleans is not supported everywhere."""
    from jax.experimental import multihost_utils

    sent = {k: v.astype(np.int8) if v.dtype == bool else v for k, v in arrays.items()}
    got = multihost_utils.process_allgather(sent, tiled=True)
    return {k: np.asarray(got[k]).astype(arrays[k].dtype) for k in arrays}


def gather_trajectories(local: Trajectories) -> Trajectories:
    """The whole batch's per-row fields and statistics from every process's share, in process order, on every
    process (collectives); the [n, t] token columns stay where they are.

    Every per-row field (outcomes, lengths, turns, group ids, scored spans) covers the whole batch, and the columns
    hold this process's rows only (`Trajectories.local_rows`), padded to the batch's width. The experience stage puts
    them on its mesh from each process and arranges them there, device to device (`Trainer._experience`), so the
    bulk of the batch never crosses the hosts; an all-gather of the columns took ~0.09 s of a 0.28 s split rollout
    on 4 H100s.

    Outcomes, lengths and token counts are recomputed from the whole batch. `rollout_s` is this process's wall
    time: its own games, then the gather (`gather_s`), which waits for the slowest process (`gather_wait_s`)
    and moves the data; `process_rollout_s` holds every process's own time. `env_s` and `wait_s` are the
    processes' means (their fractions of `rollout_s` stay comparable with one process), `decode_rows`, `busy_rows`,
    the blunder and the answer-token counts are sums (a pool's occupancy and the KV counts are this process's), the
    prompt / observation widths maxima."""
    t0 = time.perf_counter()
    s = local.stats
    turns = max(max((len(t) for t in local.turn_context_lens), default=0), 1)
    judged = s.judged
    blunders = round((s.blunder_rate or 0.0) * judged)
    micro = [round(getattr(s, k) * 1e6) for k in _TIMES]  # int32 microseconds: up to ~35 minutes
    rows = gather_ints(local.tokens.shape[1], turns, s.decode_rows, s.prompt_tokens, s.first_cache_len,
                       s.observation_tokens, judged, blunders, *micro, s.busy_rows, s.answer_tokens)
    t_synced = time.perf_counter()  # every process has finished its games
    width = max(r[0] for r in rows)  # the widest game's width, as play_games returns it
    # rounded up: process_allgather compiles a program per shape (a new one every iteration cost ~1 s on 4 H100s)
    turns = _round_up(max(r[1] for r in rows), 8)

    ctx = np.full((local.num_games, turns), -1, np.int32)
    for i, t in enumerate(local.turn_context_lens):
        ctx[i, :len(t)] = t
    winners = np.array([NO_WINNER if w is None else WINNERS.index(w) for w in local.winners], np.int8)
    per_row = {**{k: getattr(local, k) for k in _ROWS}, "turn_ctx": ctx, "winner": winners,
               "spans": scored_spans(local.loss_mask).astype(np.int32),
               "generated": local.loss_mask.sum(1).astype(np.int32)}
    got = allgather_rows(per_row)

    total_judged, total_blunders = sum(r[6] for r in rows), sum(r[7] for r in rows)
    times = np.array([r[8:8 + len(_TIMES)] for r in rows], np.float64) / 1e6
    gather_s = time.perf_counter() - t0
    stats = RolloutStats(
        **episode_stats(got["winner"], got["invalid"], got["lengths"], got["turn_ctx"], got["num_turns"],
                        got["truncated"], got["generated"]),
        env_s=float(times[:, 0].mean()), wait_s=float(times[:, 1].mean()),
        rollout_s=s.rollout_s + gather_s, gather_s=gather_s, gather_wait_s=t_synced - t0,
        process_rollout_s=tuple(times[:, 2].tolist()),
        decode_rows=sum(r[2] for r in rows), busy_rows=sum(r[-2] for r in rows), prompt_tokens=max(r[3] for r in rows),
        first_cache_len=max(r[4] for r in rows), observation_tokens=max(r[5] for r in rows),
        blunder_rate=total_blunders / total_judged if total_judged else None, judged=total_judged,
        pool_occupancy=s.pool_occupancy, answer_tokens=sum(r[-1] for r in rows), kv_used=s.kv_used,
        kv_allocated=s.kv_allocated)
    start = jax.process_index() * local.num_games  # process_block gives every process an equal share
    return Trajectories(
        **{k: np.pad(getattr(local, k), ((0, 0), (0, width - local.tokens.shape[1]))) for k in _COLS},
        **{k: got[k] for k in _ROWS},
        winners=[None if w == NO_WINNER else WINNERS[w] for w in got["winner"].tolist()],
        turn_context_lens=[row[row >= 0].tolist() for row in got["turn_ctx"]], stats=stats,
        local_rows=slice(start, start + local.num_games), spans=got["spans"])
