"""The watchdog ends a process that stopped making progress (a multi-GPU program that hangs after one device ran out
of memory), with a message naming what was running, and never one that keeps beating."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

from earl_jax.watchdog import EXIT_CODE, Watchdog

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_off_starts_no_thread():
    for off in (None, 0, -1):
        with Watchdog(off, "x") as dog:
            assert dog._thread is None


def test_beats_keep_it_alive_and_silence_ends_the_process():
    done = _run("""
        import time
        from earl_jax.watchdog import Watchdog
        with Watchdog(2.0, "a loop", on_fire=lambda: print("saved", flush=True)) as dog:
            for i in range(20):  # 4 s of beats, twice the timeout, 10x as often (room for a loaded machine)
                dog.beat(f"step {i}")
                time.sleep(0.2)
            print("alive after the beats", flush=True)
            dog.beat("the silent part")
            time.sleep(60)
        print("never")
    """)
    assert done.returncode == EXIT_CODE, done.stderr[-2000:]
    assert done.stdout.split() == ["alive", "after", "the", "beats", "saved"]
    assert re.search(r"a loop made no progress for \d+ s \(in the silent part\)", done.stderr)  # >= 2 s: load


def test_training_beats_at_every_phase_under_the_configured_timeout(tmp_path, monkeypatch):
    """Trainer.run runs under a Watchdog of --run.stall-minutes and beats before each phase that can hang (what ends a
    silent process is the test above): the start, every iteration, evaluation and checkpoint, by name."""
    from earl_jax.rl.loop import run_control as control_mod, trainer as trainer_mod
    from jobs import SMALL, with_fields

    made = []

    class Spy(Watchdog):
        def __init__(self, timeout_s, what, **kw):
            super().__init__(None, what, **kw)  # off: nothing may end the test process
            made.append(self)
            self.asked, self.beats = timeout_s, []

        def beat(self, phase: str = "") -> None:
            self.beats.append(phase)

    monkeypatch.setattr(control_mod, "Watchdog", Spy)  # the run control's watchdog
    cfg = with_fields(SMALL, run__steps=2, eval__every=2, checkpoint_every=1, sft__steps=0, stall_minutes=7.0,
                      run_dir=str(tmp_path / "run"))
    trainer_mod.Trainer(cfg, log=False).run()
    (dog,) = made
    assert dog.asked == 7.0 * 60 and "--resume" in dog.hint
    assert dog.beats == ["the start: format warm-up or the first evaluation", "iteration 1",
                         "the checkpoint after iteration 1", "iteration 2", "the evaluation after iteration 2",
                         "the checkpoint after iteration 2"]
