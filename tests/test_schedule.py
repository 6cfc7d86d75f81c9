"""The scheduler on real threads and the real clock, with intervals of a tenth of a second (bounds leave room for a
loaded machine)."""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter

import pytest

from tests.conftest import wait_until
from trainguard.pipeline.schedule import TICK_S, Schedule, next_grid, phase


def test_the_grid_point_after_a_late_run_is_one_run_not_the_missed_ones() -> None:
    assert next_grid(100.0, 100.0, 5.0) == 105.0  # on time
    assert next_grid(100.0, 103.0, 5.0) == 105.0  # a little late: the grid holds
    assert next_grid(100.0, 117.0, 5.0) == 120.0  # three points missed in a stall: the next one, once
    assert next_grid(100.0, 99.0, 5.0) == 105.0  # jitter ran it before its grid point (cannot, but harmless)


def test_each_check_runs_at_start_then_every_interval() -> None:
    runs: Counter[str] = Counter()
    first: dict[str, float] = {}
    t0 = time.monotonic()

    def run(name: str) -> None:
        first.setdefault(name, time.monotonic() - t0)
        runs[name] += 1

    schedule = Schedule({"fast": (0.1, 0.0), "slow": (0.5, 0.0), "jittery": (0.1, 0.05)}, run, lambda: None)
    schedule.start()
    try:
        time.sleep(1.0)
    finally:
        schedule.stop()
    assert first["fast"] < 0.3 and first["slow"] < 0.3  # no wait of an interval before the first run
    assert 5 <= runs["fast"] <= 12
    assert 2 <= runs["slow"] <= 3
    assert 4 <= runs["jittery"] <= runs["fast"]  # jitter delays runs, never adds any


def test_a_run_still_going_skips_the_runs_due_meanwhile() -> None:
    release = threading.Event()
    active, most, starts = [0], [0], []
    lock = threading.Lock()

    def run(name: str) -> None:
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
            starts.append(time.monotonic())
        if len(starts) == 1:
            release.wait(5)  # the first run hangs for 0.6 s: six of its successors come due meanwhile
        with lock:
            active[0] -= 1

    schedule = Schedule({"stuck": (0.1, 0.0)}, run, lambda: None)
    schedule.start()
    try:
        time.sleep(0.6)
        assert len(starts) == 1
        release.set()
        wait_until(lambda: len(starts) >= 3, 5, 0.02, what="runs after the hung one ended")
    finally:
        schedule.stop()
    assert most[0] == 1
    assert starts[2] - starts[1] >= 0.05  # no burst of the missed runs once it ended


def test_the_tick_comes_every_tick_s_outlives_its_failures_and_stops_with_the_schedule() -> None:
    ticks: list[float] = []

    def tick() -> None:
        ticks.append(time.monotonic())
        raise RuntimeError("outbox unreadable")

    schedule = Schedule({}, lambda name: None, tick, tick_s=0.3)
    schedule.start()
    wait_until(lambda: len(ticks) >= 3, 5, 0.05, what="three ticks")
    schedule.stop()
    time.sleep(0.6)
    stopped_at = len(ticks)
    time.sleep(0.6)
    assert len(ticks) == stopped_at
    assert 0.25 <= ticks[2] - ticks[1] <= 1.0
    assert TICK_S == 5.0  # the agent's: liveness, allowed 10 s by Engine.healthy


def test_the_tick_comes_sooner_when_its_work_or_a_run_asks() -> None:
    """A run's deadline is told to `wake_at` as the run starts, and the tick's work returns the soonest deadline it
    still waits for: a timeout is reported at its deadline, not up to a tick later. Between them the tick sleeps its
    whole `tick_s` (the idle agent's wake-ups)."""
    ticks: list[float] = []
    asked: list[float] = []

    during: list[float] = []

    def tick() -> float | None:
        ticks.append(time.monotonic())
        if during:
            schedule.wake_at(time.monotonic() + during.pop())
        return asked.pop() if asked else None

    schedule = Schedule({}, lambda name: None, tick, tick_s=30.0)
    schedule.start()
    try:
        wait_until(lambda: len(ticks) >= 1, 5, 0.02, what="the first tick, at start")
        time.sleep(0.3)
        assert len(ticks) == 1  # nothing asked: the next tick is 30 s away
        t = time.monotonic()
        schedule.wake_at(t + 0.2)
        schedule.wake_at(t + 60)  # later than the tick already planned: changes nothing
        wait_until(lambda: len(ticks) >= 2, 5, 0.02, what="the tick a run's deadline asked for")
        assert ticks[1] - t >= 0.19
        asked.append(time.monotonic() + 0.2)  # the work of the next tick asks for one more
        schedule.wake_at(time.monotonic())
        wait_until(lambda: len(ticks) >= 4, 5, 0.02, what="the tick the tick's own work asked for")
        assert ticks[3] - ticks[2] >= 0.19
        time.sleep(0.3)
        assert len(ticks) == 4
        during.append(0.2)  # a run that starts while the tick works: its deadline is kept for the next one
        schedule.wake_at(time.monotonic())
        wait_until(lambda: len(ticks) >= 6, 5, 0.02, what="the tick asked for during a tick")
        assert ticks[5] - ticks[4] >= 0.19
        time.sleep(0.3)
        assert len(ticks) == 6
    finally:
        schedule.stop()


def test_a_flood_of_triggers_is_at_most_one_waiting_run_per_check() -> None:
    gate = threading.Event()
    runs: list[str] = []

    def run(name: str) -> None:
        gate.wait(5)
        runs.append(name)

    schedule = Schedule({"kmsg": (3600.0, 0.0)}, run, lambda: None)
    before = threading.active_count()  # earlier tests' idle check threads may still be ending
    schedule.start()
    try:
        for _ in range(1000):
            schedule.trigger("kmsg")
        time.sleep(0.1)
        assert threading.active_count() <= before + 3  # schedule, tick, the check's run: the flood is one flag
        gate.set()
        wait_until(lambda: len(runs) >= 2, 5, 0.02, what="the runs to finish")
        time.sleep(0.2)
        assert runs == ["kmsg", "kmsg"]  # the run going when the flood began, then one for all of the flood
    finally:
        schedule.stop()


def test_a_stopped_schedule_starts_nothing() -> None:
    runs: list[str] = []
    schedule = Schedule({"a": (0.05, 0.0)}, runs.append, lambda: None)
    schedule.start()
    wait_until(lambda: runs, 5, 0.02, what="the first run")
    schedule.stop()
    time.sleep(0.1)
    count = len(runs)
    schedule.trigger("a")
    time.sleep(0.2)
    assert len(runs) == count


@pytest.mark.parametrize("interval, jitter", [(0.0, 0.0), (-1.0, 0.0), (1.0, -0.5), (float("nan"), 0.0), (1e-13, 0.0),
                                              (1.0, float("nan")), (float("inf"), 0.0)])
def test_an_interval_that_would_spin_or_never_come_is_refused_by_name(interval: float, jitter: float) -> None:
    """1e-13 s would make the grid's next point `now` for ever: the schedule thread would spin and run nothing."""
    with pytest.raises(ValueError, match=r"check disk: interval must be at least 0.01s and jitter 0 or more"):
        Schedule({"disk": (interval, jitter)}, lambda name: None, lambda: None)


def test_the_config_refuses_an_interval_shorter_than_the_schedule_takes() -> None:
    from trainguard.agent.configfile import ConfigError, parse_config

    for check in ("disk", "hang"):  # the common settings, and a check type with its own interval default
        with pytest.raises(ConfigError, match=rf"checks.{check}.interval: at least 0.01s"):
            parse_config({"checks": {check: {"interval": "0.005s"}}}, "trainguard.toml")


def test_a_run_that_raises_is_logged_and_leaves_no_pending_run_behind(caplog: pytest.LogCaptureFixture) -> None:
    gate = threading.Event()
    runs: list[int] = []

    def run(name: str) -> None:
        runs.append(1)
        if len(runs) == 1:
            gate.wait(5)
            raise RuntimeError("store closed")

    schedule = Schedule({"kmsg": (3600.0, 0.0)}, run, lambda: None)
    with caplog.at_level("ERROR", logger="trainguard.schedule"):
        schedule.start()
        try:
            wait_until(lambda: runs, 5, 0.02, what="the first run")
            schedule.trigger("kmsg")  # pending behind the run that will raise
            gate.set()
            wait_until(lambda: len(runs) == 2, 5, 0.02, what="the pending run")
            time.sleep(0.2)
            schedule.trigger("kmsg")
            wait_until(lambda: len(runs) == 3, 5, 0.02, what="the next trigger's run")
            time.sleep(0.2)
            assert len(runs) == 3  # one run per trigger: nothing left pending by the run that raised
        finally:
            schedule.stop()
    assert any("check run failed" in r.getMessage() and "store closed" in (r.exc_text or "") for r in caplog.records)


def test_each_check_runs_on_a_lane_of_its_own_and_a_blocked_lane_holds_no_other() -> None:
    """One thread per check, which runs the check itself: a run is one wake-up, not a hand-off between threads."""
    threads: dict[str, set[str]] = {"fast": set(), "stuck": set()}
    runs: Counter[str] = Counter()
    release = threading.Event()

    def run(name: str) -> None:
        threads[name].add(threading.current_thread().name)
        runs[name] += 1
        if name == "stuck":
            release.wait(5)

    schedule = Schedule({"fast": (0.05, 0.0), "stuck": (0.05, 0.0)}, run, lambda: None)
    schedule.start()
    try:
        time.sleep(0.5)
        assert threads == {"fast": {"run-fast"}, "stuck": {"run-stuck"}}  # every run of a check on its one lane
        assert runs["stuck"] == 1 and runs["fast"] >= 4  # the other lane keeps its cadence
    finally:
        release.set()
        schedule.stop()


def test_a_run_due_while_the_previous_one_is_going_is_told_to_late_from_the_tick() -> None:
    """`late(name)` is how a blocked check's skipped runs get reported: the tick sees the due points passing while
    the lane is still in its run (a lane in a run cannot see them itself). Once a run has gone on for a second, the
    tick comes at the lane's due points, a second apart at least, however long its own sleep."""
    release = threading.Event()
    runs: list[float] = []
    late: list[float] = []
    holder: list[Schedule] = []

    def run(name: str) -> None:
        runs.append(time.monotonic())
        if len(runs) == 1:
            time.sleep(0.3)  # past the first tick, at start (it would have seen the deadline, as the engine's does)
            holder[0].wake_at(time.monotonic() + 0.9)  # as a run's deadline does
            release.wait(10)

    schedule = Schedule({"nfs": (0.2, 0.0)}, run, lambda: None, lambda name: late.append(time.monotonic()),
                        tick_s=30.0)
    holder.append(schedule)
    schedule.start()
    try:
        wait_until(lambda: len(late) >= 3, 6, 0.05, what="three ticks seeing a due point pass during the run")
        assert len(runs) == 1
        assert late[0] - runs[0] >= 1.1 and all(b - a >= 0.9 for a, b in itertools.pairwise(late))
        release.set()
        wait_until(lambda: len(runs) >= 2, 5, 0.02, what="the runs after the blocked one")
        count = len(late)
        time.sleep(1.5)
        assert len(late) <= count + 1  # runs on time again: nothing late (but the tick that may have been planned)
        assert len(runs) >= 5
    finally:
        release.set()
        schedule.stop()


def test_the_tick_does_not_follow_a_check_whose_runs_it_happens_to_meet() -> None:
    """A tick that finds a lane in an ordinary run (the lane and the tick woke together) does not come back at that
    lane's due points: only a run going on for a second does that. Else the tick would come with every run of the
    2 s job_switch check."""
    ticks: list[float] = []

    def run(name: str) -> None:
        time.sleep(0.05)

    schedule = Schedule({"fast": (0.3, 0.0)}, run, lambda: ticks.append(time.monotonic()), tick_s=30.0)
    schedule.start()
    try:
        wait_until(lambda: len(ticks) >= 1, 5, 0.02, what="the first tick, at start, with the first run")
        time.sleep(2.0)
        assert len(ticks) == 1
    finally:
        schedule.stop()


def test_checks_of_commensurate_intervals_never_come_due_together() -> None:
    """After the first round (all at once), each check's grid is set apart by a fraction of a second: a 1 s, a 2 s and
    a 3 s check do not start their runs at the same instants, and each still runs once an interval."""
    starts: dict[str, list[float]] = {"one": [], "two": [], "three": []}
    t0 = time.monotonic()
    schedule = Schedule({"one": (1.0, 0.0), "two": (2.0, 0.0), "three": (3.0, 0.0)},
                        lambda name: starts[name].append(time.monotonic() - t0), lambda: None)
    schedule.start()
    try:
        time.sleep(6.5)
    finally:
        schedule.stop()
    assert all(times[0] < 0.3 for times in starts.values())  # the first round: at once
    later = sorted((t, name) for name, times in starts.items() for t in times[1:])
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(later) if a[1] != b[1]]
    assert min(gaps) > 0.1, later  # golden-ratio offsets: 0, 0.618, 0.236 s: 0.236 apart at the least
    for name, interval in (("one", 1.0), ("two", 2.0), ("three", 3.0)):
        steps = [b - a for a, b in itertools.pairwise(starts[name][1:])]
        assert steps and all(abs(step - interval) < 0.15 for step in steps), (name, starts[name])
    assert [phase(i, 30.0) for i in range(3)] == pytest.approx([0.0, 0.618, 0.236], abs=1e-3)
    assert phase(1, 0.1) == pytest.approx(0.0618, abs=1e-4)  # within a sub-second interval
