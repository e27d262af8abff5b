"""What a terminal shows while a job trains (earl_jax/progress.py): log lines above the bar, never glued to it, the
time left, and wandb silent unless asked."""

from __future__ import annotations

import io
import logging
import re
import sys
import types

import pytest
from rich.console import Console

from earl_jax.progress import ProgressBar, progress_handler
from earl_jax.rl.loop.metrics import MetricsLogger

RECORD = {"episode/return_mean": 0.25, "rollout/context_len_mean": 31.0, "train/loss": -0.0125,
          "parallel/rollout_mesh": "d1f1t1"}
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _terminal() -> tuple[Console, io.StringIO]:
    screen = io.StringIO()
    return Console(file=screen, force_terminal=True, width=160, color_system=None), screen


def _screen_lines(screen: io.StringIO) -> list[str]:
    """What the terminal shows line by line: each carriage return or newline starts a line, colours dropped."""
    return [s.strip() for s in re.split(r"[\r\n]", ANSI.sub("", screen.getvalue())) if s.strip()]


@pytest.fixture
def logger():
    stream = io.StringIO()
    log = logging.getLogger("earl_jax.test_progress")
    handler = progress_handler(stream)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    yield log, stream
    log.removeHandler(handler)


def test_a_log_line_while_the_bar_is_drawn_goes_above_it_on_a_line_of_its_own(logger):
    log, stream = logger
    console, screen = _terminal()
    with ProgressBar(150, console=console) as bar:
        bar.status("starting")
        log.info("evaluation: 64 games")
    log.info("after the bar")
    shown = _screen_lines(screen)
    line = next(s for s in shown if "evaluation" in s)
    assert re.fullmatch(r"\d\d:\d\d:\d\d evaluation: 64 games", line), shown  # not "... starting21:53:00 eval..."
    assert any(s.startswith("RL ") and "starting" in s for s in shown)
    assert re.fullmatch(r"\d\d:\d\d:\d\d after the bar\n", stream.getvalue())  # no bar: the handler's own stream


def test_the_bar_shows_the_time_left_at_the_pace_so_far():
    console, screen = _terminal()
    now = [0.0]
    with ProgressBar(150, console=console, clock=lambda: now[0]) as bar:
        bar.update(1, RECORD)
        assert "left" not in " ".join(_screen_lines(screen))  # one iteration gives no pace yet
        for step in (2, 3):
            now[0] += 10.0
            bar.update(step, RECORD)
        bar.progress.refresh()
    last = _screen_lines(screen)[-1]
    # 147 iterations to go at 10 s each
    assert re.match(r"RL .* 3/150 0:00:\d\d 0:24:30 left return \+0\.25  eval win None  ctx 31  loss -0\.013", last)


class _FakeWandb(types.ModuleType):
    """wandb, recording how it was started."""

    def __init__(self):
        super().__init__("wandb")
        self.inits = []

    def Settings(self, **kw):  # noqa: N802 (wandb's name)
        return kw

    def init(self, **kw):
        self.inits.append(kw)
        return types.SimpleNamespace(id="abc", url="https://wandb.ai/x/earl-jax/runs/abc",
                                     dir="/runs/r/wandb/run/files", log=lambda *a, **k: None, finish=lambda: None)


@pytest.mark.parametrize("mode, silent, line", [
    ("offline", True, "wandb: offline in /runs/r/wandb/run (`wandb sync` that folder uploads it)"),
    ("auto", True, "wandb: offline in /runs/r/wandb/run (`wandb sync` that folder uploads it)"),  # no API key
    ("online", False, None),  # asked for: wandb's own banner and summary, with the run's link
])
def test_wandb_is_silent_unless_asked_and_one_line_says_where_the_run_went(tmp_path, monkeypatch, mode, silent, line):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_SILENT", raising=False)
    said = io.StringIO()
    log = logging.getLogger("earl_jax.rl.loop.metrics")
    handler = logging.StreamHandler(said)
    log.addHandler(handler)
    level = log.level
    log.setLevel(logging.INFO)
    try:
        MetricsLogger(tmp_path, {}, wandb_mode=mode).close()
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    (init,) = fake.inits
    assert init["settings"] == ({"silent": True} if silent else None)
    assert said.getvalue().splitlines() == ([line] if line else [])
    monkeypatch.setenv("WANDB_SILENT", "false")  # the user's own setting stands
    MetricsLogger(tmp_path, {}, wandb_mode="offline").close()
    assert fake.inits[-1]["settings"] is None
