"""JAX's persistent compilation cache, on by default for the main jobs, and a compile counter.

`enable_compile_cache` picks the folder: the explicit argument, else $EARL_COMPILE_CACHE, else
$XDG_CACHE_HOME/earl_jax/jax_compile (~/.cache/... by default); "off" disables it. A cache that is already
configured (the test suite's, or JAX_COMPILATION_CACHE_DIR) wins, so callers never fight over it.
Every program is cached, however small or quick: a restart then skips all compiles, and the many small
programs (model init, eager ops) are exactly the ones the default 1 s threshold would leave out.

`count_compiles` counts, through jax.monitoring, the programs lowered, compiled by XLA and loaded from the
persistent cache while it is open (the init tests and benchmarks use it; so can "first compile" lines).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from typing import Iterator

import jax

log = logging.getLogger("earl_jax")

OFF = "off"
ENV = "EARL_COMPILE_CACHE"


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "earl_jax", "jax_compile")


def _set(name: str, value) -> None:
    try:
        jax.config.update(name, value)
    except AttributeError:  # an option this jax version does not have: the cache works without it
        log.debug("compile cache: jax has no option %s", name)


def enable_compile_cache(path: str | None = None) -> str | None:
    """Turn the persistent compilation cache on; returns the folder in use, or None when off."""
    configured = jax.config.jax_compilation_cache_dir
    if configured:
        log.info("compile cache: %s (already configured; it takes precedence)", configured)
        return configured
    choice = (path or os.environ.get(ENV) or "").strip()
    if choice.lower() == OFF:
        log.info("compile cache: off")
        return None
    folder = os.path.abspath(os.path.expanduser(choice or default_cache_dir()))
    os.makedirs(folder, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", folder)
    _set("jax_persistent_cache_min_compile_time_secs", 0.0)  # cache every program, however quick
    _set("jax_persistent_cache_min_entry_size_bytes", 0)  # 0 = no size floor (jax's own default)
    log.info("compile cache: %s", folder)
    return folder


# ---- counting compiles -----------------------------------------------------------------------------
_TRACE = "/jax/core/compile/jaxpr_trace_duration"  # Python tracing to a jaxpr: paid by a warm start too
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"  # every new program (cache hit or not)
_BACKEND = "/jax/core/compile/backend_compile_duration"  # XLA compile *or* persistent-cache load
_HIT = "/jax/compilation_cache/cache_hits"
AHEAD_THREAD_PREFIX = "earl-compile-ahead"  # threads of rollout/compile_ahead.py: counted apart


@dataclasses.dataclass(eq=False)  # identity: nested counters of equal counts are still different counters
class CompileCount:
    lowered: int = 0  # programs built (new jit signatures): the number of distinct programs
    backend: int = 0  # executables obtained: compiled by XLA or loaded from the persistent cache
    cache_hits: int = 0  # of those, loaded from the persistent cache
    backend_s: float = 0.0  # seconds spent getting them (compiling or loading)
    trace_s: float = 0.0  # seconds tracing Python to jaxprs, and lowering jaxprs to MLIR: what no compile cache saves
    lower_s: float = 0.0
    seconds_by_name: dict[str, float] = dataclasses.field(default_factory=dict)  # the same, per program name
    # executables obtained on compile-ahead threads (rollout/compile_ahead.py), not in the fields above: they
    # are not what the counted code waited for
    ahead: int = 0
    ahead_s: float = 0.0

    def slowest(self, k: int = 4) -> str:
        """The k programs that took longest to get, "name:seconds" (what to look at when an iteration is slow)."""
        top = sorted(self.seconds_by_name.items(), key=lambda kv: -kv[1])[:k]
        return ",".join(f"{name}:{secs:.2f}" for name, secs in top)

    @property
    def compiled(self) -> int:
        """Executables XLA really compiled (persistent-cache misses)."""
        return self.backend - self.cache_hits

    def __str__(self) -> str:
        hits = f", {self.cache_hits} from cache" if self.cache_hits else ""
        return f"{self.lowered} programs{hits}"


_active: list[CompileCount] = []
_lock = threading.Lock()
_registered = False


def _on_ahead_thread() -> bool:
    return threading.current_thread().name.startswith(AHEAD_THREAD_PREFIX)


def _on_duration(event: str, secs: float, fun_name: str = "?", **_) -> None:
    if not _active or event not in (_TRACE, _LOWER, _BACKEND):
        return
    ahead = _on_ahead_thread()
    with _lock:
        for c in _active:
            if event == _TRACE:
                if not ahead:
                    c.trace_s += secs
            elif ahead:
                if event == _BACKEND:
                    c.ahead += 1
                    c.ahead_s += secs
            elif event == _LOWER:
                c.lowered += 1
                c.lower_s += secs
            else:
                c.backend += 1
                c.backend_s += secs
                c.seconds_by_name[fun_name] = c.seconds_by_name.get(fun_name, 0.0) + secs


def _on_event(event: str, **_) -> None:
    if _active and event == _HIT and not _on_ahead_thread():
        with _lock:
            for c in _active:
                c.cache_hits += 1


@contextlib.contextmanager
def count_compiles() -> Iterator[CompileCount]:
    """Counts compiles in every thread while open (listeners are process-wide; nesting is fine)."""
    global _registered
    with _lock:
        if not _registered:  # jax has no public unregister: install once, count only while a counter is open
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            jax.monitoring.register_event_listener(_on_event)
            _registered = True
        count = CompileCount()
        _active.append(count)
    try:
        yield count
    finally:
        with _lock:
            _active.remove(count)
