"""The collector's pauses are timed, and --gc-every takes collections at fixed iterations instead."""

from __future__ import annotations

import gc

import pytest

from earl_jax.rl.gc_control import GcClock, manual_gc


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
    with pytest.raises(ValueError, match="--gc-every"):
        with manual_gc(-1):
            pass
