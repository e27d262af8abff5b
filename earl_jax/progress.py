"""Progress lines for slow set-up work: model creation, checkpoint loading, first compiles.

Lines go through `logging` at INFO under the "earl_jax" logger, so the main job shows them
(`show_progress_logs`) while tests and library users see nothing unless they ask. Long loops get a rich
progress bar, but only when stderr is a terminal (never in log files or CI).

    with phase("model: qwen2.5-7b init on mesh d1f4t1", compiles=True) as p:
        ...
        p.note("7.62B params")
    # -> "model: qwen2.5-7b init on mesh d1f4t1 ..." then "model: ... (7.62B params, 9 programs): 8.4 s"
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import Iterable, Iterator, TypeVar

from earl_jax.compile_cache import CompileCount, count_compiles

log = logging.getLogger("earl_jax")
T = TypeVar("T")


class Phase:
    """What a `phase` block reports: notes for its final line, its elapsed time and compile count."""

    def __init__(self, name: str):
        self.name, self.notes, self.elapsed = name, [], 0.0
        self.compiles: CompileCount | None = None

    def note(self, text: str) -> None:
        self.notes.append(text)


@contextlib.contextmanager
def phase(name: str, *, compiles: bool = False, logger: logging.Logger = log) -> Iterator[Phase]:
    """Log "name ..." now and "name (notes): N s" at the end; `compiles` adds the programs it built."""
    p = Phase(name)
    logger.info("%s ...", name)
    start = time.perf_counter()
    with (count_compiles() if compiles else contextlib.nullcontext()) as count:
        p.compiles = count
        try:
            yield p
        except BaseException:
            logger.info("%s failed after %.1f s", name, time.perf_counter() - start)
            raise
    p.elapsed = time.perf_counter() - start
    notes = p.notes + ([str(count)] if count is not None else [])
    logger.info("%s%s: %.1f s", name, f" ({', '.join(notes)})" if notes else "", p.elapsed)


def params_str(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def mesh_str(mesh) -> str:
    """'d1f4t1' for the stage meshes (data, fsdp, tensor), else the axis sizes ('x2y4')."""
    from earl_jax.sharding.mesh import DATA, FSDP, TENSOR, mesh_shape_of

    if set(mesh.axis_names) <= {DATA, FSDP, TENSOR}:
        return str(mesh_shape_of(mesh))
    return "".join(f"{a}{n}" for a, n in mesh.shape.items())


def track(items: Iterable[T], total: int, description: str) -> Iterable[T]:
    """`items` with a rich progress bar when stderr is a terminal and INFO lines are shown; else as is."""
    if not (sys.stderr.isatty() and log.isEnabledFor(logging.INFO)):
        return items
    from rich.console import Console
    from rich.progress import track as rich_track

    return rich_track(items, total=total, description=description, console=Console(stderr=True), transient=True)


def show_progress_logs(enabled: bool = True, level: int = logging.INFO) -> None:
    """Print the "earl_jax" INFO lines on stderr (the main job calls this; process 0 only)."""
    if not enabled or any(getattr(h, "_earl_progress", False) for h in log.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
    handler._earl_progress = True  # so a second call adds no second handler
    log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False  # a root handler (absl's, a notebook's) would print every line twice


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc), e.g. "command to first iteration"; None elsewhere."""
    try:
        import os

        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
