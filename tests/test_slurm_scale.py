"""SLURM at cluster scale (issue 19): the jobs of this node are found on the node (the SLURM cgroup tree, the slurmd
spool dir, `scontrol listpids`, the Prolog/Epilog hook), what only the controller knows is fetched once per job,
a controller that is down leaves the node's jobs known, and the agent's questions to slurmctld do not grow with
the queue.

Which discovery paths these tests exercise: the test cluster runs proctrack/linuxproc (no SLURM cgroups), so the
cluster tests use the spool dir (its SlurmdSpoolDir) and `scontrol listpids`; the cgroup path is tested on real
cgroups (v1 freezer and v2) laid out as proctrack/cgroup makes them, with a real process in them.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, require, require_root, unique_bus, wait_until, xid79
from tests.slurm_cluster import OTHER_USER, SlurmCluster, job_info_rpcs, sh, submit_held
from trainguard.agent.configfile import parse_config
from trainguard.core.model import Status
from trainguard.core.state import scoped_key
from trainguard.jobs.catalog import JobCatalog
from trainguard.jobs.model import Job
from trainguard.jobs.prolog import write_record
from trainguard.jobs.settings import JobsSettings
from trainguard.jobs.slurm import SlurmClient
from trainguard.jobs.slurmsource import LINGER_S, STARTING_S, WATCH_S, SlurmSource
from trainguard.node.kmsg import CURSOR_KEY, cursor_at_end
from trainguard.pipeline.engine import Engine


def catalog_for(slurm: SlurmCluster, **settings: object) -> JobCatalog:
    return JobCatalog(JobsSettings(**{"sources": ["slurm"], "prolog_dir": "", **settings}), slurm.node)


def running(catalog: JobCatalog, job_id: str) -> Job | None:
    job = catalog.view().by_key(f"slurm:{job_id}")
    return job if job is not None and job.running and job.processes else None


@pytest.fixture
def catalogs() -> Iterator[list[JobCatalog]]:
    made: list[JobCatalog] = []
    yield made
    for catalog in made:
        catalog.close()


@pytest.mark.parametrize("method", ["spool", "listpids"])
def test_jobs_appear_and_disappear_through_the_node(slurm: SlurmCluster, method: str,
                                                   catalogs: list[JobCatalog]) -> None:
    # spool: the default refresh (5 s) is kept: a step's socket in the spool dir is what makes the catalog look again
    settings: dict[str, object] = {} if method == "spool" else {"slurmd_spool_dir": "/nonexistent", "refresh": 0}
    catalog = catalog_for(slurm, **settings)
    catalogs.append(catalog)
    assert catalog.view().errors == {}
    name = f"tg-node-{method}-{uuid.uuid4().hex[:6]}"
    job_id = slurm.submit("sleep 300", name=name)
    job = wait_until(lambda: running(catalog, job_id), 20, interval=0.1, what="the job found on this node")
    found = time.time()
    assert isinstance(job, Job)
    assert job.extra["found_by"] == method
    first_process = min(ref.create_time for ref in job.processes)
    assert found - first_process < 1.5, f"found {found - first_process:.2f}s after its first process"
    catalog.settle(10)  # what only the controller knows, fetched once by id
    job = catalog.view(max_age=0).by_key(f"slurm:{job_id}")
    assert job is not None and job.name == name and job.user == "tgjob" and job.stdout and job.workdir
    assert "incomplete" not in job.extra

    sh("scancel", job_id)
    wait_until(lambda: not running(catalog, job_id), 5, interval=0.1, what="the job no longer running here")
    ended = wait_until(lambda: (j := catalog.view().by_key(f"slurm:{job_id}")) and j.state == "CANCELLED" and j, 20,
                       what="the controller's final state")
    assert isinstance(ended, Job) and not ended.running and not ended.processes


def test_a_job_that_ends_between_two_listings_is_still_known(slurm: SlurmCluster, catalogs: list[JobCatalog]) -> None:
    """An array task that honours the stop switch exits within a second: the watcher between listings (the spool
    dir's mtime, every WATCH_S) takes it in and asks for its record, so the next listing knows it ended here."""
    catalog = catalog_for(slurm, refresh="30s")  # listings far apart: only the watcher can see the job
    catalogs.append(catalog)
    catalog.view()  # the first listing starts the watcher
    name = f"tg-short-{uuid.uuid4().hex[:6]}"
    job_id = slurm.submit("sleep 0.7", name=name)
    final = slurm.wait_state(job_id, ("COMPLETED", "FAILED", "CANCELLED"))
    assert final["JobState"] == "COMPLETED", final
    job = wait_until(lambda: (j := catalog.view(max_age=0).by_key(f"slurm:{job_id}")) and j.state == "COMPLETED" and j,
                     20, what="the short job known, with its final state")
    assert isinstance(job, Job) and not job.running and job.name == name and job.user == "tgjob"
    assert job.uid == pwd.getpwnam("tgjob").pw_uid  # from the controller's record: no process of it was ever read


def test_prolog_and_epilog_hooks_announce_the_job(slurm: SlurmCluster, tmp_path: Path,
                                                  catalogs: list[JobCatalog]) -> None:
    records = tmp_path / "records"
    # the prolog lingers: the job is known from its record before any process of it runs
    with slurm.trainguard_hooks(records, prolog_tail="; sleep 3"):
        catalog = catalog_for(slurm, prolog_dir=str(records), slurm_timeout="10s")
        catalogs.append(catalog)
        name = f"tg-prolog-{uuid.uuid4().hex[:6]}"
        job_id = slurm.submit("echo hello; exit 3", name=name)
        early = wait_until(lambda: catalog.view().by_key(f"slurm:{job_id}"), 20, interval=0.1,
                           what="the job announced by its prolog")
        assert isinstance(early, Job)
        assert early.extra["found_by"] == "prolog" and early.running and not early.processes
        # 22.05 gives a prolog the job's user, uid and paths, not its name (tests/data/slurm/prolog-environ-running)
        assert early.user == "tgjob" and early.uid == pwd.getpwnam("tgjob").pw_uid and early.workdir
        assert (records / f"{job_id}.json").stat().st_uid == 0
        catalog.settle(10)
        named = catalog.view(max_age=0).by_key(f"slurm:{job_id}")
        assert named is not None and named.name == name
        assert named.stdout and named.stdout.endswith(f"{name}-{job_id}_4294967294.out"), named.stdout
        final = wait_until(lambda: (j := catalog.view().by_key(f"slurm:{job_id}")) and j.state == "FAILED" and j, 30,
                           what="the job's end")
        assert isinstance(final, Job) and final.exit_code == "3:0" and not final.running
        assert "ended" in (records / f"{job_id}.json").read_text()


def test_hook_never_fails_a_job(tmp_path: Path) -> None:
    """A prolog that fails drains the node: the hook exits 0 whatever its directory or environment."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    env = {**os.environ, "SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "x\ny"}
    for target, env_ in ((blocker / "sub", env), (tmp_path / "ok", {"SLURM_JOB_ID": "not-a-number"})):
        proc = subprocess.run([sys.executable, "-m", "trainguard", "slurm-prolog", "--dir", str(target)], env=env_,
                              capture_output=True, text=True, timeout=30, cwd=REPO)
        assert proc.returncode == 0, proc.stderr
    assert "record not written" in subprocess.run(
        [sys.executable, "-m", "trainguard", "slurm-epilog", "--dir", str(blocker / "sub")], env=env,
        capture_output=True, text=True, timeout=30, cwd=REPO).stderr


def test_slurmctld_killed_mid_run_leaves_the_node_jobs_and_checks_working(slurm: SlurmCluster, tmp_path: Path) -> None:
    # `scontrol listpids` alone (no spool dir, so no watcher): the late job below is found only once the controller
    # is gone; the spool dir's watcher would have asked for it within a quarter of a second of its start
    raw = {"agent": {"state_dir": str(tmp_path / "state"), "node_name": slurm.node, "listen": ""},
           "jobs": {"sources": ["slurm"], "slurm_timeout": "3s", "prolog_dir": "", "slurmd_spool_dir": "/nonexistent",
                    "refresh": 0},
           "checks": {"job_memory": {}, "job_timelimit": {"margin": "10m"}}, "notifiers": {}, "actions": {}}
    engine = Engine(parse_config(raw, "test.toml"))
    catalog = engine.catalog
    assert catalog is not None
    tag = uuid.uuid4().hex[:6]
    known = slurm.submit("sleep 300", "--time=60", name=f"tg-known-{tag}")
    wait_until(lambda: running(catalog, known), 20, what="the job found")
    # the record fetched while the controller is up (a 3 s fetch may time out on a loaded machine: the source asks
    # again 5 s later, so wait for the record itself rather than for one settle)
    catalog.settle(10)
    before = wait_until(lambda: (j := catalog.view(max_age=0).by_key(f"slurm:{known}")) and j.name and j, 30,
                        what="the known job's record")
    assert isinstance(before, Job) and before.name == f"tg-known-{tag}" and before.end_time
    # a job that starts here while the agent looks elsewhere: the controller goes before the agent asked about it
    late = slurm.submit("sleep 300", "--time=60", name=f"tg-late-{tag}")
    slurm.wait_state(late, ("RUNNING",))
    slurm.stop_ctld()
    try:
        wait_until(lambda: running(catalog, late), 10, what="the late job found on the node")
        for _ in range(2):  # the first while the late job's fetch may still be under way, then once it failed
            t0 = time.monotonic()
            reports = {r.check: r for r in engine.run_round(ingest=False)}
            # a round waits for the controller `slurm_timeout` at most (a one-shot check's settle), never longer
            assert time.monotonic() - t0 < 6, "a round must not wait for a dead controller"
            wait_until(lambda: catalog.view(max_age=0).stale, 10, what="the view marked stale")
        view = catalog.view(max_age=0)
        assert "slurm" not in view.errors
        assert "slurmctld not answering" in view.stale["slurm"]
        job = view.by_key(f"slurm:{known}")
        assert job is not None and job.running and job.name == before.name and job.stdout == before.stdout
        memory = {r.subject: r.status for r in reports["job_memory"].results}
        assert memory.get(f"slurm:{known}") is Status.OK and memory.get(f"slurm:{late}") is Status.OK, memory
        limits = {r.subject: r for r in reports["job_timelimit"].results}
        assert limits[f"slurm:{known}"].status is Status.OK
        assert "EndTime as last known: slurmctld not answering" in limits[f"slurm:{known}"].summary
        # only what truly needs the controller is UNKNOWN: the late job's time limit
        assert limits[f"slurm:{late}"].status is Status.UNKNOWN, limits[f"slurm:{late}"].summary
    finally:
        slurm.start_ctld()
    # back: both jobs still there, the late one completed from the controller, the mark gone
    wait_until(lambda: not catalog.view(max_age=0).stale, 60, what="stale cleared")
    catalog.settle(10)
    late_job = catalog.view(max_age=0).by_key(f"slurm:{late}")
    assert late_job is not None and late_job.running and late_job.name == f"tg-late-{tag}"
    assert running(catalog, known)
    sh("scancel", known, late)
    engine.stop()


@pytest.fixture
def real_cgroup(request: pytest.FixtureRequest) -> Iterator[tuple[Path, subprocess.Popen[bytes], str]]:
    """A job's cgroup as proctrack/cgroup lays it out (v1: freezer/slurm_<node>/uid_<uid>/job_<id>/step_<n>; v2:
    system.slice/<node>_slurmstepd.scope/job_<id>/step_<n>/user/task_0), real, with a real process in it."""
    require_root()
    version = request.param
    node = f"tgcg{uuid.uuid4().hex[:6]}"
    if version == 1:
        mount = Path("/sys/fs/cgroup/freezer")
        top = mount / f"slurm_{node}"
        task = top / f"uid_{os.getuid()}" / "job_4242001" / "step_0"
    else:
        mount = next((Path(p) for p in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup")
                      if (Path(p) / "cgroup.procs").exists() and Path(p, "cgroup.subtree_control").exists()),
                     Path("/nonexistent"))
        top = mount / "system.slice" / f"{node}_slurmstepd.scope"
        task = top / "job_4242001" / "step_0" / "user" / "task_0"
    require(mount.is_dir(), f"needs cgroup v{version} mounted")
    made_slice = version == 2 and not (mount / "system.slice").exists()
    task.mkdir(parents=True)
    proc = subprocess.Popen(["sleep", "300"])
    try:
        (task / "cgroup.procs").write_text(str(proc.pid))
        yield task, proc, node
    finally:
        proc.kill()
        proc.wait(5)
        for path in sorted((p for p in [top, *top.rglob("*")] if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            path.rmdir()
        if made_slice:
            (mount / "system.slice").rmdir()


@pytest.mark.parametrize("real_cgroup", [1, 2], indirect=True, ids=["v1", "v2"])
def test_cgroup_tree_lists_the_node_jobs(real_cgroup: tuple[Path, subprocess.Popen[bytes], str], tmp_path: Path) -> None:
    task, proc, node = real_cgroup
    pid = proc.pid
    source = SlurmSource(JobsSettings(sources=["slurm"], slurm_node=node, prolog_dir="", slurm_bin_dir=str(tmp_path)),
                         node, SlurmClient(3, str(tmp_path)))  # no SLURM commands: the cgroup alone must do
    try:
        [job] = source.jobs()
        assert job.job_id == "4242001" and job.running and [r.pid for r in job.processes] == [pid]
        assert job.extra["found_by"] == "cgroup"
        assert source.changed() is False
        proc.kill()
        proc.wait(5)
        wait_until(lambda: not (task / "cgroup.procs").read_text().strip(), 5, what="the cgroup empty")
        [ended] = source.jobs()
        assert not ended.running
    finally:
        source.close()


@pytest.mark.parametrize("real_cgroup", [1, 2], indirect=True, ids=["v1", "v2"])
def test_a_job_the_watcher_saw_is_starting_until_its_directory_goes(
        real_cgroup: tuple[Path, subprocess.Popen[bytes], str], tmp_path: Path) -> None:
    """A job directory with no process in it yet (slurmstepd made it, the first task has not started) is a job
    starting, not one that ended; once the directory is gone it has ended."""
    task, _, node = real_cgroup
    job_dir = next(p for p in task.parents if p.name == "job_4242001").with_name("job_4242002")
    now = [time.time()]
    source = SlurmSource(JobsSettings(sources=["slurm"], slurm_node=node, prolog_dir="", slurm_bin_dir=str(tmp_path)),
                         node, SlurmClient(3, str(tmp_path)), clock=lambda: now[0])

    def listed() -> dict[str, Job]:
        return {j.job_id: j for j in source.jobs()}

    try:
        assert [j.job_id for j in source.jobs()] == ["4242001"]  # the first listing starts the watcher
        (job_dir / "step_0").mkdir(parents=True)
        starting = wait_until(lambda: {j.job_id: j for j in source.jobs()}.get("4242002"), 5,
                              what="the watcher taking the new job in")
        assert isinstance(starting, Job)
        assert starting.running and not starting.processes
        assert {j.job_id: j for j in source.jobs()}["4242002"].running  # and again: not ended by a listing
        (job_dir / "step_0").rmdir()
        job_dir.rmdir()
        now[0] += 1  # a listing after the watcher's last look
        assert not listed()["4242002"].running

        # A directory that never holds a process (left behind by a crashed slurmstepd) is a job starting for
        # STARTING_S only; then it has ended, and once forgotten it is not taken in again while it stays.
        leftover = job_dir.with_name("job_4242003")
        (leftover / "step_0").mkdir(parents=True)
        wait_until(lambda: "4242003" in listed(), 5, what="the watcher taking the leftover in")
        now[0] += STARTING_S + 1
        assert not listed()["4242003"].running
        now[0] += LINGER_S + 1
        assert "4242003" not in listed()
        time.sleep(4 * WATCH_S)
        assert "4242003" not in listed()
    finally:
        source.close()


@pytest.mark.parametrize("real_cgroup", [2], indirect=True, ids=["v2"])
def test_the_source_tells_its_listeners_of_a_job_starting_here(
        real_cgroup: tuple[Path, subprocess.Popen[bytes], str], tmp_path: Path) -> None:
    """The log check must look at a job's logs before it writes: the catalog tells it when the watcher finds a job,
    when a prolog record is written, and when a job's first fetch is over."""
    task, _, node = real_cgroup
    job_dir = next(p for p in task.parents if p.name == "job_4242001").with_name("job_4242002")
    records = tmp_path / "records"
    scontrol = tmp_path / "scontrol"  # answers at once, so no fetch is retried (a retry would be news too)
    scontrol.write_text("#!/bin/sh\necho 'slurm_load_jobs error: Invalid job id specified' >&2\nexit 1\n")
    scontrol.chmod(0o755)
    catalog = JobCatalog(JobsSettings(sources=["slurm"], slurm_node=node, prolog_dir=str(records),
                                      slurm_bin_dir=str(tmp_path)), node)
    news: list[float] = []

    def failing() -> None:
        raise RuntimeError("a listener that fails")

    catalog.listen(failing)  # the others are told all the same, and the watcher goes on
    stop = catalog.listen(lambda: news.append(time.monotonic()))
    try:
        write_record(str(records), {"SLURM_JOB_ID": "4242009"}, ended=False)  # before the watcher: not news
        assert sorted(j.job_id for j in catalog.view().jobs) == ["4242001", "4242009"]  # starts the watcher
        wait_until(lambda: len(news) >= 2, 5, what="the first fetches over")  # 4242001's and 4242009's
        time.sleep(4 * WATCH_S)
        base = len(news)
        assert base == 2
        (job_dir / "step_0").mkdir(parents=True)
        wait_until(lambda: len(news) >= base + 2, 5, what="news of the job found, then of its first fetch")
        time.sleep(4 * WATCH_S)
        assert len(news) == base + 2
        write_record(str(records), {"SLURM_JOB_ID": "4242003"}, ended=False)
        wait_until(lambda: len(news) > base + 2, 5, what="news of the prolog record")
        time.sleep(4 * WATCH_S)
        assert len(news) == base + 3  # the record's job is news to the next listing, not to the watcher
        stop()
        time.sleep(4 * WATCH_S)
        base = len(news)
        job_dir.with_name("job_4242004").joinpath("step_0").mkdir(parents=True)
        wait_until(lambda: "4242004" in {j.job_id for j in catalog.view().jobs}, 5, what="the job listed")
        time.sleep(4 * WATCH_S)
        assert len(news) == base  # stopped: told no more
    finally:
        catalog.close()
        for name in ("job_4242002", "job_4242004"):
            step = job_dir.with_name(name) / "step_0"
            if step.is_dir():
                step.rmdir()
                step.parent.rmdir()


@pytest.mark.slow
def test_held_jobs_in_the_controller_do_not_change_what_the_agent_asks(
        slurm: SlurmCluster, tmp_path: Path, agent_process: object) -> None:
    """The installed config, the real agent, 2,000 held jobs of another user in the controller, none on this node:
    in 20 seconds of steady state the agent makes at most 1 REQUEST_JOB_INFO* RPC (sdiag): issue 19's bound of 2
    a minute, a little under its rate (the minute-long window of benchmarks/slurm_scale.py measures it whole). And the
    count does see such RPCs: one `scontrol show job` (REQUEST_JOB_INFO_SINGLE, as the agent's own) before the agent
    starts is counted."""
    config = tmp_path / "trainguard.toml"
    default = (REPO / "trainguard" / "default.toml").read_text()
    config.write_text(default.replace("[agent]\n", f'[agent]\nnode_name = "{slurm.node}"\nstate_dir = "{tmp_path}/state"'
                                                  '\nlisten = ""\n', 1).replace('paths = ["/", "/var/lib/trainguard"]',
                                                                                 'paths = ["/"]'))
    try:
        submit_held(2000, timeout=400)
        held = sh("squeue", "-h", "-t", "PD", "-u", OTHER_USER, "-o", "%i", "--noconvert").split()
        assert len(held) >= 2000
        slurm.rpc_counts(reset=True)
        sh("scontrol", "show", "job", held[0])
        # slurmctld counts an RPC after its reply: the sdiag right after may come first
        wait_until(lambda: slurm.rpc_counts().get("REQUEST_JOB_INFO_SINGLE", 0) >= 1, 10, what="the query counted")
        agent = agent_process(config)  # type: ignore[operator]
        agent.wait_for("msg=ready")
        time.sleep(5)  # steady state: whatever the start caused is done
        slurm.rpc_counts(reset=True)
        time.sleep(20)
        asked = job_info_rpcs(slurm.rpc_counts())
    finally:
        subprocess.run(["scancel", "-u", OTHER_USER], capture_output=True, timeout=60)
        slurm.restart_ctld_forgetting_jobs()  # 2,000 cancelled records would linger MinJobAge for the next tests
    assert asked <= 1, asked
    assert agent.proc.poll() is None  # type: ignore[attr-defined]


def test_an_xid_one_second_after_the_job_started_signals_it(slurm: SlurmCluster, kmsg: Any, tmp_path: Path) -> None:
    raw = {"agent": {"state_dir": str(tmp_path / "state"), "node_name": slurm.node, "listen": ""},
           "jobs": {"sources": ["slurm"], "prolog_dir": ""},
           "checks": {"xid": {"actions": {"critical": ["signal"]}}}, "notifiers": {}, "actions": {}}
    engine = Engine(parse_config(raw, "test.toml"))
    engine.store.put(scoped_key("check/xid", CURSOR_KEY), cursor_at_end())  # only this test's records count
    engine.start()
    workdir = slurm.workdir()
    job_id = slurm.submit(slurm.toy_command("--steps", "100000", "--step-time", "0.1", "--ckpt-dir", f"{workdir}/ckpt"),
                          workdir=workdir, name="tg-xid-young")
    try:
        info = slurm.wait_state(job_id, ("RUNNING",))
        time.sleep(1.0)
        bus = unique_bus()
        kmsg.write(xid79(bus))

        def signalled() -> list[dict[str, Any]]:
            incidents = [i for i in engine.tracker.incidents() if i.subject == f"pci:{bus}"]
            return incidents[0].actions if incidents and incidents[0].actions else []

        [action] = wait_until(signalled, 15, what="the signal action")  # type: ignore[misc]
        assert action["action"] == "signal" and action["outcome"] == "ok", action
        assert job_id in action["detail"], action
        wait_until(lambda: "stop requested (SIGUSR1)" in Path(info["StdOut"]).read_text(errors="replace"), 20,
                   what="the trainer told to stop")
    finally:
        sh("scancel", job_id)
        engine.stop()
