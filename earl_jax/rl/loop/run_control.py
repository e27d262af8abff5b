"""What surrounds the training loop without being part of it: stop signals, the progress display, the stall
watchdog, the garbage collector's schedule, and the lines a user reads.

    with RunControl(cfg.run, total=cfg.run.steps, ...) as control:
        control.beat("iteration 3")          # the watchdog's heartbeat, and the progress bar's status
        control.stop_point()                 # raises StopRun once SIGTERM / SIGINT arrived (every process agrees)
        control.iteration_done(step, record) # the scheduled collection, the first iteration's line
        control.checkpoint_due(step, last)   # by --run.checkpoint-every, --run.checkpoint-minutes

Stopping: SIGTERM (what schedulers send before they kill) or Ctrl-C sets a flag; the loop abandons the iteration in
progress at its next stop point (each host turn of a rollout, between stages) unless the train stage already began
(its updates donate the weights: it finishes), writes a checkpoint of the last finished iteration and exits with one
line. A second Ctrl-C exits at once. In a multi-process job the processes agree at every stop point (one small
all-gather), so they all stop after the same iteration and save the same step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from earl_jax.progress import ProgressBar, process_age_s
from earl_jax.rl.loop.gc_control import GcClock, StartupPause, collect_and_freeze, manual_gc
from earl_jax.watchdog import Watchdog

log = logging.getLogger("earl_jax.rl.loop.trainer")
EXIT_CODES = {"SIGTERM": 128 + signal.SIGTERM, "SIGINT": 128 + signal.SIGINT}  # what a shell reports for each


class StopRun(Exception):
    """A stop signal arrived: abandon the iteration in progress (nothing of it has changed the weights)."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


class RunControl(contextlib.ExitStack):
    def __init__(self, run_cfg, *, total: int, start: int, run_dir: Path, gc_clock: GcClock, enabled: bool,
                 on_stall: Callable[[], None], elapsed_before_s: float = 0.0):
        """`elapsed_before_s`: the run's time in the training loop before this process (earlier parts of a resumed
        run, from the checkpoint): --run.max-minutes and the schedules over it count the run's time, all parts."""
        super().__init__()
        self.elapsed_before_s = elapsed_before_s
        self.cfg, self.total, self.gc_clock = run_cfg, total, gc_clock
        self.bar = ProgressBar(total, enabled=run_cfg.progress and enabled and sys.stderr.isatty())
        self.dog = Watchdog(run_cfg.stall_minutes * 60, f"training in {run_dir}", on_fire=on_stall,
                            hint=f"the newest checkpoint is in {run_dir / 'checkpoints'}: run again with --resume")
        self.started = self.last_checkpoint = time.perf_counter()
        self.iterations = 0
        self._start = start
        self.requested: str | None = None  # the signal that asked to stop
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "RunControl":
        super().__enter__()
        self.enter_context(self.bar)
        self.enter_context(self.gc_clock)
        self.enter_context(manual_gc(self.cfg.gc_every))
        self.startup = self.enter_context(StartupPause(self.cfg.gc_every == 0))
        self.enter_context(self.dog)
        self.bar.advance_to(self._start)
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread only
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._on_signal)
            self.callback(self._restore_signals)
        return self

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None and signum == signal.SIGINT:  # a second Ctrl-C: out now, no checkpoint
            print("\nsecond interrupt: exiting now without a checkpoint", file=sys.stderr, flush=True)
            os._exit(EXIT_CODES["SIGINT"])
        if self.requested is None:
            self.requested = name
            if signum == signal.SIGINT:  # someone at a terminal: say the first was heard
                print("\ninterrupt: stopping after a checkpoint of the last finished iteration (Ctrl-C again: exit "
                      "now)", file=sys.stderr, flush=True)

    def _restore_signals(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def stop_point(self) -> None:
        """Raise StopRun when a stop signal arrived here or, in a multi-process job, on any process."""
        name = self.requested
        if self._agree(name is not None):
            raise StopRun(name or "SIGTERM")

    def _agree(self, flag: bool) -> bool:
        """True on every process when it is true on any (one small all-gather; nothing with one process)."""
        import jax

        if jax.process_count() == 1:
            return flag
        from earl_jax.distributed import gather_ints

        return any(v for (v,) in gather_ints(int(flag)))

    def checkpoint_due(self, step: int, last_step: bool) -> bool:
        """--run.checkpoint-every, the end of the run or of its time, or --run.checkpoint-minutes since the last one
        (decided once for all processes: each measures its own time)."""
        every = self.cfg.checkpoint_every and step % self.cfg.checkpoint_every == 0
        minutes = self.cfg.checkpoint_minutes
        by_time = bool(minutes) and (time.perf_counter() - self.last_checkpoint) / 60 >= minutes
        return bool(every or last_step or self.out_of_time()) or (bool(minutes) and self._agree(by_time))

    def saved(self) -> None:
        self.last_checkpoint = time.perf_counter()

    def stopped(self, stop: StopRun, step: int, saved: int, save: Callable[[], None], run_dir: Path) -> None:
        """After a stop signal: the last finished iteration checkpointed (`save`) unless step `saved` is it, and one
        line saying where to resume from."""
        if step > saved:
            save()
        where = (f"checkpoint {run_dir / 'checkpoints' / str(step)}" if step else
                 "no iteration had finished, nothing to resume")
        log.warning("%s: stopped after iteration %d; %s", stop.signal_name, step, where)

    def beat(self, what: str) -> None:
        """A heartbeat for the watchdog (what the run is doing now) and the bar's status."""
        self.dog.beat(what)
        self.bar.status(what)

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    @property
    def run_elapsed_s(self) -> float:
        """The run's time in the training loop, this part and the parts before a resume."""
        return self.elapsed_before_s + self.elapsed_s

    def agreed_run_elapsed_s(self) -> float:
        """`run_elapsed_s`, the same on every process (the largest; one small all-gather with several): what the
        time limit and the schedules over it read, so that every process decides alike."""
        import jax

        if jax.process_count() == 1:
            return self.run_elapsed_s
        from earl_jax.distributed import gather_ints

        return max(ms for (ms,) in gather_ints(int(self.run_elapsed_s * 1000))) / 1000

    def run_fraction(self) -> float:
        """The share of --run.max-minutes the run has spent, in [0, 1] (0 without a limit)."""
        if not self.cfg.max_minutes:
            return 0.0
        return min(1.0, self.agreed_run_elapsed_s() / (60 * self.cfg.max_minutes))

    def out_of_time(self) -> bool:
        return bool(self.cfg.max_minutes) and self.agreed_run_elapsed_s() / 60 > self.cfg.max_minutes

    def times(self) -> dict[str, float]:
        """This part's wall time and the run's, all parts (an iteration's record)."""
        return {"time/elapsed_s": self.elapsed_s, "time/run_elapsed_s": self.run_elapsed_s}

    def spent_at_start(self) -> bool:
        """A resumed run whose --run.max-minutes are already spent (said in one line): it runs no iteration."""
        if not self.out_of_time():
            return False
        logging.getLogger("earl_jax.rl.loop.trainer").warning(
            "--run.max-minutes %g: the run has spent its time (%.1f minutes); raise it to continue",
            self.cfg.max_minutes, self.run_elapsed_s / 60)
        return True

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
            task = "task/success_rate" in record  # a task's episodes succeed; a game's are won
            log.info("iteration %d/%d: return %+.2f, %s %.2f, context %.0f, %.2f s (rollout %.2f, experience %.2f, "
                     "train %.2f), meshes %s / %s / %s", step, self.total, record["episode/return_mean"],
                     "success" if task else "win", record["task/success_rate" if task else "episode/win_rate"],
                     record["rollout/context_len_mean"], record["time/iteration_s"],
                     record["time/rollout_s"], record["time/experience_s"], record["time/train_s"],
                     record["parallel/rollout_mesh"], record["parallel/experience_mesh"], record["parallel/train_mesh"])
