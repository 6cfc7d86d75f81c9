"""The multi-node SLURM cluster of tests/multinode_cluster.py (several slurmd on this one host), and what the agent's
job source needs there: each node's pids of a job spanning nodes, not the first node's."""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.conftest import require, wait_until
from tests.helpers.fake_nvml import FakeGpu, FakeNvml, NVMLError, NVMLError_GpuIsLost
from tests.multinode_cluster import MultiNodeCluster
from tests.slurm_cluster import JOB_USER, missing_components
from trainguard.agent.configfile import parse_config
from trainguard.checks.base import CheckContext
from trainguard.checks.training_log import TrainingLogCheck, TrainingLogSettings
from trainguard.core.model import Status
from trainguard.gpu.nvml import Nvml
from trainguard.jobs.catalog import JobCatalog
from trainguard.jobs.hostlist import expand
from trainguard.jobs.model import Job
from trainguard.jobs.settings import JobsSettings
from trainguard.pipeline.engine import Engine


@pytest.fixture(scope="module")
def multinode() -> Iterator[MultiNodeCluster]:
    require(os.geteuid() == 0, "needs root to run slurmctld, slurmd and munged")
    missing = missing_components()
    require(not missing, f"needs SLURM and munge installed (missing: {', '.join(missing)})")
    for sbin in ("/usr/sbin", "/sbin"):
        if sbin not in os.environ.get("PATH", "").split(":"):
            os.environ["PATH"] = os.environ.get("PATH", "") + ":" + sbin
    base = Path(tempfile.mkdtemp(prefix="trainguard-multinode-", dir="/tmp"))
    base.chmod(0o755)
    cluster = MultiNodeCluster(base / "cluster", 3, cred_expire=5, sched_interval=1)  # a requeued job back in ~7 s
    cluster.base.mkdir()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.slow
def test_each_nodes_agent_sees_the_pids_of_its_own_rank(multinode: MultiNodeCluster,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_CONF", str(multinode.conf))
    workdir = multinode.workdir()
    job_id = multinode.submit("exec srun --ntasks-per-node=1 sleep 120", "-N", "2", workdir=workdir, name="two-nodes")
    try:
        wait_until(lambda: multinode.job(job_id).get("JobState") == "RUNNING", 30, what="the job running")
        assert multinode.job(job_id)["NodeList"] == "n[1-2]"

        def sleeps(node: str) -> set[int]:
            catalog = JobCatalog(JobsSettings(sources=["slurm"], slurm_node=node, refresh="0s"), "agent-host")
            try:  # a node outside the job does not list it at all: its agent knows its own node's jobs only
                job = next((j for j in catalog.view().jobs if j.job_id == job_id), None)
                return {r.pid for r in job.processes if "sleep" in psutil.Process(r.pid).name()} if job else set()
            finally:
                catalog.close()

        pids = {node: wait_until(lambda node=node: sleeps(node), 15, what=f"the sleep of {node}")  # type: ignore[misc]
                for node in ("n1", "n2")}
        pids["n3"] = sleeps("n3")
        # one srun task per node: each agent finds its own node's, and n3, outside the job, none
        assert len(pids["n1"]) == 1 and len(pids["n2"]) == 1 and pids["n1"] != pids["n2"], pids
        assert pids["n3"] == set()
        for node in ("n1", "n2"):
            [pid] = pids[node]
            assert psutil.Process(pid).username() == JOB_USER
            assert psutil.Process(pid).environ().get("SLURMD_NODENAME") == node
    finally:
        multinode.run("scancel", job_id, check=False)


@pytest.mark.slow
def test_only_the_owner_node_speaks_for_a_job_level_check(multinode: MultiNodeCluster, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 24: a job-level problem was announced and acted on by the agent of every node the job runs on. A
    two-node job's stop switch is seen by both nodes' `job_switch`; only the owner (BatchHost n1) opens an incident."""
    monkeypatch.setenv("SLURM_CONF", str(multinode.conf))
    workdir = multinode.workdir()
    job_id = multinode.submit("exec srun --ntasks-per-node=1 sleep 120", "-N", "2", workdir=workdir, name="tg-owner")
    engines: dict[str, Engine] = {}
    try:
        wait_until(lambda: multinode.job(job_id).get("JobState") == "RUNNING", 30, what="the job running")
        info = multinode.job(job_id)
        assert (info["NodeList"], info["BatchHost"]) == ("n[1-2]", "n1")
        for node in ("n1", "n2"):
            raw = {"agent": {"state_dir": str(tmp_path / node), "node_name": node, "listen": ""},
                   "jobs": {"sources": ["slurm"], "slurm_node": node, "slurm_timeout": "10s", "refresh": 0,
                            "stop_dir": str(tmp_path / node / "stop")},
                   "checks": {"stop": {"type": "job_switch", "switch": "stop", "interval": "1s"}},
                   "notifiers": {"console": {}}, "actions": {}}
            engines[node] = Engine(parse_config(raw, f"{node}.toml"))
        multinode.run("mkdir", "-p", str(workdir / ".trainguard"), user=JOB_USER)
        multinode.run("touch", str(workdir / ".trainguard" / "stop"), user=JOB_USER)
        subject = f"slurm:{job_id}:stop"

        def round_on(node: str) -> tuple[list[Status], set[str]]:
            [report] = engines[node].run_round(ingest=True)
            seen = [r.status for r in report.results if r.subject == subject]
            return seen, {i.subject for i in engines[node].tracker.incidents() if i.firing}

        wait_until(lambda: subject in round_on("n1")[1], 20, what="n1's incident")
        # n2 sees the same switch (its check reports it) and stays silent: no incident, so no notification or action
        seen, firing = wait_until(lambda: (r := round_on("n2"))[0] and r, 20, what="n2 seeing the switch")  # type: ignore[misc]
        assert seen == [Status.WARNING] and firing == set()
        assert [j.spoken_for_by(n) for n in ("n1", "n2") for j in engines[n].catalog.view().jobs  # type: ignore[union-attr]
                if j.job_id == job_id] == [True, False]

        # The operator's stop file is in one node's own /etc: touched on n2 alone, n2 speaks for it (never a silence)
        multinode.run("rm", str(workdir / ".trainguard" / "stop"), user=JOB_USER)
        (tmp_path / "n2" / "stop").mkdir(parents=True)
        (tmp_path / "n2" / "stop" / "tg-owner").touch()
        wait_until(lambda: subject in round_on("n2")[1], 20, what="n2's incident for the operator's stop file")
    finally:
        for engine in engines.values():
            engine.stop()
        multinode.run("scancel", job_id, check=False)


@pytest.mark.slow
@pytest.mark.parametrize("open_mode", ["truncate", "append"])
def test_a_requeued_job_starts_a_new_life_in_its_logs(multinode: MultiNodeCluster, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch, open_mode: str) -> None:
    """Issue 24: SLURM keeps a requeued job's id; the NaN streak of its earlier life must not be the new life's. The
    first life logs three NaN losses (and leaves a NaN heartbeat); requeued, the second logs a finite loss: its result
    is OK, whether the StdOut was truncated or appended to (the earlier life's lines still in it)."""
    monkeypatch.setenv("SLURM_CONF", str(multinode.conf))
    workdir = multinode.workdir()
    beat = (f"PYTHONPATH={multinode.lib} {multinode.python} -c 'from trainguard.trainer import Trainer; "
            "Trainer().heartbeat(53, loss=float(\"nan\"))'")
    script = (f'if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then {beat}; echo "step 51 loss=nan"; echo "step 52 loss=nan"; '
              'echo "step 53 loss=nan"; else echo "$SLURM_RESTART_COUNT" > life; echo "step 41 loss=2.0"; fi; '
              'exec sleep 120')
    job_id = multinode.submit(script, "-N", "1", "-w", "n1", "--requeue", f"--open-mode={open_mode}", workdir=workdir,
                              name="tg-lives")
    jobs = JobCatalog(JobsSettings(sources=["slurm"], slurm_node="n1", refresh="0s"), "agent-host")
    watch = TrainingLogCheck("logs", TrainingLogSettings(), CheckContext(
        "n1", tmp_path, jobs=jobs, nvml=Nvml(FakeNvml(init_error=NVMLError))))
    key = f"slurm:{job_id}"

    def result(status: Status) -> object:
        jobs.settle(10)
        found = next((r for r in watch.run() if r.subject == key), None)
        return found if found is not None and found.status is status else None

    try:
        # n1 may still be letting go of the previous test's job (its epilog) under the suite's load: the 30 s below
        # are the check's, not the scheduler's
        wait_until(lambda: multinode.job(job_id).get("JobState") == "RUNNING", 60, interval=0.5,
                   what="the first life running on n1")
        first = wait_until(lambda: result(Status.CRITICAL), 30, what="the first life's NaN streak")
        assert "3 in a row" in first.summary  # type: ignore[attr-defined]
        multinode.run("scontrol", "requeue", job_id)
        # the agent lists its node's jobs all along (each check's run does): it sees the first life end
        wait_until(lambda: jobs.view() and (multinode.job(job_id).get("Restarts"), multinode.job(job_id).get(
            "JobState")) == ("1", "RUNNING"), 60, what="the job running again")
        out = Path(multinode.job(job_id)["StdOut"])
        wait_until(lambda: "step 41" in out.read_text(), 20, what="the second life's first line")
        # the life the relaunch loop names its records of nodes left by (SLURM_RESTART_COUNT in the batch
        # environment) is the controller's Restarts, which the agent names a spare's record by
        assert (workdir / "life").read_text().strip() == multinode.job(job_id)["Restarts"] == "1"
        second = wait_until(lambda: result(Status.OK), 20, what="the second life's own result")
        assert second.details["job_key"] == key and "findings" not in second.details  # type: ignore[attr-defined]
        # what the earlier life left is still there, and is not this life's
        assert ("step 53 loss=nan" in out.read_text()) == (open_mode == "append")
        assert json.loads((workdir / ".trainguard" / "heartbeat.json").read_text())["metrics"]["loss"] == "nan"
        assert result(Status.OK) is not None
    finally:
        jobs.close()
        multinode.run("scancel", job_id, check=False)


@pytest.mark.slow
def test_a_node_meeting_a_requeued_job_first_does_not_read_its_earlier_lives_lines(
        multinode: MultiNodeCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--open-mode=append` and a requeue onto another node: the job's first life logs an OOM on n1; its next life runs
    on n2, whose agent never saw the first, and prints at once. n2's agent hears of the job from its SLURM source and
    looks at the log within seconds of the start: it reads the new life's lines, not the OOM. Its log check runs every
    10 minutes here: only the source's news can make it look (and read) in time."""
    monkeypatch.setenv("SLURM_CONF", str(multinode.conf))
    workdir = multinode.workdir()
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    script = (f'if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then echo "{oom}"; '
              'else echo "life $SLURM_RESTART_COUNT: step 0 loss=2.3"; fi; exec sleep 120')
    job_id = multinode.submit(script, "-N", "1", "-w", "n1", "--requeue", "--open-mode=append", workdir=workdir,
                              name="tg-elsewhere")
    raw = {"agent": {"state_dir": str(tmp_path / "n2"), "node_name": "n2", "listen": ""},
           "jobs": {"sources": ["slurm"], "slurm_node": "n2", "slurm_timeout": "10s", "refresh": 0},
           "checks": {"logs": {"type": "training_log", "interval": "600s", "jitter": "0s"}},
           "notifiers": {"console": {}}, "actions": {}}
    engine = Engine(parse_config(raw, "n2.toml"))
    key = f"slurm:{job_id}"

    def read() -> object:
        last = engine.snapshot().checks["logs"].last
        return next((r for r in (last.results if last else ()) if r.subject == key), None)

    try:
        wait_until(lambda: multinode.job(job_id).get("JobState") == "RUNNING", 30, what="the first life running")
        out = Path(multinode.job(job_id)["StdOut"])
        wait_until(lambda: out.exists() and "CUDA out of memory" in out.read_text(), 20, what="the first life's OOM")
        engine.start()  # its first round: no job on n2
        multinode.run("scontrol", "requeue", job_id)
        wait_until(lambda: multinode.job(job_id).get("JobState") == "PENDING", 30, what="the job back in the queue")
        multinode.run("scontrol", "update", f"JobId={job_id}", "NodeList=n2")  # the requeue places it elsewhere
        wait_until(lambda: (multinode.job(job_id).get("JobState"), multinode.job(job_id).get("Restarts")) == (
            "RUNNING", "1"), 60, what="the next life running on n2")
        result = wait_until(read, 30, what="n2's agent reading the new life's log")
        assert result.status is Status.OK, result.summary  # type: ignore[attr-defined]
        assert "life 1: step 0" in out.read_text() and "CUDA out of memory" in out.read_text()
    finally:
        engine.stop()
        multinode.run("scancel", job_id, check=False)


RANK_SCRIPT = """#!/bin/bash
# One rank of a job restarted in place: it logs its start, and saves and exits on SIGUSR1, except rank 1 of step 1,
# which is hung (a rank stuck in a collective never gets to its signal handler).
echo "start step=$SLURM_STEP_ID rank=$SLURM_PROCID node=$SLURMD_NODENAME" >> ranks.log
if [ "$SLURM_STEP_ID" = 1 ] && [ "$SLURM_PROCID" = 1 ]; then
    trap '' USR1
else
    trap 'echo "saved step=$SLURM_STEP_ID rank=$SLURM_PROCID" >> ranks.log; exit 0' USR1
fi
while :; do sleep 0.2; done
"""


def _step_nodes(log: Path, step: int) -> list[str]:
    """The nodes the ranks of the loop's srun `step` started on, per the ranks' log."""
    return sorted(line.rsplit("node=", 1)[1] for line in (log.read_text().splitlines() if log.exists() else ())
                  if line.startswith(f"start step={step} "))


def _looped_job(multinode: MultiNodeCluster, monkeypatch: pytest.MonkeyPatch, name: str, nodes: str,
                srun_options: str, script: str = RANK_SCRIPT) -> tuple[str, Path, Path]:
    """A job of `script` ranks under the relaunch loop, on `nodes` (sbatch -N): its id, workdir and ranks' log."""
    monkeypatch.setenv("SLURM_CONF", str(multinode.conf))
    workdir = multinode.workdir()
    (workdir / "rank.sh").write_text(script)
    shutil.chown(workdir / "rank.sh", JOB_USER, JOB_USER)
    command = (f"exec {multinode.python} {multinode.lib}/trainguard/trainer.py relaunch -- "
               f"srun {srun_options}--ntasks-per-node=1 bash rank.sh")
    job_id = multinode.submit(command, "-N", nodes, "--requeue", workdir=workdir, name=name)
    return job_id, workdir, workdir / "ranks.log"


@pytest.mark.slow
def test_restart_in_place_keeps_the_allocation_and_the_relaunch_loop_starts_the_ranks_again(
        multinode: MultiNodeCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 24: a fault that leaves the nodes usable restarts the ranks inside the job's allocation, without a
    requeue through slurmctld. The `restart` action asks the job's relaunch loop (the trainer helper) for a restart,
    signals the srun steps (never the batch script), and cancels a step whose ranks did not exit in `wait_exit`."""
    from trainguard.actions.base import ActionContext
    from trainguard.actions.restart import RestartAction, RestartSettings
    from trainguard.core.events import Event, EventKind
    from trainguard.jobs.slurm import SlurmClient

    job_id, workdir, log = _looped_job(multinode, monkeypatch, "tg-restart", "2", "")

    def lines(word: str) -> list[str]:
        return [line for line in (log.read_text().splitlines() if log.exists() else ()) if line.startswith(word)]

    catalog = JobCatalog(JobsSettings(sources=["slurm"], slurm_node="n1", refresh="0s"), "agent-host")

    def restart(wait_exit: float) -> str:
        def known() -> Job | None:  # the job's record comes from slurmctld a moment after its pids
            return next((j for j in catalog.view(fresh=True).jobs if j.job_id == job_id and j.switch_dir), None)

        job = wait_until(known, 20, what="the job's record")
        assert job.switch_dir == f"{workdir}/.trainguard" and job.uid is not None
        event = Event(EventKind.FIRED, "i1", "training_log", job.key, Status.CRITICAL, "NaN loss in 3 steps", "n1",
                      time.time(), time.time(), details={"job_key": job.key})
        action = RestartAction("restart", RestartSettings(wait_exit=wait_exit, timeout=30))
        return action.run(ActionContext(event, (job,), "n1", SlurmClient(10.0), time.time, slurmd="n1"))

    try:
        wait_until(lambda: len(lines("start step=0")) == 2, 30, what="both ranks of step 0")
        detail = restart(10)
        # both ranks saved and exited on the signal: nothing to cancel, and the loop launched step 1
        assert f"SIGUSR1 to step {job_id}.0: ended in" in detail, detail
        assert sorted(lines("saved")) == ["saved step=0 rank=0", "saved step=0 rank=1"]
        wait_until(lambda: len(lines("start step=1")) == 2, 30, what="both ranks of step 1")
        request = workdir / ".trainguard" / f"restart.{job_id}"
        assert request.owner() == JOB_USER and json.loads(request.read_text())["reason"] == "NaN loss in 3 steps"

        started = time.monotonic()
        detail = restart(3)
        # rank 1 of step 1 is hung: after wait_exit the step is cancelled on every node, and step 2 starts
        assert f"cancelled {job_id}.1 still running after" in detail, detail
        assert time.monotonic() - started < 15
        wait_until(lambda: len(lines("start step=2")) == 2, 30, what="both ranks of step 2")
        info = multinode.job(job_id)
        assert info["JobState"] == "RUNNING" and info["Restarts"] == "0"  # the same allocation, never requeued
        out = (workdir / f"tg-restart-{job_id}.out").read_text()
        assert out.count("trainguard relaunch: restart ") == 2 and "(NaN loss in 3 steps)" in out, out
    finally:
        catalog.close()
        multinode.run("scancel", job_id, check=False)


def _job_record(job_id: str, node: str) -> Job:
    """The job as `node`'s agent knows it (the node-local source, with the controller's record fetched once)."""
    catalog = JobCatalog(JobsSettings(sources=["slurm"], slurm_node=node, refresh="0s"), "agent-host")
    try:
        return wait_until(lambda: next((j for j in catalog.view(fresh=True).jobs
                                        if j.job_id == job_id and j.switch_dir), None), 20, what="the job's record")
    finally:
        catalog.close()


@pytest.mark.slow
def test_restart_leaving_a_lost_node_goes_on_on_the_allocations_spare(multinode: MultiNodeCluster,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU lost on one node of a job that holds a spare (`sbatch -N 2-3`, `srun -N 2`): the node is drained and
    `restart` with `leave_node` asks the relaunch loop to start srun again without it, so the ranks go on on the
    spare, inside the same allocation, with no requeue."""
    from trainguard.actions.base import ActionContext
    from trainguard.actions.restart import RestartAction, RestartSettings
    from trainguard.core.events import Event, EventKind
    from trainguard.jobs.slurm import SlurmClient

    job_id, workdir, log = _looped_job(multinode, monkeypatch, "tg-leave", "2-3", "-N 2 ")

    nodes = functools.partial(_step_nodes, log)

    lost = ""
    try:
        wait_until(lambda: len(nodes(0)) == 2, 30, what="both ranks of step 0")
        info = multinode.job(job_id)
        assert len(expand(info["NodeList"])) == 3  # the allocation holds a spare
        lost = info["BatchHost"]  # the GPU lost where the loop runs: later restarts are asked from there too
        assert lost in nodes(0), (lost, nodes(0))
        multinode.run("scontrol", "update", f"nodename={lost}", "state=drain", "reason=test: GPU lost")
        job = _job_record(job_id, lost)
        event = Event(EventKind.FIRED, "i1", "xid", "pci:0000:17:00", Status.CRITICAL, "XID 79: GPU fell off the bus",
                      lost, time.time(), time.time(), details={"job_key": job.key})
        action = RestartAction("restart_elsewhere", RestartSettings(wait_exit=10, timeout=30, leave_node=True))
        detail = action.run(ActionContext(event, (job,), lost, SlurmClient(10.0), time.time, slurmd=lost))
        assert detail.startswith(f"restart of {job_id} without {lost} requested"), detail
        wait_until(lambda: len(nodes(1)) == 2, 30, what="both ranks of step 1")
        assert lost not in nodes(1) and len(set(nodes(0)) | set(nodes(1))) == 3  # the spare took the lost node's rank
        info = multinode.job(job_id)
        assert info["JobState"] == "RUNNING" and info["Restarts"] == "0"  # the same allocation, never requeued
        out = (workdir / f"tg-leave-{job_id}.out").read_text()
        assert f"starting it again without {lost}" in out, out

        # A hang next: `hang` speaks from the batch host, where the loop's srun runs and no rank does any more. The
        # controller's record of which srun launched step 1 names the step; its hung rank is cancelled after
        # wait_exit, and step 2 starts on the same two nodes, still without the lost one.
        hang = Event(EventKind.FIRED, "i2", "hang", job.key, Status.CRITICAL, "no progress for 30m", lost, time.time(),
                     time.time(), details={"job_key": job.key})
        detail = RestartAction("restart", RestartSettings(wait_exit=3, timeout=30)).run(
            ActionContext(hang, (job,), lost, SlurmClient(10.0), time.time, slurmd=lost))
        assert f"cancelled {job_id}.1 still running after" in detail, detail
        wait_until(lambda: len(nodes(2)) == 2, 30, what="both ranks of step 2")
        assert nodes(2) == nodes(1) and multinode.job(job_id)["Restarts"] == "0"
    finally:
        multinode.run("scancel", job_id, check=False)
        if lost:
            multinode.resume(lost)


@pytest.mark.slow
def test_a_lost_spare_is_recorded_and_the_next_restart_keeps_off_it(multinode: MultiNodeCluster,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A job with two spares (`sbatch -N 3`, `srun -N 1`): the spare srun would pick next loses its GPU first. No step
    of the job runs there, so nothing restarts, but the node is recorded as left; when the rank's own node is lost
    next, the loop starts srun without both, and the rank lands on the last good node. Without the record srun
    would pick the lost spare: SLURM starts a step on a drained node of the allocation. (A spare's agent knows the
    job while something of it runs there, its extern step under `PrologFlags=Contain`; this cluster has none, so
    the spare's action gets the job's record as the rank's node has it.)"""
    from trainguard.actions.base import ActionContext
    from trainguard.actions.restart import RestartAction, RestartSettings
    from trainguard.core.events import Event, EventKind
    from trainguard.jobs.slurm import SlurmClient

    job_id, workdir, log = _looped_job(multinode, monkeypatch, "tg-spare", "3", "-N 1 ")

    nodes = functools.partial(_step_nodes, log)

    def lose(node: str, job: Job) -> str:
        multinode.run("scontrol", "update", f"nodename={node}", "state=drain", "reason=test: GPU lost")
        event = Event(EventKind.FIRED, f"i-{node}", "xid", "pci:0000:17:00", Status.CRITICAL,
                      "XID 79: GPU fell off the bus", node, time.time(), time.time(), details={"job_key": job.key})
        action = RestartAction("restart_elsewhere", RestartSettings(wait_exit=10, timeout=30, leave_node=True))
        return action.run(ActionContext(event, (job,), node, SlurmClient(10.0), time.time, slurmd=node))

    lost: list[str] = []
    try:
        wait_until(lambda: len(nodes(0)) == 1, 30, what="the rank of step 0")
        allocation = sorted(expand(multinode.job(job_id)["NodeList"]))
        assert len(allocation) == 3
        rank, spares = nodes(0)[0], [n for n in allocation if n != nodes(0)[0]]
        job = _job_record(job_id, rank)
        lost.append(spares[0])  # the one srun picks first without the rank's node (it takes them in name order)
        detail = lose(spares[0], job)
        assert detail.endswith(f"nothing of it runs on {spares[0]}: nothing to restart; {spares[0]} recorded as "
                               f"left ({workdir}/.trainguard/left.{job_id}.0.{spares[0]})"), detail
        lost.append(rank)
        detail = lose(rank, job)
        assert detail.startswith(f"restart of {job_id} without {rank} requested"), detail
        wait_until(lambda: len(nodes(1)) == 1, 30, what="the rank of step 1")
        assert nodes(1) == [spares[1]], (nodes(1), spares)
        assert multinode.job(job_id)["Restarts"] == "0"  # the same allocation, never requeued
        out = (workdir / f"tg-spare-{job_id}.out").read_text()
        assert f"starting it again without {rank}, {spares[0]}" in out, out
    finally:
        multinode.run("scancel", job_id, check=False)
        for node in lost:
            multinode.resume(node)


# A rank that takes a few seconds to save on SIGUSR1, as a real one does, then exits.
SAVING_RANK_SCRIPT = """#!/bin/bash
echo "start step=$SLURM_STEP_ID rank=$SLURM_PROCID node=$SLURMD_NODENAME" >> ranks.log
trap 'sleep 3; echo "saved step=$SLURM_STEP_ID rank=$SLURM_PROCID" >> ranks.log; exit 0' USR1
while :; do sleep 0.2; done
"""


@pytest.mark.slow
@pytest.mark.parametrize("first", ["in_place", "elsewhere"])
def test_a_restart_in_place_and_one_without_the_node_start_the_job_once_without_it(
        multinode: MultiNodeCluster, monkeypatch: pytest.MonkeyPatch, first: str) -> None:
    """The goodput runs of record: a port down on one node of the job puts NCCL errors in its log; `training_log` on
    the other rank's node restarts it in place, `infiniband` on the faulty node restarts it without the node, a moment
    apart, in either order, from two agents (only the switch dir between them). The job starts again once, without
    the node, on its spare: the restart without the node goes on beside one in place under way, and one in place
    after it is skipped."""
    from trainguard.actions.base import ActionContext, ActionError, ActionSkippedError
    from trainguard.actions.restart import RestartAction, RestartSettings
    from trainguard.core.events import Event, EventKind
    from trainguard.jobs.slurm import SlurmClient

    # -N 2-3 starts on what is free: the last test's cancelled job may still be leaving a node (slow under load)
    wait_until(lambda: all(s.lower() == "idle" for s, _ in multinode.node_states().values()), 60,
               what="every node idle (the last test's job gone)")
    job_id, workdir, log = _looped_job(multinode, monkeypatch, "tg-race", "2-3", "-N 2 ", SAVING_RANK_SCRIPT)

    nodes = functools.partial(_step_nodes, log)

    faulty = ""
    try:
        wait_until(lambda: len(nodes(0)) == 2, 30, what="both ranks of step 0")
        assert len(expand(multinode.job(job_id)["NodeList"])) == 3  # the allocation holds a spare
        faulty, other = nodes(0)
        multinode.run("scontrol", "update", f"nodename={faulty}", "state=drain", "reason=test: port down")
        outcomes: dict[str, str] = {}

        def act(name: str, node: str, event: Event, settings: RestartSettings) -> threading.Thread:
            job = _job_record(job_id, node)

            def run() -> None:
                try:
                    outcomes[name] = "ok: " + RestartAction(name, settings).run(
                        ActionContext(event, (job,), node, SlurmClient(10.0), time.time, slurmd=node))
                except ActionSkippedError as exc:
                    outcomes[name] = f"skipped: {exc}"
                except ActionError as exc:
                    outcomes[name] = f"failed: {exc}"
            return threading.Thread(target=run)

        nccl = Event(EventKind.FIRED, "i1", "training_log", f"slurm:{job_id}", Status.CRITICAL, "NCCL error", other,
                     time.time(), time.time(), details={"job_key": f"slurm:{job_id}"})
        port = Event(EventKind.FIRED, "i2", "infiniband", "mlx5_0/1", Status.CRITICAL, "mlx5_0/1 down", faulty,
                     time.time(), time.time())
        threads = {"restart": act("restart", other, nccl, RestartSettings(wait_exit=20, timeout=40)),
                   "restart_elsewhere": act("restart_elsewhere", faulty, port,
                                            RestartSettings(wait_exit=20, timeout=40, leave_node=True))}
        order = ["restart", "restart_elsewhere"] if first == "in_place" else ["restart_elsewhere", "restart"]
        threads[order[0]].start()
        wait_until((workdir / ".trainguard" / f"restart.{job_id}").exists, 20, what="the first restart's request")
        time.sleep(0.5)  # the ranks are saving (3 s)
        threads[order[1]].start()
        for thread in threads.values():
            thread.join(60)
        assert outcomes["restart_elsewhere"].startswith(f"ok: restart of {job_id} without {faulty} requested"), outcomes
        if first == "in_place":
            assert outcomes["restart"].startswith(f"ok: restart of {job_id} requested"), outcomes
        else:
            assert outcomes["restart"].startswith(f"skipped: job {job_id} (tg-race): not restarted in place: "), outcomes
        wait_until(lambda: len(nodes(1)) == 2, 30, what="both ranks of step 1")
        assert faulty not in nodes(1) and other in nodes(1)
        time.sleep(3)  # a second restart would have started step 2 by now
        assert nodes(2) == [] and multinode.job(job_id)["Restarts"] == "0"
        out = (workdir / f"tg-race-{job_id}.out").read_text()
        assert out.count("trainguard relaunch: restart ") == 1 and f"starting it again without {faulty}" in out, out
    finally:
        multinode.run("scancel", job_id, check=False)
        if faulty:
            multinode.resume(faulty)


@pytest.mark.slow
def test_restart_of_a_job_without_the_relaunch_loop_requeues_it(multinode: MultiNodeCluster,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the loop the ranks would exit at the signal and the job would end: `restart` falls back to what
    `signal, requeue` do (or fails, `fallback = "none"`), so a site may bind it for every job."""
    from trainguard.actions.base import ActionContext, ActionError
    from trainguard.actions.restart import RestartAction, RestartSettings
    from trainguard.core.events import Event, EventKind
    from trainguard.jobs.slurm import SlurmClient

    monkeypatch.setenv("SLURM_CONF", str(multinode.conf))
    workdir = multinode.workdir()
    job_id = multinode.submit("exec srun sleep 120", "-N", "1", "-w", "n1", "--requeue", workdir=workdir,
                              name="tg-noloop")
    catalog = JobCatalog(JobsSettings(sources=["slurm"], slurm_node="n1", refresh="0s"), "agent-host")
    try:
        job = wait_until(lambda: next((j for j in catalog.view(fresh=True).jobs
                                       if j.job_id == job_id and j.switch_dir), None), 30, what="the job's record")
        event = Event(EventKind.FIRED, "i1", "hang", job.key, Status.CRITICAL, "no progress", "n1", time.time(),
                      time.time(), details={"job_key": job.key})

        def ctx() -> ActionContext:
            return ActionContext(event, (job,), "n1", SlurmClient(10.0), time.time, slurmd="n1")

        strict = RestartAction("restart", RestartSettings(wait_exit=5, timeout=20, fallback="none"))
        with pytest.raises(ActionError, match="its ranks here do not run under the relaunch loop: not restarted in "
                                              r"place \(fallback none\)"):
            strict.run(ctx())
        assert multinode.job(job_id)["JobState"] == "RUNNING"  # refused before any signal
        assert not (workdir / ".trainguard" / f"restart.{job_id}").exists()

        detail = RestartAction("restart", RestartSettings(wait_exit=5, timeout=20)).run(ctx())
        assert "its ranks here do not run under the relaunch loop: requeue instead: SIGUSR1 to every step, " \
               f"requeued {job_id}" in detail, detail
        wait_until(lambda: multinode.job(job_id).get("Restarts") == "1", 30, what="the job requeued")
    finally:
        catalog.close()
        multinode.run("scancel", job_id, check=False)


# One rank per node under the trainer helper: rank 1 is on the GPU that fell off the bus (stuck in the driver, it
# never reaches its signal handler); rank 0 saves on SIGUSR1 and reports it (`saved()`), as any rank 0 would.
LOST_GPU_RANK = """
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
from trainguard.trainer import Trainer
t = Trainer().install()
t.heartbeat(0)  # the switch dir, as the first step of a run makes it
rank = os.environ["SLURM_PROCID"]
if rank == "1":
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: (open("rank1.ended", "w").close(), sys.exit(0)))  # the requeue's
with open(f"rank{rank}.node", "w") as f:
    f.write(os.environ["SLURMD_NODENAME"])
while rank == "1" or not t.should_stop():
    time.sleep(0.1)
with open("checkpoint", "w") as f:
    f.write("saved\\n")
t.saved()
"""


@pytest.mark.slow
def test_a_lost_gpus_rank_holds_the_requeue_only_until_rank_0_reports_its_checkpoint(
        multinode: MultiNodeCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default binding of a lost GPU, `signal` then `requeue` (drain has no part in the wait): the requeue waits
    for the job's processes on this node to exit, and the rank on the lost GPU never does. Once rank 0, on the other
    node, reports its checkpoint written, the requeue waits `after_save` more, not the whole `wait_exit`."""
    import re

    from trainguard.actions.base import ActionContext
    from trainguard.actions.signal import SignalAction, SignalSettings
    from trainguard.actions.slurmctl import RequeueAction, RequeueSettings
    from trainguard.core.events import Event, EventKind
    from trainguard.jobs.slurm import SlurmClient

    monkeypatch.setenv("SLURM_CONF", str(multinode.conf))
    workdir = multinode.workdir()
    (workdir / "rank.py").write_text(LOST_GPU_RANK)
    shutil.chown(workdir / "rank.py", JOB_USER, JOB_USER)
    job_id = multinode.submit(f"exec srun --ntasks-per-node=1 {multinode.python} rank.py {multinode.lib}", "-N", "2",
                              "--requeue", workdir=workdir, name="tg-lost-gpu")
    try:
        lost = str(wait_until(lambda: (workdir / "rank1.node").exists() and (workdir / "rank1.node").read_text(), 30,
                              what="the rank on the lost GPU"))
        job = _job_record(job_id, lost)
        assert job.processes and job.switch_dir == f"{workdir}/.trainguard"
        event = Event(EventKind.FIRED, "i1", "xid", "pci:0000:17:00", Status.CRITICAL, "XID 79: GPU fell off the bus",
                      lost, time.time(), time.time(), details={"job_key": job.key})
        ctx = ActionContext(event, (job,), lost, SlurmClient(10.0), time.time, slurmd=lost)
        try:
            assert SignalAction("signal", SignalSettings()).run(ctx) == f"scancel --signal=USR1 --full {job_id}"
            started = time.monotonic()
            detail = RequeueAction("requeue", RequeueSettings(wait_exit=120, timeout=150, after_save=1)).run(ctx)
            took = time.monotonic() - started
        finally:
            ctx.done()
        assert re.fullmatch(rf"requeued {job_id} \(saved\.{job_id} \d+\.\ds after the wait began: the checkpoint "
                            r"was written\)", detail), detail
        assert 1 <= took < 60, (took, detail)  # wait_exit is 120 s; after_save 1 s
        wait_until((workdir / "rank1.ended").exists, 30, what="the lost GPU's rank ended by the requeue, not before")
        assert (workdir / "checkpoint").read_text() == "saved\n"
        wait_until(lambda: multinode.job(job_id).get("Restarts") == "1", 30, what="the job requeued")
        switch_dir = workdir / ".trainguard"  # the request served this fault: gone (the report stays for other agents)
        wait_until(lambda: f"signalled.{job_id}" not in {p.name for p in switch_dir.iterdir()}, 10,
                   what="the request removed")
    finally:
        multinode.run("scancel", job_id, check=False)


@pytest.mark.slow
def test_the_node_a_requeued_job_left_does_not_read_its_next_lifes_log(multinode: MultiNodeCluster, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 24's short goodput run: the job's batch host n1 was drained for an XID and the job requeued onto other
    nodes; n1's agent still listed the job (ended here), took the controller's record of the next life as its own,
    read that life's NaN losses in the shared log, spoke for the job (n1 not in the new NodeList: "every node speaks")
    and requeued it. The life that ran here ended REQUEUED: its owner and nodes stay that life's, and its log is not
    read any more."""
    monkeypatch.setenv("SLURM_CONF", str(multinode.conf))
    workdir = multinode.workdir()
    script = ('if [ "${SLURM_RESTART_COUNT:-0}" = 1 ]; then echo "step 51 loss=nan"; echo "step 52 loss=nan"; '
              'echo "step 53 loss=nan"; fi; exec srun --ntasks-per-node=1 sleep 120')
    job_id = multinode.submit(script, "-N", "2", "--requeue", workdir=workdir, name="tg-left")
    wait_until(lambda: multinode.job(job_id).get("JobState") == "RUNNING", 30, what="the job running")
    first = multinode.job(job_id)
    owner, nodes = first["BatchHost"], first["NodeList"]  # not pinned with -w: a requeued job keeps that list
    jobs = JobCatalog(JobsSettings(sources=["slurm"], slurm_node=owner, refresh="0s"), "agent-host")
    watch = TrainingLogCheck("logs", TrainingLogSettings(), CheckContext(
        owner, tmp_path, jobs=jobs, nvml=Nvml(FakeNvml(init_error=NVMLError))))
    key = f"slurm:{job_id}"

    def mine() -> Job | None:
        jobs.settle(10)
        return next((j for j in jobs.view().jobs if j.key == key), None)

    try:
        wait_until(lambda: (j := mine()) is not None and j.node_list == nodes and j.batch_host == owner, 30,
                   what="the owner node running the job")
        assert next(r for r in watch.run() if r.subject == key).status is Status.OK
        multinode.run("scontrol", "update", f"nodename={owner}", "state=drain", "reason=test: GPU lost")
        multinode.run("scontrol", "requeue", job_id)
        wait_until(lambda: (multinode.job(job_id).get("Restarts"), multinode.job(job_id).get("JobState")) ==
                   ("1", "RUNNING"), 60, what="the next life running")
        assert owner not in expand(multinode.job(job_id)["NodeList"])
        out = Path(multinode.job(job_id)["StdOut"])
        wait_until(lambda: "step 53" in out.read_text(), 20, what="the next life's NaN losses")
        job = wait_until(lambda: (j := mine()) is not None and j.state == "REQUEUED" and j, 20,
                         what="the owner node seeing its life of the job end, requeued")
        assert (job.restarts, job.node_list, job.batch_host, job.processes) == (0, nodes, owner, ())  # type: ignore[union-attr]
        for _ in range(3):  # the node has nothing to say about the next life, which runs elsewhere
            assert [r for r in watch.run() if r.subject == key] == []
            time.sleep(0.5)
    finally:
        jobs.close()
        multinode.run("scancel", job_id, check=False)
        multinode.run("scontrol", "update", f"nodename={owner}", "state=resume", check=False)


@pytest.mark.slow
def test_a_bad_repair_keeps_the_node_drained_and_the_job_runs_on_another(multinode: MultiNodeCluster, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 50's goal: a resumed node whose diagnostics fail is never given a job. n1's agent drains n1 for a lost
    GPU; the GPU answers again and `resume` validates first: dcgmi (its real failing output) fails, so n1 stays
    drained with the failed test in its reason and in the ledger, and a one-node job for n1 or n2 runs on n2."""
    from tests.test_diag import cat

    monkeypatch.setenv("SLURM_CONF", str(multinode.conf))
    tools = tmp_path / "tools"
    tools.mkdir()
    cat(tools, "nvidia-smi", "nvidia-smi-q-h100-pass.txt")
    cat(tools, "dcgmi", "dcgmi-r1-fail-gb10.json", rc=226)
    gpu = FakeGpu("GPU-00000001-0000-4000-8000-000000000000", serial="1320000000001")
    raw = {"agent": {"state_dir": str(tmp_path / "state"), "node_name": "n1", "listen": ""},
           "jobs": {"sources": [], "slurm_node": "n1", "slurm_timeout": "10s"},
           "checks": {"gpu": {"interval": "1s", "actions": {"critical": ["drain"], "resolved": ["resume"]}}},
           "notifiers": {}, "actions": {"resume": {"tool_dir": str(tools), "gpus": 1}}}
    engine = Engine(parse_config(raw, "n1.toml"), notifiers={}, nvml=Nvml(FakeNvml([gpu])), ledger=True)
    job_id = ""

    def settle() -> list[dict[str, object]]:
        engine.run_round()
        for thread in list(engine.responder.threads):
            thread.join(60)
        return [r.data for r in engine.ledger.history() if r.event in ("drain", "resume", "diag")] if engine.ledger else []

    try:
        gpu.fail = {"nvmlDeviceGetMemoryInfo": NVMLError_GpuIsLost}  # the GPU off the bus
        wait_until(lambda: settle() is not None and "drain" in multinode.node_states()["n1"][0], 20, what="n1 drained")
        gpu.fail = {}  # repaired, or so it seems
        wait_until(lambda: any(d.get("source") == "resume" for d in settle()), 30, what="the resume's validation")
        state, reason = multinode.node_states()["n1"]
        assert "drain" in state and reason.startswith("trainguard: quick diag failed: dcgmi diag -r 1: failed software")
        # one run per incident resolved (the GPU's, and the count's), each failed
        diags = [r.data for r in engine.ledger.history() if r.event == "diag"] if engine.ledger else []
        assert diags and all(d["passed"] is False and [f["test"] for f in d["failed"]] == ["dcgmi diag -r 1"]  # type: ignore[union-attr]
                             for d in diags), diags
        assert not [r for r in engine.ledger.history() if r.event == "resume"] if engine.ledger else False

        job_id = multinode.submit("hostname", "-N", "1", "-x", "n3", workdir=multinode.workdir(), name="tg-after-repair")
        info = wait_until(lambda: (j := multinode.job(job_id)).get("JobState") in ("RUNNING", "COMPLETING",
                                                                                   "COMPLETED") and j, 30,
                          what="the job started")
        assert info["NodeList"] == "n2", info  # type: ignore[index]
        assert "drain" in multinode.node_states()["n1"][0]
    finally:
        engine.stop()
        if job_id:
            multinode.run("scancel", job_id, check=False)
        multinode.resume("n1")
