"""When checks run: one APScheduler interval job per check (its first run at start, then every interval; jitter,
coalesced, one instance at a time), a one-second tick that proves the scheduler itself still makes progress, and
triggered runs for event-driven checks."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any

TICK_S = 1.0


class Schedule:
    def __init__(self, intervals: Mapping[str, tuple[float, float]], run: Callable[[str], None],
                 tick: Callable[[], None]) -> None:
        """`intervals`: check name -> (interval, jitter) in seconds; `run(name)` runs one check and never raises."""
        self._intervals = dict(intervals)
        self._run = run
        self._tick = tick
        self._lock = threading.Lock()
        self._queued: set[str] = set()
        self._stopped = threading.Event()
        self._scheduler: Any = None

    def start(self) -> None:
        from apscheduler.executors.pool import ThreadPoolExecutor
        from apscheduler.schedulers.background import BackgroundScheduler
        from apscheduler.triggers.interval import IntervalTrigger

        self._scheduler = BackgroundScheduler(
            executors={"default": ThreadPoolExecutor(max(4, len(self._intervals) + 2)), "tick": ThreadPoolExecutor(1)},
            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": None},
            timezone="UTC",
        )
        now = datetime.now(timezone.utc)
        for name, (interval, jitter) in self._intervals.items():  # the first run of every check is due now
            self._scheduler.add_job(self._run, IntervalTrigger(seconds=interval, jitter=jitter or None), args=[name],
                                    id=f"check:{name}", name=name, next_run_time=now)
        self._scheduler.add_job(self._tick, IntervalTrigger(seconds=TICK_S), id="tick", executor="tick")
        self._scheduler.start()

    def trigger(self, name: str) -> None:
        """Run a check now (an event-driven check saw something). At most one run waits per check, so a flood of
        events costs a bounded number of runs."""
        with self._lock:
            if name in self._queued or self._stopped.is_set():
                return
            self._queued.add(name)

        def run() -> None:
            with self._lock:
                self._queued.discard(name)
            self._run(name)

        threading.Thread(target=run, name=f"trigger-{name}", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=False)
            self._scheduler = None
