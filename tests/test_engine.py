from __future__ import annotations

import os
import resource
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.conftest import HungMount, require_tool, wait_until
from trainguard.agent.configfile import parse_config
from trainguard.agent.http import HttpEndpoint
from trainguard.agent.status import status_document
from trainguard.checks.base import Check, CheckIdle
from trainguard.core.events import Event
from trainguard.core.model import Metric, Result, Status
from trainguard.notifiers.base import Notifier, NotifierError, NotifierSettings
from trainguard.pipeline.engine import Engine
from trainguard.pipeline.incidents import Operator
from trainguard.pipeline.runner import RunReport
from trainguard.pipeline.selfcheck import NAME as SELF_NAME
from trainguard.pipeline.store import Store
from trainguard.registry import CHECKS, NOTIFIERS, Registry


class Wedged(Check):
    """Blocks forever, as a check stuck inside the kernel would."""

    forever = threading.Event()

    def run(self) -> Sequence[Result]:
        self.forever.wait()
        return []


TEST_VALUE = Metric("trainguard_test_value", "A test value.", ("thing",))


class Flaky(Check):
    """Reports whatever status the test sets."""

    status = Status.OK
    metrics = (TEST_VALUE,)

    def run(self) -> Sequence[Result]:
        return [self.result("thing", self.status, f"thing is {self.status.name}",
                            samples=[TEST_VALUE(1.5, {"thing": "a"})])]


class Recording(Notifier):
    def __init__(self, name: str, settings: NotifierSettings) -> None:
        super().__init__(name, settings)
        self.events: list[Event] = []
        self.failures: list[NotifierError] = []

    def send(self, event: Event) -> None:
        if self.failures:
            raise self.failures.pop(0)
        self.events.append(event)


class Vanishing(Check):
    """Reports a fault until the test makes it idle, as a check whose hardware is absent."""

    idle = False

    def run(self) -> Sequence[Result]:
        if self.idle:
            raise CheckIdle("no such device on this node")
        return [self.result("dev0", Status.CRITICAL, "dev0 broken")]


class Slow(Check):
    """Its first run waits for the test: a long first round (a big kernel log backlog) while an event triggers a run."""

    release = threading.Event()
    started = threading.Event()
    runs = 0

    def run(self) -> Sequence[Result]:
        Slow.runs += 1
        mine = Slow.runs
        if mine == 1:
            Slow.started.set()
            Slow.release.wait(10)
        return [self.result(f"seen-by-run-{mine}", Status.WARNING, f"run {mine}")]


class Held(Check):
    """Its first run blocks until the test opens the gate; every run after reports OK. Notes what it is told to
    forget."""

    gate = threading.Event()
    cleared: list[str] = []

    def run(self) -> Sequence[Result]:
        self.gate.wait(30)
        return [self.result("held", Status.OK, "fine")]

    def clear(self, subject: str, at: float) -> None:
        Held.cleared.append(subject)
        if subject == "bad":
            raise OSError("state file unreadable")


REGISTRY = Registry(checks={**CHECKS, "wedged": Wedged, "flaky": Flaky, "vanishing": Vanishing, "slow": Slow,
                            "held": Held},
                    notifiers={**NOTIFIERS, "recording": Recording})


def make_engine(tmp_path: Path, checks: dict[str, Any], notifiers: dict[str, Any] | None = None) -> Engine:
    raw = {"agent": {"state_dir": str(tmp_path / "state"), "node_name": "node1"}, "checks": checks,
           "notifiers": notifiers or {"recording": {}}}
    return Engine(parse_config(raw, "test.toml", REGISTRY), REGISTRY)


@pytest.fixture
def running() -> Iterator[list[Any]]:
    """Collects engines and endpoints to stop after the test."""
    items: list[Any] = []
    yield items
    for item in reversed(items):
        item.stop()


def serve(engine: Engine, running: list[Any]) -> str:
    endpoint = HttpEndpoint(engine, "127.0.0.1", 0)
    endpoint.start()
    running.append(endpoint)
    return f"http://127.0.0.1:{endpoint.address[1]}"


def test_stuck_mount_does_not_stall_the_agent(tmp_path: Path, hung_mount: HungMount, running: list[Any]) -> None:
    engine = make_engine(tmp_path, {
        "nfs": {"type": "disk", "paths": [str(hung_mount.mountpoint)], "interval": "1s", "jitter": 0,
                "mount_timeout": "0.5s", "timeout": "2s"},
        "memory": {"interval": "1s", "jitter": 0},
    })
    running.append(engine)
    url = serve(engine, running)
    engine.start()
    memory_runs = engine.snapshot().checks["memory"].runs
    time.sleep(4.2)
    snap = engine.snapshot()
    assert snap.checks["memory"].runs - memory_runs >= 3  # cadence kept beside the stuck mount
    assert snap.checks["nfs"].runs >= 4
    last = snap.checks["nfs"].last
    assert last is not None and last.outcome == "ok"  # the disk check itself returns on time
    [result] = last.results
    assert result.status is Status.UNKNOWN and "mount not responding" in result.summary
    t0 = time.monotonic()
    metrics = requests.get(url + "/metrics", timeout=5)
    assert metrics.status_code == 200 and time.monotonic() - t0 < 1
    assert f'trainguard_check_status{{check="nfs",subject="{hung_mount.mountpoint}",type="disk"}} 3.0' in metrics.text
    assert hung_mount.statfs_calls() == 1
    assert requests.get(url + "/healthz", timeout=5).status_code == 200


def test_wedged_check_times_out_and_never_blocks_others_or_shutdown(tmp_path: Path, running: list[Any]) -> None:
    engine = make_engine(tmp_path, {
        "wedged": {"interval": "1s", "timeout": "0.5s", "jitter": 0},
        "flaky": {"interval": "1s", "jitter": 0},
    })
    running.append(engine)
    engine.start()
    time.sleep(3.2)
    snap = engine.snapshot()
    wedged = snap.checks["wedged"]
    assert wedged.timeouts == 1 and wedged.skipped >= 2
    assert wedged.last is not None and "previous run still blocked" in wedged.last.results[0].summary
    assert snap.checks["flaky"].runs >= 4
    assert engine.healthy()
    t0 = time.monotonic()
    engine.stop()
    assert time.monotonic() - t0 < 3
    assert not engine.healthy()


def test_a_blocked_lane_is_reported_by_the_tick_and_a_stalled_ingest_piles_nothing_up(
        tmp_path: Path, running: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The check runs on its lane, which stays blocked: the tick reports the timeout at the deadline (the run
    asked for a tick then), then a skipped run a second at most, on a worker of the check's. While that worker's
    ingest is stalled (the check's ingest lock held, as a stalled state file would), at most one report waits: the
    skipped runs of five seconds of ticks are counted, and one is ingested once the stall ends, not five."""
    engine = make_engine(tmp_path, {"wedged": {"interval": "0.2s", "timeout": "0.5s", "jitter": 0}})
    running.append(engine)
    ingested: list[float] = []
    observe = engine.tracker.observe

    def spy(*args: Any, **kwargs: Any) -> Any:
        ingested.append(time.monotonic())
        return observe(*args, **kwargs)

    monkeypatch.setattr(engine.tracker, "observe", spy)
    t0 = time.monotonic()
    engine.start()
    wait_until(lambda: engine.snapshot().checks["wedged"].timeouts == 1, 5, 0.05, what="the timeout report")
    assert time.monotonic() - t0 < 0.5 + 1.0  # the deadline (and a loaded machine's slack)
    wait_until(lambda: engine.snapshot().checks["wedged"].skipped >= 1, 5, 0.05, what="a skipped run")
    with engine._ingest_locks["wedged"]:
        before = engine.snapshot().checks["wedged"].skipped
        time.sleep(5.2)
        released = time.monotonic()
    time.sleep(0.5)
    assert engine.snapshot().checks["wedged"].skipped - before >= 3  # counted while the ingest was stalled
    assert 1 <= len([t for t in ingested if t >= released]) <= 2  # the one that waited (and a tick's since)
    assert engine.snapshot().checks["wedged"].runs < 25  # not a report per due point of the blocked lane


def test_an_operators_clear_does_not_wait_on_a_lane_blocked_past_its_timeout(tmp_path: Path,
                                                                            running: list[Any]) -> None:
    """A clear waits for a check's run (it must not change the history under it), but a run blocked in the kernel
    holds its lane for ever: the clear waits the check's timeout and the tick's second, resolves the incident, and
    the check forgets the subject's history before its next run; what the blocked run returns is dropped."""
    engine = make_engine(tmp_path, {"held": {"interval": "1s", "timeout": "0.5s", "jitter": 0}})
    running.append(engine)
    Held.gate.clear()
    Held.cleared.clear()
    engine.start()
    wait_until(lambda: engine.snapshot().checks["held"].timeouts == 1, 5, 0.05, what="the timeout report")
    wait_until(lambda: any(i.check == "held" for i in engine.tracker.incidents()), 5, 0.05, what="its incident")
    t0 = time.monotonic()
    events = engine.clear("held/held", Operator("root", 0, "remounted"))
    assert time.monotonic() - t0 < 0.5 + 1.0 + 1.0
    assert [e.kind.value for e in events] == ["resolved"]
    assert Held.cleared == []  # not under the blocked run
    Held.gate.set()  # the run returns: its results (the history the clear ended) are dropped
    wait_until(lambda: Held.cleared == ["held"], 5, 0.05, what="the history forgotten before the next run")
    assert not engine._forgotten["held"]  # applied once
    wait_until(lambda: (engine.snapshot().checks["held"].last or RunReport("", 0, 0, "", ())).outcome == "ok", 5, 0.05,
               what="a run after the clear")
    assert not any(i.check == "held" and i.firing for i in engine.tracker.incidents())


def test_a_deferred_forget_that_fails_leaves_the_others_forgotten(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    engine = make_engine(tmp_path, {"held": {}})
    Held.cleared.clear()
    engine._forgotten["held"] += [("bad", 1.0), ("good", 2.0)]
    with caplog.at_level("ERROR", logger="trainguard.engine"):
        engine._forget_deferred("held")
    assert Held.cleared == ["bad", "good"]  # both were asked; the first raised
    assert any(r.getMessage() == "check could not forget a subject" for r in caplog.records)
    assert not engine._forgotten["held"]


def test_a_late_report_older_than_the_latest_run_is_counted_but_changes_no_result(tmp_path: Path) -> None:
    """A timeout report waits on its worker while the blocked run returns and the next run is ingested: it still
    counts as a timeout, but its UNKNOWN must not follow (and undo) what that later run found."""
    engine = make_engine(tmp_path, {"flaky": {}})
    newer = RunReport("flaky", time.time(), 0.01, "ok", (), seq=5)
    engine.ingest(newer)
    older = RunReport("flaky", time.time() - 10, 0.5, "timeout",
                      (Result("flaky", "flaky", Status.UNKNOWN, "timed out after 0.5s"),), seq=3)
    engine._report_late(older)
    wait_until(lambda: engine.snapshot().checks["flaky"].timeouts == 1, 5, 0.02, what="the late report")
    state = engine.snapshot().checks["flaky"]
    assert state.last is newer and state.runs == 2
    assert not engine.tracker.incidents()  # no UNKNOWN incident from the older run
    engine._report_late(RunReport("flaky", time.time(), 0.5, "timeout",
                                  (Result("flaky", "flaky", Status.UNKNOWN, "timed out after 0.5s"),), seq=6))
    wait_until(lambda: engine.snapshot().checks["flaky"].timeouts == 2, 5, 0.02, what="the newer late report")
    assert engine.snapshot().checks["flaky"].last.seq == 6  # type: ignore[union-attr]
    assert [i.status for i in engine.tracker.incidents()] == [Status.UNKNOWN]
    engine.stop()


def test_incident_flow_to_notifier(tmp_path: Path, running: list[Any]) -> None:
    engine = make_engine(tmp_path, {"flaky": {"fire_after_runs": 2}})
    running.append(engine)
    notifier = engine.notifiers["recording"]
    assert isinstance(notifier, Recording)
    engine.dispatcher.start()
    Flaky.status = Status.CRITICAL
    engine.run_round()
    assert notifier.events == []
    engine.run_round()
    wait_until(lambda: len(notifier.events) == 1, 5)
    assert notifier.events[0].kind.value == "fired" and notifier.events[0].node == "node1"
    Flaky.status = Status.OK
    engine.run_round()
    wait_until(lambda: len(notifier.events) == 2, 5)
    assert notifier.events[1].kind.value == "resolved"


def test_transient_failures_retry_permanent_ones_drop(tmp_path: Path, running: list[Any]) -> None:
    engine = make_engine(tmp_path, {"flaky": {}})
    running.append(engine)
    notifier = engine.notifiers["recording"]
    assert isinstance(notifier, Recording)
    notifier.failures = [NotifierError("503 from upstream", retry_after=0.1)]
    engine.dispatcher.start()
    Flaky.status = Status.WARNING
    engine.run_round()
    wait_until(lambda: len(notifier.events) == 1, 5)
    assert engine.dispatcher.stats["recording"].failed == 1
    notifier.failures = [NotifierError("invalid_payload", permanent=True)]
    Flaky.status = Status.OK
    engine.run_round()
    wait_until(lambda: engine.dispatcher.stats["recording"].failed == 2, 5)
    # the failure is counted before the rejected row leaves the outbox: wait for that too (it raced once under load)
    wait_until(lambda: engine.store.outbox_stats() == {}, 5, what="the rejected notification dropped")
    assert len(notifier.events) == 1


def test_console_notifier_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], running: list[Any]) -> None:
    engine = make_engine(tmp_path, {"flaky": {}}, {"console": {}})
    running.append(engine)
    Flaky.status = Status.CRITICAL
    engine.run_round()
    engine.dispatcher.deliver_pending("console")
    err = capsys.readouterr().err
    assert "event=fired status=CRITICAL node=node1 check=flaky subject=thing" in err
    assert 'summary="thing is CRITICAL"' in err


def test_broken_check_constructor_becomes_unknown(tmp_path: Path) -> None:
    class Exploding(Check):
        def __init__(self, *a: Any) -> None:
            raise OSError("no such device")

        def run(self) -> Sequence[Result]:
            return []

    registry = Registry(checks={"exploding": Exploding}, notifiers={})
    engine = Engine(parse_config({"agent": {"state_dir": str(tmp_path)}, "checks": {"exploding": {}}}, "t", registry),
                    registry, store=Store(None))
    [report] = engine.run_round(ingest=False)
    assert report.results[0].status is Status.UNKNOWN
    assert report.results[0].summary == "check could not start: OSError: no such device"


def test_http_endpoints_and_promtool(tmp_path: Path, running: list[Any]) -> None:
    promtool = require_tool("promtool")
    engine = make_engine(tmp_path, {"flaky": {}, "wedged": {"timeout": "0.2s"},
                                    "disk": {"paths": ["/", str(tmp_path / "missing")]}, "memory": {}})
    running.append(engine)
    url = serve(engine, running)
    Flaky.status = Status.WARNING
    engine.run_round()
    engine.tick()
    metrics = requests.get(url + "/metrics", timeout=5)
    assert metrics.status_code == 200
    text = metrics.text
    for needle in ('trainguard_check_status{check="flaky",subject="thing",type="flaky"} 1.0',
                   'trainguard_check_timeouts_total{check="wedged"} 1.0',
                   'trainguard_incidents_firing{severity="unknown"} 2.0',
                   'trainguard_check_duration_seconds{check="disk"}',
                   'trainguard_check_last_run_timestamp_seconds{check="memory"}',
                   'trainguard_test_value{thing="a"} 1.5',
                   'trainguard_filesystem_avail_bytes{device=',
                   "trainguard_memory_available_bytes ",
                   "trainguard_agent_open_fds ", "trainguard_agent_max_fds ", "trainguard_agent_threads "):
        assert needle in text, needle
    lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert lint.returncode == 0 and lint.stdout.strip() == "" and lint.stderr.strip() == "", lint.stdout + lint.stderr

    status = requests.get(url + "/status", timeout=5).json()
    assert status["node"] == "node1"
    assert {i["check"] for i in status["incidents"]} == {"flaky", "wedged", "disk"}
    # over TCP: names, subjects and statuses; the summary on the control socket only
    assert status["checks"]["flaky"]["results"] == [{"check": "flaky", "subject": "thing", "status": "WARNING"}]
    assert status_document(engine)["checks"]["flaky"]["results"][0]["summary"] == "thing is WARNING"
    assert requests.get(url + "/healthz", timeout=5).text == "ok\n"
    assert requests.post(url + "/metrics", timeout=5).status_code == 405
    assert requests.get(url + "/nope", timeout=5).status_code == 404


def test_an_idle_check_opens_nothing_alerts_on_nothing_and_says_so_in_metrics(tmp_path: Path, running: list[Any]) -> None:
    engine = make_engine(tmp_path, {"vanishing": {}})
    running.append(engine)
    url = serve(engine, running)
    engine.run_round()
    [incident] = engine.tracker.incidents()
    assert incident.firing and incident.check == "vanishing"
    Vanishing.idle = True
    try:
        engine.run_round()
        engine.run_round()
    finally:
        Vanishing.idle = False
    assert engine.tracker.incidents() == []  # an idle run is complete: what it no longer reports is resolved
    assert engine.tracker.firing_by_status()[Status.CRITICAL] == 0
    text = requests.get(url + "/metrics", timeout=5).text
    assert 'trainguard_check_idle{check="vanishing"} 1.0' in text
    assert 'trainguard_check_runs_total{check="vanishing",outcome="idle"} 2.0' in text
    assert 'trainguard_check_success{check="vanishing"} 1.0' in text
    assert 'trainguard_check_status{check="vanishing"' not in text  # no result, so no alert rule can match it
    status = requests.get(url + "/status", timeout=5).json()["checks"]["vanishing"]
    assert (status["outcome"], status["idle_reason"], status["results"]) == ("idle", "no such device on this node", [])


def test_a_run_triggered_during_the_first_round_is_ingested_after_it(tmp_path: Path) -> None:
    """The first round (engine.start) and a run an XID triggers meanwhile never overlap: else the round's older
    report, ingested last, resolves what the triggered run found."""
    engine = make_engine(tmp_path, {"slow": {"timeout": "20s"}})
    round_thread = threading.Thread(target=engine.run_round)
    round_thread.start()
    assert Slow.started.wait(5)
    triggered = threading.Thread(target=engine.run_check, args=("slow",))
    triggered.start()
    time.sleep(0.2)
    assert triggered.is_alive()  # waiting for the round's run of the same check
    Slow.release.set()
    round_thread.join(10)
    triggered.join(10)
    last = engine.snapshot().checks["slow"].last
    assert last is not None and [r.summary for r in last.results] == ["run 2"]
    assert {i.subject for i in engine.tracker.incidents()} == {"seen-by-run-2"}
    engine.stop()


def test_the_endpoint_sleeps_between_requests_and_stops_once(tmp_path: Path) -> None:
    """The server thread waits on its socket and a pipe, not on a poll timeout: idle it uses no CPU; stop() ends it at
    once, and a second stop() touches no descriptor (the pipe's numbers may belong to another file by then)."""
    engine = make_engine(tmp_path, {"memory": {}})
    endpoint = HttpEndpoint(engine, "127.0.0.1", 0)
    endpoint.start()
    url = f"http://127.0.0.1:{endpoint.address[1]}"
    try:
        assert requests.get(url + "/healthz", timeout=5).status_code in (200, 503)
        status = Path(f"/proc/self/task/{endpoint._thread.native_id}/status")

        def switches() -> int:
            return int(next(line.split()[1] for line in status.read_text().splitlines()
                            if line.startswith("voluntary_ctxt_switches:")))

        time.sleep(0.3)  # the request's own connection closing (its EOF) is the last wake it causes
        before = switches()
        time.sleep(1.5)
        assert switches() == before  # never woke in 1.5 s idle (with a 0.2 s poll it woke 7 times)
    finally:
        started = time.monotonic()
        endpoint.stop()
        assert time.monotonic() - started < 1.0 and not endpoint._thread.is_alive()
        endpoint.stop()
        engine.stop()


def test_the_agents_own_check_warns_while_its_descriptors_near_their_limit(tmp_path: Path) -> None:
    """The agent/fds result follows the descriptors this process really holds against its real RLIMIT_NOFILE."""
    raw = {"agent": {"state_dir": str(tmp_path / "state"), "node_name": "node1"}, "checks": {},
           "notifiers": {"recording": {}}}
    engine = Engine(parse_config(raw, "test.toml", REGISTRY), REGISTRY, self_check=True)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []
    try:
        engine.tick()
        limit = int(engine.own_usage()["fds"]) + 50
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))

        def fds_result() -> Result:
            engine._usage_at = float("-inf")  # the tick reads the usage every 5 s: now
            engine.tick()
            return next(r for r in engine.checks[SELF_NAME].run() if r.subject == "fds")

        assert fds_result().status is Status.OK
        held = [os.open("/dev/null", os.O_RDONLY) for _ in range(45)]
        warned = fds_result()
        assert warned.status is Status.WARNING and f"of {limit} file descriptors open" in warned.summary
        assert warned.details["limit"] == limit and warned.details["open"] > 0.8 * limit
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert fds_result().status is Status.OK
    engine.stop()
