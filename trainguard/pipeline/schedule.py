"""When checks run: each check every `interval` seconds (its first run at start, then on a fixed grid from there, set
apart from the other checks' grids by a fraction of a second (`phase`), each run delayed by up to `jitter`), one run
of a check at a time (a run still going when the next is due skips that one; runs missed during a stall are one run,
not a burst), a tick that proves the agent still makes progress, and triggered runs for event-driven checks.

Each check has a lane: a daemon thread of its own (`run-NAME`) that sleeps until its check is due or triggered and
runs it itself, so a check stuck in the kernel (a dead NFS mount) holds its own lane and never the others or the
agent's exit. The tick has a thread of its own too (`tick`); besides the liveness it stands for, it tells about the
due points that passed while a lane was still in its run (`late`), which is where a blocked check's skipped runs are
reported. One wake-up per run and one per tick: three a run (a schedule thread's hand-off to a worker, its hand-off
to the check's thread, the result back) made about 1,150 wake-ups a minute in an idle agent, this about 250, for
some 15% less CPU (docs/benchmarks-history.md). The clock is monotonic: a wall clock stepped by NTP neither fires every
check at once nor stops them."""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable, Mapping

from trainguard.checks.base import MIN_INTERVAL
from trainguard.core.logs import kv

log = logging.getLogger("trainguard.schedule")

# The longest the tick sleeps. It wakes sooner when asked (`wake_at`: a run's deadline, a blocked lane's due point),
# so a timeout is reported at its deadline, not at the next tick; and every TICK_S for the rest: the liveness that
# `Engine.healthy` allows three ticks for, the agent's usage, silences ending, a lane's thread started again. At 1 s
# the tick was a third of an idle agent's wake-ups.
TICK_S = 5.0
LATE_EVERY_S = 1.0  # the tick looks at a lane blocked in a run at most this often


def next_grid(grid: float, now: float, interval: float) -> float:
    """The first point of the grid `grid + k * interval` after `now`: a run that came late (a stall, a suspended VM)
    is followed by one run at the next point, not by the runs it missed."""
    return grid + interval * (max(0, math.floor((now - grid) / interval)) + 1)


def phase(index: int, interval: float) -> float:
    """Where the `index`th check's grid sits within its interval: a fraction of a second (of the interval, if
    shorter), spread by the golden ratio so that no two checks of whole-second intervals ever come due together.
    Checks that ran at the same instants (a 15 s and a 30 s one) handed the interpreter's lock to each other at every
    system call of their runs: in the installed config about 270 of an idle agent's 530 thread wake-ups a minute."""
    return (index * 0.6180339887498949) % 1.0 * min(interval, 1.0)


class _Lane:
    """One check's place in the schedule; every field is read and written under `cond`."""

    def __init__(self, name: str, interval: float, jitter: float, now: float, offset: float = 0.0) -> None:
        self.name, self.interval, self.jitter, self.offset = name, interval, jitter, offset
        self.cond = threading.Condition()
        self.begin(now)  # due, grid
        self.triggered = False  # one more run asked for (at most one waits, however many events)
        self.busy = False  # in a run
        self.busy_since = 0.0  # when that run began (monotonic)
        self.late_at = -math.inf  # when the tick last told `late` about this lane
        self.thread: threading.Thread | None = None

    def begin(self, now: float) -> None:
        """The first run at once (`due`, the next scheduled run); the next at `offset` after it, then every interval
        (the grid, start + offset + k * interval; jitter moves a run, never the grid)."""
        self.due = now
        self.grid = now + self.offset - self.interval  # whose next point after now is now + offset (or + interval)

    def skip_past(self, now: float) -> None:
        """The due point passed while the lane was in a run: that run is skipped; the next one is on the grid."""
        self.grid = next_grid(self.grid, now, self.interval)
        self.due = self.grid + (random.uniform(0, self.jitter) if self.jitter else 0.0)


class Schedule:
    def __init__(self, intervals: Mapping[str, tuple[float, float]], run: Callable[[str], None],
                 tick: Callable[[], float | None], late: Callable[[str], None] | None = None,
                 tick_s: float = TICK_S) -> None:
        """`intervals`: check name -> (interval, jitter) in seconds; `run(name)` runs one check and never raises;
        `tick()`: the tick's work, returning the monotonic time it wants the next tick by (None: no sooner than
        `tick_s`); `late(name)`: a run of the check came due while its previous run was still going (that run is
        skipped)."""
        for name, (interval, jitter) in intervals.items():
            if not (MIN_INTERVAL <= interval < math.inf and 0 <= jitter < math.inf):
                raise ValueError(f"check {name}: interval must be at least {MIN_INTERVAL}s and jitter 0 or more, both "
                                 f"finite (got {interval}, {jitter})")
        self._run = run
        self._tick = tick
        self._tick_s = tick_s
        self._late = late
        now = time.monotonic()
        self._lanes = {name: _Lane(name, interval, jitter, now, phase(i, interval))
                       for i, (name, (interval, jitter)) in enumerate(intervals.items())}
        self._stopped = threading.Event()
        self._wake = threading.Condition()
        self._planned = -math.inf  # when the tick comes next (monotonic); -inf: the first at start

    def start(self) -> None:
        now = time.monotonic()
        for lane in self._lanes.values():
            with lane.cond:
                lane.begin(now)  # the first run, at once, is also what a trigger before start asked for
                lane.triggered = False
            self._start_lane(lane)
        threading.Thread(target=self._ticker, name="tick", daemon=True).start()

    def _start_lane(self, lane: _Lane) -> None:
        thread = threading.Thread(target=self._keep, args=(lane,), name=f"run-{lane.name}", daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:  # no thread to be had (a pids limit): the tick tries again
            log.error("check lane not started; retried at each tick", extra=kv(check=lane.name, error=exc,
                                                                              tick_s=self._tick_s))
            return
        with lane.cond:
            lane.thread = thread

    def _keep(self, lane: _Lane) -> None:
        """The lane's thread: wait for the check's next due point or a trigger, run it, again."""
        while True:
            with lane.cond:
                while True:
                    if self._stopped.is_set():
                        return
                    now = time.monotonic()
                    if lane.triggered:
                        lane.triggered = False
                        break
                    if now >= lane.due:
                        lane.skip_past(now)  # this run is the one due: the next is the grid point after now
                        break
                    lane.cond.wait(lane.due - now)
                lane.busy, lane.busy_since = True, now
            try:
                self._run(lane.name)
            except BaseException:  # `run` never raises by contract; if it does (even SystemExit from a check's
                # code), the check's next runs still come
                log.exception("check run failed", extra=kv(check=lane.name))
            with lane.cond:
                lane.busy = False
                now = time.monotonic()
                if now >= lane.due and not lane.triggered:  # due points passed during the run: skipped, not a burst
                    lane.skip_past(now)

    def _ticker(self) -> None:
        """The tick on a thread of its own, timed by itself: a slow tick (a busy state file) delays no check, and a
        blocked check delays no tick. It also reports the runs that came due while their lane was still in a run.
        It comes every `tick_s`, or sooner at what `tick()` returned, a busy lane's due point or a `wake_at`."""
        while True:
            with self._wake:
                while not self._stopped.is_set() and (now := time.monotonic()) < self._planned:
                    self._wake.wait(self._planned - now)
                if self._stopped.is_set():
                    return
                self._planned = math.inf  # a `wake_at` during this tick is kept for the next one
            now = time.monotonic()
            soonest = now + self._tick_s
            # The lanes first: a due point that passed while a run was still within its timeout is told to `late`
            # before the tick's work marks that run as timed out, so it is not reported as a skipped run.
            for lane in self._lanes.values():
                soonest = min(soonest, self._look_at(lane, now))
            try:
                wanted = self._tick()
                if wanted is not None:
                    soonest = min(soonest, wanted)
            except Exception:  # the tick is the liveness signal: its thread must outlive a failure
                log.exception("tick failed")
            with self._wake:
                self._planned = min(self._planned, soonest)

    def wake_at(self, when: float) -> None:
        """Have the tick come by `when` (monotonic) if it would come later: a run's deadline, registered as the run
        starts. One lock and a comparison; a wake-up only when the deadline is sooner than the next tick. (Before
        the first tick nothing is planned: it comes at start, and the tick's work returns the deadlines of the runs
        going then.)"""
        with self._wake:
            if when < self._planned:
                self._planned = when
                self._wake.notify()

    def _look_at(self, lane: _Lane, now: float) -> float:
        """A lane's missing thread started again, and a due point that passed during its run told to `late`; the
        time the tick should look again (the busy lane's next due point), or infinity."""
        with lane.cond:
            missing = lane.thread is None
            late = not missing and lane.busy and now >= lane.due
            if late:
                lane.skip_past(now)
                lane.late_at = now
            # A busy lane's skipped runs matter only when it is blocked: the tick comes at its due points (told a
            # second apart at least) once its run has gone on for a second. Not for an ordinary run the tick happened
            # to meet: the tick would then come with that check's every run (it is busy again at each due point).
            blocked = lane.busy and now - lane.busy_since >= LATE_EVERY_S
            again = max(lane.due, lane.late_at + LATE_EVERY_S) if blocked else math.inf
        if missing:
            self._start_lane(lane)
        if not late:
            return again
        log.debug("check run skipped: its previous run is still going", extra=kv(check=lane.name))
        if self._late is not None:
            try:
                self._late(lane.name)
            except Exception:
                log.exception("reporting a skipped run failed", extra=kv(check=lane.name))
        return again

    def trigger(self, name: str) -> None:
        """Run a check now (an event-driven check saw something). At most one run waits per check, so a flood of
        events costs a bounded number of runs, and no thread."""
        lane = self._lanes.get(name)
        if lane is None or self._stopped.is_set():  # a check the schedule does not know: nothing to run
            return
        with lane.cond:
            lane.triggered = True
            lane.cond.notify()

    def stop(self) -> None:
        self._stopped.set()
        with self._wake:
            self._wake.notify()
        for lane in self._lanes.values():
            with lane.cond:
                lane.cond.notify()
