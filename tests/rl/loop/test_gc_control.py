"""The collector's pauses are timed, and --run.gc-every takes collections at fixed iterations instead."""

from __future__ import annotations

import gc

import pytest

from earl_jax.rl.loop.gc_control import GcClock, StartupPause, manual_gc


def test_clock_times_collections_while_entered():
    with GcClock() as clock:
        garbage = [[i] for i in range(200_000)]  # objects for the collector to walk
        gc.collect()
        paused = clock.take()
        assert paused > 0 and clock.take() == 0.0  # take() resets
        del garbage
    gc.collect()  # outside: not counted
    assert clock.take() == 0.0


def test_manual_collection_freezes_then_restores():
    assert gc.isenabled()
    with manual_gc(0):
        assert gc.isenabled()
    with manual_gc(3):
        assert not gc.isenabled() and gc.get_freeze_count() > 0
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with pytest.raises(ValueError, match="--run.gc-every"):
        with manual_gc(-1):
            pass


def test_startup_pause_holds_the_collector_until_the_first_iteration_ends():
    assert gc.isenabled()
    frozen = gc.get_freeze_count()  # what the suite froze after earlier tests (tests/conftest.py)
    with StartupPause(True) as pause:
        assert not gc.isenabled()
        pause.end()
        assert gc.isenabled() and gc.get_freeze_count() == frozen  # it freezes nothing
        pause.end()  # once only
        assert gc.isenabled()
    with StartupPause(True):
        assert not gc.isenabled()
    assert gc.isenabled()  # leaving the context ends it (an error in the first iteration)
    with StartupPause(False):  # --run.gc-every manages the collector
        assert gc.isenabled()


def test_the_trainer_collects_automatically_again_after_its_first_iteration(tmp_path, monkeypatch):
    from earl_jax.rl.loop.trainer import Trainer
    from jobs import job

    cfg = job(groups=2, group_size=4, run__steps=2, sft__steps=0, devices=1, eval__games=4, eval__every=0,
              checkpoint_every=0, max_context=256, run_dir=str(tmp_path))
    trainer = Trainer(cfg, log=False)
    seen = []
    iteration = trainer.iteration
    monkeypatch.setattr(trainer, "iteration", lambda: (seen.append(gc.isenabled()), iteration())[1])
    trainer.run()
    assert seen == [False, True] and gc.isenabled()
