"""The gate between stage programs' first calls and rollouts running ahead on another thread
(parallel/first_call_gate.py): neither runs while the other does, and the rollout's own first calls pass."""

from __future__ import annotations

import threading
import time

from earl_jax.parallel.first_call_gate import FirstCallGate


def _in_thread(fn) -> threading.Thread:
    th = threading.Thread(target=fn)
    th.start()
    return th


def test_a_first_call_waits_for_the_rollout_in_progress_and_the_next_rollout_waits_for_it():
    gate, log = FirstCallGate(), []
    rollout_started, release = threading.Event(), threading.Event()

    def rollout(name, hold=None):
        with gate.rollout():
            log.append(f"{name} start")
            rollout_started.set()
            if hold is not None:
                hold.wait(5)
            log.append(f"{name} end")

    def first_call():
        with gate.first_call():
            log.append("first call")
            time.sleep(0.05)
            log.append("first call end")

    a = _in_thread(lambda: rollout("a", release))
    rollout_started.wait(5)
    fc = _in_thread(first_call)
    time.sleep(0.05)
    assert log == ["a start"]  # the first call waits for rollout a
    b = _in_thread(lambda: rollout("b"))
    time.sleep(0.05)
    release.set()
    for th in (a, fc, b):
        th.join(5)
    # rollout b, queued behind the waiting first call, starts only after it
    assert log == ["a start", "a end", "first call", "first call end", "b start", "b end"]


def test_a_first_call_on_the_rollout_thread_passes_and_an_idle_gate_does_not_wait():
    gate = FirstCallGate()
    with gate.first_call():  # no rollout: straight through
        pass
    seen = []
    with gate.rollout():
        with gate.first_call():  # the rollout's own program: it holds the gate already
            seen.append(gate.rollouts)
    assert seen == [1] and gate.rollouts == 0
