"""Runs one check with a time budget and turns every failure into data.

A run happens in a daemon thread: a check blocked forever inside the kernel (statvfs on a dead
NFS mount) costs one parked thread, never the scheduler, the HTTP endpoint or shutdown. While
that thread is still blocked, further runs of the check are skipped and reported as such. A check whose hardware is
absent raises CheckIdle: the run is `idle` (no result, so no incident), logged once when the check turns idle.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from trainguard.checks.base import Check, CheckIdle
from trainguard.core.logs import kv
from trainguard.core.model import Result, Status
from trainguard.core.units import format_duration

log = logging.getLogger("trainguard.runner")


@dataclass(frozen=True)
class RunReport:
    check: str
    started: float
    duration: float
    outcome: str  # ok | idle | error | timeout | skipped
    results: tuple[Result, ...]
    idle_reason: str | None = None  # why an idle run had nothing to watch

    @property
    def complete(self) -> bool:
        """The run finished: a subject it did not report is OK (an idle run reports none)."""
        return self.outcome in ("ok", "idle")


class _Attempt:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.results: list[Result] = []
        self.error: BaseException | None = None
        self.idle: str | None = None


class CheckRunner:
    def __init__(self, check: Check, clock: Callable[[], float] = time.time) -> None:
        self.check = check
        self._clock = clock
        self._lock = threading.Lock()
        self._stuck: tuple[_Attempt, float] | None = None
        self._idle: str | None = None  # the reason while idle: logged on the change, not every run

    def _failure(self, started: float, duration: float, outcome: str, summary: str) -> RunReport:
        result = Result(self.check.name, self.check.name, Status.UNKNOWN, summary, {"outcome": outcome})
        return RunReport(self.check.name, started, duration, outcome, (result,))

    def run_once(self, stop: threading.Event | None = None) -> RunReport:
        started = self._clock()
        timeout = self.check.settings.timeout
        with self._lock:
            if self._stuck is not None:
                attempt, since = self._stuck
                if not attempt.done.is_set():
                    return self._failure(started, 0.0, "skipped",
                                         f"timed out after {timeout:g}s; previous run still blocked "
                                         f"for {format_duration(started - since)}, run skipped")
                log.info("blocked check run returned", extra=kv(check=self.check.name,
                                                               blocked_s=round(started - since, 1)))
                self._stuck = None
            attempt = _Attempt()
        worker = threading.Thread(target=self._execute, args=(attempt,), name=f"check-{self.check.name}", daemon=True)
        t0 = time.monotonic()
        worker.start()
        deadline = t0 + timeout
        # Wait in slices so shutdown never waits out a long check timeout.
        while not attempt.done.wait(min(0.25, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline or (stop is not None and stop.is_set()):
                break
        duration = time.monotonic() - t0
        if not attempt.done.is_set():
            with self._lock:
                self._stuck = (attempt, started)
            if stop is not None and stop.is_set():
                return self._failure(started, duration, "skipped", "agent shutting down")
            log.warning("check timed out", extra=kv(check=self.check.name, timeout_s=timeout))
            return self._failure(started, duration, "timeout", f"timed out after {timeout:g}s")
        if attempt.error is None:
            self._note_idle(attempt.idle)
        if attempt.idle is not None:
            return RunReport(self.check.name, started, duration, "idle", (), attempt.idle)
        if attempt.error is not None:
            err = attempt.error
            log.error("check failed", extra=kv(check=self.check.name, error=f"{type(err).__name__}: {err}"))
            return self._failure(started, duration, "error", f"check failed: {type(err).__name__}: {err}")
        return RunReport(self.check.name, started, duration, "ok", tuple(attempt.results))

    def _note_idle(self, reason: str | None) -> None:
        """One log line when the check turns idle (at start on a node without its hardware), one when it wakes."""
        with self._lock:
            was, self._idle = self._idle, reason
        if reason is not None and was is None:
            log.info("check idle: what it watches is absent here", extra=kv(check=self.check.name, reason=reason))
        elif reason is None and was is not None:
            log.info("check active: what it watches is present again", extra=kv(check=self.check.name))

    def _execute(self, attempt: _Attempt) -> None:
        try:
            results = list(self.check.run())
            for result in results:
                if not isinstance(result, Result):
                    raise TypeError(f"run() returned {type(result).__name__}, not Result")
            attempt.results = results
        except CheckIdle as idle:
            attempt.idle = idle.reason
        except Exception as exc:  # noqa: BLE001 - the runner alone turns a check's failure into data
            attempt.error = exc
        finally:
            attempt.done.set()
