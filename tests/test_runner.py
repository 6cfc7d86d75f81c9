from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.conftest import wait_until
from trainguard.checks.base import Check, CheckContext, CheckIdle, CheckSettings
from trainguard.core.model import Result, Status
from trainguard.pipeline.runner import CheckRunner, RunReport

CTX = CheckContext("node1", Path("/tmp"))


class Blocking(Check):
    """Blocks until released, like statvfs on a dead mount."""

    def __init__(self, name: str = "blocking", timeout: float = 0.3) -> None:
        super().__init__(name, CheckSettings(timeout=timeout), CTX)
        self.release = threading.Event()
        self.calls = 0

    def run(self) -> Sequence[Result]:
        self.calls += 1
        self.release.wait()
        return [self.result("x", Status.OK, "fine")]


class Raising(Check):
    def run(self) -> Sequence[Result]:
        raise RuntimeError("nvml exploded")


class WrongType(Check):
    def run(self) -> Sequence[Result]:
        return ["not a result"]  # type: ignore[list-item]


def test_exception_becomes_unknown() -> None:
    report = CheckRunner(Raising("gpu", CheckSettings(), CTX)).run_once()
    assert report.outcome == "error"
    [result] = report.results
    assert result.status is Status.UNKNOWN
    assert result.subject == "gpu"
    assert result.summary == "check failed: RuntimeError: nvml exploded"


def test_wrong_return_type_becomes_unknown() -> None:
    report = CheckRunner(WrongType("w", CheckSettings(), CTX)).run_once()
    assert report.outcome == "error"
    assert "not Result" in report.results[0].summary


def test_timeout_then_skip_until_the_blocked_run_returns() -> None:
    check = Blocking()
    runner = CheckRunner(check)
    t0 = time.monotonic()
    report = runner.run_once()
    assert time.monotonic() - t0 < 1.0
    assert report.outcome == "timeout"
    assert report.results[0].summary == "timed out after 0.3s"
    for _ in range(3):
        skipped = runner.run_once()
        assert skipped.outcome == "skipped"
        assert skipped.results[0].status is Status.UNKNOWN
        assert "previous run still blocked" in skipped.results[0].summary
    assert check.calls == 1  # no second run piled up behind the blocked one
    check.release.set()
    time.sleep(0.05)
    ok = runner.run_once()
    assert ok.outcome == "ok"
    assert ok.results[0].summary == "fine"
    assert check.calls == 2


class Where(Check):
    """Notes the thread each run happens on."""

    def __init__(self) -> None:
        super().__init__("where", CheckSettings(), CTX)
        self.threads: list[threading.Thread] = []

    def run(self) -> Sequence[Result]:
        self.threads.append(threading.current_thread())
        return [self.result("x", Status.OK, "fine")]


def test_runs_share_the_checks_thread_until_close() -> None:
    """A thread per run cost more CPU than a check every 2 s does; the check's thread is kept between its runs."""
    check = Where()
    runner = CheckRunner(check)
    for _ in range(5):
        assert runner.run_once().outcome == "ok"
    assert len(set(check.threads)) == 1 and check.threads[0].name == "check-where"
    assert check.threads[0] is not threading.current_thread()
    runner.close()
    check.threads[0].join(5)
    assert not check.threads[0].is_alive()


def test_stop_event_cuts_the_wait_short() -> None:
    check = Blocking(timeout=30)
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    t0 = time.monotonic()
    report = CheckRunner(check).run_once(stop)
    assert time.monotonic() - t0 < 2.0
    assert report.outcome == "skipped"
    check.release.set()


class Absent(Check):
    """Idle until its hardware appears, as a check over NVML on a CPU-only node."""

    present = False

    def run(self) -> Sequence[Result]:
        if not self.present:
            raise CheckIdle("no such hardware here")
        return [self.result("dev0", Status.OK, "present")]


def test_idle_is_its_own_outcome_logged_once_per_change(caplog: pytest.LogCaptureFixture) -> None:
    check = Absent("hw", CheckSettings(), CTX)
    runner = CheckRunner(check)
    with caplog.at_level(logging.INFO, logger="trainguard.runner"):
        for _ in range(3):
            report = runner.run_once()
            assert (report.outcome, report.results, report.idle_reason) == ("idle", (), "no such hardware here")
            assert report.complete  # the run finished: nothing it watched is left open
        check.present = True
        woke = runner.run_once()
    assert woke.outcome == "ok" and woke.results[0].summary == "present"
    lines = [(r.getMessage(), r.__dict__["kv"]) for r in caplog.records]
    assert lines == [("check idle: what it watches is absent here", {"check": "hw", "reason": "no such hardware here"}),
                     ("check active: what it watches is present again", {"check": "hw"})]


def test_a_run_on_its_lane_is_reported_timed_out_once_then_skipped_and_its_late_results_dropped(
        caplog: pytest.LogCaptureFixture) -> None:
    """The agent's runs happen on the check's lane (`run_here`): the tick asks `overdue` for the timeout report of a
    run past its deadline; while the run stays blocked, each run that comes due gets a skipped report (`blocked`);
    what the run returns once it is released is dropped: the timeout said what there is to say about that run."""
    check = Blocking(timeout=0.3)
    runner = CheckRunner(check)
    returned: list[RunReport | None] = []
    lane = threading.Thread(target=lambda: returned.append(runner.run_here()), name="run-blocking", daemon=True)
    lane.start()
    wait_until(lambda: check.calls == 1, 5, 0.01, what="the run to begin")
    assert runner.overdue() is None  # not yet past its deadline
    assert runner.blocked() is None  # a run merely still going is not a skipped one
    time.sleep(0.35)
    with caplog.at_level(logging.INFO, logger="trainguard.runner"):
        timeout = runner.overdue()
        assert timeout is not None and timeout.outcome == "timeout"
        assert timeout.results[0].summary == "timed out after 0.3s" and timeout.results[0].status is Status.UNKNOWN
        assert runner.overdue() is None  # once per run
        skipped = runner.blocked()
        assert skipped is not None and skipped.outcome == "skipped"
        assert "previous run still blocked" in skipped.results[0].summary
        assert runner.run_once().outcome == "skipped"  # a one-shot run meanwhile is skipped as well
        assert check.calls == 1
        check.release.set()
        lane.join(5)
        assert returned == [None]  # the late results are dropped
        assert runner.blocked() is None  # ... and the check runs again
        again = runner.run_here()
    assert again is not None and again.outcome == "ok" and again.results[0].summary == "fine"
    assert check.calls == 2
    assert any(r.getMessage() == "blocked check run returned" for r in caplog.records)


def test_a_run_on_its_lane_happens_on_the_callers_thread() -> None:
    check = Where()
    runner = CheckRunner(check)
    for _ in range(3):
        report = runner.run_here()
        assert report is not None and report.outcome == "ok"
    assert set(check.threads) == {threading.current_thread()}  # no hand-off to a second thread
    assert runner.overdue(time.monotonic() + 3600) is None  # nothing going: nothing overdue


class Exiting(Check):
    """Check code that calls sys.exit: a failure of the check, not a run that found nothing."""

    def run(self) -> Sequence[Result]:
        raise SystemExit(3)


def test_a_system_exit_from_a_checks_code_is_its_failure_on_either_path() -> None:
    runner = CheckRunner(Exiting("exiting", CheckSettings(), CTX))
    for report in (runner.run_once(), runner.run_here()):
        assert report is not None and report.outcome == "error"
        assert report.results[0].summary == "check failed: SystemExit: 3"
        assert not report.complete  # it resolves nothing
    first, then = runner.run_once(), runner.run_here()
    assert then is not None and then.seq > first.seq  # later runs, higher numbers
