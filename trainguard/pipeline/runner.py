"""Runs one check with a time budget and turns every failure into data.

Two ways to run, one outcome. The agent's scheduled runs happen on the check's own lane thread (`run_here`): the run
is registered with its deadline (told to `on_deadline`: the schedule's tick comes by then), and the tick asks
`overdue()` for the timeout report of a run past it; the lane stays blocked with the check. One-shot runs
(`run_once`: `trainguard check`, a round) hand the run to the check's own daemon thread (a Worker, kept between
runs) and wait for it with the time budget. Either way a check blocked forever inside the kernel (statvfs on a dead
NFS mount) costs its parked thread, never the scheduler, the HTTP endpoint or shutdown; while it is blocked, further
runs of the check are skipped and reported as such, and the blocked run's late results are dropped. A check whose
hardware is absent raises CheckIdle: the run is `idle` (no result, so no incident), logged once when the check
turns idle.

Why the lane runs the check itself: handing each run to a second thread and waiting for it woke three threads per
run, and those wake-ups were most of what an idle agent did (trainguard.pipeline.schedule).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from trainguard.checks.base import Check, CheckIdle, PartialView
from trainguard.core.logs import kv
from trainguard.core.model import Result, Status
from trainguard.core.units import format_duration
from trainguard.core.worker import Worker

log = logging.getLogger("trainguard.runner")


@dataclass(frozen=True)
class RunReport:
    check: str
    started: float
    duration: float
    outcome: str  # ok | idle | error | timeout | skipped
    results: tuple[Result, ...]
    idle_reason: str | None = None  # why an idle run had nothing to watch
    partial: str | None = None  # why a run saw only part of what it watches (PartialView)
    seq: int = 0  # the runner's count of runs when this one began: later runs have higher (0: not from a runner)

    @property
    def complete(self) -> bool:
        """The run finished and saw everything it watches: a subject it did not report is OK (an idle run reports
        none). A partial view never resolves what it does not report."""
        return self.outcome in ("ok", "idle") and self.partial is None


class _Attempt:
    def __init__(self, seq: int, started: float = 0.0, t0: float = 0.0, deadline: float = math.inf) -> None:
        self.seq = seq
        self.started, self.t0, self.deadline = started, t0, deadline  # wall clock; monotonic start and deadline
        self.timed_out = False  # reported as a timeout (by `overdue`): its own results are dropped
        self.done = threading.Event()
        self.results: list[Result] = []
        self.error: BaseException | None = None
        self.idle: str | None = None
        self.partial: str | None = None


class CheckRunner:
    def __init__(self, check: Check, clock: Callable[[], float] = time.time,
                 on_deadline: Callable[[float], None] | None = None) -> None:
        self.check = check
        self._clock = clock
        self._on_deadline = on_deadline  # told each scheduled run's deadline (monotonic) as the run starts
        self._lock = threading.Lock()
        self._stuck: tuple[_Attempt, float] | None = None
        self._current: _Attempt | None = None  # the run going on the lane (run_here), for `overdue`
        self._seq = 0  # runs and skipped runs so far: orders their reports
        self._idle: str | None = None  # the reason while idle: logged on the change, not every run
        self._worker = Worker(f"check-{check.name}")  # runs the check; a blocked run holds it (skipped meanwhile)

    def close(self) -> None:
        """The check's thread ends once its run is done (the agent is stopping)."""
        self._worker.close()

    def _next(self) -> int:
        """The next run's number (called with the lock held)."""
        self._seq += 1
        return self._seq

    def _failure(self, started: float, duration: float, outcome: str, summary: str, seq: int) -> RunReport:
        result = Result(self.check.name, self.check.name, Status.UNKNOWN, summary, {"outcome": outcome})
        return RunReport(self.check.name, started, duration, outcome, (result,), seq=seq)

    def _blocked(self, started: float) -> RunReport | None:
        """The skipped report while an earlier run is still blocked past its timeout (called with the lock held)."""
        if self._stuck is None:
            return None
        attempt, since = self._stuck
        if not attempt.done.is_set():
            return self._failure(started, 0.0, "skipped", f"timed out after {self.check.settings.timeout:g}s; "
                                 f"previous run still blocked for {format_duration(started - since)}, run skipped",
                                 self._next())
        log.info("blocked check run returned", extra=kv(check=self.check.name, blocked_s=round(started - since, 1)))
        self._stuck = None
        return None

    def blocked(self) -> RunReport | None:
        """A run that came due while the check's previous run is blocked past its timeout: its skipped report, or
        None when no run is blocked (a run merely still going is not reported)."""
        with self._lock:
            return self._blocked(self._clock())

    def run_here(self) -> RunReport | None:
        """Run the check on this thread (its lane). None when the run went past its deadline: `overdue` reported it
        then, and what the run returned late is dropped."""
        started = self._clock()
        with self._lock:
            skipped = self._blocked(started)
            if skipped is not None:
                return skipped
            t0 = time.monotonic()
            attempt = self._current = _Attempt(self._next(), started, t0, t0 + self.check.settings.timeout)
        try:
            if self._on_deadline is not None:
                self._on_deadline(attempt.deadline)
            self._execute(attempt)
        finally:  # a BaseException from the check's code (SystemExit) leaves no run registered as going
            with self._lock:
                self._current = None
        if attempt.timed_out:  # set under the lock, before `_current` was cleared: no run can set it now
            return None
        return self._report(attempt, started, time.monotonic() - t0)

    def deadline(self) -> float:
        """The deadline (monotonic) of the lane's run going and not yet reported as a timeout; infinity if none."""
        with self._lock:
            attempt = self._current
            if attempt is None or attempt.timed_out or attempt.done.is_set():
                return math.inf
            return attempt.deadline

    def overdue(self, now: float | None = None) -> RunReport | None:
        """The timeout report of the lane's run once it is past its deadline (`now`, monotonic), given once per run.
        The run is then blocked: later runs are skipped until it returns."""
        now = time.monotonic() if now is None else now
        with self._lock:
            attempt = self._current
            if attempt is None or attempt.timed_out or attempt.done.is_set() or now < attempt.deadline:
                return None
            attempt.timed_out = True
            self._stuck = (attempt, attempt.started)
        timeout = self.check.settings.timeout
        log.warning("check timed out", extra=kv(check=self.check.name, timeout_s=timeout))
        return self._failure(attempt.started, now - attempt.t0, "timeout", f"timed out after {timeout:g}s",
                             attempt.seq)

    def run_once(self, stop: threading.Event | None = None) -> RunReport:
        started = self._clock()
        timeout = self.check.settings.timeout
        with self._lock:
            skipped = self._blocked(started)
            if skipped is not None:
                return skipped
            attempt = _Attempt(self._next())
        t0 = time.monotonic()
        self._worker.submit(lambda: self._execute(attempt))
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
                return self._failure(started, duration, "skipped", "agent shutting down", attempt.seq)
            log.warning("check timed out", extra=kv(check=self.check.name, timeout_s=timeout))
            return self._failure(started, duration, "timeout", f"timed out after {timeout:g}s", attempt.seq)
        return self._report(attempt, started, duration)

    def _report(self, attempt: _Attempt, started: float, duration: float) -> RunReport:
        if attempt.error is None:
            self._note_idle(attempt.idle)
        if attempt.idle is not None:
            return RunReport(self.check.name, started, duration, "idle", (), attempt.idle, seq=attempt.seq)
        if attempt.error is not None:
            err = attempt.error
            log.error("check failed", extra=kv(check=self.check.name, error=f"{type(err).__name__}: {err}"))
            return self._failure(started, duration, "error", f"check failed: {type(err).__name__}: {err}", attempt.seq)
        return RunReport(self.check.name, started, duration, "ok", tuple(attempt.results), partial=attempt.partial,
                         seq=attempt.seq)

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
            returned = self.check.run()
            results = list(returned)
            for result in results:
                if not isinstance(result, Result):
                    raise TypeError(f"run() returned {type(result).__name__}, not Result")
            attempt.results = results
            attempt.partial = returned.reason if isinstance(returned, PartialView) else None
        except CheckIdle as idle:
            attempt.idle = idle.reason
        except BaseException as exc:  # noqa: BLE001 - the runner alone turns a check's failure into data; a
            # SystemExit from a check's code too (as nothing caught, it read as a run that found nothing: resolved)
            attempt.error = exc
        finally:
            attempt.done.set()
