"""What surrounds the training loop without being part of it: the progress display, the stall watchdog, the garbage
collector's schedule, and the lines a user reads (the first iteration's, one per iteration when not in a terminal).

    with Session(cfg.run, total=cfg.run.steps, run_dir=..., on_stall=logger.close) as session:
        session.beat("iteration 3")          # the watchdog's heartbeat, and the progress bar's status
        session.iteration_done(record)       # the bar, the plain line, the scheduled collection
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from pathlib import Path
from typing import Any, Callable

from earl_jax.progress import process_age_s
from earl_jax.rl.gc_control import GcClock, StartupPause, collect_and_freeze, manual_gc
from earl_jax.rl.progress import Progress
from earl_jax.watchdog import Watchdog

log = logging.getLogger("earl_jax.rl.trainer")


class Session(contextlib.ExitStack):
    def __init__(self, run_cfg, *, total: int, start: int, run_dir: Path, gc_clock: GcClock, enabled: bool,
                 on_stall: Callable[[], None]):
        super().__init__()
        self.cfg, self.total, self.gc_clock = run_cfg, total, gc_clock
        self.bar = Progress(total, enabled=run_cfg.progress and enabled and sys.stderr.isatty())
        self.dog = Watchdog(run_cfg.stall_minutes * 60, f"training in {run_dir}", on_fire=on_stall,
                            hint=f"the newest checkpoint is in {run_dir / 'checkpoints'}: run again with --resume")
        self.started = time.perf_counter()
        self.iterations = 0
        self._start = start

    def __enter__(self) -> "Session":
        super().__enter__()
        self.enter_context(self.bar)
        self.enter_context(self.gc_clock)
        self.enter_context(manual_gc(self.cfg.gc_every))
        self.startup = self.enter_context(StartupPause(self.cfg.gc_every == 0))
        self.enter_context(self.dog)
        self.bar.advance_to(self._start)
        return self

    def beat(self, what: str) -> None:
        """A heartbeat for the watchdog (what the run is doing now) and the bar's status."""
        self.dog.beat(what)
        self.bar.status(what)

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def out_of_time(self) -> bool:
        return bool(self.cfg.max_minutes) and self.elapsed_s / 60 > self.cfg.max_minutes

    def iteration_done(self, step: int, record: dict[str, Any]) -> None:
        """After an iteration's stages: the collector back on after the first, the scheduled collection
        (--run.gc-every), the first iteration's time since the command."""
        t_gc = time.perf_counter()
        self.startup.end()
        if self.cfg.gc_every and step % self.cfg.gc_every == 0:  # every process at the same iteration
            collect_and_freeze()
        record["time/gc_s"] = time.perf_counter() - t_gc
        if not self.iterations:  # what a user waits for: the command to the first finished iteration
            age = process_age_s()
            record["time/command_to_first_iteration_s"] = age
            log.info("first RL iteration finished %.1f s after the command (rollout %.1f s, experience %.1f s, "
                     "train %.1f s, compiles included)", age or float("nan"), record["time/rollout_s"],
                     record["time/experience_s"], record["time/train_s"])
        self.iterations += 1

    def show(self, step: int, record: dict[str, Any]) -> None:
        """The bar in a terminal; elsewhere (logs, CI) one plain line per iteration."""
        self.bar.update(step, record)
        if not self.bar.enabled:
            log.info("iteration %d/%d: return %+.2f, win %.2f, context %.0f, %.2f s (rollout %.2f, experience %.2f, "
                     "train %.2f), meshes %s / %s / %s", step, self.total, record["episode/return_mean"],
                     record["episode/win_rate"], record["rollout/context_len_mean"], record["time/iteration_s"],
                     record["time/rollout_s"], record["time/experience_s"], record["time/train_s"],
                     record["parallel/rollout_mesh"], record["parallel/experience_mesh"], record["parallel/train_mesh"])
