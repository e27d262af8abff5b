"""What a user watches: progress lines for slow set-up work (model creation, checkpoint loading, first compiles) and
the training loop's bar.

Lines go through `logging` at INFO under the "earl_jax" logger, so the main job shows them (`show_progress_logs`)
while tests and library users see nothing unless they ask. While a bar is live (`ProgressBar`, or `track` over a long
loop; only when stderr is a terminal), each line is printed above it through the bar's console, never onto the bar.

    with phase("model: qwen2.5-7b init on mesh d1f4t1", compiles=True) as p:
        ...
        p.note("7.62B params")
    # -> "model: qwen2.5-7b init on mesh d1f4t1 ..." then "model: ... (7.62B params, 9 programs): 8.4 s"
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import sys
import time
from typing import IO, Any, Callable, Iterable, Iterator, Mapping, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Column
from rich.text import Text

from earl_jax.compile_cache import CompileCount, count_compiles

log = logging.getLogger("earl_jax")
T = TypeVar("T")
_live: list[Console] = []  # the consoles of the bars drawn now, newest last: log lines print above them


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
    return _tracked(items, total, description)


def _tracked(items: Iterable[T], total: int, description: str) -> Iterator[T]:
    with Progress(TextColumn(description), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar, _lines_above(bar.console):
        yield from bar.track(items, total=total)


@contextlib.contextmanager
def _lines_above(console: Console) -> Iterator[None]:
    _live.append(console)
    try:
        yield
    finally:
        _live.remove(console)


class _LineHandler(logging.StreamHandler):
    """Lines on its stream, or above the live bar through the bar's console (written to the terminal directly, a line
    would land on the bar's own line)."""

    def emit(self, record: logging.LogRecord) -> None:
        if not _live:
            return super().emit(record)
        try:
            _live[-1].print(self.format(record), markup=False, highlight=False, emoji=False, soft_wrap=True)
        except Exception:
            self.handleError(record)


def progress_handler(stream: IO[str]) -> logging.Handler:
    """The handler `show_progress_logs` adds: "HH:MM:SS message" lines on `stream`, above a live bar."""
    handler = _LineHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
    return handler


def show_progress_logs(enabled: bool = True, level: int = logging.INFO) -> None:
    """Print the "earl_jax" INFO lines on stderr (the main job calls this; process 0 only)."""
    if not enabled or any(getattr(h, "_earl_progress", False) for h in log.handlers):
        return
    handler = progress_handler(sys.stderr)
    handler._earl_progress = True  # so a second call adds no second handler
    log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False  # a root handler (absl's, a notebook's) would print every line twice


class _TimeLeft(ProgressColumn):
    """"0:07:21 left" at the pace of the iterations so far (blank until two have finished)."""

    def render(self, task) -> Text:
        left = task.time_remaining
        return Text("" if left is None else f"{datetime.timedelta(seconds=round(left))} left",
                    style="progress.remaining")


class ProgressBar:
    """The training loop's bar: iterations done, time spent and left, and the numbers people watch (return, win rate,
    context length, loss, the rollout's mesh). Every method is a no-op unless `enabled`."""

    def __init__(self, total: int, enabled: bool = True, *, console: Console | None = None,
                 clock: Callable[[], float] | None = None):
        """`console`: where it draws (default: stderr); `clock`: its time in seconds (default: time.monotonic)."""
        self.enabled = enabled
        if enabled:
            # a narrow terminal cuts the numbers short rather than the times; the pace is the last hour's (an
            # iteration takes seconds to minutes, and grows with the context)
            numbers = TextColumn("{task.description}", table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis"))
            self.progress = Progress(TextColumn("[bold]RL"), BarColumn(bar_width=20), MofNCompleteColumn(),
                                     TimeElapsedColumn(), _TimeLeft(), numbers, console=console or Console(stderr=True),
                                     expand=True, speed_estimate_period=3600.0,
                                     **({"get_time": clock} if clock else {}))
            self._task = self.progress.add_task("starting", total=total)
            self._stack = contextlib.ExitStack()

    def __enter__(self) -> "ProgressBar":
        if self.enabled:
            self._stack.enter_context(self.progress)
            self._stack.enter_context(_lines_above(self.progress.console))
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._stack.close()

    def status(self, text: str) -> None:
        if self.enabled:
            self.progress.update(self._task, description=text)

    def advance_to(self, step: int) -> None:
        if self.enabled:
            self.progress.update(self._task, completed=step)

    def update(self, step: int, record: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        what = "success" if "eval/success_rate" in record else "win"  # a task's held-out success, a game's wins
        win = record.get(f"eval/{what}_rate")
        text = (f"return {record['episode/return_mean']:+.2f}  "
                f"eval {what} {win if win is None else f'{win:.2f}'}  "
                f"ctx {record['rollout/context_len_mean']:.0f}  loss {record['train/loss']:+.3f}  "
                f"mesh {record.get('parallel/rollout_mesh', '')}")
        self.progress.update(self._task, completed=step, description=text)


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
