"""A gate between a stage program's first call and the rollouts running ahead on another thread.

cuDNN's fused attention (the train and experience programs on GPU, models/attention.py) builds its graph at a
program's first execution inside a CUDA stream capture, and a launch from any other thread of the process during that
capture breaks it ("capturing stream has unjoined work", or a crash; docs/design.md, staleness). So while rollouts
run ahead (rl/loop/overlap.py), a first call waits until no background rollout runs, and no rollout starts while a
first call is in progress. First calls are few (the programs are bounded) and a rollout holds the gate for one
batch, so the wait is at most one rollout per new program. The rollout's own programs (cached attention, no cuDNN)
are not gated: a first call made on the rollout thread passes straight through.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator


class FirstCallGate:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._rollouts = 0  # background rollouts running
        self._first_calls = 0  # first calls in progress or waiting: no rollout starts meanwhile
        self._local = threading.local()

    @contextlib.contextmanager
    def rollout(self) -> Iterator[None]:
        """Around one background rollout: waits for the first calls in progress or waiting."""
        with self._cond:
            self._cond.wait_for(lambda: self._first_calls == 0)
            self._rollouts += 1
        self._local.in_rollout = True
        try:
            yield
        finally:
            self._local.in_rollout = False
            with self._cond:
                self._rollouts -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def first_call(self) -> Iterator[None]:
        """Around a program's compile and first execution (until its outputs are ready)."""
        if getattr(self._local, "in_rollout", False):  # the rollout's own programs: no cuDNN, and it holds the gate
            yield
            return
        with self._cond:
            self._first_calls += 1  # claimed before waiting, so the rollouts queued behind do not start first
            self._cond.wait_for(lambda: self._rollouts == 0)
        try:
            yield
        finally:
            with self._cond:
                self._first_calls -= 1
                self._cond.notify_all()

    @property
    def rollouts(self) -> int:
        return self._rollouts
