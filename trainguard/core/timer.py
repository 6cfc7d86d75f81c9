"""WakeTimer: run a check at a moment it computed (a hang deadline), not at the next poll."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class WakeTimer:
    """One daemon thread calling `wake()` at the earliest time set; `set` moves the alarm."""

    def __init__(self, wake: Callable[[], None], clock: Callable[[], float] = time.time, name: str = "wake") -> None:
        self._wake = wake
        self._clock = clock
        self._when: float | None = None
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def when(self) -> float | None:
        return self._when

    def set(self, when: float | None) -> None:
        """Wake at `when` (clock time); None cancels."""
        with self._cond:
            self._when = when
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=2)

    def _loop(self) -> None:
        with self._cond:
            while not self._stopped:
                if self._when is None:
                    self._cond.wait()
                    continue
                delay = self._when - self._clock()
                if delay > 0:
                    self._cond.wait(min(delay, 60.0))  # re-read the clock now and then: it may jump
                    continue
                self._when = None
                self._cond.release()
                try:
                    self._wake()
                finally:
                    self._cond.acquire()
