"""Python's garbage collector in the training loop: its pauses timed, and optionally taken at fixed iterations.

A full (generation-2) collection walks every live Python object, and a process holding JAX's caches, compiled
programs and a vector env holds many. Python starts one whenever enough objects were allocated since the last,
so in a multi-process job each process pauses at its own moments, and a pause in one stalls the others at
the next collective (a rollout split by process waits for its slowest process in the gather). `--run.gc-every N`
does what Megatron-LM's `--manual-gc` does: automatic collection is off and every process collects at the same
iterations, every N; the objects that survive a collection are then frozen (never scanned again), so the next
one walks only what the last N iterations made. Measured on 4 H100s (one process per GPU, tiny model, 2048
games; experiments/results/bench_agent_loop_nvidia_h100x4.json): a full collection took 0.29-0.37 s
per process when only start-up's objects were frozen. The slow iterations of a split rollout turned out to be
compiles, not collections: with `--run.gc-every 1` they stayed. Frozen objects that later become cyclic garbage are not
freed (objects freed by their reference count still are).
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Iterator

__all__ = ["GcClock", "StartupPause", "collect_and_freeze", "manual_gc"]


class GcClock:
    """Seconds the collector paused this process since the last `take()` (gc.callbacks; any generation)."""

    def __init__(self):
        self._paused = 0.0
        self._since: float | None = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._since = time.perf_counter()
        elif self._since is not None:
            self._paused += time.perf_counter() - self._since
            self._since = None

    def __enter__(self) -> "GcClock":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def take(self) -> float:
        paused, self._paused = self._paused, 0.0
        return paused


@contextlib.contextmanager
def manual_gc(every: int) -> Iterator[None]:
    """With every > 0: objects alive now are frozen and automatic collection is off (the caller collects every
    `every` iterations); the collector's state is restored on exit. every == 0: Python's automatic collection."""
    if every < 0:
        raise ValueError(f"--run.gc-every must be >= 0 (0: automatic collection), got {every}")
    if not every:
        yield
        return
    was_enabled = gc.isenabled()
    collect_and_freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()


def collect_and_freeze() -> None:
    """A full collection, then the survivors frozen: the next collection walks only newer objects."""
    gc.collect()
    gc.freeze()


class StartupPause:
    """Automatic collection off from the start of a run until its first iteration ends (`end()`, or leaving the
    context), then one full collection. Start-up traces and compiles every program, creating
    objects by the million, and Python's collector keeps walking them: on 4 H100s the pod job's first iteration
    paused 4.8-5.3 s in collections, and tracing the 1.5B train program took 8.7 s of a
    warm start. Objects freed by their reference count still go at once; only cyclic garbage waits for `end()`.
    Nothing is frozen (unlike `--run.gc-every`): a frozen object that later becomes cyclic garbage would never be freed,
    and a process may hold several trainers (tests, sweeps). Off (a no-op) with `--run.gc-every`, which manages the
    collector itself."""

    def __init__(self, enabled: bool):
        self.active = enabled and gc.isenabled()
        if self.active:
            gc.disable()

    def end(self) -> None:
        if self.active:
            self.active = False
            gc.collect()
            gc.enable()

    def __enter__(self) -> "StartupPause":
        return self

    def __exit__(self, *exc) -> None:
        self.end()
