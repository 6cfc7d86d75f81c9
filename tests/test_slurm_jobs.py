"""Jobs and actions against a real one-node SLURM cluster."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.conftest import AgentProcess, control_status, free_port, unique_bus, wait_until, xid79
from tests.slurm_cluster import JOB_USER, OTHER_USER, SlurmCluster, sh
from trainguard.agent.configfile import parse_config
from trainguard.checks.base import CheckContext
from trainguard.checks.job_timelimit import TimeLimitCheck, TimeLimitSettings
from trainguard.core.events import Event, EventKind
from trainguard.core.model import Result, Status
from trainguard.core.state import scoped_key
from trainguard.jobs import slurmsource
from trainguard.jobs.catalog import JobCatalog, JobView
from trainguard.jobs.model import Job
from trainguard.jobs.settings import JobsSettings
from trainguard.jobs.slurm import SlurmClient, SlurmError, parse_job_record
from trainguard.jobs.slurmsource import SlurmSource
from trainguard.node.kmsg import CURSOR_KEY, cursor_at_end
from trainguard.pipeline.engine import Engine
from trainguard.registry import CHECKS, Registry


def engine_for(slurm: SlurmCluster, tmp_path: Path, checks: dict[str, Any], actions: dict[str, Any] | None = None,
               **jobs: Any) -> Engine:
    raw = {"agent": {"state_dir": str(tmp_path / "state"), "node_name": slurm.node, "listen": ""},
           "jobs": {"sources": ["slurm"], "slurm_timeout": "10s", "refresh": 0, **jobs},
           "checks": checks, "notifiers": {"console": {}}, "actions": actions or {}}
    return Engine(parse_config(raw, "test.toml"))


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    started: list[Engine] = []
    yield started
    for engine in started:
        engine.stop()


def event(job: Job | None = None, summary: str = "test incident") -> Event:
    return Event(EventKind.FIRED, uuid.uuid4().hex[:12], "test", "subject", Status.CRITICAL, summary, "node",
                 time.time(), time.time(), details={"job_key": job.key} if job else {})


def job_here(slurm: SlurmCluster, job_id: str) -> Job | None:
    """The job as a fresh catalog lists it, once what slurmctld knows of it came back; None until its first step
    runs on this node (the controller says RUNNING a moment before)."""
    catalog = JobCatalog(JobsSettings(sources=["slurm"], refresh=0), slurm.node)
    try:
        catalog.settle(10)
        return catalog.view().by_key(f"slurm:{job_id}")
    finally:
        catalog.close()


def find_job(slurm: SlurmCluster, job_id: str) -> Job:
    job = wait_until(lambda: job_here(slurm, job_id), 10, what=f"job {job_id} running on this node")
    assert isinstance(job, Job)
    return job


def run_action(engine: Engine, name: str, ev: Event, jobs: tuple[Job, ...],
               others_critical: tuple[str, ...] = ()) -> dict[str, Any]:
    return engine.responder.run_named(name, ev, jobs, others_critical)


def log_has(path: str, text: str) -> bool:
    """slurmd creates the output file just after the job turns RUNNING."""
    p = Path(path)
    return p.exists() and text in p.read_text(errors="replace")


def toy(slurm: SlurmCluster, workdir: Path, *extra: str) -> str:
    return slurm.toy_command("--steps", "100000", "--step-time", "0.1", "--ckpt-dir", f"{workdir}/ckpt", *extra)


def test_catalog_sees_jobs_on_this_node(slurm: SlurmCluster) -> None:
    name = f"tg catalog ünï {uuid.uuid4().hex[:6]}"
    job_id = slurm.submit("sleep 120", name=name)
    slurm.wait_state(job_id, ("RUNNING",))
    # A fresh catalog settles once the record's first fetch came back or failed; a fetch that failed once (a busy
    # controller) is retried, and the name comes with the record then.
    def with_record() -> Job | None:
        listed = job_here(slurm, job_id)
        return listed if listed is not None and listed.name else None

    job = wait_until(with_record, 30, what=f"job {job_id} listed with its record")
    assert isinstance(job, Job)
    assert job.name == name and job.user == JOB_USER and job.on_this_node and job.running
    assert job.stdout and Path(job.stdout).exists()
    wait_until(lambda: getattr(job_here(slurm, job_id), "processes", None), 10, what="pids of the job")
    assert all(ref.matches() for ref in find_job(slurm, job_id).processes)
    sh("scancel", job_id)


def test_liveness(slurm: SlurmCluster, tmp_path: Path, engines: list[Engine]) -> None:
    name = f"tg live {uuid.uuid4().hex[:6]} ✓"
    engine = engine_for(slurm, tmp_path, {"alive": {"type": "job_liveness", "names": [name, name[:-2]]}})
    engines.append(engine)

    def status() -> dict[str, Any]:
        [report] = engine.run_round(ingest=False)
        return {r.subject: r for r in report.results}

    first = slurm.submit("sleep 300", name=name)
    slurm.wait_state(first, ("RUNNING",))
    results = status()
    assert results[name].status is Status.OK and f"job {first}" in results[name].summary
    # the truncated name is another job: exact matching only
    assert results[name[:-2]].status is Status.CRITICAL

    successor = slurm.submit("sleep 300", "--begin=now+3600", name=name)
    sh("scancel", first)
    slurm.wait_state(first, ("CANCELLED",))
    pending = status()[name]
    assert pending.status is Status.OK
    assert pending.summary == f"{name}: pending (BeginTime)"

    sh("scancel", successor)
    slurm.wait_state(successor, ("CANCELLED",))
    dead = status()[name]
    assert dead.status is Status.CRITICAL
    assert "no job running or pending; last was job" in dead.summary and "CANCELLED exit" in dead.summary
    assert dead.details["state"] == "CANCELLED"


def test_signal_reaches_the_trainer_which_saves_and_exits_0(
        slurm: SlurmCluster, tmp_path: Path, engines: list[Engine]) -> None:
    engine = engine_for(slurm, tmp_path, {})
    engines.append(engine)
    workdir = slurm.workdir()
    job_id = slurm.submit(toy(slurm, workdir), workdir=workdir, name="tg-signal")
    info = slurm.wait_state(job_id, ("RUNNING",))
    wait_until(lambda: log_has(info["StdOut"], "step 3"), 20, what="training steps")
    record = run_action(engine, "signal", event(find_job(slurm, job_id)), (find_job(slurm, job_id),))
    assert record["outcome"] == "ok", record
    assert record["detail"] == f"scancel --signal=USR1 --full {job_id}"
    final = slurm.wait_state(job_id, ("COMPLETED", "FAILED", "CANCELLED"))
    out = Path(final["StdOut"]).read_text()
    assert final["JobState"] == "COMPLETED" and final["ExitCode"] == "0:0", out
    assert "stop requested (SIGUSR1)" in out
    assert list((workdir / "ckpt").glob("ckpt-*.json"))


def test_drain_sets_our_reason_and_resume_clears_only_ours(
        slurm: SlurmCluster, tmp_path: Path, engines: list[Engine]) -> None:
    engine = engine_for(slurm, tmp_path, {})
    engines.append(engine)
    try:
        record = run_action(engine, "drain", event(summary="GPU 3 fell off the bus (XID 79)"), ())
        assert record["outcome"] == "ok", record
        node = slurm.node_info()
        assert "DRAIN" in node["State"]
        assert node["Reason"] == "trainguard: GPU 3 fell off the bus (XID 79)"
        record = run_action(engine, "resume", event(), (), others_critical=("gpu/GPU-1234",))
        assert record["outcome"] == "skipped", record  # nothing was done: no alert may say the node was resumed
        assert record["detail"] == f"{slurm.node} left drained: still critical: gpu/GPU-1234"
        assert "DRAIN" in slurm.node_info()["State"]
        record = run_action(engine, "resume", event(), ())
        assert record["outcome"] == "ok" and record["detail"].startswith(f"resumed {slurm.node}")
        assert "DRAIN" not in slurm.node_info()["State"]

        sh("scontrol", "update", f"nodename={slurm.node}", "state=drain", "reason=admin: fan replacement")
        record = run_action(engine, "resume", event(), ())
        assert record["outcome"] == "skipped", record
        assert record["detail"] == f"{slurm.node} drained by someone else ('admin: fan replacement'): left alone"
        assert "DRAIN" in slurm.node_info()["State"]
    finally:
        slurm.resume_node()


def test_requeue_only_jobs_that_allow_it(slurm: SlurmCluster, tmp_path: Path, engines: list[Engine]) -> None:
    engine = engine_for(slurm, tmp_path, {}, actions={"requeue-now": {"type": "requeue", "wait_exit": "0s"}})
    engines.append(engine)
    job_id = slurm.submit("sleep 300", "--requeue", name="tg-requeue")
    fixed = slurm.submit("sleep 300", "--no-requeue", name="tg-no-requeue")
    slurm.wait_state(job_id, ("RUNNING",))
    slurm.wait_state(fixed, ("RUNNING",))
    jobs = (find_job(slurm, job_id), find_job(slurm, fixed))
    assert jobs[0].requeue and not jobs[1].requeue
    record = run_action(engine, "requeue-now", event(), jobs)
    assert record["outcome"] == "ok", record
    assert record["detail"] == f"requeued {job_id}; not requeueable (--no-requeue): {fixed}"
    wait_until(lambda: slurm.job(job_id).get("Restarts") == "1", 30, what="job requeued")
    slurm.wait_state(job_id, ("RUNNING", "PENDING"))
    assert slurm.job(fixed)["JobState"] == "RUNNING" and slurm.job(fixed).get("Restarts") == "0"
    sh("scancel", job_id, fixed)


def test_requeue_waits_for_the_job_to_exit(slurm: SlurmCluster, tmp_path: Path, engines: list[Engine]) -> None:
    engine = engine_for(slurm, tmp_path, {}, actions={"requeue": {"wait_exit": "20s", "timeout": "30s"}})
    engines.append(engine)
    job_id = slurm.submit("sleep 3", "--requeue", name="tg-requeue-wait")
    slurm.wait_state(job_id, ("RUNNING",))
    wait_until(lambda: getattr(job_here(slurm, job_id), "processes", None), 10, what="pids of the job")
    job = find_job(slurm, job_id)
    started = time.monotonic()
    record = run_action(engine, "requeue", event(), (job,))
    assert record["outcome"] == "ok", record
    assert not any(ref.matches() for ref in job.processes)
    assert time.monotonic() - started < 15
    wait_until(lambda: slurm.job(job_id).get("Restarts") == "1", 30, what="finished job requeued")
    sh("scancel", job_id)


def test_time_limit_exit_before_end_time(slurm: SlurmCluster, tmp_path: Path, engines: list[Engine]) -> None:
    engine = engine_for(slurm, tmp_path, {"limit": {"type": "job_timelimit", "margin": "110s", "interval": "1s",
                                                    "jitter": 0, "actions": {"warning": ["signal"]}}})
    engines.append(engine)
    workdir = slurm.workdir()
    job_id = slurm.submit(toy(slurm, workdir), "--time=2", workdir=workdir, name="tg-timelimit")
    info = slurm.wait_state(job_id, ("RUNNING",))
    end_time = time.mktime(time.strptime(info["EndTime"], "%Y-%m-%dT%H:%M:%S"))
    engine.start()
    final = slurm.wait_state(job_id, ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED"), timeout=60)
    finished = time.time()
    out = Path(final["StdOut"]).read_text()
    assert final["JobState"] == "COMPLETED", out
    assert finished < end_time
    assert "stop requested (SIGUSR1)" in out
    assert list((workdir / "ckpt").glob("ckpt-*.json"))
    [incident] = [i for i in engine.tracker.incidents() if i.check == "limit"] or [None]
    if incident is not None:  # the job may already be gone, resolving it
        assert incident.actions[0]["action"] == "signal" and incident.actions[0]["outcome"] == "ok"


def test_time_limit_judges_only_running_jobs(slurm: SlurmCluster, tmp_path: Path, engines: list[Engine]) -> None:
    """Issue 24's run: `job_timelimit` fired on an ended job ("reaches its time limit ... (in 0s)": a finished job's
    EndTime is its end) and requeued it. A cancelled job whose steps ignore SIGTERM stays on the node for KillWait
    (5 s here) while the controller already says it ended: the source reports it COMPLETING and the check leaves it
    alone, before and after its steps are gone."""
    engine = engine_for(slurm, tmp_path, {"limit": {"type": "job_timelimit", "margin": "110s", "interval": "1s",
                                                    "jitter": 0}},
                        slurm_refetch_min="0.1s")  # the check's refresh near the margin: every round
    engines.append(engine)
    assert engine.catalog is not None
    job_id = slurm.submit("trap '' TERM; while :; do sleep 0.2; done", "--time=3", name="tg-going")
    slurm.wait_state(job_id, ("RUNNING",))
    key = f"slurm:{job_id}"

    def limit() -> list[Any]:
        [report] = [r for r in engine.run_round(ingest=False) if r.check == "limit"]
        return [r for r in report.results if r.subject == key]

    first = wait_until(lambda: limit() or None, 15, what="the running job judged")
    assert first[0].status is Status.OK and first[0].details["seconds_left"] > 110
    sh("scancel", job_id)
    states: list[str] = []
    deadline = time.monotonic() + 12
    while time.monotonic() < deadline:
        results = limit()
        job = engine.catalog.view().by_key(key)
        states.append(job.state if job else "gone")
        assert all(r.status is Status.OK for r in results), (results, states)
        if job is not None and job.state == "COMPLETING":
            assert job.processes  # its steps are still here, and the check did not judge it
        time.sleep(0.2)
    assert "COMPLETING" in states, " ".join(states)  # the controller's word was seen while the steps were still here
    assert states[-1] in ("CANCELLED", "ENDED", "gone"), states


@pytest.mark.parametrize("limit", ["60", "UNLIMITED"])
def test_a_time_limit_cut_by_scontrol_update_is_seen_within_recheck(slurm: SlurmCluster, tmp_path: Path,
                                                                    engines: list[Engine], limit: str) -> None:
    """Issue 24's runs: the job's TimeLimit was cut to ~20 (scaled) minutes while the EndTime the agent knew was far
    away, or none (no limit), so it never asked again and SLURM killed the job at the limit. Now a running job's
    EndTime is asked again every `recheck`: the cut is seen and the job told to save before the margin."""
    engine = engine_for(slurm, tmp_path, {"limit": {"type": "job_timelimit", "margin": "150s", "interval": "0.5s",
                                                    "jitter": 0, "recheck": "2s"}},
                        slurm_refetch_min="1s")
    engines.append(engine)
    assert engine.catalog is not None
    job_id = slurm.submit("while :; do sleep 0.2; done", f"--time={limit}", name="tg-limit-cut")
    slurm.wait_state(job_id, ("RUNNING",))
    key = f"slurm:{job_id}"

    def limit_result() -> Any:
        [report] = [r for r in engine.run_round(ingest=False) if r.check == "limit"]
        return next((r for r in report.results if r.subject == key), None)

    try:
        if limit == "UNLIMITED":  # no EndTime, no result: wait until the job's record came back
            wait_until(lambda: (j := job_here(slurm, job_id)) and j.extra.get("incomplete") is None, 15,
                       what="the job's record fetched")
            time.sleep(1)
            assert limit_result() is None
        else:
            first = wait_until(limit_result, 15, what="the running job judged")
            assert first.status is Status.OK and first.details["seconds_left"] > 50 * 60
        sh("scontrol", "update", f"jobid={job_id}", "TimeLimit=2")  # the limit now ~1 minute away: in the margin
        cut = wait_until(lambda: (r := limit_result()) and r.status is Status.WARNING and r, 10,
                         what="the cut TimeLimit seen and the job told to save")
        assert cut.details["seconds_left"] <= 120 and "reaches its time limit" in cut.summary
    finally:
        sh("scancel", job_id)


def _switch_engine(slurm: SlurmCluster, tmp_path: Path) -> Engine:
    return engine_for(slurm, tmp_path, {"stop": {"type": "job_switch", "switch": "stop", "interval": "1s",
                                                 "actions": {"warning": ["hold-array"]}}})


def test_kill_switch_stops_trainer_and_holds_array(slurm: SlurmCluster, tmp_path: Path, engines: list[Engine]) -> None:
    engine = _switch_engine(slurm, tmp_path)
    engines.append(engine)
    workdir = slurm.workdir()
    array = slurm.submit(toy(slurm, workdir), "--array=0-3%1", workdir=workdir, name="tg-switch")
    task0 = f"{array}_0"
    slurm.wait_state(task0, ("RUNNING",))
    wait_until((workdir / ".trainguard" / "heartbeat.json").exists, 20, what="first heartbeat")
    engine.start()
    sh("touch", str(workdir / ".trainguard" / "stop"), user=JOB_USER)
    final = slurm.wait_state(task0, ("COMPLETED", "FAILED", "CANCELLED"))
    out = Path(final["StdOut"]).read_text()
    assert final["JobState"] == "COMPLETED" and "stop requested (switch)" in out, out
    assert list((workdir / "ckpt").glob("ckpt-*.json"))
    wait_until(lambda: any(i.check == "stop" and i.actions for i in engine.tracker.incidents())
               or "held" in json.dumps(slurm.jobs_of(array)).lower(), 20, what="array held")
    pending = [j for j in slurm.jobs_of(array) if j.get("JobState") == "PENDING"]
    assert pending and all(j.get("Reason") in ("JobHeldAdmin", "JobHeldUser") for j in pending), pending
    sh("scancel", array)


def test_switch_by_another_user_is_ignored(slurm: SlurmCluster, tmp_path: Path, engines: list[Engine]) -> None:
    engine = _switch_engine(slurm, tmp_path)
    engines.append(engine)
    workdir = slurm.workdir()
    job_id = slurm.submit(toy(slurm, workdir), workdir=workdir, name="tg-intruder")
    info = slurm.wait_state(job_id, ("RUNNING",))
    wait_until((workdir / ".trainguard" / "heartbeat.json").exists, 20, what="first heartbeat")
    (workdir / ".trainguard").chmod(0o777)  # a carelessly shared switch dir
    sh("touch", str(workdir / ".trainguard" / "stop"), user=OTHER_USER)
    [report] = engine.run_round(ingest=True)
    [result] = report.results
    assert result.status is Status.UNKNOWN
    assert f"created by {OTHER_USER}, not by the job's owner {JOB_USER} or root" in result.summary
    time.sleep(2)
    assert slurm.job(job_id)["JobState"] == "RUNNING"  # neither the agent nor the trainer honoured it
    assert "stop requested" not in Path(info["StdOut"]).read_text()
    assert not any(i.actions for i in engine.tracker.incidents())
    sh("scancel", job_id)


def test_slurmctld_down_makes_the_source_unknown_and_the_agent_keeps_serving(
        slurm: SlurmCluster, tmp_path: Path, agent_process: Callable[..., AgentProcess]) -> None:
    port = free_port()
    config = tmp_path / "trainguard.toml"
    config.write_text(f"""
[agent]
node_name = "{slurm.node}"
state_dir = "{tmp_path}/state"
listen = "127.0.0.1:{port}"
[jobs]
sources = ["slurm"]
slurm_timeout = "3s"
refresh = "0s"
[checks.alive]
type = "job_liveness"
names = ["anything"]
interval = "1s"
jitter = 0
timeout = "8s"
""")
    agent = agent_process(config)
    agent.wait_for("msg=ready")
    slurm.stop_ctld()
    try:
        t0 = time.monotonic()

        def unknown() -> str | None:
            results = control_status(tmp_path / "state")["checks"]["alive"]["results"]  # TCP's: no summaries
            summary = results[0]["summary"] if results else ""
            return summary if results and results[0]["status"] == "UNKNOWN" else None

        summary = wait_until(unknown, 20, what="liveness UNKNOWN")
        assert time.monotonic() - t0 < 10
        assert str(summary).startswith("job source slurm: squeue")
        assert requests.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
        assert requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).status_code == 200
    finally:
        slurm.start_ctld()
    agent.signal(signal.SIGTERM)
    assert agent.wait(10) == 0


def test_slurm_commands_missing(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    catalog = JobCatalog(JobsSettings(sources=["slurm"], slurm_bin_dir=str(empty)), "node1")
    view = catalog.view()
    assert view.errors == {"slurm": "scontrol not installed (not found on PATH)"}
    assert shutil.which("true")
    assert SlurmClient(5, str(empty)).local_pids  # the client itself constructs fine


def test_scancel_failure_is_a_clear_action_failure(slurm: SlurmCluster, tmp_path: Path, engines: list[Engine]) -> None:
    engine = engine_for(slurm, tmp_path, {})
    engines.append(engine)
    gone = Job(key="slurm:999999", source="slurm", name="gone", state="RUNNING", job_id="999999")
    record = run_action(engine, "signal", event(gone), (gone,))
    assert record["outcome"] == "failed"
    assert "scancel --signal=USR1 exited" in record["detail"]
    proc = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=10)
    assert proc.returncode == 0


def test_xid79_signals_the_job_and_drains_the_node(slurm: SlurmCluster, kmsg: Any, tmp_path: Path,
                                                   engines: list[Engine]) -> None:
    engine = engine_for(slurm, tmp_path, {"xid": {"actions": {"critical": ["signal", "drain", "requeue"],
                                                              "resolved": ["resume"]}}})
    engines.append(engine)
    engine.store.put(scoped_key("check/xid", CURSOR_KEY), cursor_at_end())  # only this test's records count
    workdir = slurm.workdir()
    job_id = slurm.submit(toy(slurm, workdir), workdir=workdir, name="tg-xid")
    info = slurm.wait_state(job_id, ("RUNNING",))
    wait_until(lambda: log_has(info["StdOut"], "step 3"), 20, what="training steps")
    engine.start()
    try:
        bus = unique_bus()
        kmsg.write(xid79(bus))
        wait_until(lambda: "DRAIN" in slurm.node_info()["State"], 10, what="node drained")
        reason = slurm.node_info()["Reason"]
        assert reason.startswith(f"trainguard: GPU {bus} fell off the bus (XID 79)"), reason
        [incident] = [i for i in engine.tracker.incidents() if i.subject == f"pci:{bus}"]
        wait_until(lambda: len(next(i for i in engine.tracker.incidents() if i.subject == f"pci:{bus}").actions) == 3, 10)
        incident = next(i for i in engine.tracker.incidents() if i.subject == f"pci:{bus}")
        assert [(a["action"], a["outcome"]) for a in incident.actions] == [("signal", "ok"), ("drain", "ok"),
                                                                           ("requeue", "ok")]
        # requeued after it saved and exited; it waits in the queue because this, the only node, is drained
        out = Path(info["StdOut"]).read_text()
        assert "stop requested (SIGUSR1)" in out, out
        assert list((workdir / "ckpt").glob("ckpt-*.json"))
        requeued = slurm.job(job_id)
        assert requeued.get("Restarts") == "1" and requeued["JobState"] == "PENDING", requeued
    finally:
        sh("scancel", job_id)
        slurm.resume_node()


def test_a_requeue_cut_short_by_a_crash_of_the_agent_is_done_by_the_next_start(
        slurm: SlurmCluster, tmp_path: Path) -> None:
    """The agent is killed (the watchdog, the OOM killer) while its requeue waits for the ranks to save: they save
    and exit, the job ends, and without the next start taking up the list nobody would requeue it. Real agents,
    started as `trainguard run`; the fault is a disk check that is always CRITICAL, bound as a lost GPU is."""
    state = tmp_path / "state"
    config = tmp_path / "trainguard.toml"
    config.write_text(f"""
[agent]
state_dir = "{state}"
node_name = "{slurm.node}"
listen = ""
[jobs]
sources = ["slurm"]
refresh = "1s"
slurm_timeout = "10s"
[checks.disk]
paths = ["/"]
free_critical = "100%"
interval = "1s"
jitter = "0s"
[checks.disk.actions]
critical = ["signal", "drain", "requeue"]
[actions.requeue]
type = "requeue"
wait_exit = "60s"
timeout = "90s"
""")
    # saves for 4 s once signalled, then ends (the requeue waits up to its wait_exit for that)
    job_id = slurm.submit("trap 'sleep 4; exit 0' USR1; sleep 300 & wait", "--requeue", name="tg-requeue-cut")
    slurm.wait_state(job_id, ("RUNNING",))
    wait_until(lambda: getattr(job_here(slurm, job_id), "processes", None), 10, what="pids of the job")
    first = AgentProcess(config, tmp_path / "first.log").start()
    second = AgentProcess(config, tmp_path / "second.log")
    try:
        first.wait_for("action=drain outcome=ok", timeout=30)
        first.signal(signal.SIGKILL)  # the requeue, waiting for the job to save, dies with it
        first.wait()
        assert "action=requeue" not in first.output()
        slurm.wait_state(job_id, ("COMPLETED",), timeout=30)  # saved and ended while no agent ran

        second.start()
        second.wait_for("action list cut short by the agent's stop or crash; taken up", timeout=30)
        second.wait_for("action=requeue outcome=ok", timeout=30)
        assert "action=signal" not in second.output() and "action=drain" not in second.output()
        requeued = slurm.job(job_id)
        assert requeued.get("Restarts") == "1" and requeued["JobState"] == "PENDING", requeued
    finally:
        first.stop()
        second.stop()
        sh("scancel", job_id)
        slurm.resume_node()


def test_liveness_asks_accounting_for_jobs_the_controller_forgot(slurm: SlurmCluster, tmp_path: Path,
                                                                 engines: list[Engine]) -> None:
    # Last in this module: restarting the controller with a clean state drops every job it knew.
    name = f"tg forgotten {uuid.uuid4().hex[:6]} ✓"
    engine = engine_for(slurm, tmp_path, {"alive": {"type": "job_liveness", "names": [name]}})
    engines.append(engine)
    job_id = slurm.submit("exit 3", name=name)
    slurm.wait_state(job_id, ("FAILED",))
    client = SlurmClient(10)
    wait_until(lambda: [j for j in client.history([name], 3600) if j.job_id == job_id], 30, what="job in accounting")
    slurm.restart_ctld_forgetting_jobs()
    assert not slurm.job(job_id), "the controller should have forgotten the job"

    [report] = engine.run_round(ingest=False)
    [result] = report.results
    assert result.status is Status.CRITICAL
    assert f"last was job {job_id} ({name}) FAILED exit 3:0, down for" in result.summary, result.summary
    assert result.details["known_from"] == "accounting" and result.details["exit_code"] == "3:0"


DATA = Path(__file__).parent / "data" / "slurm"


def test_record_names_the_jobs_nodes_and_owner() -> None:
    """BatchHost and NodeList as 22.05 prints them (tests/data/slurm/README.md): a two-node job of the multi-node
    cluster, a one-node job, and a pending job (no nodes yet)."""
    two = parse_job_record((DATA / "show-job-multinode.txt").read_text(), 1001)
    one = parse_job_record((DATA / "show-job-running.txt").read_text(), 1001)
    pending = parse_job_record((DATA / "show-job-pending.txt").read_text(), 1001)
    assert two and one and pending
    assert (two.node_list, two.batch_host) == ("n[1-2]", "n1")
    assert (one.node_list, one.batch_host) == ("vm", "vm")
    assert (pending.node_list, pending.batch_host) == (None, None)
    requeued = parse_job_record((DATA / "show-job-requeued.txt").read_text(), 1001)
    assert requeued and (two.restarts, requeued.restarts) == (0, 1)  # a requeued job keeps its id: this is its life


def test_a_job_name_that_forges_its_owner_node_and_life_silences_no_node() -> None:
    """A name is free text: one that carries a record of its own user's, with a BatchHost on no node and another
    restart count, would silence every node for the job-scoped checks and wipe its findings by a rename. The real
    two-node record with such a name: neither is taken from it; every node speaks."""
    real = (DATA / "show-job-multinode.txt").read_text()
    forged = ("x UserId=tgjob(1001) GroupId=tgjob(1001) MCS_label=N/A Priority=1 Nice=0 Account=(null) QOS=(null) "
              "JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=7 NodeList=zz,gpu[000-999] "
              "BatchHost=zz tg")
    record = parse_job_record(real.replace("JobName=tg two nodes", f"JobName={forged}", 1), 1001)
    assert record is not None and record.uid == 1001  # the name is cut at its first `UserId=`, as before
    assert (record.batch_host, record.node_list, record.restarts) == (None, None, None)
    job = Job(key="slurm:1", source="slurm", name=record.name, state="RUNNING", job_id="1",
              node_list=record.node_list, batch_host=record.batch_host)
    assert job.spoken_for_by("n1") and job.spoken_for_by("n2")


def test_a_job_the_controller_says_is_going_is_asked_about_less_and_less() -> None:
    """A step stuck in D state keeps a job COMPLETING for days: asked again after 5 s at first, then backing off to
    the once a minute of any job's refresh."""
    refetch_min = JobsSettings().slurm_refetch_min
    waits = [slurmsource.going_wait(t, refetch_min) for t in (0, 5, 10, 20, 40, 80, 86400)]
    assert waits == [5.0, 5.0, 10.0, 20.0, 40.0, 60.0, 60.0]
    assert max(waits) == refetch_min == 60.0


def test_only_the_owner_speaks_for_a_multi_node_job() -> None:
    job = Job(key="slurm:1", source="slurm", name="x", state="RUNNING", job_id="1", node_list="n[1-2]",
              batch_host="n1")
    assert job.spoken_for_by("n1") and not job.spoken_for_by("n2")
    assert job.spoken_for_by("n1.cluster")  # a name SLURM does not use for this node: it speaks, as before
    assert replace(job, batch_host=None, node_list="n[2-3],n1").spoken_for_by("n2")  # no BatchHost: first node
    assert replace(job, node_list="n1").spoken_for_by("n1")
    assert replace(job, node_list=None, batch_host=None).spoken_for_by("n2")  # not known: every node speaks
    assert replace(job, node_list="n[bad").spoken_for_by("n2")


class _Listing:
    def __init__(self, job: Job, stale: dict[str, str] | None = None) -> None:
        self.job, self.stale, self.node = job, stale or {}, "n2"

    def view(self) -> JobView:
        return JobView(jobs=(self.job,), stale=self.stale)


def test_a_job_listed_before_its_record_came_is_spoken_for_once_it_has(tmp_path: Path) -> None:
    """Issue 24's 15-minute run: a job requeued onto n4, listed by its prolog before its record came, had no known
    owner, so n4 spoke with the NaN streak it held from an earlier start of the job (dealt with by the owner's
    restart in place): a false restart, then a requeue of the healthy job. While its record is asked and not yet
    answered, a job-scoped result is withheld (its incident left as it is); a record that failed or came back empty
    leaves every node speaking, as before; a node-scoped result (this node's own stop file) always counts."""
    raw = {"agent": {"state_dir": str(tmp_path / "state"), "node_name": "n2", "listen": ""},
           "jobs": {"sources": ["slurm"]}, "checks": {}, "notifiers": {"console": {}}}
    engine = Engine(parse_config(raw, "test.toml"))
    try:
        unknown = "not yet known to the agent: asking slurmctld"
        job = Job(key="slurm:1", source="slurm", name="", state="RUNNING", job_id="1", on_this_node=True,
                  extra={"found_by": "prolog", "incomplete": unknown, "record_pending": True})
        check = Registry().check_class("training_log")
        results = (Result("training_log", "slurm:1", Status.CRITICAL, "NaN", {"job_key": "slurm:1"}),
                   Result("training_log", "slurm:1", Status.WARNING, "stop", {"job_key": "slurm:1", "scope": "node"}))

        def spoken(listed: Job) -> tuple[list[str], list[str]]:
            engine.catalog = _Listing(listed)  # type: ignore[assignment]
            kept, withheld = engine._spoken(check, results)  # type: ignore[arg-type]
            return [r.summary for r in kept], sorted(withheld)

        assert spoken(job) == (["stop"], ["slurm:1"])
        assert spoken(replace(job, extra={"found_by": "prolog", "incomplete": unknown})) == (["NaN", "stop"], [])
        known = replace(job, node_list="n[2-4]", batch_host="n2", extra={"found_by": "listpids"})
        assert spoken(known) == (["NaN", "stop"], [])
        assert spoken(replace(known, batch_host="n3")) == (["stop"], [])  # not the owner: silent, as before
    finally:
        engine.store.close()


def test_hardware_checks_speak_on_the_node_at_fault() -> None:
    """A fault of the node's hardware (an XID, a GPU, a link) is that node's evidence: every node speaks for its own;
    only checks about a job as a whole are job-scoped."""
    scopes = {kind: Registry().check_class(kind) for kind in CHECKS}
    assert {k for k, c in scopes.items() if c.scope == "job"} == {"hang", "training_log", "job_timelimit",
                                                                   "job_switch"}
    assert all(c.scope == "node" for c in scopes.values() if c.layer == "hardware")


class CountingClient(SlurmClient):
    """`scontrol show job` answered from memory, or refused while the controller is down; every ask counted."""

    def __init__(self) -> None:
        super().__init__(3, "/nonexistent")
        self.asked: list[str] = []
        self.down = True

    def show_job(self, job_id: str) -> str | None:
        self.asked.append(job_id)
        if self.down:
            raise SlurmError("slurmctld down (a test)")
        return f"JobId={job_id} JobName=t UserId=u(1000) JobState=RUNNING EndTime=Unknown"


def test_asking_again_never_overrides_a_retry_backoff_nor_the_refetch_minimum() -> None:
    """The review of the recheck: while slurmctld was down, every run's ask replaced the retry's backoff with a fetch
    now (a job whose first fetch never answered was asked every run): 48 RPCs a minute for 8 jobs, at the moment
    the controller comes back."""
    now = [1000.0]
    client = CountingClient()
    source = SlurmSource(JobsSettings(sources=["slurm"], slurm_node="n1", prolog_dir=""), "n1", client,
                         clock=lambda: now[0])
    try:
        with source._lock:  # a job this node found, whose first fetch has not been made yet
            source._jobs["7"] = slurmsource._Local("7", seen=now[0])

        def extra() -> dict[str, object]:
            with source._lock:
                return dict(source._job(source._jobs["7"]).extra)

        assert extra()["record_pending"] is True  # asked, not answered: its owner's results wait (engine._spoken)
        source.refresh("7", 300.0)
        wait_until(lambda: len(client.asked) == 1, 5, what="the first fetch, refused")
        wait_until(lambda: "record_pending" not in extra(), 5, what="the refusal counted")
        assert "slurmctld not answering" in str(extra()["incomplete"])  # refused: every node speaks, as before
        for _ in range(20):  # the time-limit check runs every second, asking again each time
            now[0] += 1
            source.refresh("7", 300.0)
            time.sleep(0.01)
        assert client.asked == ["7"], "asked again over the retry's backoff"

        client.down = False  # the retry (due 5 s after the refusal) is answered
        wait_until(lambda: source._jobs["7"].fetched is not None, 10, what="the retry, answered")
        assert "record_pending" not in extra()  # answered (this short record parses to none): every node speaks
        assert client.asked == ["7"] * 2
        for _ in range(5):  # answered a moment ago: younger than the recheck, nothing asked
            now[0] += 1
            source.refresh("7", 300.0)
        time.sleep(0.2)
        assert len(client.asked) == 2
        now[0] += 300
        source.refresh("7", 300.0)
        wait_until(lambda: len(client.asked) == 3, 5, what="the recheck once its age is reached")
    finally:
        source.close()


def test_only_the_node_that_speaks_for_a_job_asks_its_end_time_again(tmp_path: Path) -> None:
    """A 1,000-node job rechecked by every node is 1,000 RPCs every recheck: only its owner (BatchHost) asks."""

    class Catalog:
        node = "n2"
        asked: list[tuple[str, float]] = []

        def __init__(self, job: Job) -> None:
            self.job = job

        def view(self) -> JobView:
            return JobView((self.job,))

        def refresh(self, job: Job, max_age: float = 0.0) -> None:
            self.asked.append((job.key, max_age))

    far = time.time() + 86400
    for batch_host, asks in (("n1", []), ("n2", [("slurm:9", 300.0)])):
        job = Job(key="slurm:9", source="slurm", name="big", state="RUNNING", job_id="9", on_this_node=True,
                  end_time=far, node_list="n[1-1000]", batch_host=batch_host)
        catalog = Catalog(job)
        catalog.asked = []
        check = TimeLimitCheck("limit", TimeLimitSettings(), CheckContext("n2", tmp_path, jobs=catalog))  # type: ignore[arg-type]
        [result] = check.run()
        assert result.status is Status.OK and catalog.asked == asks, (batch_host, catalog.asked)
