"""End a process that stopped making progress, instead of letting it wait forever.

With one process driving several GPUs, a program that runs out of memory on one device can leave the others waiting
in the next collective with no error raised anywhere (Fig. 3's 3B train stage on 4 H100s waited until the
command's time limit). Python cannot interrupt a thread blocked in XLA, so the
only way out is to leave: a watchdog thread that, when `beat()` has not been called for `timeout_s` seconds, says
what was running, runs a last callback (e.g. save a table) and ends the process with EXIT_CODE. Whatever supervises
the process (a script loop, a sweep agent, a user) can then resume from what was saved.

    with Watchdog(1800, "training") as dog:
        for step in ...:
            dog.beat(f"iteration {step + 1}")   # what runs next, for the message if it never ends
            ...
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

EXIT_CODE = 75  # EX_TEMPFAIL: not a failure of the input; run again (resume) to go on
ON_FIRE_S = 15.0  # the most the last callback may take before the process ends anyway


class Watchdog:
    """A daemon thread that ends the process when `beat()` is not called for `timeout_s` seconds (None or <= 0:
    off: the context manager does nothing)."""

    def __init__(self, timeout_s: float | None, what: str, *, on_fire: Callable[[], None] | None = None,
                 hint: str = "", exit_code: int = EXIT_CODE):
        self.timeout_s = timeout_s if timeout_s and timeout_s > 0 else None
        self.what, self.on_fire, self.hint, self.exit_code = what, on_fire, hint, exit_code
        self.phase = ""
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, phase: str = "") -> None:
        """Progress: the clock starts again; `phase` names what runs from now on."""
        self._last, self.phase = time.monotonic(), phase

    def __enter__(self) -> "Watchdog":
        if self.timeout_s is not None:
            self._last = time.monotonic()
            self._thread = threading.Thread(target=self._watch, name=f"watchdog: {self.what}", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(min(self.timeout_s, 5.0)):
            idle = time.monotonic() - self._last
            if idle < self.timeout_s:
                continue
            where = f" (in {self.phase})" if self.phase else ""
            print(f"watchdog: {self.what} made no progress for {idle:.0f} s{where}: a device out of memory inside a "
                  f"multi-device program can leave the others waiting forever; ending the process with exit code "
                  f"{self.exit_code}{'; ' + self.hint if self.hint else ''}", file=sys.stderr, flush=True)
            if self.on_fire is not None:  # in a thread of its own: a last callback that hangs must not keep us
                last = threading.Thread(target=self.on_fire, name="watchdog: last callback", daemon=True)
                last.start()
                last.join(ON_FIRE_S)
            os._exit(self.exit_code)
