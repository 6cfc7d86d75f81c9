"""node_drain: a node SLURM is taking away (drained for a reboot or a repair) with a job on it asks the job to save and
leave; another drain is said; trainguard's own drain is its own incident's; a node without a job costs slurmctld
nothing. The parser reads real `sinfo --Node` rows (tests/data/slurm/README.md says where each came from)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_until
from tests.slurm_cluster import SlurmCluster, sh
from tests.test_incidents import Clock
from tests.test_slurm_jobs import engine_for, engines, find_job, log_has, toy
from trainguard.checks.base import CheckContext, CheckIdle
from trainguard.checks.node_drain import NodeDrainCheck, NodeDrainSettings
from trainguard.core.events import Event, EventKind
from trainguard.core.model import Status
from trainguard.jobs.catalog import JobView
from trainguard.jobs.model import Job
from trainguard.jobs.slurm import NodeRecord, SlurmError, parse_node
from trainguard.pipeline.engine import Engine
from trainguard.pipeline.incidents import IncidentPolicy, IncidentTracker
from trainguard.pipeline.runner import CheckRunner
from trainguard.pipeline.store import Store

__all__ = ["engines"]  # the fixture, imported for this module's tests
DATA = Path(__file__).parent / "data" / "slurm"


def check(**settings: Any) -> NodeDrainCheck:
    return NodeDrainCheck("node_drain", NodeDrainSettings(**settings), CheckContext("n1", Path("/nonexistent")))


def test_the_parser_reads_real_node_rows() -> None:
    idle = parse_node((DATA / "sinfo-node-idle.txt").read_text(), "n2")
    assert idle == NodeRecord("IDLE") and idle.base == "IDLE" and idle.flags == frozenset() and not idle.drained
    ours = parse_node((DATA / "sinfo-node-drained-trainguard.txt").read_text(), "n1")
    assert ours is not None and ours.drained and ours.trainguards and ours.flags == {"COMPLETING", "DRAIN"}
    assert ours.reason.startswith("trainguard: GPU 0") and ours.reason.endswith("then nvidia-smi -r or reboot)")
    assert ours.reason_by == "root" and ours.reason_at
    assert parse_node((DATA / "sinfo-node-idle.txt").read_text(), "n1") is None  # another node's row
    assert parse_node("", "n1") is None and parse_node("n1|\x00|||", "n1") == NodeRecord("\x00")
    window = parse_node((DATA / "sinfo-node-maint.txt").read_text(), "vm")
    assert window == NodeRecord("ALLOCATED+MAINTENANCE+RESERVED") and not window.drained
    assert check().evaluate(window)[0] is Status.WARNING


@pytest.mark.parametrize("reason", [
    "Scheduled [CHG0042] kernel upgrade", "ticket id=5: reboot at 23:00", "PSU | fan swap: power cycle",
    # a health checker's message quoting a user's process, named to look like more fields
    "NHC: check_ps: process a|root|2026-01-01T00:00:00|reboot",
])
def test_a_reason_is_the_rows_last_field_whatever_it_holds(reason: str) -> None:
    """A foreign drain of a node running a job (built on the captured row: the tests' clusters run no other)."""
    real = (DATA / "sinfo-node-drained-trainguard.txt").read_text()
    row = "mixed+drain|root|2026-11-29T22:26:53|" + reason
    record = parse_node(real.replace(real.split("|", 1)[1], row + "\n") + "n1|idle|Unknown|Unknown|none\n", "n1")
    assert record == NodeRecord("MIXED+DRAIN", reason, "root", parse_node(real, "n1").reason_at)  # type: ignore[union-attr]
    expected = Status.WARNING if reason.startswith("NHC") else Status.CRITICAL
    assert check().evaluate(record)[0] is expected


@pytest.mark.parametrize(("state", "reason", "status"), [
    ("ALLOCATED", "", Status.OK),
    ("MIXED+DRAIN", "maintenance: host reboot", Status.CRITICAL),
    ("ALLOCATED+DRAIN", "Kernel upgrade to 6.8", Status.CRITICAL),
    ("ALLOCATED+DRAIN", "RMA: GPU 3 replaced next week", Status.CRITICAL),
    ("ALLOCATED+DRAIN", "information gathering (format disk later)", Status.WARNING),  # no word starts so
    ("ALLOCATED+DRAIN", "Kill task failed", Status.WARNING),  # SLURM's own drain: said, the job may finish
    # NHC's drains begin `NHC:` (its offline helper's leader); the rest is a check's message, which may quote a
    # user's process name (this one made up): its words never stop the node's jobs
    ("MIXED+DRAIN", "NHC: check_ps_unauth_users: process reboot-now of user tgjob", Status.WARNING),
    ("ALLOCATED+DRAIN", "trainguard: GPU 3 fell off the bus (XID 79)", Status.OK),  # its own incident acts
    ("ALLOCATED+DRAIN+REBOOT_REQUESTED", "trainguard: lemon", Status.CRITICAL),  # `scontrol reboot ASAP` on it
    ("MIXED+DRAIN+REBOOT_REQUESTED", "", Status.CRITICAL),
    ("MIXED+REBOOT_REQUESTED", "", Status.WARNING),  # `scontrol reboot`: once idle; jobs still start here
    ("MIXED+POWERING_DOWN", "", Status.CRITICAL),
    ("ALLOCATED*+DRAIN", "maint window", Status.CRITICAL),
    ("ALLOCATED+MAINTENANCE+RESERVED", "", Status.WARNING),  # a maintenance reservation has begun (the capture's)
    ("MIXED+MAINT", "", Status.WARNING),  # the flag's name in SLURM's code (NODE_STATE_MAINT)
])
def test_what_a_job_on_a_node_in_each_state_is_told(state: str, reason: str, status: Status) -> None:
    got, said = check().evaluate(NodeRecord(state, reason, "root", 1_790_000_000.0))
    assert got is status, said
    if reason and status is not Status.OK:
        assert repr(reason) in said and "by root" in said


def test_leave_reasons_are_words_matched_at_their_start() -> None:
    assert check(leave_reasons=["Swap"]).evaluate(NodeRecord("MIXED+DRAIN", "PSU swap"))[0] is Status.CRITICAL
    assert check(leave_reasons=["swap"]).evaluate(NodeRecord("MIXED+DRAIN", "hotswap"))[0] is Status.WARNING
    assert check(leave_reasons=[]).evaluate(NodeRecord("MIXED+DRAIN", "reboot"))[0] is Status.WARNING
    for bad in ([""], ["re.*boot"], ["x" * 33]):
        with pytest.raises(ValueError, match="a word of letters and digits"):
            NodeDrainSettings(leave_reasons=bad)
    nhc = NodeRecord("MIXED+DRAIN", "  nhc: check_ps: process reboot of user tgjob")
    assert check(checker_reasons=[" NHC: "]).evaluate(nhc)[0] is Status.WARNING  # blanks stripped, as the reason's
    with pytest.raises(ValueError, match="not blank"):
        NodeDrainSettings(checker_reasons=[" "])


def test_a_maintenance_window_is_said_or_asks_the_job_to_leave_as_the_site_says() -> None:
    window = NodeRecord("MIXED+MAINT")
    assert check(maintenance="critical").evaluate(window)[0] is Status.CRITICAL
    assert check(maintenance="ok").evaluate(window)[0] is Status.OK
    status, said = check().evaluate(window)
    assert status is Status.WARNING and said == "the node's maintenance window has begun (MIXED+MAINT): the site's " \
                                               "work may take the node"
    # a drain says more than the window: its own status, whatever the window's
    assert check(maintenance="ok").evaluate(NodeRecord("MIXED+DRAIN+MAINT", "reboot"))[0] is Status.CRITICAL
    assert check().evaluate(NodeRecord("MIXED+DRAIN+MAINT", "Kill task failed"))[0] is Status.WARNING
    assert check(maintenance="critical").evaluate(NodeRecord("MIXED+DRAIN+MAINT", "Kill task failed"))[0] \
        is Status.CRITICAL


def test_a_job_whose_batch_host_goes_gets_the_batch_host_actions() -> None:
    """Its batch script, and the relaunch loop in it, go down with the node: a restart without the node cannot keep
    it; the others restart without the node."""
    plain = check(actions={"critical": ["restart_elsewhere"]})
    both = check(actions={"critical": ["restart_elsewhere"]}, batch_host_actions={"critical": ["signal", "requeue"]})

    def bound(c: NodeDrainCheck, batch_host: bool) -> list[str]:
        ev = Event(EventKind.FIRED, "i1", "node_drain", "slurm:7", Status.CRITICAL, "s", "node", 0.0, 0.0,
                   details={"job_key": "slurm:7", "batch_host": batch_host})
        return c.actions_for(ev).critical
    assert bound(both, True) == ["signal", "requeue"] and bound(both, False) == ["restart_elsewhere"]
    assert bound(plain, True) == ["restart_elsewhere"]  # None: `actions` for every job


@dataclass
class _Client:
    record: NodeRecord = field(default_factory=NodeRecord)
    error: Exception | None = None
    asked: list[str] = field(default_factory=list)

    def node(self, node: str) -> NodeRecord:
        self.asked.append(node)
        if self.error:
            raise self.error
        return self.record


@dataclass
class _Catalog:
    jobs: list[Job]
    slurm: _Client
    sources: tuple[str, ...] = ("slurm",)
    node: str = "n1"
    errors: dict[str, str] = field(default_factory=dict)

    def view(self) -> JobView:
        return JobView(tuple(self.jobs), dict(self.errors))


def _job(job_id: str, source: str = "slurm") -> Job:
    return Job(key=f"{source}:{job_id}", source=source, name="llm", state="RUNNING", job_id=job_id, on_this_node=True)


def run(catalog: _Catalog, **settings: Any) -> list[Any]:
    ctx = CheckContext("n1", Path("/nonexistent"), jobs=catalog)  # type: ignore[arg-type]
    return list(NodeDrainCheck("node_drain", NodeDrainSettings(**settings), ctx).run())


def test_a_node_without_a_slurm_job_costs_slurmctld_nothing() -> None:
    client = _Client(NodeRecord("IDLE+DRAIN", "maintenance"))
    assert run(_Catalog([], client)) == [] and client.asked == []
    assert run(_Catalog([_job("7", source="process")], client)) == [] and client.asked == []
    with pytest.raises(CheckIdle):
        run(_Catalog([_job("7")], client, sources=("process",)))
    [one, two] = run(_Catalog([_job("7"), _job("8")], client))
    assert client.asked == ["n1"]  # one RPC a run, however many jobs
    assert (one.subject, one.status, two.subject) == ("slurm:7", Status.CRITICAL, "slurm:8")
    assert one.details["job_id"] == "7" and one.details["leaving"] and one.details["reason"] == "maintenance"
    assert one.details["batch_host"] is False


def test_a_controller_that_does_not_answer_is_unknown_not_a_drain() -> None:
    [result] = run(_Catalog([_job("7")], _Client(error=SlurmError("sinfo: timed out after 10s"))), unknown_after=0)
    assert result.status is Status.UNKNOWN and result.subject == "node:n1" and "timed out" in result.summary
    assert not NodeDrainSettings().alert_on_unknown  # a controller down: the cluster's one fault, not every node's


def test_a_short_silence_of_the_controller_is_not_said_by_every_node() -> None:
    """slurmctld restarting: every node with a job would open an UNKNOWN incident at once. Said once the silence
    outlasts `unknown_after`; an answer starts the count again."""
    clock = Clock()
    client = _Client(NodeRecord("MIXED"), error=SlurmError("sinfo: timed out after 10s"))
    ctx = CheckContext("n1", Path("/nonexistent"), clock=clock, jobs=_Catalog([_job("7")], client))  # type: ignore[arg-type]
    drain = NodeDrainCheck("node_drain", NodeDrainSettings(unknown_after="5m"), ctx)
    assert list(drain.run()) == []
    clock.now += 299
    assert list(drain.run()) == []
    clock.now += 1
    [unknown] = drain.run()
    assert unknown.status is Status.UNKNOWN and "silent for 300s" in unknown.summary
    client.error = None
    assert [r.status for r in drain.run()] == [Status.OK]
    client.error = SlurmError("sinfo: timed out after 10s")
    clock.now += 60
    assert list(drain.run()) == []


def test_a_silent_controller_neither_resolves_a_jobs_incident_nor_runs_its_actions_again() -> None:
    """Through the real runner into the tracker: drained for a reboot (fired: the actions ran), then slurmctld silent
    for a run, then drained still: one incident, fired once. Resolved by the silence, it would fire again at the
    controller's return and signal (or requeue) the job a second time. A failed job source (no job listed) too."""
    client = _Client(NodeRecord("MIXED+DRAIN", "maintenance: host reboot"))
    catalog = _Catalog([_job("7")], client)
    ctx = CheckContext("n1", Path("/nonexistent"), jobs=catalog)  # type: ignore[arg-type]
    runner = CheckRunner(NodeDrainCheck("node_drain", NodeDrainSettings(unknown_after=0), ctx))
    tracker = IncidentTracker(Store(None), "n1", Clock())
    fired: list[str] = []

    def once() -> None:
        report = runner.run_once()
        events = tracker.observe("node_drain", report.results, IncidentPolicy(), report.complete, lambda e: [])
        fired.extend(e.subject for e in events if e.kind is EventKind.FIRED)
        assert not [e for e in events if e.kind is EventKind.RESOLVED and e.subject == "slurm:7"], events

    once()
    client.error = SlurmError("scontrol show: timed out after 10s")
    once()
    client.error, catalog.jobs, catalog.errors = None, [], {"slurm": "scontrol listpids: timed out after 10s"}
    once()
    catalog.jobs, catalog.errors = [_job("7")], {}
    once()
    assert fired == ["slurm:7", "node:n1", "source:slurm"] and [i.subject for i in tracker.incidents()] == ["slurm:7"]


# the real thing: the tests' one-node SLURM cluster ----------------------------------------------------------------
def test_a_drain_for_a_reboot_asks_the_job_to_save_and_leave_and_another_is_only_said(
        slurm: SlurmCluster, tmp_path: Path, engines: list[Engine]) -> None:
    # the job's batch script runs on this node (the cluster's only one): `batch_host_actions` are its actions
    engine = engine_for(slurm, tmp_path, {"node_drain": {"interval": "1s", "jitter": 0, "actions": {"critical": ["stop"]},
                                                         "batch_host_actions": {"critical": ["signal"]}}})
    engines.append(engine)
    workdir = slurm.workdir()
    job_id = slurm.submit(toy(slurm, workdir), workdir=workdir, name="tg-node-drain")
    info = slurm.wait_state(job_id, ("RUNNING",))
    wait_until(lambda: log_has(info["StdOut"], "step 3"), 20, what="training steps")
    job = find_job(slurm, job_id)
    try:
        # the site's maintenance window opens over the running job: said, the job runs on
        sh("scontrol", "create", "reservation", "reservationname=tg-maint", "starttime=now", "duration=10",
           f"nodes={slurm.node}", "users=root", "flags=maint,ignore_jobs")
        try:
            def window() -> Any:
                return next((r for r in engine.checks["node_drain"].run() if r.subject == job.key
                             and r.status is not Status.OK), None)
            said = wait_until(window, 20, interval=0.5, what="the maintenance window said")
            assert said.status is Status.WARNING and "maintenance window has begun" in said.summary, said
            assert "MAINTENANCE" in said.details["node_state"].split("+"), said.details
        finally:
            sh("scontrol", "delete", "reservationname=tg-maint")
        sh("scontrol", "update", f"nodename={slurm.node}", "state=drain", "reason=investigating ECC counts")
        results = engine.checks["node_drain"].run()
        [said] = [r for r in results if r.subject == job.key]
        assert said.status is Status.WARNING and "'investigating ECC counts' by root" in said.summary, said
        assert slurm.job(job_id)["JobState"] == "RUNNING"

        sh("scontrol", "update", f"nodename={slurm.node}", "state=drain", "reason=maintenance: host reboot")
        engine.start()
        final = slurm.wait_state(job_id, ("COMPLETED", "FAILED", "CANCELLED"), timeout=60)
        out = Path(final["StdOut"]).read_text()
        assert final["JobState"] == "COMPLETED" and "stop requested (SIGUSR1)" in out, out
        assert list((workdir / "ckpt").glob("ckpt-*.json"))
        [incident] = [i for i in engine.tracker.incidents() if i.check == "node_drain" and i.subject == job.key]
        assert incident.status is Status.CRITICAL and "'maintenance: host reboot' by root" in incident.summary
        # sinfo said ALLOCATED+DRAIN here where scontrol, before, said MIXED+DRAIN of the same kind of job: the flag counts
        assert incident.details["batch_host"] is True and "DRAIN" in incident.details["node_state"].split("+")
        assert incident.actions[0]["action"] == "signal" and incident.actions[0]["outcome"] == "ok", incident.actions
    finally:
        slurm.resume_node()
