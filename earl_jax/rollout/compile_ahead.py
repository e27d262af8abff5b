"""Compile the rollout's next programs in a background thread before the rollout reaches them.

A rollout meets its decode programs one at a time: the prompt's extend, the first generate, the observation
extend, then, as games grow and finish, a larger KV cache (grow, then generate / extend at that size) and a
smaller batch (take, then generate / extend at that batch). Each is compiled when first called, so the first
iteration waits for every compile in turn, and later iterations stall whenever a game first reaches a new
cache size or batch (on 4 H100s most slow iterations were such compiles).

`CompileAhead` runs `jitted.lower(*specs).compile()` for predicted programs (the neighbours of the shape a sampler
just ran: next cache size, next compacted batch; the experience / train widths put off) on worker threads. XLA
compiles outside the GIL, so the host goes on stepping games meanwhile. JAX keeps the executable of an ahead-of-time
compile in the same cache the jitted call reads (and writes it to the persistent cache), so the real call finds it; a
real call whose program is still compiling ahead waits for that compile (`wait`) instead of starting a second one.

Which programs, and when: the planner's program service (parallel/shapes.py) decides; a sampler reports the shapes
it runs to its `SamplerShapes` and waits there before each program. A wrong prediction costs only background CPU
time; a failed ahead-of-time compile is counted (`failed`, with its error) and changes nothing else: the real call
compiles (and raises) as it would have.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Hashable

import jax
import numpy as np

from earl_jax.compile_cache import AHEAD_THREAD_PREFIX


class CompileAhead:
    """A deduplicated queue of ahead-of-time compiles, keyed by whatever identifies a program's signature."""

    def __init__(self, workers: int = 2):
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=AHEAD_THREAD_PREFIX)
        self._futures: dict[Hashable, Future] = {}
        self._lock = threading.Lock()
        self.failed: list[tuple[Hashable, str]] = []
        self.waited_s = 0.0  # time real calls spent waiting for a compile that had started ahead
        self.used: set[Hashable] = set()  # submitted keys a real call then asked for (the rest was wasted work)

    def submit(self, key: Hashable, compile_job: Callable[[], Any]) -> None:
        """Run `compile_job` (it lowers and compiles, e.g. `lambda: fn.lower(*specs).compile()`) once per key, on a
        worker thread: building the specs happens there too, so a prediction costs the caller only this call."""
        with self._lock:
            if key in self._futures:
                return
            self._futures[key] = self._pool.submit(self._run, key, compile_job)

    def _run(self, key: Hashable, compile_job: Callable[[], Any]) -> None:
        try:
            compile_job()
        except Exception as e:  # noqa: BLE001 (a miss: the real call compiles and reports its own error)
            self.failed.append((key, f"{type(e).__name__}: {e}"[:300]))

    def wait(self, key: Hashable) -> None:
        """Before the real call of `key`'s program: let a compile already under way finish (a second compile of
        the same program would only take longer)."""
        future = self._futures.get(key)
        if future is None:
            return
        self.used.add(key)
        if not future.done():
            t0 = time.perf_counter()
            future.result()
            self.waited_s += time.perf_counter() - t0

    def __contains__(self, key: Hashable) -> bool:
        """Whether `key` was submitted (callers skip building specs for a program already on its way)."""
        return key in self._futures

    @property
    def submitted(self) -> int:
        return len(self._futures)

    def drain(self) -> None:
        """Wait for every compile submitted so far (tests; a clean exit)."""
        for f in list(self._futures.values()):
            f.result()


def spec_of(x: Any, width: int | None = None) -> jax.ShapeDtypeStruct:
    """The argument spec jit sees for `x` (with its second dimension set to `width`, if given): a committed array
    keeps its sharding, an uncommitted one or a numpy value has none (jit places it)."""
    shape = tuple(x.shape) if width is None else (x.shape[0], width, *x.shape[2:])
    if isinstance(x, jax.Array):
        committed = getattr(x, "_committed", True)
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=x.sharding if committed else None,
                                    weak_type=x.aval.weak_type)
    return jax.ShapeDtypeStruct(shape, np.asarray(x).dtype)


class SamplerShapes:
    """What a `Sampler` tells about the shapes its programs run at, and where it waits before running one. This one
    records nothing and compiles nothing ahead (a sampler of its own: tests, benchmarks, the profiler); the planner's
    program service watches a rollout's samplers with its own (parallel/decode_shapes.py)."""

    def wait(self, key: tuple) -> None:
        """Before the program `key` runs: a compile of it under way finishes first."""

    def needed(self, length: int) -> None:
        """Rows are about to hold `length` tokens (how fast they grow)."""

    def extended(self, params: Any, state: Any, width: int) -> None:
        """An extend of `width` (bucketed) new tokens per row ran; `state` is its result."""

    def generating(self, key: tuple, active: int) -> None:
        """A generate of `active` decoding rows is about to run the program `key` (waits as `wait` does)."""
        self.wait(key)

    def generated(self, params: Any, state: Any, statics: tuple, rng: Any, temperature: Any,
                  greedy: Any) -> None:
        """A generate with these static arguments and runtime values ran; `state` is its result."""

    def drafted(self, decoder: Any, params: Any, state: Any, statics: tuple, rng: Any, temperature: Any,
                greedy: Any) -> None:
        """A drafted generate (rollout/speculate.DraftDecoder) with these static values ran; `state` is its result."""

    def prepare_generate(self, params: Any, state: Any, statics: tuple, temperature: Any,
                         greedy: Any) -> None:
        """A rollout's first generate, of `state`'s shape, comes after the prompt's extend."""
