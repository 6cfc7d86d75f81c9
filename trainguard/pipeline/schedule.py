"""When checks run: each check every `interval` seconds (its first run at start, then on a fixed grid from there, each
run delayed by up to `jitter`), one run of a check at a time (a run still going when the next is due skips that one;
runs missed during a stall are one run, not a burst), a one-second tick that proves the scheduler itself still makes
progress, and triggered runs for event-driven checks.

One thread keeps the schedule (`schedule`); each check's runs go to a daemon thread of its own (`run-NAME`, kept
between runs), so a check stuck in the kernel (a dead NFS mount) holds its threads and never the others or the
agent's exit. The clock is monotonic: a wall clock
stepped by NTP neither fires every check at once nor stops them."""

from __future__ import annotations

import heapq
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Mapping

from trainguard.checks.base import MIN_INTERVAL
from trainguard.core.logs import kv
from trainguard.core.worker import Worker

log = logging.getLogger("trainguard.schedule")

TICK_S = 1.0


def next_grid(grid: float, now: float, interval: float) -> float:
    """The first point of the grid `grid + k * interval` after `now`: a run that came late (a stall, a suspended VM)
    is followed by one run at the next point, not by the runs it missed."""
    return grid + interval * (max(0, math.floor((now - grid) / interval)) + 1)


class Schedule:
    def __init__(self, intervals: Mapping[str, tuple[float, float]], run: Callable[[str], None],
                 tick: Callable[[], None]) -> None:
        """`intervals`: check name -> (interval, jitter) in seconds; `run(name)` runs one check and never raises."""
        for name, (interval, jitter) in intervals.items():
            if not (MIN_INTERVAL <= interval < math.inf and 0 <= jitter < math.inf):
                raise ValueError(f"check {name}: interval must be at least {MIN_INTERVAL}s and jitter 0 or more, both "
                                 f"finite (got {interval}, {jitter})")
        self._intervals = dict(intervals)
        self._run = run
        self._tick = tick
        self._lock = threading.Lock()
        self._busy: set[str] = set()  # checks with a run going (scheduled or triggered)
        self._again: set[str] = set()  # ... and triggered again meanwhile
        self._workers: dict[str, Worker] = {}  # a thread per check, kept between its runs
        self._stopped = threading.Event()
        self._tick_due = threading.Event()

    def start(self) -> None:
        now = time.monotonic()
        # (due, grid time, name): the grid is start + k * interval; jitter moves a run, never the grid.
        due = [(now, now, name) for name in self._intervals]
        heapq.heapify(due)
        threading.Thread(target=self._keep, args=(due,), name="schedule", daemon=True).start()
        threading.Thread(target=self._ticker, name="tick", daemon=True).start()

    def _keep(self, due: list[tuple[float, float, str]]) -> None:
        next_tick = time.monotonic()
        while not self._stopped.is_set():
            now = time.monotonic()
            while due and due[0][0] <= now:
                _, grid, name = heapq.heappop(due)
                self._launch(name)
                interval, jitter = self._intervals[name]
                grid = next_grid(grid, now, interval)
                heapq.heappush(due, (grid + (random.uniform(0, jitter) if jitter else 0.0), grid, name))
            if now >= next_tick:
                self._tick_due.set()
                next_tick = max(next_tick + TICK_S, now)
            self._stopped.wait(max(0.0, min(due[0][0] if due else math.inf, next_tick) - time.monotonic()))

    def _ticker(self) -> None:
        """The tick on a thread of its own: a slow tick (a busy state file) delays no check, and a wedged schedule
        stops the ticks, which is what /healthz and the systemd watchdog see."""
        while True:
            self._tick_due.wait()
            self._tick_due.clear()  # before the check: a stop() in between is seen, never cleared away
            if self._stopped.is_set():
                return
            try:
                self._tick()
            except Exception:  # the tick is the liveness signal: its thread must outlive a failure
                log.exception("tick failed")

    def _launch(self, name: str, triggered: bool = False) -> None:
        with self._lock:
            if self._stopped.is_set():
                return
            if name in self._busy:
                if triggered:  # seen after the run began reading: one more run when it ends, however many events
                    self._again.add(name)
                else:
                    log.debug("check run skipped: its previous run is still going", extra=kv(check=name))
                return
            self._busy.add(name)
            worker = self._workers.get(name)
            if worker is None:
                worker = self._workers[name] = Worker(f"run-{name}")
        try:
            worker.submit(lambda: self._runs(name))
        except RuntimeError as exc:  # no thread to be had (a pids limit): this run is lost, the next one is tried
            with self._lock:
                self._busy.discard(name)
            log.error("check run not started", extra=kv(check=name, error=exc))

    def _runs(self, name: str) -> None:
        again = True
        while again:
            try:
                self._run(name)
            except Exception:  # `run` never raises by contract; if it does, the check's next runs still come
                log.exception("check run failed", extra=kv(check=name))
            with self._lock:
                again = name in self._again and not self._stopped.is_set()
                self._again.discard(name)
                if not again:
                    self._busy.discard(name)

    def trigger(self, name: str) -> None:
        """Run a check now (an event-driven check saw something). At most one run waits per check, so a flood of
        events costs a bounded number of runs, and no thread."""
        self._launch(name, triggered=True)

    def stop(self) -> None:
        self._stopped.set()
        self._tick_due.set()
        with self._lock:
            for worker in self._workers.values():
                worker.close()
