"""Metrics every iteration to a JSONL file, to wandb (when available) and to a rich progress display."""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from pathlib import Path
from typing import Any, Mapping

import numpy as np

# The names every iteration's record carries (the end-to-end test checks them all).
REQUIRED_METRICS = (
    "step", "episode/return_mean", "eval/win_rate", "eval/draw_rate", "eval/loss_rate", "eval/invalid_rate",
    "rollout/context_len_mean", "rollout/context_len_max", "rollout/tokens", "time/rollout_s",
    "time/experience_s", "time/train_s", "time/dispatch_s", "train/loss", "train/kl", "train/entropy",
    "train/grad_norm", "parallel/rollout_mesh", "parallel/experience_mesh", "parallel/train_mesh",
    "time/gc_pause_s", "time/gc_s", "compile/programs", "compile/lowered", "time/compile_s",
    "compile/ahead", "time/compile_ahead_s", "compile/ahead_failed",
)


def _plain(v: Any) -> Any:
    if isinstance(v, (str, bool)) or v is None:
        return v
    if isinstance(v, (int, np.integer)):
        return int(v)
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    return f if math.isfinite(f) else None  # JSON has no NaN; a missing value is explicit


class MetricsLogger:
    """Writes `metrics.jsonl` in the run folder; wandb mode auto/online/offline/disabled.

    `auto` is online when WANDB_API_KEY is set and offline otherwise. wandb is silent (no banner at start, no
    summary at the end) unless asked for by `online` or by WANDB_SILENT; one line of ours says where the run went.
    wandb missing or failing to start never stops a run: the JSONL file is the record, and the failure is reported
    once.

    Resuming (`resume_step` = the restored checkpoint's step): records past that step were written by
    iterations the checkpoint does not hold, and the resumed run writes them again, so they are dropped
    first; the file then holds each step once. wandb resumes the same run (its id is kept in the run
    folder); wandb itself ignores a step it has already seen, so there the first record of a replayed
    step stays.
    """

    def __init__(self, run_dir: str | Path, config: Mapping[str, Any], *, wandb_mode: str = "auto",
                 project: str = "earl-jax", resume_step: int | None = None, enabled: bool = True,
                 write_config: bool = False):
        """`write_config`: also (re)write the run's config.json, what --resume restores."""
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self._wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if write_config:
            (self.path.parent / "config.json").write_text(json.dumps(dict(config), indent=1))
        if resume_step is not None and self.path.exists():
            kept = [r for r in read_metrics(self.path) if int(r.get("step", 0)) <= resume_step]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            tmp.replace(self.path)
        self._file = open(self.path, "a" if resume_step is not None else "w")
        mode = wandb_mode
        if mode == "auto":
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        if mode != "disabled":
            try:
                import wandb

                id_file = Path(run_dir) / "wandb_run_id"
                run_id = id_file.read_text().strip() if resume_step is not None and id_file.exists() else None
                quiet = wandb_mode != "online" and "WANDB_SILENT" not in os.environ
                self._wandb = wandb.init(project=project, config=dict(config), mode=mode, dir=str(run_dir),
                                         name=Path(run_dir).name, id=run_id, resume="allow" if run_id else None,
                                         settings=wandb.Settings(silent=True) if quiet else None)
                id_file.write_text(self._wandb.id)
                if quiet:
                    where = (self._wandb.url if mode == "online" else
                             f"offline in {Path(self._wandb.dir).parent} (`wandb sync` that folder uploads it)")
                    logging.getLogger("earl_jax.rl.loop.metrics").info("wandb: %s", where)
            except Exception as e:  # a logging backend must not take the run down with it
                warnings.warn(f"wandb disabled for this run ({type(e).__name__}: {e}); metrics go to {self.path}")

    def log(self, record: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: _plain(v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in clean.items() if v is not None}, step=int(record["step"]))

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------------ an iteration's record

def iteration_record(step: int, traj, times: Mapping[str, float], exp_metrics: Mapping[str, Any],
                     train_metrics: Mapping[str, float], *, turn_tokens: int, num_devices: int, epochs: int,
                     decode_groups: int, no_signal: int, dispatch_bytes: int) -> dict[str, Any]:
    """What one iteration did: outcomes, contexts, stage times, throughput (EARL's tokens per device per second) and
    every metric of the train stage (`train_metrics`: loss, grad_norm, skipped, and what `losses.policy_loss`
    reports). `times`: rollout, experience, train, dispatch and iteration seconds."""
    s = traj.stats
    t_roll, t_exp, t_train, t_iter = (max(times[k], 1e-9) for k in ("rollout", "experience", "train", "iteration"))
    return {
        "step": step,
        "episode/return_mean": float(traj.returns.mean() if traj.played is None else traj.returns[traj.played].mean()),
        "episode/win_rate": s.win_rate, "episode/invalid_rate": s.invalid_rate,
        "episode/turns_mean": s.turns_mean, "episode/truncated_rate": s.truncated_rate,
        **({} if s.blunder_rate is None else {"rollout/blunder_rate": s.blunder_rate}),
        "rollout/context_len_mean": s.context_len_mean, "rollout/context_len_max": s.context_len_max,
        "rollout/turn_tokens": turn_tokens, "rollout/turn_context_len_mean": s.turn_context_len_mean,
        "rollout/tokens": s.tokens, "rollout/generated_tokens": s.generated_tokens,
        "rollout/env_frac": s.env_s / max(s.rollout_s, 1e-9), "rollout/wait_frac": s.wait_s / max(s.rollout_s, 1e-9),
        "rollout/decode_rows": s.decode_rows, "rollout/groups": decode_groups,
        # decode rows that held a game decoding (a pool of games, --rollout.slots: while games waited)
        "rollout/occupancy": s.busy_rows / max(s.decode_rows, 1),
        **({} if s.pool_occupancy is None else {"rollout/pool_occupancy": s.pool_occupancy}),
        # cache positions holding a decoding game's context over those allocated: 1 - this, a paged cache's saving
        **({"rollout/kv_used_frac": s.kv_used / s.kv_allocated} if s.kv_allocated else {}),
        "rollout/preempted": s.preempted,  # games a paged cache's pool sent back to wait for pages (--rollout.kv-pages)
        **({} if s.draft_proposed is None else {
            "rollout/draft_proposed": s.draft_proposed, "rollout/draft_accepted": s.draft_accepted,
            "rollout/draft_acceptance": s.draft_accepted / max(s.draft_proposed, 1)}),
        "rollout/gather_frac": s.gather_s / max(s.rollout_s, 1e-9),
        "rollout/gather_wait_frac": s.gather_wait_s / max(s.rollout_s, 1e-9),
        # each process's own games (a rollout split by process; one process: the rollout itself)
        "rollout/process_min_s": min(s.process_rollout_s or (s.rollout_s,)),
        "rollout/process_max_s": max(s.process_rollout_s or (s.rollout_s,)),
        "time/rollout_s": s.rollout_s, "time/experience_s": times["experience"], "time/train_s": times["train"],
        "time/dispatch_s": times["dispatch"], "time/iteration_s": times["iteration"],
        # generated tokens in the rollout; the batch's real (unpadded) tokens in experience, train and the iteration
        "throughput/rollout_tgs": s.generated_tokens / max(s.rollout_s, 1e-9) / num_devices,
        "throughput/experience_tgs": s.tokens / t_exp / num_devices,
        "throughput/train_tgs": s.tokens * epochs / t_train / num_devices,
        "throughput/iteration_tgs": s.tokens / t_iter / num_devices,
        "time/dispatch_share": times["dispatch"] / t_iter,
        # every metric of the train stage as train/<name>: the update's, policy_loss's and the registered loss's own
        # (ppo_clip's clip_frac; a loss without a clip reports none)
        **{f"train/{k}": v for k, v in train_metrics.items()},
        "train/filtered_frac": float(exp_metrics.get("filtered_frac", 0.0)),
        **{f"experience/{k}": float(v) for k, v in exp_metrics.items() if k != "filtered_frac"},
        "train/no_signal_iters": no_signal,
        "dispatch/bytes": dispatch_bytes,
    }


class NoSignal:
    """Iterations in a row with a zero gradient (every advantage 0: every group constant or filtered). The weights then
    stay where they are until some group's rewards vary again, so a collapsed policy stays collapsed: said once and
    every 10th iteration after."""

    def __init__(self):
        self.count = 0

    def __call__(self, step: int, grad_norm: float, filtered_frac) -> int:
        import warnings

        self.count = self.count + 1 if grad_norm == 0.0 else 0
        if self.count % 10 == 1:
            warnings.warn(f"iteration {step}: no learning signal for {self.count} iteration(s) in a row (zero "
                          f"gradient; {float(filtered_frac):.0%} of games in constant groups); see "
                          "--loss.entropy-floor and --loss.between-group-weight", RuntimeWarning, stacklevel=3)
        return self.count


class CompileStats:
    """`compile_metrics`, and one warning line per compile-ahead failure (a miss only: the real call compiles)."""

    def __init__(self):
        self.failed_seen = 0

    def __call__(self, compiles, programs: int, decode_programs: int, gc_pause_s: float, aheads: list) -> dict:
        failed = [f for a in aheads for f in a.failed]
        if len(failed) > self.failed_seen:
            logging.getLogger("earl_jax.rl.loop.trainer").warning(
                "compiling ahead failed for %d program(s), e.g. %s: %s", len(failed) - self.failed_seen,
                *failed[self.failed_seen])
            self.failed_seen = len(failed)
        return compile_metrics(compiles, programs, decode_programs, gc_pause_s, aheads)


def compile_metrics(compiles, programs: int, decode_programs: int, gc_pause_s: float, aheads: list) -> dict[str, Any]:
    """Compiled programs, this iteration's compiles and collector pauses, the most of any process: each process of a
    split rollout compiles for its own games' shapes and pauses on its own (one slow process holds up the others)."""
    import jax

    from earl_jax.distributed import gather_ints

    mine = (decode_programs, round(gc_pause_s * 1e6), compiles.lowered, round(compiles.backend_s * 1e6))
    rows = gather_ints(*mine) if jax.process_count() > 1 else [mine]
    decode, paused_us, lowered, compile_us = (max(col) for col in zip(*rows))
    return {"compile/programs": programs + decode, "time/gc_pause_s": paused_us / 1e6,
            "compile/lowered": lowered, "time/compile_s": compile_us / 1e6,
            # this process's tracing and lowering (foreground): the part of a start no compile cache saves
            "time/trace_s": compiles.trace_s, "time/lower_s": compiles.lower_s,
            "compile/slowest": compiles.slowest(),  # names to look for when an iteration is slow
            # this process's compiles on compile-ahead threads (rollout/compile_ahead.py)
            "compile/ahead": compiles.ahead, "time/compile_ahead_s": compiles.ahead_s,
            "compile/ahead_failed": sum(len(a.failed) for a in aheads),
            # of the programs submitted so far, those a real call then asked for (the rest was a wrong guess)
            "compile/ahead_submitted": sum(a.submitted for a in aheads),
            "compile/ahead_used": sum(len(a.used) for a in aheads),
            "time/compile_ahead_waited_s": sum(a.waited_s for a in aheads)}


def opponent_metrics(traj, mix_games: np.ndarray | None, league: tuple | None, env) -> dict[str, Any]:
    """Outcomes against --curriculum.mix-opponent (or the rehearsed rung) and against the league's frozen snapshot,
    apart from the other games."""
    out: dict[str, Any] = {}
    won = np.array([w == "agent" for w in traj.winners])
    if mix_games is not None:
        drew = np.array([w == "draw" for w in traj.winners])
        out.update({"mix/games_frac": float(mix_games.mean()), "mix/win_rate": float(won[mix_games].mean()),
                    "mix/draw_rate": float(drew[mix_games].mean()), "mix/other_win_rate": float(won[~mix_games].mean()),
                    "mix/other_draw_rate": float(drew[~mix_games].mean())})
    if league is not None:
        games, snap_step, _ = league
        out.update({"league/games_frac": float(games.mean()), "league/snapshot_step": snap_step,
                    "league/win_rate": float(won[games].mean()),
                    "league/scripted_win_rate": float(won[~games].mean()) if (~games).any() else float("nan"),
                    "league/opponent_fallback_rate": env.policy_fallbacks / max(env.policy_moves, 1)})
    return out


def device_memory() -> dict[str, float]:
    """Largest bytes in use / peak / limit over this process's devices, in GiB (GPU, TPU; {} on CPU)."""
    import jax

    from earl_jax.parallel.memory import device_memory_stats

    stats = [device_memory_stats(d) for d in jax.local_devices()]
    out = {}
    for key, name in (("bytes_in_use", "in_use_gib"), ("peak_bytes_in_use", "peak_gib"), ("bytes_limit", "limit_gib")):
        vals = [st[key] for st in stats if key in st]
        if vals:
            out[f"memory/{name}"] = max(vals) / 2**30
    return out


def trainer_record(trainer, done, batch, times: dict[str, float], exp_metrics: dict[str, Any],
                   train_metrics: dict[str, Any], compiles, *, no_signal, dispatch_bytes: int) -> dict[str, Any]:
    """A `Trainer.iteration`'s record of the batch `done` (rl/stages/staleness.py's `Sampled`; `batch` its
    RolloutBatch):
    `iteration_record`, the batch's staleness, then the rollout's pipeline, the compiles (and those compiled ahead),
    the layouts that ran (with rollouts ahead, the one that sampled this batch), device memory, the opponents played
    and a text task's episode log."""
    from earl_jax.rl.stages.staleness import staleness_metrics

    t, cfg, traj, league = trainer, trainer.cfg, done.traj, done.league
    planner = t.policy.planner
    record = iteration_record(t.step, traj, times, exp_metrics, train_metrics,
                              turn_tokens=cfg.rollout.turn_tokens(t.step - 1), num_devices=len(planner.devices),
                              epochs=cfg.optim.ppo_epochs, decode_groups=t.rollout.decode_groups,
                              no_signal=no_signal, dispatch_bytes=dispatch_bytes)
    compile_metrics = t._compile_stats(compiles, len(planner.programs), t.rollout.compile_count, t._gc.take(),
                                       planner.shapes.queues())
    return {**record, **staleness_metrics(batch, t.step - 1), "rollout/pipeline_groups": t.rollout.pipeline_groups,
            **compile_metrics, **planner.ran_log_dict(), **(t.overlap.log_dict(done) if t.overlap else {}),
            **device_memory(), **t.matchmaker.metrics(), **opponent_metrics(traj, done.mix_games, league, t.env),
            **(t.task.train_log.drain("task") if t.task else {}), **done.metrics}
