"""Restart in place (issue 24): the trainer helper's relaunch loop, the `restart` action's parsers, and the check
forgetting what it learned about a job that started afresh. The action against real SLURM steps is in
tests/test_multinode.py."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.conftest import require_root, wait_until
from tests.slurm_cluster import JOB_USER, ensure_user
from trainguard.actions.base import (
    ActionAnsweredError,
    ActionContext,
    ActionError,
    ActionList,
    ActionSkippedError,
    Claim,
    Claims,
    Reports,
)
from trainguard.actions.restart import RestartAction, RestartSettings, request_name
from trainguard.actions.savereport import SaveReport
from trainguard.actions.signal import SignalAction, SignalSettings
from trainguard.actions.slurmctl import DrainAction, DrainSettings, RequeueAction, RequeueSettings
from trainguard.agent.configfile import parse_config
from trainguard.checks.base import ActionBinding
from trainguard.core.events import Event, EventKind
from trainguard.core.model import Result, Status
from trainguard.jobs.catalog import JobView
from trainguard.jobs.model import Job, ProcessRef
from trainguard.jobs.slurm import SlurmClient, SlurmError, parse_listpids_steps, parse_steps
from trainguard.node.procfs import ProcFS
from trainguard.pipeline.engine import Engine
from trainguard.pipeline.incidents import IncidentPolicy, IncidentTracker
from trainguard.pipeline.responder import Responder, _brief
from trainguard.pipeline.store import Store
from trainguard.registry import Registry
from trainguard.trainer import Trainer

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).parent / "data" / "slurm"

# One launch of the job's command: it logs which launch it is, and does what the step file says for that launch:
# "request" writes a restart request as the agent does (a new file renamed into place) and exits 0, "kill" writes
# one and dies of SIGKILL, "exit N" exits N.
LAUNCH = r"""
import json, os, signal, sys, pathlib
sw = pathlib.Path(sys.argv[1]); n = int(os.environ["TRAINGUARD_RESTARTS"])
with open(sw.parent / "launches", "a") as f: f.write(f"{n}\n")
plan = (sw.parent / "plan").read_text().split(",")
what = plan[n] if n < len(plan) else "exit 0"
if what in ("request", "kill"):
    tmp = sw / ".restart.tmp"; tmp.write_text(json.dumps({"reason": f"NaN loss\nin launch {n}"}))
    tmp.rename(sw / ("restart." + os.environ["SLURM_JOB_ID"]))
    if what == "kill": os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(0)
if what == "other": (sw / "restart.78").write_text("{}"); sys.exit(0)
if what == "sleep": signal.signal(signal.SIGTERM, lambda *_: sys.exit(143)); (sw.parent / "sleeping").touch(); signal.pause()
sys.exit(int(what.split()[1]))
"""


def _loop(tmp_path: Path, plan: str, *args: str) -> subprocess.Popen[str]:
    (tmp_path / "sw").mkdir(exist_ok=True)
    (tmp_path / "plan").write_text(plan)
    return subprocess.Popen([sys.executable, "-m", "trainguard.trainer", "relaunch", *args, "--switch-dir",
                             str(tmp_path / "sw"), "--", sys.executable, "-c", LAUNCH, str(tmp_path / "sw")],
                            cwd=REPO, stderr=subprocess.PIPE, text=True, env={**os.environ, "SLURM_JOB_ID": "77"})


def _launches(tmp_path: Path) -> list[str]:
    return (tmp_path / "launches").read_text().split()


def test_the_loop_starts_the_command_again_for_each_new_restart_request(tmp_path: Path) -> None:
    proc = _loop(tmp_path, "request,kill,exit 3")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 3  # the last launch's status, as a shell would return it
    assert _launches(tmp_path) == ["0", "1", "2"]
    lines = [line for line in err.splitlines() if line.startswith("trainguard relaunch:")]
    # the request's reason in one line, and the status of the launch that ended (128+9: killed)
    assert lines == ["trainguard relaunch: restart 1 of at most 10 asked (NaN loss in launch 0); python exited 0: "
                     "starting it again".replace("python", sys.executable),
                     "trainguard relaunch: restart 2 of at most 10 asked (NaN loss in launch 1); python exited 137: "
                     "starting it again".replace("python", sys.executable)], err


def test_a_request_older_than_the_loop_or_none_at_all_ends_it_with_the_commands_status(tmp_path: Path) -> None:
    (tmp_path / "sw").mkdir()
    (tmp_path / "sw" / "restart.77").write_text("{}")  # left by an earlier life of the job
    proc = _loop(tmp_path, "exit 5")
    proc.communicate(timeout=60)
    assert proc.returncode == 5 and _launches(tmp_path) == ["0"]


def test_a_request_for_another_job_of_the_same_directory_is_not_this_ones(tmp_path: Path) -> None:
    """Every job submitted from one directory (an array's tasks) shares its switch dir: the request names its job."""
    proc = _loop(tmp_path, "other,exit 0")
    proc.communicate(timeout=60)
    assert proc.returncode == 0 and _launches(tmp_path) == ["0"]


def test_max_restarts_bounds_a_job_that_asks_for_ever(tmp_path: Path) -> None:
    proc = _loop(tmp_path, "request,request,request,request", "--max-restarts", "2")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and _launches(tmp_path) == ["0", "1", "2"]
    assert "restart asked after 2 restarts (--max-restarts 2): not starting" in err


def test_sigterm_ends_the_loop_after_the_command_even_with_a_request(tmp_path: Path) -> None:
    """The time limit, scancel: SIGTERM reaches the loop and its command (slurmd signals the whole batch step); the
    command may have asked for a restart on its way out, and is not started again. SIGUSR1, the ranks' save and
    exit, does not end the loop."""
    proc = _loop(tmp_path, "sleep")
    wait_until((tmp_path / "sleeping").exists, 30, what="the command running")
    proc.send_signal(signal.SIGUSR1)
    time.sleep(0.3)
    assert proc.poll() is None
    (tmp_path / "sw" / "restart.77").write_text("{}")
    proc.send_signal(signal.SIGTERM)
    for child in _children(proc.pid):
        os.kill(child, signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 143 and _launches(tmp_path) == ["0"]


# A stand-in `srun`: it logs its options and TRAINGUARD_LEFT, then does what its plan says for this launch (steps
# joined by "+"): "left N" records node N as left as another node's agent does, "leave N" asks to leave node N as
# this node's agent does (both), anything else exits.
SRUN = r"""#!PYTHON
import json, os, sys, pathlib
sw = pathlib.Path(os.environ["SW"]); n = int(os.environ["TRAINGUARD_RESTARTS"])
with open(sw.parent / "launches", "a") as f:
    f.write(json.dumps([sys.argv[1:], os.environ.get("TRAINGUARD_LEFT")]) + "\n")
plan = (sw.parent / "plan").read_text().split(";")
for what in plan[n].split("+") if n < len(plan) else ():
    if what.startswith("left "):
        (sw / f"left.77.{os.environ.get('SLURM_RESTART_COUNT', '0')}.{what[5:]}").write_text("{}")
    if what.startswith("leave "):
        tmp = sw / ".restart.tmp"; tmp.write_text(json.dumps({"reason": "XID 79", "leave": what[6:]}))
        tmp.rename(sw / "restart.77")
"""


def _srun_loop(tmp_path: Path, plan: str, *srun_args: str, **env: str) -> list[tuple[list[str], str | None]]:
    (tmp_path / "sw").mkdir(exist_ok=True)
    (tmp_path / "plan").write_text(plan)
    srun = tmp_path / "bin" / "srun"
    srun.parent.mkdir()
    srun.write_text(SRUN.replace("PYTHON", sys.executable, 1))
    srun.chmod(0o755)
    proc = subprocess.run([sys.executable, "-m", "trainguard.trainer", "relaunch", "--switch-dir",
                           str(tmp_path / "sw"), "--", str(srun), *srun_args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "SLURM_JOB_ID": "77", "SW": str(tmp_path / "sw"), **env})
    assert proc.returncode == 0, proc.stderr
    return [tuple(json.loads(line)) for line in (tmp_path / "launches").read_text().splitlines()]  # type: ignore[misc]


def test_a_request_to_leave_a_node_starts_srun_again_without_every_node_left(tmp_path: Path) -> None:
    launches = _srun_loop(tmp_path, "leave n3;leave n1;leave n3;exit", "-N", "3", "python", "train.py")
    assert launches == [(["-N", "3", "python", "train.py"], ""),
                        (["--exclude=n3", "-N", "3", "python", "train.py"], "n3"),
                        (["--exclude=n3,n1", "-N", "3", "python", "train.py"], "n3,n1"),
                        (["--exclude=n3,n1", "-N", "3", "python", "train.py"], "n3,n1")]  # n3 once


def test_nodes_recorded_as_left_in_this_life_are_left_and_an_earlier_lifes_records_are_removed(tmp_path: Path) -> None:
    """Two nodes lost at once: each agent records its node in a file of its own, and the one request names only the
    later one; a lost spare is recorded with no request at all, maybe before the loop started (the batch script
    preparing). The loop leaves every node this life of the job recorded (`SLURM_RESTART_COUNT`), as the agent writes
    them (regular files of the user or root); an earlier life's records (another allocation) are removed."""
    sw = tmp_path / "sw"
    sw.mkdir()
    (sw / "left.77.0.n9").write_text("{}")  # the first life's: this is the second (requeued once)
    (sw / "left.77.1.n8").write_text("{}")  # this life's, from before the loop started
    (sw / "left.78.1.n5").write_text("{}")  # another job's of the same directory
    (sw / "left.77.1.--uid=0").write_text("{}")  # not a host name
    os.symlink(tmp_path / "plan", sw / "left.77.1.n7")  # not a regular file
    (sw / "left.77.1.n6").write_text("{}")
    os.chown(sw / "left.77.1.n6", 65534, 65534)  # another user's (a teammate's): not the agent's
    launches = _srun_loop(tmp_path, "left n2+leave n3;left n4+leave n1;exit", "-N", "2", "python", "train.py",
                          SLURM_RESTART_COUNT="1")
    assert launches == [(["--exclude=n8", "-N", "2", "python", "train.py"], "n8"),
                        (["--exclude=n8,n3,n2", "-N", "2", "python", "train.py"], "n8,n3,n2"),
                        (["--exclude=n8,n3,n2,n1,n4", "-N", "2", "python", "train.py"], "n8,n3,n2,n1,n4")]
    assert (sw / "left.78.1.n5").exists() and (sw / "left.77.1.n6").exists()  # another job's; not this user's
    # the job's life ended with its loop: none of its records is left for a later job given the same id
    assert sorted(p.name for p in sw.glob("left.77.*")) == ["left.77.1.--uid=0", "left.77.1.n6", "left.77.1.n7"]


@pytest.mark.parametrize("leave", ["n[1-3]", "--uid=0", "n1,n2", "", "n1 n2"])
def test_a_node_to_leave_that_is_not_one_host_name_is_ignored(tmp_path: Path, leave: str) -> None:
    launches = _srun_loop(tmp_path, f"leave {leave};exit", "python", "train.py")
    assert launches[1] == (["python", "train.py"], "")  # restarted, on the same nodes


def test_a_command_with_an_exclusion_of_its_own_cannot_leave_a_node(tmp_path: Path) -> None:
    """Two --exclude would not merge: the loop says it cannot leave a node (no TRAINGUARD_LEFT), and the agent then
    requeues instead."""
    launches = _srun_loop(tmp_path, "leave n3;exit", "-x", "n9", "python", "train.py")
    assert launches == [(["-x", "n9", "python", "train.py"], None), (["-x", "n9", "python", "train.py"], None)]


def _children(pid: int) -> list[int]:
    import psutil

    return [c.pid for c in psutil.Process(pid).children()]


def test_relaunch_needs_a_command() -> None:
    proc = subprocess.run([sys.executable, "-m", "trainguard.trainer", "relaunch", "--"], cwd=REPO,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "relaunch: no command given" in proc.stderr


def test_restart_requested_is_a_request_for_this_job_newer_than_the_process(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    (tmp_path / "restart.77").write_text("{}")
    t = Trainer(switch_dir=tmp_path)
    assert not t.restart_requested()  # there before this process: an earlier life's
    (tmp_path / "restart.78").write_text("{}")
    assert not t.restart_requested()  # another job's
    tmp = tmp_path / ".restart.tmp"
    tmp.write_text("{}")
    tmp.rename(tmp_path / "restart.77")
    assert t.restart_requested()
    (tmp_path / "restart.77").unlink()
    os.symlink("/etc/hostname", tmp_path / "restart.77")  # never a link
    assert not t.restart_requested()


def test_listpids_steps_and_squeue_steps_as_captured() -> None:
    """tests/data/slurm/listpids-steps.txt, squeue-steps.txt, squeue-steps-array.txt: captured 2026-11-27 (README
    there)."""
    steps = parse_listpids_steps((DATA / "listpids-steps.txt").read_text())
    assert steps == {"1": {"0": [8483, 8485]}}  # the batch step is not an srun step
    assert parse_steps((DATA / "squeue-steps.txt").read_text(), "1") == ["0"]
    assert parse_steps("1.3\n1.extern\n1.x9\n1.batch\n", "1") == ["3"]
    # an array task's steps are named ARRAY_TASK.STEP (raw job id 2 is task 3 of array 1)
    assert parse_steps((DATA / "squeue-steps-array.txt").read_text(), "2") == ["0", "1"]


def _event(check: str = "training_log", subject: str = "slurm:5") -> Event:
    return Event(EventKind.FIRED, "i1", check, subject, Status.CRITICAL, "NaN loss", "n1", time.time(), time.time(),
                 details={"job_key": subject})


def test_restart_refuses_what_it_cannot_restart_in_place() -> None:
    action = RestartAction("restart", RestartSettings())
    proc_job = Job(key="process:train", source="process", name="train", state="RUNNING")
    ctx = ActionContext(_event(), (proc_job,), "n1", SlurmClient(), time.time)
    with pytest.raises(ActionError, match=r"restart in place is for SLURM jobs.*Restart=on-failure"):
        action.run(ctx)
    with pytest.raises(ActionSkippedError, match="no SLURM job on this node to restart"):
        action.run(ActionContext(_event(), (), "n1", SlurmClient(), time.time))
    with pytest.raises(ValueError, match=r"wait_exit \(400s\) must be shorter than timeout"):
        RestartSettings(wait_exit=400)


def test_a_done_restart_makes_the_check_forget_the_jobs_history(tmp_path: Path) -> None:
    """After a restart in place the job's log goes on in the same file, in the same SLURM life: the NaN streak the
    check found there is the earlier start's, and must not hold the incident open (nor stop a later one firing)."""
    raw = {"agent": {"state_dir": str(tmp_path), "listen": ""}, "jobs": {"sources": []},
           "checks": {"training_log": {}}, "actions": {}}
    engine = Engine(parse_config(raw, "t.toml"), store=Store(None))
    check = engine.checks["training_log"]
    forgotten: list[tuple[str, float]] = []
    check.clear = lambda subject, at: forgotten.append((subject, at))  # type: ignore[method-assign]

    class Done(RestartAction):
        def run(self, ctx: ActionContext) -> str:
            return "restarted"

    class Failed(RestartAction):
        def run(self, ctx: ActionContext) -> str:
            raise ActionError("no srun step")

    try:
        responder = engine.responder
        for name, cls in (("failed", Failed), ("done", Done)):
            responder.actions[name] = cls(name, RestartSettings())
        responder._run_all(_event(), ["failed"])
        assert forgotten == []  # nothing restarted: the history stands
        responder._run_all(_event(), ["done"])
        assert [s for s, _ in forgotten] == ["slurm:5"]
    finally:
        engine.stop()


class StubSlurm:
    """What the action asks of SLURM, scripted: the local steps (real processes, whose environment is read), the
    controller's step list, and a record of every signal, cancel and requeue."""

    def __init__(self, here: dict[str, list[int]], steps: list[str], fail_signal: bool = False,
                 gone: bool = False, batch: list[int] | None = None,
                 sruns: dict[str, tuple[str, int]] | None = None, spans: dict[str, str] | None = None) -> None:
        self.here, self.listed, self.fail_signal, self.gone = here, steps, fail_signal, gone
        self.batch, self.sruns = batch or [], sruns or {}  # this node's processes of the job; who launched each step
        self.spans = spans or {}  # each step's NodeList
        self.fail_steps = False
        self.calls: list[tuple[str, ...]] = []
        self.record: str | None = None  # the controller's record of job 5 (`scontrol show job 5 --oneliner`)

    def local_pids(self, node: str = "") -> dict[str, list[int]]:
        pids = self.batch + [pid for pids in self.here.values() for pid in pids]
        return {"5": pids} if pids else {}

    def local_work_pids(self, job_id: str, node: str = "") -> list[int]:
        return self.local_pids(node).get(job_id, [])

    def step_nodes(self, job_id: str) -> dict[str, str]:
        return self.spans

    def step_sruns(self, job_id: str) -> dict[str, tuple[str, int]]:
        return self.sruns

    def local_steps(self, job_id: str, node: str = "") -> dict[str, list[int]]:
        return self.here

    def steps(self, job_id: str) -> list[str]:
        if self.fail_steps:
            raise SlurmError("squeue: error: slurm_load_jobs error: Socket timed out on send/recv operation")
        return self.listed

    def signal(self, job_id: str, signal_name: str, mode: str = "full") -> None:
        if self.fail_signal:
            raise SlurmError("scancel: error: Unable to contact slurm controller (connect failure)")
        self.calls.append(("signal", job_id, signal_name, mode))

    def signal_step(self, job_id: str, step: str, signal_name: str) -> bool:
        self.signal(f"{job_id}.{step}", signal_name, "step")
        return not self.gone  # gone: SLURM said "Invalid job id" and no longer lists the step

    def cancel_step(self, job_id: str, step: str) -> bool:
        self.calls.append(("cancel", f"{job_id}.{step}"))
        return True

    def requeue(self, job_id: str) -> None:
        self.calls.append(("requeue", job_id))
        self.record = self.record.replace("JobState=RUNNING", "JobState=PENDING") if self.record else None

    def show_job(self, job_id: str) -> str | None:
        return self.record


@pytest.fixture
def ranks() -> Iterator[Callable[..., int]]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(**env: str) -> int:
        procs.append(subprocess.Popen(["sleep", "60"], env={"PATH": os.environ["PATH"], **env}))
        # Popen returns once exec has begun; /proc/PID/environ reads empty until the kernel has laid out the new
        # program's stack, a moment later (this raced in the suite)
        wait_until(lambda: ProcFS().environ_var(procs[-1].pid, "PATH") is not None, 10, what="the rank's environment")
        return procs[-1].pid

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def _job(tmp_path: Path, requeue: bool = True) -> Job:
    return Job(key="slurm:5", source="slurm", name="t", state="RUNNING", job_id="5", uid=os.getuid(),
               switch_dir=str(tmp_path / "sw"), requeue=requeue)


def _run(slurm: StubSlurm, job: Job, **settings: object) -> str:
    action = RestartAction("restart", RestartSettings(**{"wait_exit": 0.5, "timeout": 5, **settings}))
    ctx = ActionContext(_event(), (job,), "n1", slurm, time.time)  # type: ignore[arg-type]
    try:
        return action.run(ctx)
    finally:
        ctx.done()


def test_only_the_loops_steps_are_signalled_and_those_left_cancelled(tmp_path: Path,
                                                                      ranks: Callable[..., int]) -> None:
    """A sidecar step (srun --overlap: a monitor, a debug shell) is neither signalled nor cancelled; the rank that
    did not exit in wait_exit is cancelled on every node; the request names the job (one switch dir serves every job
    submitted from one directory)."""
    slurm = StubSlurm({"0": [ranks(TRAINGUARD_RESTARTS="0")], "3": [ranks()]}, ["0", "3"])
    detail = _run(slurm, _job(tmp_path))
    assert slurm.calls == [("signal", "5.0", "USR1", "step"), ("cancel", "5.0")]
    assert "SIGUSR1 to step 5.0: cancelled 5.0 still running after" in detail, detail
    request = tmp_path / "sw" / "restart.5"
    assert json.loads(request.read_text())["job_id"] == "5" and not (tmp_path / "sw" / "restart").exists()


def test_a_loop_out_of_restarts_and_a_job_without_the_loop_are_requeued(tmp_path: Path,
                                                                        ranks: Callable[..., int]) -> None:
    slurm = StubSlurm({"0": [ranks(TRAINGUARD_RESTARTS="3", TRAINGUARD_MAX_RESTARTS="3")]}, ["0"])
    detail = _run(slurm, _job(tmp_path))
    assert "its relaunch loop has used its 3 restarts: requeue instead" in detail, detail
    assert slurm.calls == [("signal", "5", "USR1", "full"), ("requeue", "5")]
    assert not (tmp_path / "sw").exists()  # nothing asked of a loop that would not restart

    slurm = StubSlurm({"0": [ranks(TRAINGUARD_RESTARTS="0", TRAINGUARD_MAX_RESTARTS="0")]}, ["0"])
    assert "its relaunch loop has used its 0 restarts: requeue instead" in _run(slurm, _job(tmp_path))

    slurm = StubSlurm({"0": [ranks()]}, ["0"])
    with pytest.raises(ActionError, match="do not run under the relaunch loop, and it was submitted --no-requeue: "
                                          "left alone"):
        _run(slurm, _job(tmp_path, requeue=False))
    assert slurm.calls == []  # a signal would end a job nobody may requeue


def test_leave_node_restarts_without_this_node_when_the_allocation_holds_a_spare(tmp_path: Path,
                                                                                ranks: Callable[..., int]) -> None:
    """An XID on n1: the request names n1 for the loop to exclude; the step spans 3 of the allocation's 4 nodes."""
    job = replace(_job(tmp_path), node_list="n[1-4]")
    slurm = StubSlurm({"0": [ranks(TRAINGUARD_RESTARTS="0", TRAINGUARD_LEFT="", SLURM_STEP_NUM_NODES="3")]}, ["0"])
    detail = _run(slurm, job, leave_node=True)
    assert detail.startswith("restart of 5 without n1 requested"), detail
    assert json.loads((tmp_path / "sw" / "restart.5").read_text())["leave"] == "n1"
    assert json.loads((tmp_path / "sw" / "left.5.0.n1").read_text())["life"] == 0
    assert slurm.calls == [("signal", "5.0", "USR1", "step"), ("cancel", "5.0")]


@pytest.mark.parametrize(("env", "why"), [
    ({"TRAINGUARD_LEFT": "n4", "SLURM_STEP_NUM_NODES": "3"}, r"no spare node in its allocation \(4 node\(s\), 2 left or "
                                                             r"leaving, its step spans 3\)"),
    ({"TRAINGUARD_LEFT": "", "SLURM_STEP_NUM_NODES": "4"}, "no spare node in its allocation"),
    ({"SLURM_STEP_NUM_NODES": "3"}, "its relaunch loop cannot leave a node"),
    ({"TRAINGUARD_LEFT": ""}, "its ranks here do not say how many nodes their step spans"),
    ({"TRAINGUARD_LEFT": "", "SLURM_STEP_NUM_NODES": "\u00b2"}, "its ranks here do not say how many"),  # the user's text
])
def test_leave_node_without_a_spare_is_requeued_instead(tmp_path: Path, ranks: Callable[..., int],
                                                        env: dict[str, str], why: str) -> None:
    job = replace(_job(tmp_path), node_list="n[1-4]")
    slurm = StubSlurm({"0": [ranks(TRAINGUARD_RESTARTS="1", **env)]}, ["0"])
    detail = _run(slurm, job, leave_node=True)
    assert re.search(f"not restarted without n1: {why}.*: requeue instead", detail), detail
    assert slurm.calls == [("signal", "5", "USR1", "full"), ("requeue", "5")]
    # no restart request; the node is recorded as left only where the loop could have left it (a true record: the
    # next life of the job, after the requeue, removes it)
    assert sorted(p.name for p in (tmp_path / "sw").glob("*")) == (["left.5.0.n1"] if "no spare" in why else [])


def test_two_nodes_lost_at_once_count_each_others_record(tmp_path: Path, ranks: Callable[..., int]) -> None:
    """n2's agent recorded n2 as left a moment ago; its restart has not reached the ranks yet (TRAINGUARD_LEFT is
    still empty). n1's agent counts n2 too: with one spare in the allocation the job cannot go on without both, and
    is requeued; with two it restarts without n1, and the loop reads both records. A symlink is no record, and
    neither is an earlier life's (the job was requeued once: its ranks say so, the controller's record did not)."""
    sw = tmp_path / "sw"
    sw.mkdir()
    (sw / "left.5.1.n2").write_text("{}")
    os.symlink(tmp_path, sw / "left.5.1.n3")
    env = {"TRAINGUARD_RESTARTS": "0", "TRAINGUARD_LEFT": "", "SLURM_STEP_NUM_NODES": "3", "SLURM_RESTART_COUNT": "1"}
    slurm = StubSlurm({"0": [ranks(**env)]}, ["0"])
    detail = _run(slurm, replace(_job(tmp_path), node_list="n[1-4]"), leave_node=True)
    assert "not restarted without n1: no spare node in its allocation (4 node(s), 2 left or leaving, its step spans " \
           "3): requeue instead" in detail, detail
    assert json.loads((sw / "left.5.1.n1").read_text())["node"] == "n1" and not (sw / "restart.5").exists()

    (sw / "left.5.1.n1").unlink()
    (sw / "left.5.0.n4").write_text("{}")
    (sw / "left.5.0.n5").write_text("{}")
    slurm = StubSlurm({"0": [ranks(**env)]}, ["0"])
    detail = _run(slurm, replace(_job(tmp_path), node_list="n[1-5]"), leave_node=True)
    assert detail.startswith("restart of 5 without n1 requested"), detail
    assert (sw / "left.5.1.n1").is_file() and json.loads((sw / "restart.5").read_text())["leave"] == "n1"


def test_a_restart_under_way_keeps_its_record_when_the_controller_fails_after_the_signal(
        tmp_path: Path, ranks: Callable[..., int]) -> None:
    """The request is written and the steps signalled: the loop restarts the job without this node whatever fails
    next, so the record stays (another node's agent counts it)."""
    env = {"TRAINGUARD_RESTARTS": "0", "TRAINGUARD_LEFT": "", "SLURM_STEP_NUM_NODES": "3"}
    slurm = StubSlurm({"0": [ranks(**env)]}, ["0"])
    slurm.fail_steps = True
    with pytest.raises(ActionError, match=r"restart 5: .*restart.5 written, SIGUSR1 sent, then: squeue: error"):
        _run(slurm, replace(_job(tmp_path), node_list="n[1-4]"), leave_node=True)
    assert sorted(p.name for p in (tmp_path / "sw").iterdir()) == ["left.5.0.n1", "restart.5"]


def test_a_node_left_but_neither_restarted_nor_requeued_is_not_left_recorded(tmp_path: Path,
                                                                              ranks: Callable[..., int]) -> None:
    """No spare and `fallback = "none"` (or a job submitted --no-requeue): the job goes on as it was, and a later
    restart (a NaN) must not leave the node its step needs. A switch dir the record cannot be written in is the
    fallback too (a requeue), as a job without a spare would get."""
    env = {"TRAINGUARD_RESTARTS": "0", "TRAINGUARD_LEFT": "", "SLURM_STEP_NUM_NODES": "4"}
    job = replace(_job(tmp_path), node_list="n[1-4]")
    slurm = StubSlurm({"0": [ranks(**env)]}, ["0"])
    with pytest.raises(ActionError, match=r"no spare node in its allocation.*fallback none"):
        _run(slurm, job, leave_node=True, fallback="none")
    assert list((tmp_path / "sw").iterdir()) == [] and slurm.calls == []

    (tmp_path / "sw").rmdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "sw").symlink_to(tmp_path / "elsewhere")
    slurm = StubSlurm({"0": [ranks(**{**env, "SLURM_STEP_NUM_NODES": "3"})]}, ["0"])
    detail = _run(slurm, job, leave_node=True)
    assert "not restarted without n1: n1 cannot be recorded as left (switch dir" in detail and "is a symlink: " \
           "refused): requeue instead" in detail, detail
    assert slurm.calls == [("signal", "5", "USR1", "full"), ("requeue", "5")]
    assert list((tmp_path / "elsewhere").iterdir()) == []


# A rank 0 that saves when the restart is asked (the trainer helper's saved(), as the goodput trainer calls it) and
# exits, while another rank of the job stays hung.
SAVER = r"""
import os, signal, sys, time
from trainguard.trainer import Trainer
t = Trainer(switch_dir=sys.argv[1]).install()
open(sys.argv[2], "w").close()
deadline = time.monotonic() + 30
while not t.restart_requested() and time.monotonic() < deadline:
    time.sleep(0.05)
os.kill(os.getpid(), signal.SIGUSR1)  # the restart's save signal (the stub SLURM sends none)
while not t.should_stop():
    time.sleep(0.01)
t.saved()
"""


def test_a_checkpoint_reported_written_cuts_the_wait_for_a_hung_rank_to_after_save(tmp_path: Path,
                                                                                  ranks: Callable[..., int]) -> None:
    """A rank hung in a collective never exits: once the trainer reports the checkpoint the restart asked for, the
    steps still running after `after_save` are cancelled, not after the whole wait_exit."""
    ready = tmp_path / "ready"
    saver = subprocess.Popen([sys.executable, "-c", SAVER, str(tmp_path / "sw"), str(ready)], cwd=REPO,
                             env={**os.environ, "SLURM_JOB_ID": "5", "RANK": "0"})
    try:
        wait_until(ready.exists, 30, what="the saving rank's start")
        slurm = StubSlurm({"0": [ranks(TRAINGUARD_RESTARTS="0")]}, ["0"])
        started = time.monotonic()
        detail = _run(slurm, _job(tmp_path), wait_exit=20, timeout=30, after_save=0.3)
        took = time.monotonic() - started
        assert saver.wait(10) == 0
    finally:
        saver.kill()
    assert slurm.calls == [("signal", "5.0", "USR1", "step"), ("cancel", "5.0")]
    assert took < 10, (took, detail)  # wait_exit is 20 s
    assert re.search(r"cancelled 5\.0 still running after \d+\.\ds \(saved\.5 \d+\.\ds after the signal: the "
                     r"checkpoint was written\)", detail), detail


def test_an_earlier_restarts_report_or_a_link_is_no_report(tmp_path: Path, ranks: Callable[..., int]) -> None:
    """The report the last restart left is no answer to this one (it stays: another agent's request may be waiting
    for it), and a link made after the request is not a report (a link to a file the user could not write): the
    steps get the whole wait_exit."""
    sw = tmp_path / "sw"
    sw.mkdir()
    (sw / "saved.5").write_text("{}")  # the last restart's
    slurm = StubSlurm({"0": [ranks(TRAINGUARD_RESTARTS="0")]}, ["0"])
    started = time.monotonic()
    detail = _run(slurm, _job(tmp_path), wait_exit=1.0, after_save=0.0)
    assert time.monotonic() - started >= 1.0 and "saved.5" not in detail, detail
    assert (sw / "saved.5").read_text() == "{}" and slurm.calls[-1] == ("cancel", "5.0")

    (sw / "restart.5").unlink()
    (sw / "saved.5").unlink()
    linked = threading.Thread(target=lambda: (wait_until((sw / "restart.5").exists, 10, what="the request"),
                                              os.symlink("/etc/hostname", sw / "saved.5")))
    linked.start()
    started = time.monotonic()
    detail = _run(slurm, _job(tmp_path), wait_exit=1.5, after_save=0.0)
    linked.join(10)
    assert (sw / "saved.5").is_symlink()  # made while the action waited
    assert time.monotonic() - started >= 1.5 and "saved.5" not in detail, detail


def _fresh(path: Path) -> None:
    """A new request where `path` is: the agent writes each under a temporary name and renames it into place."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("{}")
    tmp.rename(path)


@pytest.mark.parametrize("request_name", ["restart.77", "signalled.77"])
def test_saved_reports_on_rank_0_a_stops_checkpoint_while_the_agent_asks(tmp_path: Path, request_name: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A restart's request, or the one the `signal` action writes before its save signal: rank 0 reports the
    checkpoint it took for a stop decided while the request was there; not for a request older than the process
    (an earlier life's), not on another rank, and not for a checkpoint begun before the stop was decided."""
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    (tmp_path / request_name).write_text("{}")
    t = Trainer(switch_dir=tmp_path)
    (tmp_path / "stop").write_text("")  # the stop (a signal, in the agent's case)
    assert t.should_stop()
    t.saved()
    assert not (tmp_path / "saved.77").exists()  # the request is an earlier life's: nobody waits for the report
    _fresh(tmp_path / request_name)
    t.saved()  # a checkpoint begun before the stop that answers the request was decided (the periodic one)
    assert not (tmp_path / "saved.77").exists()
    monkeypatch.setenv("RANK", "3")  # torchrun's global rank comes first: SLURM_PROCID is then the node's task
    assert t.should_stop()
    t.saved()
    assert not (tmp_path / "saved.77").exists()  # rank 3 knows only that its part is written
    monkeypatch.setenv("RANK", "0")
    assert t.should_save()  # a stop is a save too, and decides the same
    t.saved()
    report = tmp_path / "saved.77"
    assert json.loads(report.read_text())["pid"] == os.getpid()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([request_name, "saved.77", "stop"])  # no tmp left
    report.unlink()
    assert t.should_stop()
    _fresh(tmp_path / request_name)  # replaced between the stop and its checkpoint (a second node's agent asking too)
    t.saved()
    assert report.exists()  # the stop's checkpoint answers them all
    report.unlink()
    assert t.should_stop()
    (tmp_path / request_name).unlink()  # withdrawn (the signal failed): nobody waits
    t.saved()
    assert not report.exists()


# A job's rank 0 that saves once the agent's save signal asks for a report, while a rank on a lost GPU never exits.
SIGNALLED_SAVER = r"""
import os, signal, sys, time
from trainguard.trainer import Trainer
t = Trainer(switch_dir=sys.argv[1]).install()
open(sys.argv[2], "w").close()
deadline = time.monotonic() + 30
while not os.path.exists(os.path.join(sys.argv[1], "signalled.5")) and time.monotonic() < deadline:
    time.sleep(0.05)
os.kill(os.getpid(), signal.SIGUSR1)  # the save signal (the stub SLURM sends none)
while not t.should_stop():
    time.sleep(0.01)
t.saved()
"""


@contextlib.contextmanager
def _rank0(sw: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Rank 0 of job 5 under the trainer helper, started, waiting for the agent's request with its save signal."""
    ready = sw.parent / "ready"
    saver = subprocess.Popen([sys.executable, "-c", SIGNALLED_SAVER, str(sw), str(ready)], cwd=REPO,
                             env={**os.environ, "SLURM_JOB_ID": "5", "RANK": "0"})
    try:
        wait_until(ready.exists, 30, what="rank 0's start")
        yield saver
    finally:
        saver.kill()
        saver.wait()


def _signal_requeue(job: Job, slurm: StubSlurm, **requeue: object) -> tuple[str, str, float]:
    """The default binding of a lost GPU (`signal`, then `requeue`; drain has no part here) as the responder runs
    it: one context, closed once the list is done. Their details and how long the requeue took."""
    ctx = ActionContext(_event("xid", "pci:0000:3b:00"), (job,), "n1", slurm, time.time)  # type: ignore[arg-type]
    try:
        signalled = SignalAction("signal", SignalSettings()).run(ctx)
        started = time.monotonic()
        requeued = RequeueAction("requeue", RequeueSettings(**{"wait_exit": 20, "timeout": 30, **requeue})).run(ctx)
        return signalled, requeued, time.monotonic() - started
    finally:
        ctx.done()


def test_a_requeue_after_the_save_signal_waits_for_rank_0s_report_not_for_a_rank_that_never_exits(
        tmp_path: Path, ranks: Callable[..., int]) -> None:
    """A rank on a GPU that fell off the bus never exits: once rank 0 reports its checkpoint written, the requeue
    waits `after_save` more, not the whole wait_exit; the request and the report are gone once the list is done."""
    sw = tmp_path / "sw"
    sw.mkdir()
    (sw / "saved.5").write_text("{}")  # an earlier fault's report: never read as this one (rank 0's replaces it)
    with _rank0(sw) as saver:
        hung = ProcessRef.of(ranks())
        assert hung is not None
        slurm = StubSlurm({}, [])
        signalled, requeued, took = _signal_requeue(replace(_job(tmp_path), processes=(hung,)), slurm,
                                                    after_save=0.3)
        assert saver.wait(10) == 0
    assert signalled == "scancel --signal=USR1 --full 5"
    assert slurm.calls == [("signal", "5", "USR1", "full"), ("requeue", "5")]
    assert took < 10, (took, requeued)  # wait_exit is 20 s
    assert re.fullmatch(r"requeued 5 \(saved\.5 \d+\.\ds after the wait began: the checkpoint was written\)",
                        requeued), requeued
    wait_until(lambda: sorted(p.name for p in sw.iterdir()) == ["saved.5"], 10,
               what="the request removed (the report stays: another node's agent may not have seen it yet)")


@pytest.mark.parametrize("case", ["kept", "earlier-version", "not-taken-up"])
def test_a_requeue_taken_up_after_a_crash_reads_the_report_the_dead_agent_asked_for(
        tmp_path: Path, ranks: Callable[..., int], case: str) -> None:
    """The agent dies while its requeue waits for a rank that never exits (a lost GPU), and rank 0 reports its
    checkpoint while no agent runs. The next start takes the list up (trainguard.pipeline.responder): its requeue reads
    that report, since the list kept what the signal asked for (the report noted before the request, the request), and
    waits `after_save`, not its whole `wait_exit` a second time; the dead agent's request is removed once the list is
    done. A list kept by a version before that (no reports kept) waits `wait_exit`, as it did. A list not taken up
    (here: `requeue` no longer bound) still has the dead agent's request removed."""
    sw = tmp_path / "sw"
    sw.mkdir()
    (sw / "saved.5").write_text("{}")  # an earlier fault's report: never read as this one (rank 0's replaces it)
    hung = ProcessRef.of(ranks())
    assert hung is not None
    job = replace(_job(tmp_path), processes=(hung,), on_this_node=True)  # as the catalog lists it after the restart
    slurm = StubSlurm({}, [])
    store = Store(tmp_path / "state")
    tracker = IncidentTracker(store, "n1", time.time)
    tracker.observe("xid", [Result("xid", "pci:0000:3b:00", Status.CRITICAL, "XID 79", {})], IncidentPolicy(), True,
                    lambda event: ())
    [incident] = tracker.incidents()
    event = Event(EventKind.FIRED, incident.id, "xid", incident.subject, Status.CRITICAL, "XID 79", "n1", time.time(),
                  time.time())
    wait_exit = 3 if case == "earlier-version" else 10
    dead = ActionContext(event, (job,), "n1", slurm, time.time)  # type: ignore[arg-type]
    try:
        with _rank0(sw) as saver:
            SignalAction("signal", SignalSettings()).run(dead)  # asks for the report; then the agent dies
            asked = dead.reports.get("5")
            assert asked is not None and asked.requested.wait(10)  # type: ignore[attr-defined]
            reports = Responder._reports_asked(dead)
            request = (sw / "signalled.5").stat()
            assert reports["5"]["request"] == [request.st_ino, request.st_ctime_ns], reports
            assert saver.wait(10) == 0  # rank 0 saved and reported while no agent ran

        class Catalog:
            node = "n1"

            def __init__(self) -> None:
                self.slurm = slurm

            def view(self, max_age: float | None = None, fresh: bool = False) -> JobView:
                return JobView((job,))

        config = parse_config({"agent": {"state_dir": str(tmp_path), "listen": ""}, "jobs": {"sources": []}},
                              "t.toml")
        responder = Responder(config, Registry(), Catalog(), tracker, state=store)  # type: ignore[arg-type]
        responder.actions["requeue"] = RequeueAction("requeue", RequeueSettings(wait_exit=wait_exit, timeout=20,
                                                                                after_save=0.3))
        responder._keep("cut", {"event": event.to_dict(), "names": ["requeue"], "next": 0, "started": True,
                                "at": time.time(), "kinds": {"requeue": "RequeueAction"}, "jobs": [_brief(job)],
                                **({"reports": reports} if case != "earlier-version" else {})})
        started = time.monotonic()
        bound = ActionBinding(critical=[] if case == "not-taken-up" else ["requeue"])
        for thread in responder.resume(lambda event: bound if event.check == "xid" else None):
            thread.join(30)
        took = time.monotonic() - started
        # the dead agent's request: removed by the list that took it up once done, or at once for a list not taken up,
        # as the dead agent would have; a list kept by an earlier version knows nothing of it
        wait_until(lambda: (sw / "signalled.5").exists() is (case == "earlier-version"), 10,
                   what="the request removed, or left")
    finally:
        dead.done()  # (the dead agent's own report thread: it would have removed the request itself)
    if case == "not-taken-up":
        assert slurm.calls == [("signal", "5", "USR1", "full")]
        return
    [requeued] = [a for a in tracker.incidents()[0].actions if a["action"] == "requeue"]
    assert slurm.calls[-1] == ("requeue", "5") and requeued["outcome"] == "ok"
    if case == "kept":
        assert took < 5, (took, requeued)  # wait_exit is 10 s
        assert re.fullmatch(r"requeued 5 \(saved\.5 \d+\.\ds (after|before) the wait began, looked for again after "
                            r"the agent's restart: the checkpoint was written\)", requeued["detail"]), requeued
    else:
        assert took >= wait_exit and requeued["detail"] == "requeued 5", (took, requeued)


def test_without_a_switch_dir_the_requeue_waits_out_wait_exit_and_says_why(tmp_path: Path,
                                                                          ranks: Callable[..., int]) -> None:
    """No switch dir (the job runs no trainer helper): no request is made for it, and nothing cuts the wait."""
    hung = ProcessRef.of(ranks())
    assert hung is not None
    slurm = StubSlurm({}, [])
    _, requeued, took = _signal_requeue(replace(_job(tmp_path), processes=(hung,)), slurm, wait_exit=1.0)
    assert took >= 1.0 and slurm.calls[-1] == ("requeue", "5")
    assert re.fullmatch(r"requeued 5 \(no report asked: switch dir .*/sw does not exist\)", requeued), requeued
    assert not (tmp_path / "sw").exists()


# the captured record as job 5 of this test's user (the action reads it with the job's uid)
RUNNING_RECORD = ((REPO / "tests/data/slurm/show-job-running.txt").read_text().replace("JobId=1 ", "JobId=5 ", 1)
                  .replace("UserId=tgjob(1001)", f"UserId=tester({os.getuid()})", 1))


def test_two_incidents_about_one_lost_gpu_share_the_report_and_requeue_the_job_once(
        tmp_path: Path, ranks: Callable[..., int]) -> None:
    """A GPU off the bus is two incidents with the same default actions (`xid` at once, `gpu` on its next poll). The
    second list joins the first's report instead of removing it and asking again, and does not requeue the job the
    first requeued (its next life may be running elsewhere by then)."""
    sw = tmp_path / "sw"
    sw.mkdir()
    with _rank0(sw) as saver:
        hung = ProcessRef.of(ranks())
        assert hung is not None
        job = replace(_job(tmp_path), processes=(hung,), restarts=0)
        slurm = StubSlurm({}, [])
        slurm.record = RUNNING_RECORD
        shared = Reports()
        requeue = RequeueAction("requeue", RequeueSettings(wait_exit=20, timeout=30, after_save=0.3))
        first = ActionContext(_event("xid", "pci:0000:3b:00"), (job,), "n1", slurm, time.time,  # type: ignore[arg-type]
                              reports=shared)
        second = replace(first, event=_event("gpu", "gpu:0000:3b:00"), actions=ActionList())
        SignalAction("signal", SignalSettings()).run(first)
        SignalAction("signal", SignalSettings()).run(second)  # before rank 0 answered: the same report
        assert shared.get("5") is not None
        started = time.monotonic()
        done = requeue.run(first)
        assert saver.wait(10) == 0
        first.done()
        assert (sw / "signalled.5").exists()  # the second list still holds the report
        with pytest.raises(ActionSkippedError) as again:  # requeued by the first: nothing left for this one to do
            requeue.run(second)
        second.done()
        took = time.monotonic() - started
    assert done.startswith("requeued 5 (saved.5 ") and took < 10, (done, took)
    assert str(again.value).startswith("5 not requeued: requeued already (PENDING, Restarts=0) (saved.5 "), again
    assert [c for c in slurm.calls if c[0] == "requeue"] == [("requeue", "5")]
    assert sorted(p.name for p in sw.iterdir()) == ["saved.5"]  # the last list out removed the request


def test_a_restart_beside_a_save_signal_reads_the_report_the_signal_asked_for(
        tmp_path: Path, ranks: Callable[..., int]) -> None:
    """One fault, two lists: the lost GPU's XID signals the job (asking rank 0 for a report) while its CUDA error in
    the log restarts it. The restart joins the report instead of removing it before its own request: rank 0 answered
    already, so the hung rank is cancelled `after_save` after that, not after the whole wait_exit."""
    sw = tmp_path / "sw"
    sw.mkdir()
    with _rank0(sw) as saver:
        shared = Reports()
        signal_list = ActionContext(_event("xid", "pci:0000:3b:00"), (_job(tmp_path),), "n1",  # type: ignore[arg-type]
                                    StubSlurm({}, []), time.time, reports=shared)
        SignalAction("signal", SignalSettings()).run(signal_list)
        assert saver.wait(10) == 0
        report = shared.get("5")
        assert report is not None
        wait_until(lambda: report.at is not None, 10, what="rank 0's report read")
        slurm = StubSlurm({"0": [ranks(TRAINGUARD_RESTARTS="0")]}, ["0"])
        restart_list = ActionContext(_event(), (_job(tmp_path),), "n1", slurm, time.time,  # type: ignore[arg-type]
                                     reports=shared)
        started = time.monotonic()
        try:
            detail = RestartAction("restart", RestartSettings(wait_exit=20, timeout=30, after_save=0.3)).run(
                restart_list)
        finally:
            restart_list.done()
        took = time.monotonic() - started
        assert (sw / "saved.5").exists()  # the signal's list still holds the report
        signal_list.done()
    assert slurm.calls == [("signal", "5.0", "USR1", "step"), ("cancel", "5.0")]
    assert took < 10, (took, detail)  # wait_exit is 20 s
    assert re.search(r"\(saved\.5 \d+\.\ds before the signal: the checkpoint was written\)", detail), detail
    wait_until(lambda: sorted(p.name for p in sw.iterdir()) == ["restart.5", "saved.5"], 10,
               what="the signal's request removed (the loop removes the restart's request and the report)")


def test_a_job_that_reported_is_requeued_without_waiting_for_another_job_of_the_node(
        tmp_path: Path, ranks: Callable[..., int]) -> None:
    """An XID names no job: the requeue acts on every job of the node, each once its own wait is over."""
    sw = tmp_path / "sw"
    sw.mkdir()
    times: dict[str, float] = {}

    class Timed(StubSlurm):
        def requeue(self, job_id: str) -> None:
            times[job_id] = time.monotonic()
            super().requeue(job_id)

    with _rank0(sw) as saver:
        reporting = replace(_job(tmp_path), processes=(ProcessRef.of(ranks()),))
        silent = replace(_job(tmp_path), key="slurm:6", job_id="6", switch_dir=str(tmp_path / "none"),
                         processes=(ProcessRef.of(ranks()),))
        started = time.monotonic()
        slurm = Timed({}, [])
        ctx = ActionContext(_event("xid", "pci:0000:3b:00"), (reporting, silent), "n1", slurm,  # type: ignore[arg-type]
                            time.time)
        try:
            SignalAction("signal", SignalSettings()).run(ctx)
            detail = RequeueAction("requeue", RequeueSettings(wait_exit=4, timeout=10, after_save=0.3)).run(ctx)
        finally:
            ctx.done()
        assert saver.wait(10) == 0
    assert times["5"] - started < 3 and times["6"] - started >= 4, (times, started, detail)  # wait_exit 4 s
    assert re.fullmatch(r"requeued 5 \(saved\.5 \d+\.\ds after the wait began: the checkpoint was written\); "
                        r"requeued 6 \(no report asked: switch dir .*/none does not exist\)", detail), detail


class TwoJobs(StubSlurm):
    """Two jobs' steps on this node (step 0 each, under the loop); the ranks of those in `exits` save and exit as soon
    as they are signalled, the others ignore the signal. Whether job 6's restart was over when job 5's step was
    cancelled, read from the agent's claims."""

    def __init__(self, here: dict[str, dict[str, list[int]]], exits: dict[str, subprocess.Popen[bytes]],
                 claims: Claims) -> None:
        super().__init__({}, [])
        self.here_of, self.exits, self.claims = here, exits, claims
        self.ended: set[str] = set()
        self.six_over_at_cancel: bool | None = None

    def local_steps(self, job_id: str, node: str = "") -> dict[str, list[int]]:
        return self.here_of[job_id]

    def steps(self, job_id: str) -> list[str]:
        return [] if job_id in self.ended else ["0"]

    def signal_step(self, job_id: str, step: str, signal_name: str) -> bool:
        self.calls.append(("signal", f"{job_id}.{step}", signal_name, "step"))
        if job_id in self.exits:
            self.exits[job_id].kill()
            self.exits[job_id].wait()
            self.ended.add(job_id)
        return True

    def cancel_step(self, job_id: str, step: str) -> bool:
        self.six_over_at_cancel = self.claims.last("6", 60) is not None
        return super().cancel_step(job_id, step)


def test_a_job_whose_ranks_ignore_the_signal_never_delays_another_jobs_restart(tmp_path: Path,
                                                                               ranks: Callable[..., int]) -> None:
    """Two users' jobs on one node, one incident naming neither (a node fault): job 5's ranks ignore the save signal
    and get the whole wait_exit, job 6's exit at once. Job 6's restart is over before job 5's wait is; the outcome
    names them in the order given."""
    saving = subprocess.Popen(["sleep", "60"], env={"PATH": os.environ["PATH"], "TRAINGUARD_RESTARTS": "0"})
    try:
        wait_until(lambda: ProcFS().environ_var(saving.pid, "PATH") is not None, 10, what="the rank's environment")
        claims = Claims()
        slurm = TwoJobs({"5": {"0": [ranks(TRAINGUARD_RESTARTS="0")]}, "6": {"0": [saving.pid]}}, {"6": saving},
                        claims)
        require_root()
        ensure_user(JOB_USER)
        other = pwd.getpwnam(JOB_USER)
        top = Path(tempfile.mkdtemp(prefix="tg-lanes-"))  # reachable by the other user, as a workdir is
        top.chmod(0o755)
        os.chown(top, other.pw_uid, other.pw_gid)
        jobs = (_job(tmp_path), replace(_job(tmp_path), key="slurm:6", job_id="6", uid=other.pw_uid,
                                        user=JOB_USER, switch_dir=str(top / "sw")))
        ctx = ActionContext(_event(), jobs, "n1", slurm, time.time, claims=claims)  # type: ignore[arg-type]
        try:
            detail = RestartAction("restart", RestartSettings(wait_exit=2, timeout=10, after_save=0)).run(ctx)
        finally:
            ctx.done()
            shutil.rmtree(top, ignore_errors=True)
    finally:
        saving.kill()
        saving.wait()
    assert sorted(slurm.calls[:2]) == [("signal", "5.0", "USR1", "step"), ("signal", "6.0", "USR1", "step")]
    assert slurm.calls[2:] == [("cancel", "5.0")] and slurm.six_over_at_cancel, slurm.calls
    sw, sw6 = re.escape(str(tmp_path / "sw")), re.escape(str(top / "sw"))
    assert re.fullmatch(rf"restart of 5 requested \({sw}/restart\.5\); SIGUSR1 to step 5\.0: cancelled 5\.0 still "
                        rf"running after \d+\.\ds \(no report [^;]*\); restart of 6 requested \({sw6}/restart\.6\); "
                        r"SIGUSR1 to step 6\.0: ended in \d+\.\ds \(no report [^;]*\)", detail), detail


def test_a_closed_report_removes_only_the_request_it_wrote(tmp_path: Path) -> None:
    """Another node's agent (or a later list, after this one's close) may write its own request in the same name
    meanwhile: it is not this report's to remove. The report stays (another node's agent may not have seen it)."""
    sw = tmp_path / "sw"
    sw.mkdir()
    report = SaveReport(str(sw), "5", None)
    report.ask(os.getuid(), {"requested_by": "trainguard"})
    assert report.requested.wait(5) and (sw / "signalled.5").exists() and not report.note
    _fresh(sw / "signalled.5")  # another agent's request, written over this one
    report.close()
    assert (sw / "signalled.5").exists()
    mine = SaveReport(str(sw), "5", None)  # asks, sees the report, removes its request once closed
    mine.ask(os.getuid(), {"requested_by": "trainguard"})
    assert mine.requested.wait(5)
    _fresh(sw / "saved.5")
    wait_until(lambda: mine.at is not None, 5, what="the report seen")
    mine.close()
    assert sorted(p.name for p in sw.iterdir()) == ["saved.5"]


def test_a_request_replaced_before_it_was_looked_at_is_not_taken_for_ours(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Another node's agent renames its own request into place between this agent's rename and its look: the file
    there is not this agent's (another inode), so it is neither kept for a list taken up after a crash nor removed."""
    sw = tmp_path / "sw"
    sw.mkdir()
    real = os.rename

    def then_replaced(src: Any, dst: Any, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None) -> None:
        real(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        if dst == "signalled.5" and dst_dir_fd is not None:  # the agent's rename, through the switch dir's fd
            _fresh(sw / "signalled.5")

    monkeypatch.setattr(os, "rename", then_replaced)
    report = SaveReport(str(sw), "5", None)
    report.ask(os.getuid(), {"requested_by": "trainguard"})
    assert report.requested.wait(5) and not report.note
    assert report.kept() is None
    report.close()
    assert (sw / "signalled.5").exists()


def test_two_agents_asking_at_once_never_take_the_report_from_each_other(tmp_path: Path) -> None:
    """A fault seen on two nodes: each agent asks rank 0. One that asks after rank 0 answered the other notes that
    report as earlier than its request (no answer to it) and leaves it for the agent it answered."""
    sw = tmp_path / "sw"
    sw.mkdir()
    first, second = SaveReport(str(sw), "5", None), SaveReport(str(sw), "5", None)
    first.ask(os.getuid(), {"requested_by": "trainguard", "node": "n1"})
    assert first.requested.wait(5) and not first.note
    _fresh(sw / "saved.5")  # rank 0's answer
    second.ask(os.getuid(), {"requested_by": "trainguard", "node": "n2"})  # before the first looked again
    assert second.requested.wait(5) and not second.note
    wait_until(lambda: first.at is not None, 5, what="the first agent's report")
    time.sleep(0.5)  # the second agent looks twice meanwhile
    assert second.at is None  # written before its request: rank 0 decided without it
    first.close()
    second.close()
    assert sorted(p.name for p in sw.iterdir()) == ["saved.5"]  # each removed its own request

    both = [SaveReport(str(sw), "5", None) for _ in range(2)]  # both asked before rank 0 answered: both read it
    for report in both:
        report.ask(os.getuid(), {"requested_by": "trainguard"})
        assert report.requested.wait(5)
    _fresh(sw / "saved.5")
    wait_until(lambda: all(r.at is not None for r in both), 5, what="both agents' reports")
    for report in both:
        report.close()
    assert sorted(p.name for p in sw.iterdir()) == ["saved.5"]


def test_a_requeue_that_requeued_nothing_fails_and_one_job_failing_never_keeps_another(tmp_path: Path) -> None:
    class Refusing(StubSlurm):
        def requeue(self, job_id: str) -> None:
            if job_id == "6":
                raise SlurmError("scontrol: error: Unable to contact slurm controller (connect failure)")
            super().requeue(job_id)

    slurm = Refusing({}, [])
    other = replace(_job(tmp_path), key="slurm:6", job_id="6")
    action = RequeueAction("requeue", RequeueSettings(wait_exit=0, timeout=5))
    both = action.run(ActionContext(_event(), (other, _job(tmp_path)), "n1", slurm, time.time))  # type: ignore[arg-type]
    assert both == "requeued 5; 6: requeue: scontrol: error: Unable to contact slurm controller (connect failure)", both
    with pytest.raises(ActionError, match=r"^6: requeue: .*connect failure\); not requeueable \(--no-requeue\): 5$"):
        action.run(ActionContext(_event(), (other, _job(tmp_path, requeue=False)), "n1", slurm,  # type: ignore[arg-type]
                                 time.time))


def test_a_job_cancelled_while_the_requeue_waited_is_not_requeued(tmp_path: Path) -> None:
    """Its user (or an operator) ended it meanwhile: `scontrol requeue` would start it again against their call."""
    slurm = StubSlurm({}, [])
    slurm.record = RUNNING_RECORD.replace("JobState=RUNNING", "JobState=CANCELLED", 1)
    action = RequeueAction("requeue", RequeueSettings(wait_exit=0, timeout=5))
    job = replace(_job(tmp_path), restarts=0)
    with pytest.raises(ActionSkippedError) as skipped:  # nothing requeued: skipped, never "job requeued"
        action.run(ActionContext(_event(), (job,), "n1", slurm, time.time))  # type: ignore[arg-type]
    assert str(skipped.value) == "5 not requeued: cancelled meanwhile" and not slurm.calls, skipped


def test_reports_are_shared_by_lists_and_closed_by_the_last_one_done() -> None:
    class Probe:
        at = None
        closed = 0

        def said(self, since: float, what: str) -> str:
            return ""

        def close(self) -> None:
            self.closed += 1

    reports, a, b = Reports(), ActionList(), ActionList()
    made = [Probe(), Probe()]
    first = reports.join("5", a, made.pop)
    assert reports.join("5", b, made.pop) is first and len(made) == 1  # joined, not made again
    reports.release(a)
    assert first.closed == 0 and reports.get("5") is first
    reports.release(b)
    assert first.closed == 1 and reports.get("5") is None
    assert reports.join("5", a, made.pop) is None and len(made) == 1  # asked after its list was done: nothing
    c, d = ActionList(), ActionList()  # a restart's list leaves the report it made; a list that joined it holds on
    mine = reports.join("6", c, made.pop)
    assert reports.join("6", d, list) is mine
    reports.leave("6", c)
    reports.leave("6", c)  # once only
    assert mine.closed == 0 and reports.get("6") is mine
    reports.leave("6", d)
    assert mine.closed == 1 and reports.get("6") is None


def test_the_loop_removes_the_ranks_last_report_when_it_returns(tmp_path: Path) -> None:
    (tmp_path / "sw").mkdir()
    (tmp_path / "sw" / "saved.77").write_text("{}")
    (tmp_path / "sw" / "signalled.77").write_text("{}")  # the agent's request, had it not removed it
    (tmp_path / "sw" / "saved.78").write_text("{}")  # another job's, from the same directory
    proc = _loop(tmp_path, "exit 0")
    proc.communicate(timeout=60)
    assert proc.returncode == 0 and sorted(p.name for p in (tmp_path / "sw").iterdir()) == ["saved.78"]


def test_a_looped_job_whose_record_has_not_come_is_neither_restarted_nor_requeued(tmp_path: Path,
                                                                                   ranks: Callable[..., int]) -> None:
    """The controller's record has not come (its switch dir, nodes and --no-requeue unknown): whatever it holds, it
    is neither restarted nor requeued, whose fallbacks would guess (a requeue would cost a looped job its
    allocation for want of a record)."""
    slurm = StubSlurm({"0": [ranks(TRAINGUARD_RESTARTS="0")]}, ["0"])
    job = replace(_job(tmp_path), switch_dir=None, extra={"incomplete": "not yet known to the agent: asking slurmctld"})
    for listed in (job, replace(job, switch_dir=str(tmp_path / "sw"))):  # a prolog's workdir gives a switch dir
        with pytest.raises(ActionError, match=r"its record has not come from slurmctld \(not yet known to the agent: "
                                              r"asking slurmctld\): not restarted, not requeued"):
            _run(slurm, listed)
        with pytest.raises(ActionError, match="not restarted, not requeued"):
            _run(StubSlurm({}, []), listed, leave_node=True)  # no rank here, no NodeList: no fallback either
    assert slurm.calls == []


def test_a_failed_signal_withdraws_the_request(tmp_path: Path, ranks: Callable[..., int]) -> None:
    """Left in place, the request would restart the job the next time its srun ends, even at the end of training."""
    slurm = StubSlurm({"0": [ranks(TRAINGUARD_RESTARTS="0")]}, ["0"], fail_signal=True)
    reports = Reports()
    ctx = ActionContext(_event(), (_job(tmp_path),), "n1", slurm, time.time, reports=reports)  # type: ignore[arg-type]
    with pytest.raises(ActionError, match=r"\(connect failure\) \(the request is withdrawn\)"):
        RestartAction("restart", RestartSettings(wait_exit=0.5, timeout=5)).run(ctx)
    assert list((tmp_path / "sw").iterdir()) == []
    assert reports.get("5") is None  # its report let go at once, not held unwatched until the list is done
    ctx.done()


def test_a_withdrawn_request_removes_only_the_file_the_agent_wrote(tmp_path: Path,
                                                                   ranks: Callable[..., int]) -> None:
    """Between the request and its withdrawal the job's user (or its loop) may put a file of its own at that name:
    the agent takes back what it wrote, never what it finds there."""
    class Replacing(StubSlurm):
        def signal_step(self, job_id: str, step: str, signal_name: str) -> bool:
            mine = tmp_path / "sw" / request_name("5")
            theirs = mine.with_name("theirs")
            theirs.write_text('{"by": "the user"}\n')
            os.rename(theirs, mine)  # a new inode at the request's name, of the same owner
            return super().signal_step(job_id, step, signal_name)

    slurm = Replacing({"0": [ranks(TRAINGUARD_RESTARTS="0")]}, ["0"], fail_signal=True)
    with pytest.raises(ActionError, match=r"\(the request is withdrawn\)"):
        _run(slurm, _job(tmp_path))
    assert (tmp_path / "sw" / request_name("5")).read_text() == '{"by": "the user"}\n'


def test_a_restart_joining_a_signals_report_that_asked_nothing_watches_its_own(
        tmp_path: Path, ranks: Callable[..., int]) -> None:
    """The signal's request could not be written (here its owner is unknown): its report has no thread and would
    never see an answer, so the restart does not lean on it."""
    ready = tmp_path / "ready"
    saver = subprocess.Popen([sys.executable, "-c", SAVER, str(tmp_path / "sw"), str(ready)], cwd=REPO,
                             env={**os.environ, "SLURM_JOB_ID": "5", "RANK": "0"})
    try:
        wait_until(ready.exists, 30, what="the saving rank's start")
        reports = Reports()
        failed = reports.join("5", ActionList(), lambda: SaveReport(str(tmp_path / "sw"), "5", None))
        assert isinstance(failed, SaveReport)
        failed.ask(2**31 - 7, {"requested_by": "trainguard"})  # nobody's uid
        assert failed.requested.wait(5) and failed.note.startswith(" (no report ")
        slurm = StubSlurm({"0": [ranks(TRAINGUARD_RESTARTS="0")]}, ["0"])
        ctx = ActionContext(_event(), (_job(tmp_path),), "n1", slurm, time.time,  # type: ignore[arg-type]
                            reports=reports)
        started = time.monotonic()
        try:
            detail = RestartAction("restart", RestartSettings(wait_exit=20, timeout=30, after_save=0.3)).run(ctx)
        finally:
            ctx.done()
        assert saver.wait(10) == 0
    finally:
        saver.kill()
    assert time.monotonic() - started < 10, detail  # wait_exit is 20 s
    assert re.search(r"\(saved\.5 \d+\.\ds after the signal: the checkpoint was written\)", detail), detail


def test_a_second_incident_about_the_same_job_waits_for_the_restart_under_way(tmp_path: Path,
                                                                                ranks: Callable[..., int]) -> None:
    """training_log and job_memory may both see the fault: one restart, not a second of the fresh start, and not
    said done twice: the second is skipped, answered (its check forgets the job's history too)."""
    slurm = StubSlurm({"0": [ranks(TRAINGUARD_RESTARTS="0")]}, ["0"])
    action = RestartAction("restart", RestartSettings(wait_exit=1.0, timeout=5))
    ctx = ActionContext(_event(), (_job(tmp_path),), "n1", slurm, time.time)  # type: ignore[arg-type]
    out: list[str] = []
    first = threading.Thread(target=lambda: out.append(action.run(ctx)))
    first.start()
    wait_until(lambda: slurm.calls, 10, what="the first restart signalling")
    with pytest.raises(ActionAnsweredError, match=r"^job 5 \(t\): already restarted in place for "
                                                  r"training_log/slurm:5 \(\d+\.\ds ago\): not restarted twice$"):
        action.run(replace(ctx, event=_event("job_memory")))
    first.join(10)
    assert [c[0] for c in slurm.calls] == ["signal", "cancel"] and "restart of 5 requested" in out[0]


def test_a_second_incident_waiting_on_a_restart_that_failed_fails_too(tmp_path: Path,
                                                                       ranks: Callable[..., int]) -> None:
    """Its outcome is the first's: an 'ok' would make the check forget the job's findings though nothing restarted."""
    slurm = StubSlurm({"0": [ranks(TRAINGUARD_RESTARTS="0")]}, ["0"])
    slurm.fail_steps = True  # the controller fails once the ranks here had their wait_exit
    action = RestartAction("restart", RestartSettings(wait_exit=1.5, timeout=5))
    ctx = ActionContext(_event(), (_job(tmp_path),), "n1", slurm, time.time)  # type: ignore[arg-type]
    errors: list[str] = []

    def first() -> None:
        try:
            action.run(ctx)
        except ActionError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=first)
    thread.start()
    wait_until(lambda: slurm.calls, 10, what="the first restart signalling")
    with pytest.raises(ActionError, match=r"the restart in place for training_log/slurm:5 failed: restart 5: .* Socket "
                                          r"timed out"):
        action.run(ctx)
    thread.join(10)
    assert len(errors) == 1 and "Socket timed out" in errors[0], errors


@pytest.mark.parametrize(("listed", "signalled"), [("5.0\n5.batch\n", True), ("5.batch\n", False)])
def test_a_step_signal_that_slurm_calls_an_invalid_job_id_counts_when_the_step_is_still_there(
        tmp_path: Path, listed: str, signalled: bool) -> None:
    """SLURM 22.05 with a spare node in the allocation: scancel exits 225 "Invalid job id specified" though the step's
    tasks got the signal (tests/data/slurm/README.md). The step still listed counts as signalled; one gone is said to
    be gone (it may have ended at the signal itself), and any other error is one."""
    (tmp_path / "scancel").write_text("#!/bin/sh\necho 'scancel: error: Kill job error on job step id 5: Invalid job id "
                                      "specified' >&2\nexit 225\n")
    (tmp_path / "squeue").write_text(f"#!/bin/sh\nprintf '{listed}'\n")
    for tool in ("scancel", "squeue"):
        (tmp_path / tool).chmod(0o755)
    slurm = SlurmClient(10.0, bin_dir=str(tmp_path))
    assert slurm.signal_step("5", "0", "USR1") is signalled
    (tmp_path / "scancel").write_text("#!/bin/sh\necho 'scancel: error: Unable to contact slurm controller' >&2\nexit 1\n")
    with pytest.raises(SlurmError, match="Unable to contact"):
        slurm.signal_step("5", "0", "USR1")


def test_a_restart_whose_steps_had_all_ended_needs_the_loop_to_start_a_new_one(tmp_path: Path,
                                                                               ranks: Callable[..., int],
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step gone when signalled: either the ranks exited at once on the signal (the loop then starts the next
    srun) or they had ended before it (a loop whose srun failed has returned): only a new step says it restarted."""
    from trainguard.actions import restart

    monkeypatch.setattr(restart, "RELAUNCH_WAIT", 0.5)
    slurm = StubSlurm({"0": [ranks(TRAINGUARD_RESTARTS="0")]}, ["1"], gone=True)  # step 1: the loop's next srun
    assert "(5.0 no longer listed when signalled)" in _run(slurm, _job(tmp_path))
    slurm = StubSlurm({"0": [ranks(TRAINGUARD_RESTARTS="0")]}, [], gone=True)
    with pytest.raises(ActionError, match=r"had ended before the signal and no new step started within 0.5s: its "
                                          r"relaunch loop is over \(the request is withdrawn\)"):
        _run(slurm, _job(tmp_path))
    assert list((tmp_path / "sw").iterdir()) == []


def test_a_node_outside_the_allocation_or_a_huge_count_is_no_spare(tmp_path: Path, ranks: Callable[..., int]) -> None:
    job = replace(_job(tmp_path), node_list="n[2-5]")  # the agent's SLURM name is n1: not among them
    slurm = StubSlurm({"0": [ranks(TRAINGUARD_RESTARTS="0", TRAINGUARD_LEFT="", SLURM_STEP_NUM_NODES="3")]}, ["0"])
    assert "not restarted without n1: this node (n1) is not in its allocation (n[2-5])" in _run(slurm, job,
                                                                                                  leave_node=True)
    job = replace(_job(tmp_path), node_list="n[1-4]")
    slurm = StubSlurm({"0": [ranks(TRAINGUARD_RESTARTS="0", TRAINGUARD_LEFT="", SLURM_STEP_NUM_NODES="9" * 5000)]},
                      ["0"])  # past int()'s 4300-digit limit: no count, never an exception
    assert "do not say how many nodes their step spans" in _run(slurm, job, leave_node=True)


def test_the_request_names_the_node_first_and_keeps_its_reason_short(tmp_path: Path, ranks: Callable[..., int]) -> None:
    """The loop reads the file's first 64 KiB: a summary naming a long job name (each non-ASCII character six bytes
    in JSON) must not push the node to leave out of it."""
    job = replace(_job(tmp_path), node_list="n[1-4]")
    slurm = StubSlurm({"0": [ranks(TRAINGUARD_RESTARTS="0", TRAINGUARD_LEFT="", SLURM_STEP_NUM_NODES="3")]}, ["0"])
    action = RestartAction("restart", RestartSettings(wait_exit=0.5, timeout=5, leave_node=True))
    event = replace(_event("xid"), summary="XID 79 \u00e9" * 20000)
    action.run(ActionContext(event, (job,), "n1", slurm, time.time))  # type: ignore[arg-type]
    raw = (tmp_path / "sw" / "restart.5").read_text()
    assert raw.startswith('{"leave": "n1"') and len(json.loads(raw)["reason"]) <= 200


def test_an_inherited_left_variable_is_not_passed_on_where_the_loop_cannot_leave(tmp_path: Path) -> None:
    """A job submitted from a rank of a looped job inherits TRAINGUARD_LEFT: the agent would take it for a loop that
    can leave a node."""
    proc = subprocess.run([sys.executable, "-m", "trainguard.trainer", "relaunch", "--switch-dir", str(tmp_path), "--",
                           "sh", "-c", 'echo "${TRAINGUARD_LEFT-unset}"'], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "SLURM_JOB_ID": "77", "TRAINGUARD_LEFT": "n9"})
    assert proc.stdout.strip() == "unset", proc.stdout


@pytest.mark.parametrize(("args", "can"), [
    (["-N", "3", "--ntasks-per-node=1", "--nodes=3", "--exclusive", "python", "t.py"], True),
    (["-x", "n5", "python", "t.py"], False), (["-lx", "n5", "python", "t.py"], False), (["-lxn5", "t.py"], False),
    (["--exclude=n5", "t.py"], False), (["--exclu=n5", "t.py"], False), (["--exclude", "n5", "t.py"], False),
    (["-w", "n[1-4]", "t.py"], False), (["--nodelist=n1", "t.py"], False), (["--nodefile=f", "t.py"], False),
    (["-F", "f", "t.py"], False), (["--node=3", "t.py"], False)])
def test_the_loop_leaves_a_node_only_when_srun_names_no_nodes_of_its_own(args: list[str], can: bool) -> None:
    from trainguard.trainer import _can_exclude

    assert _can_exclude(["/usr/bin/srun", *args]) is can
    assert _can_exclude(["torchrun", *args]) is False  # not srun itself: no option to add


def test_on_the_batch_host_with_no_rank_the_loops_srun_names_its_steps(tmp_path: Path,
                                                                       ranks: Callable[..., int]) -> None:
    """After a restart that left the batch host (its GPU lost), the job-level checks still speak from there: the loop
    runs there, its ranks elsewhere. The srun carrying the loop's variables, and the controller's record of which
    srun launched which step, say what to restart; a sidecar step launched by another srun is left alone."""
    import socket

    srun = ranks(TRAINGUARD_RESTARTS="1", TRAINGUARD_MAX_RESTARTS="10", TRAINGUARD_LEFT="n1")
    other = ranks()  # the batch script's own `srun --overlap` monitor: not the loop's
    me = socket.gethostname()
    slurm = StubSlurm({}, ["4", "5"], batch=[srun, other], sruns={"4": (me, srun), "5": (me, other),
                                                                  "3": ("elsewhere", srun)})
    detail = _run(slurm, _job(tmp_path))
    assert slurm.calls == [("signal", "5.4", "USR1", "step"), ("cancel", "5.4")], slurm.calls
    assert detail.startswith("restart of 5 requested"), detail

    slurm = StubSlurm({}, ["4"], batch=[other], sruns={"4": (me, other)})  # no loop here: requeued as before
    assert "no srun step of it on this node: requeue instead" in _run(slurm, _job(tmp_path))


def test_which_srun_launched_each_step_as_captured() -> None:
    """tests/data/slurm/show-step.txt: a job whose batch script runs `srun --overlap` (step 1) and `srun -N 2` (step
    0); the sruns' pids in the batch step's listpids were 26714 and 26715."""
    from trainguard.jobs.slurm import parse_step_sruns

    assert parse_step_sruns((DATA / "show-step.txt").read_text(), "1") == {"0": ("vm", 26715), "1": ("vm", 26714)}
    # the step's name is the user's and comes first: a forged field in it does not win
    assert parse_step_sruns("StepId=1.2 Name=x SrunHost:Pid=evil:1 Dist=Cyclic SrunHost:Pid=vm:77\n", "1") == \
        {"2": ("vm", 77)}
    assert parse_step_sruns("StepId=2.0 SrunHost:Pid=vm:5\nStepId=1.batch SrunHost:Pid=(null):0\n", "1") == {}


def test_the_extern_step_is_no_work_of_the_job_on_a_node() -> None:
    """`scontrol listpids` as captured (tests/data/slurm/listpids-steps.txt: the batch step and step 0), plus an
    extern step's line written in the same format (this cluster runs no extern step: `PrologFlags=Contain` needs
    proctrack/cgroup here), whose `sleep` SLURM keeps on every node of the job, spares included."""
    from trainguard.jobs.slurm import parse_listpids_work

    captured = (DATA / "listpids-steps.txt").read_text()
    assert parse_listpids_work(captured) == {"1": [8483, 8485, 8457, 8461, 8458]}
    assert parse_listpids_work(captured + "9001     2        extern   0       0       \n") == \
        {"1": [8483, 8485, 8457, 8461, 8458]}


def test_which_nodes_each_step_spans_as_captured() -> None:
    """The same capture: step 0 spans n[2-3], step 1 n3 (the batch step, on n1, is no srun step). The step's name
    comes after SLURM's NodeList: a forged one in it does not win."""
    from trainguard.jobs.slurm import parse_step_nodes

    assert parse_step_nodes((DATA / "show-step.txt").read_text(), "1") == {"0": "n[2-3]", "1": "n3"}
    assert parse_step_nodes("StepId=1.2 UserId=1 NodeList=n1 Nodes=1 Name=x NodeList=evil\n", "1") == {"2": "n1"}


def test_leave_node_on_a_node_the_job_runs_nothing_on_leaves_the_job_alone(tmp_path: Path,
                                                                           ranks: Callable[..., int]) -> None:
    """The spare itself lost its GPU: no process of the job here and no step spans the node, so no restart and no
    requeue (the drain bound before it keeps new jobs off the node); the record keeps the job's next restart off it.
    A node whose rank already died (its step still spans it), or whose batch script trains without srun, is no
    spare: the fallback requeues the job."""
    job = replace(_job(tmp_path), node_list="n[1-4]", restarts=2)
    slurm = StubSlurm({}, ["0"], spans={"0": "n[2-4]"})
    record = tmp_path / "sw" / "left.5.2.n1"
    assert _run(slurm, job, leave_node=True) == (f"job 5 (t): nothing of it runs on n1: nothing to restart; n1 "
                                                 f"recorded as left ({record})")
    # no signal, no request: the record only keeps the job's next restart off the node
    assert slurm.calls == [] and [p.name for p in record.parent.iterdir()] == ["left.5.2.n1"]
    assert json.loads(record.read_text())["check"] == "training_log"

    assert "(n1 not recorded as left: its life is unknown)" in _run(slurm, replace(job, restarts=None),
                                                                    leave_node=True)
    for slurm in (StubSlurm({}, ["0"], spans={"0": "n[1-3]"}), StubSlurm({}, ["0"], batch=[ranks()], spans={"0": "n2"})):
        assert "no srun step of it on this node: requeue instead" in _run(slurm, job, leave_node=True)
        assert slurm.calls == [("signal", "5", "USR1", "full"), ("requeue", "5")]


# One fault, one answer per job (the goodput runs of record: an InfiniBand port down is two `infiniband` incidents,
# `mlx5_0/1` and `ports`, each bound to `drain, restart_elsewhere`, and NCCL errors in the job's log, `training_log`
# bound to `restart` in place, on this node or on another).

# A stand-in `srun` under a real relaunch loop, the job's one step: it logs its options, says which launch it is and
# its pid (LoopSlurm lists it as the step here), and the first launch trains until a save signal, then saves for a
# moment and exits 0; a later one is the fresh start, which exits 3 once the test is over (`end`), unless a second
# restart ends it first.
RANK_SRUN = r"""#!PYTHON
import json, os, signal, sys, pathlib, time
here = pathlib.Path(os.environ["SW"]).parent; n = int(os.environ["TRAINGUARD_RESTARTS"])
with open(here / "launches", "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\n")
if n == 0:
    asked = []
    signal.signal(signal.SIGUSR1, lambda *_: asked.append(1))
    (here / "step").write_text(f"{n} {os.getpid()}")
    while not asked:
        signal.pause()
    time.sleep(1.5)
    sys.exit(0)
(here / "step").write_text(f"{n} {os.getpid()}")
deadline = time.monotonic() + 20
while not (here / "end").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit(3)
"""


class LoopSlurm(StubSlurm):
    """The stand-in srun is the job's step on every node: listed while it runs, its process the rank here, ended by
    a step signal as srun ends when its tasks do."""

    def __init__(self, tmp_path: Path) -> None:
        super().__init__({}, [])
        self.step_file = tmp_path / "step"

    def _step(self) -> tuple[str, int] | None:
        try:
            step, pid = self.step_file.read_text().split()
            return (step, int(pid)) if _alive(int(pid)) else None
        except (OSError, ValueError):
            return None

    def local_steps(self, job_id: str, node: str = "") -> dict[str, list[int]]:
        now = self._step()
        return {now[0]: [now[1]]} if now else {}

    def steps(self, job_id: str) -> list[str]:
        now = self._step()
        return [now[0]] if now else []

    def signal_step(self, job_id: str, step: str, signal_name: str) -> bool:
        self.calls.append(("signal", f"{job_id}.{step}", signal_name, "step"))
        now = self._step()
        if now is None or now[0] != step:
            return False
        os.kill(now[1], signal.Signals["SIG" + signal_name])
        return True

    def cancel_step(self, job_id: str, step: str) -> bool:
        self.calls.append(("cancel", f"{job_id}.{step}"))
        return self.signal_step(job_id, step, "KILL")


def _alive(pid: int) -> bool:
    """Running, not a zombie the loop has yet to reap."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@contextlib.contextmanager
def _relaunch_loop(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """Job 5's relaunch loop around the stand-in srun (its step spans 3 of the allocation's 4 nodes), its first
    launch running."""
    (tmp_path / "sw").mkdir()
    srun = tmp_path / "bin" / "srun"
    srun.parent.mkdir()
    srun.write_text(RANK_SRUN.replace("PYTHON", sys.executable, 1))
    srun.chmod(0o755)
    proc = subprocess.Popen([sys.executable, "-m", "trainguard.trainer", "relaunch", "--", str(srun), "python",
                             "train.py"], cwd=REPO, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "SLURM_JOB_ID": "5", "SW": str(tmp_path / "sw"),
                                 "TRAINGUARD_SWITCH_DIR": str(tmp_path / "sw"), "SLURM_STEP_NUM_NODES": "3"})
    try:
        wait_until((tmp_path / "step").exists, 30, what="the job's first launch")
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def _agent(tmp_path: Path, slurm: StubSlurm, node: str, agent: tuple[Reports, Claims] | None = None,
           node_list: str = "n[1-4]") -> Callable[[RestartAction, Event], Callable[[], str]]:
    """An agent on `node` (two calls with the same `agent` are one agent's lists): a restart action for an event, as
    a function that runs it and returns its outcome, said as the responder says it."""
    reports, claims = agent or (Reports(), Claims())

    def act(action: RestartAction, event: Event) -> Callable[[], str]:
        def run() -> str:
            job = replace(_job(tmp_path), node_list=node_list)
            ctx = ActionContext(event, (job,), node, slurm, time.time,  # type: ignore[arg-type]
                                reports=reports, actions=ActionList(), claims=claims)
            try:
                return f"ok: {action.run(ctx)}"
            except ActionAnsweredError as exc:
                return f"answered: {exc}"
            except ActionSkippedError as exc:
                return f"skipped: {exc}"
            except ActionError as exc:
                return f"failed: {exc}"
            finally:
                ctx.done()
        return run
    return act


def _in_thread(run: Callable[[], str], out: list[str]) -> threading.Thread:
    thread = threading.Thread(target=lambda: out.append(run()))
    thread.start()
    return thread


IN_PLACE = RestartSettings(wait_exit=4.0, timeout=8)
ELSEWHERE = RestartSettings(wait_exit=4.0, timeout=8, leave_node=True)


@pytest.mark.parametrize("same_agent", [True, False])
def test_a_restart_in_place_under_way_still_leaves_the_node_a_restart_without_it_asks_to_leave(
        tmp_path: Path, same_agent: bool) -> None:
    """training_log restarts job 5 in place (its log shows the NCCL errors of n1's port down); while the ranks save,
    infiniband on n1 restarts it without n1: it goes on beside the one in place (not answered by it), records n1 as
    left and asks to leave it before the first srun returns, so the loop starts the job once, without n1."""
    slurm = LoopSlurm(tmp_path)
    agent = (Reports(), Claims()) if same_agent else None
    out: list[str] = []
    with _relaunch_loop(tmp_path) as loop:
        first = _in_thread(_agent(tmp_path, slurm, "n1" if same_agent else "n2", agent)(
            RestartAction("restart", IN_PLACE), _event("training_log", "slurm:5")), out)
        wait_until(lambda: slurm.calls, 10, what="the restart in place signalling")
        first.join(0.3)  # the ranks are saving
        second = _in_thread(_agent(tmp_path, slurm, "n1", agent)(
            RestartAction("restart_elsewhere", ELSEWHERE), _event("infiniband", "mlx5_0/1")), out)
        for thread in (first, second):
            thread.join(15)
        wait_until(lambda: len(_launched(tmp_path)) == 2 and slurm.local_steps("5"), 10, what="the relaunch")
        (tmp_path / "end").touch()
        loop.communicate(timeout=30)
    assert sorted(o.split(" (")[0] for o in out) == ["ok: restart of 5 requested", "ok: restart of 5 without n1 requested"]
    assert _launched(tmp_path) == [["python", "train.py"], ["--exclude=n1", "python", "train.py"]]
    assert loop.returncode == 3  # the fresh start ended by itself: no second restart


@pytest.mark.parametrize("same_agent", [True, False])
def test_a_restart_in_place_after_a_restart_without_the_node_is_skipped(tmp_path: Path, same_agent: bool) -> None:
    """infiniband on n1 restarts job 5 without n1; training_log's restart in place comes while it is under way, and
    again once the job started without n1 (the fault it answers began before that start): skipped both times, saying
    why; one relaunch, without n1. On the same agent the restart under way answers it (its check forgets the job's
    history, as after its own restart); from another agent the job's switch dir says so."""
    slurm = LoopSlurm(tmp_path)
    agent = (Reports(), Claims()) if same_agent else None
    log_agent = _agent(tmp_path, slurm, "n1" if same_agent else "n2", agent)
    elsewhere: list[str] = []
    in_place: list[str] = []
    with _relaunch_loop(tmp_path) as loop:
        nccl = _event("training_log", "slurm:5")  # the errors began before either restart
        first = _in_thread(_agent(tmp_path, slurm, "n1", agent)(RestartAction("restart_elsewhere", ELSEWHERE),
                                                                _event("infiniband", "mlx5_0/1")), elsewhere)
        wait_until(lambda: slurm.calls, 10, what="the restart without n1 signalling")
        in_place.append(log_agent(RestartAction("restart", IN_PLACE), nccl)())
        first.join(15)
        wait_until(lambda: len(_launched(tmp_path)) == 2 and slurm.local_steps("5"), 10, what="the relaunch")
        in_place.append(log_agent(RestartAction("restart", IN_PLACE), replace(nccl, incident_id="i2"))())
        (tmp_path / "end").touch()
        loop.communicate(timeout=30)
    assert elsewhere[0].startswith("ok: restart of 5 without n1 requested"), elsewhere
    if same_agent:
        assert all(re.fullmatch(r"answered: job 5 \(t\): already restarted without n1 for infiniband/mlx5_0/1 "
                                r"\(\d+\.\ds ago\): not restarted twice", o) for o in in_place), in_place
    else:
        assert re.fullmatch(r"skipped: job 5 \(t\): not restarted in place: a restart of it without n1 is under way "
                            r"\(left\.5\.0\.n1, and restart\.5 written \d+\.\ds ago\)", in_place[0]), in_place
        assert re.fullmatch(r"skipped: job 5 \(t\): not restarted in place: it started again without n1 \d+\.\ds ago "
                            r"\(left\.5\.0\.n1\), after the fault this restart answers began", in_place[1]), in_place
    assert _launched(tmp_path) == [["python", "train.py"], ["--exclude=n1", "python", "train.py"]]
    assert loop.returncode == 3 and [c[1] for c in slurm.calls if c[0] == "signal"] == ["5.0"]


def test_a_restart_in_place_is_skipped_while_one_without_a_node_finds_no_spare_and_requeues(tmp_path: Path) -> None:
    """A hung file system on n3 of a job with no spare (its allocation, n[1-3], is its step): n3's agent restarts job
    5 without n3, records it as left, finds no spare and requeues the job instead; n1's agent, whose ranks wait in the
    collective, restarts it in place meanwhile: skipped, saying why (before, it signalled the step and said the job
    restarted while the job was being requeued). One requeue, no relaunch."""
    slurm = LoopSlurm(tmp_path)
    elsewhere: list[str] = []
    with _relaunch_loop(tmp_path):
        first = _in_thread(_agent(tmp_path, slurm, "n3", node_list="n[1-3]")(
            RestartAction("restart_elsewhere", ELSEWHERE), _event("hang", "slurm:5")), elsewhere)
        wait_until((tmp_path / "sw" / "left.5.0.n3").exists, 10, what="n3 recorded as left")
        in_place = _agent(tmp_path, slurm, "n1", node_list="n[1-3]")(RestartAction("restart", IN_PLACE),
                                                                      _event("hang", "slurm:5"))()
        first.join(15)
        os.kill(int((tmp_path / "step").read_text().split()[1]), signal.SIGKILL)  # the step the requeue would end
    assert re.fullmatch(r"skipped: job 5 \(t\): not restarted in place: a restart of it without n3 is under way "
                        r"\(left\.5\.0\.n3, written \d+\.\ds ago\) and finds no spare node in its allocation \(3 "
                        r"node\(s\), 1 left or leaving, its step spans 3\): its fallback answers the fault", in_place), in_place
    assert elsewhere[0].startswith("ok: job 5 (t): not restarted without n3: no spare node"), elsewhere
    assert "requeue instead" in elsewhere[0], elsewhere
    assert ("requeue", "5") in slurm.calls and not any(c[0] == "signal" and c[1] == "5.0" for c in slurm.calls)
    assert _launched(tmp_path) == [["python", "train.py"]]


def test_a_fresh_left_record_without_a_spare_skips_a_restart_in_place_only_where_its_fallback_requeues(
        tmp_path: Path, ranks: Callable[..., int], monkeypatch: pytest.MonkeyPatch) -> None:
    """n3 was recorded as left a moment ago and the allocation, n[1-3], holds no spare: n1's restart in place is
    skipped while n3's fallback requeues the job. A job submitted --no-requeue is never requeued by that fallback
    (it is left alone): skipped, nothing would restart it. Ranks that do not say how many nodes their step spans
    (the user's variable) give no count to weigh the record with: restarted in place, never an exception. The nodes
    left are counted together, as the restart without one counts them."""
    sw = tmp_path / "sw"
    sw.mkdir()
    (sw / "left.5.0.n3").write_text("{}")
    env = {"TRAINGUARD_RESTARTS": "0", "TRAINGUARD_LEFT": "", "SLURM_STEP_NUM_NODES": "3"}
    job = replace(_job(tmp_path), node_list="n[1-3]")
    with pytest.raises(ActionSkippedError, match=r"finds no spare node in its allocation .*its fallback answers"):
        _run(StubSlurm({"0": [ranks(**env)]}, ["0"]), job)
    detail = _run(StubSlurm({"0": [ranks(**env)]}, ["0"]), replace(job, requeue=False))
    assert detail.startswith("restart of 5 requested"), detail
    (sw / "restart.5").unlink()
    del env["SLURM_STEP_NUM_NODES"]
    detail = _run(StubSlurm({"0": [ranks(**env)]}, ["0"]), job)
    assert detail.startswith("restart of 5 requested"), detail
    # a lost spare (n4, only recorded) and n3: neither alone leaves the step short, together they do, as n3's
    # restart counted them (every node recorded): it requeues the job
    (sw / "restart.5").unlink()
    (sw / "left.5.0.n4").write_text("{}")
    env["SLURM_STEP_NUM_NODES"] = "3"
    with pytest.raises(ActionSkippedError, match=r"no spare node in its allocation \(4 node\(s\), 2 left or leaving"):
        _run(StubSlurm({"0": [ranks(**env)]}, ["0"]), replace(job, node_list="n[1-4]"))

    # n3's fallback waits up to its wait_exit for the ranks to save before it requeues: 40 s after the record, a
    # restart in place with a wait_exit of a minute is still skipped; past wait_exit and 30 s more it goes on
    later = SimpleNamespace(time=lambda: time.time() + 40, monotonic=time.monotonic, sleep=time.sleep)
    monkeypatch.setattr("trainguard.actions.restart.time", later)
    with pytest.raises(ActionSkippedError, match=r"written 4\d\.\ds ago\) and finds no spare"):
        _run(StubSlurm({"0": [ranks(**env)]}, ["0"]), replace(job, node_list="n[1-4]"), wait_exit=60.0, timeout=90)
    detail = _run(StubSlurm({"0": [ranks(**env)]}, ["0"]), replace(job, node_list="n[1-4]"))
    assert detail.startswith("restart of 5 requested"), detail


def _launched(tmp_path: Path) -> list[list[str]]:
    try:
        return [json.loads(line) for line in (tmp_path / "launches").read_text().splitlines()]
    except OSError:
        return []


class NodeSlurm(StubSlurm):
    """StubSlurm with this node (n1 of four) to drain: the controller answers `sinfo` a moment late, as under load,
    so that two lists at once would both see the node not drained yet."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reason = ""

    def run(self, *args: str) -> str:
        state, reason = ("drained", self.reason) if self.reason else ("allocated", "none")
        time.sleep(0.3)  # the table as it was when asked
        return f"n1|gpu|{state}|{reason}\n" + "".join(f"n{i}|gpu|allocated|none\n" for i in (2, 3, 4))

    def drain(self, node: str, reason: str) -> None:
        self.calls.append(("drain", node))
        self.reason = reason


def test_one_port_down_is_two_incidents_and_one_drain_and_one_restart(tmp_path: Path,
                                                                        ranks: Callable[..., int]) -> None:
    """The goodput runs of record: one InfiniBand port down on n1 fires `infiniband` twice (the port, and the node's
    ports up), both lists `drain, restart_elsewhere` at once. One drain, one restart without n1; the second of each
    is skipped, saying why (never said done twice), and the second restart's check forgets the job's history as the
    first's does (the job started afresh)."""
    raw = {"agent": {"state_dir": str(tmp_path / "state"), "listen": "", "node_name": "n1"}, "jobs": {"sources": []},
           "checks": {}, "actions": {"drain": {"type": "drain", "max_drained": "2"},
                                     "restart_elsewhere": {"type": "restart", "leave_node": True, "wait_exit": 1.0,
                                                           "timeout": 5}}}
    engine = Engine(parse_config(raw, "t.toml"), store=Store(None))
    responder = engine.responder
    slurm = NodeSlurm({"0": [ranks(TRAINGUARD_RESTARTS="0", TRAINGUARD_LEFT="", SLURM_STEP_NUM_NODES="3")]}, ["0"])
    job = replace(_job(tmp_path), node_list="n[1-4]")
    records: list[tuple[str, dict[str, Any]]] = []
    forgotten: list[str] = []
    responder.slurm = slurm  # type: ignore[assignment]
    responder.jobs_for = lambda event, names=(): (job,)  # type: ignore[method-assign]
    responder.tracker.record_action = lambda check, subject, record, incident=None: records.append(  # type: ignore[method-assign]
        (subject, record))
    responder.forget = lambda check, subject: forgotten.append(subject)
    try:
        lists = [threading.Thread(target=responder._run_all, args=(replace(
            _event("infiniband", subject), incident_id=subject, summary=f"{subject} down"), ["drain", "restart_elsewhere"]))
            for subject in ("mlx5_0/1", "ports")]
        for thread in lists:
            thread.start()
        for thread in lists:
            thread.join(15)
    finally:
        engine.stop()
    said = sorted(f"{r['action']} {r['outcome']}" for _, r in records)
    assert said == ["drain ok", "drain skipped", "restart_elsewhere ok", "restart_elsewhere skipped"], records
    [skipped_drain] = [r["detail"] for _, r in records if r["action"] == "drain" and r["outcome"] == "skipped"]
    assert skipped_drain.startswith("n1 already drained by trainguard (trainguard: "), skipped_drain
    [(first, done)] = [(s, r) for s, r in records if r["action"] == "restart_elsewhere" and r["outcome"] == "ok"]
    [answered] = [r for _, r in records if r["action"] == "restart_elsewhere" and r["outcome"] == "skipped"]
    assert done["detail"].startswith("restart of 5 without n1 requested"), done
    assert re.fullmatch(rf"job 5 \(t\): already restarted without n1 for infiniband/{re.escape(first)} "
                        r"\(\d+\.\ds ago\): not restarted twice", answered["detail"]), answered
    assert sorted(forgotten) == ["mlx5_0/1", "ports"]
    assert [c for c in slurm.calls if c[0] != "cancel"] == [("drain", "n1"), ("signal", "5.0", "USR1", "step")]


def test_a_node_drained_for_a_lemon_hold_already_is_not_drained_again() -> None:
    """A lemon hold gives every drain its reason (it replaces another one): once the node has it, a second drain of
    the same fault is skipped like any other."""
    slurm = NodeSlurm({}, [])
    held = "GPU 3 XID 79 2x in 2m: RMA"
    action = DrainAction("drain", DrainSettings(max_drained="2"))
    ctx = ActionContext(_event("xid", "GPU-3"), (), "n1", slurm, time.time, held_reason=held)  # type: ignore[arg-type]
    assert action.run(ctx).startswith("drained n1: trainguard: GPU 3 XID 79")
    with pytest.raises(ActionSkippedError, match="n1 already drained by trainguard"):
        action.run(replace(ctx, event=_event("gpu", "GPU-3")))
    slurm.reason = "trainguard: an earlier fault's reason"
    assert action.run(ctx).startswith("drained n1: trainguard: GPU 3 XID 79")  # the hold's reason replaces it
    assert slurm.calls == [("drain", "n1"), ("drain", "n1")]


def test_a_fault_that_began_after_a_restart_ended_is_restarted_again(tmp_path: Path, ranks: Callable[..., int]) -> None:
    """The restart done a moment ago answers the incidents of the fault it answered, not a new one: a NaN streak of
    the fresh start (its incident began after that restart ended) restarts the job again, and is not said answered
    (its check would forget the new streak, and the incident stay open with nothing done)."""
    slurm = StubSlurm({"0": [ranks(TRAINGUARD_RESTARTS="0")]}, ["0"])
    action = RestartAction("restart", RestartSettings(wait_exit=0.3, timeout=5))
    ctx = ActionContext(_event(), (_job(tmp_path),), "n1", slurm, time.time)  # type: ignore[arg-type]
    assert "restart of 5 requested" in action.run(ctx)
    with pytest.raises(ActionAnsweredError, match="already restarted in place for training_log"):
        action.run(replace(ctx, event=replace(ctx.event, check="job_memory", since=ctx.event.since)))
    fresh = _event()  # the fresh start's fault: it began now, after the first restart ended
    assert "restart of 5 requested" in action.run(replace(ctx, event=fresh))
    assert [c[1] for c in slurm.calls if c[0] == "signal"] == ["5.0", "5.0"]


def test_a_spare_recorded_as_left_never_skips_a_loop_that_cannot_leave_a_node(tmp_path: Path,
                                                                             ranks: Callable[..., int]) -> None:
    """The spare n4 lost its GPU (its agent recorded it as left) and the job was since restarted in place; its loop
    cannot leave a node (no TRAINGUARD_LEFT: an older helper, or a command that is not srun), so no restart without a
    node is ever under way: a later restart in place runs (not skipped for the rest of the job's life)."""
    sw = tmp_path / "sw"
    sw.mkdir()
    (sw / "left.5.0.n4").write_text("{}")
    time.sleep(0.05)  # the request the restart in place wrote, after the record
    (sw / "restart.5").write_text("{}")
    slurm = StubSlurm({"0": [ranks(TRAINGUARD_RESTARTS="1", SLURM_STEP_NUM_NODES="3")]}, ["0"])
    assert "restart of 5 requested" in _run(slurm, replace(_job(tmp_path), node_list="n[1-4]"))


def test_a_restart_without_the_node_done_a_moment_ago_answers_the_next_one_though_one_in_place_ended_after_it() -> None:
    """training_log's restart in place and infiniband's without n1 ran side by side; the one in place ended last.
    A third incident of the port fault (one more port, a moment later) asks to leave n1: the restart without n1 done
    a moment ago answers it (not hidden by the later one in place, which does not): the fresh start, already without
    n1, is not restarted again."""
    claims = Claims()
    in_place, without = Claim("in place", "training_log/slurm:5"), Claim("without n1", "infiniband/mlx5_0/1", "n1")
    assert claims.take("5", in_place, 30.0, lambda other: True) is None
    assert claims.take("5", without, 30.0, lambda other: other.leave == "n1") is None  # beside it
    claims.end("5", without, None)
    claims.end("5", in_place, None)
    assert claims.take("5", Claim("without n1", "infiniband/ports", "n1"), 30.0,
                       lambda other: other.leave == "n1") is without
    assert claims.last("5", 30.0) is in_place  # the last restart done, whichever it was


def test_a_lost_spare_only_recorded_as_left_answers_no_restart_as_if_it_had_restarted_the_job(tmp_path: Path) -> None:
    """n1, the spare, lost its GPU: `restart_elsewhere` only records it as left (nothing of the job runs there). A
    restart in place of the job on n1 for another incident is not 'already restarted without n1' (nothing was
    restarted, and its check must not forget what it found): it is skipped because the job left n1."""
    job = replace(_job(tmp_path), node_list="n[1-4]", restarts=2)
    slurm = StubSlurm({}, ["0"], spans={"0": "n[2-4]"})
    ctx = ActionContext(_event("xid", "GPU-3"), (job,), "n1", slurm, time.time)  # type: ignore[arg-type]
    elsewhere = RestartAction("restart_elsewhere", RestartSettings(wait_exit=0.5, timeout=5, leave_node=True))
    assert "nothing to restart; n1 recorded as left" in elsewhere.run(ctx)
    in_place = RestartAction("restart", RestartSettings(wait_exit=0.5, timeout=5))
    with pytest.raises(ActionSkippedError) as caught:
        in_place.run(replace(ctx, event=replace(_event(), since=ctx.event.since)))  # the one fault's NCCL errors
    assert not isinstance(caught.value, ActionAnsweredError) and "it left n1" in str(caught.value), caught.value
    assert slurm.calls == []


def test_after_a_restart_without_this_node_no_next_step_is_waited_for_here(tmp_path: Path,
                                                                            ranks: Callable[..., int]) -> None:
    """This agent restarted the job without n1 a moment ago: its next srun never comes to n1, so a restart for a new
    fault of the node finds nothing here at once (the wait for a next step, 10 s, would hold every other job of the
    list back too)."""
    job = replace(_job(tmp_path), node_list="n[1-4]", restarts=0)
    looks: list[str] = []

    class Counting(StubSlurm):
        def local_steps(self, job_id: str, node: str = "") -> dict[str, list[int]]:
            looks.append(job_id)
            return super().local_steps(job_id, node)

    slurm = Counting({"0": [ranks(TRAINGUARD_RESTARTS="0", TRAINGUARD_LEFT="", SLURM_STEP_NUM_NODES="3")]}, ["0"],
                     spans={"0": "n[1-3]"})
    action = RestartAction("restart_elsewhere", RestartSettings(wait_exit=0.3, timeout=15, leave_node=True))
    ctx = ActionContext(_event("xid", "GPU-3"), (job,), "n1", slurm, time.time)  # type: ignore[arg-type]
    assert action.run(ctx).startswith("restart of 5 without n1 requested")
    slurm.here, slurm.spans, looks[:] = {}, {"1": "n[2-4]"}, []  # relaunched without n1
    assert "nothing to restart" in action.run(replace(ctx, event=_event("xid", "GPU-2")))
    assert looks == ["5"]


def test_a_lemon_holds_long_reason_cut_at_a_space_is_still_the_nodes_reason() -> None:
    """The drain reason is cut to 200 characters; cut just after a word, the node table shows it without the space:
    still the hold's reason, not drained again (nor counted as a drain again)."""
    slurm = NodeSlurm({}, [])
    held = "x" * 187 + " RMA please"  # "trainguard: " and 187 characters: the 200th is the space
    action = DrainAction("drain", DrainSettings(max_drained="2"))
    ctx = ActionContext(_event("xid", "GPU-3"), (), "n1", slurm, time.time, held_reason=held)  # type: ignore[arg-type]
    action.run(ctx)
    slurm.reason = slurm.reason.strip()  # as sinfo's line is read
    with pytest.raises(ActionSkippedError, match="n1 already drained by trainguard"):
        action.run(replace(ctx, event=_event("gpu", "GPU-3")))
    assert slurm.calls == [("drain", "n1")]


def test_a_restart_in_place_under_way_still_answers_once_one_without_the_node_beside_it_failed() -> None:
    """training_log's restart in place is under way; infiniband's without n1 went on beside it and failed (no
    spare). A third incident's restart in place is answered by the one still under way, not run a second time."""
    claims = Claims()
    in_place, without = Claim("in place", "training_log/slurm:5"), Claim("without n1", "infiniband/mlx5_0/1", "n1")
    assert claims.take("5", in_place, 30.0, lambda other: True) is None
    assert claims.take("5", without, 30.0, lambda other: other.leave == "n1") is None
    claims.end("5", without, ActionError("no spare node in its allocation"))
    assert claims.take("5", Claim("in place", "job_memory/slurm:5"), 30.0, lambda other: True) is in_place


def test_a_drain_waiting_for_another_gives_up_within_its_timeout() -> None:
    """One drain at a time, each waited for within the action's timeout: a drain its list gave up on (the controller
    hanging the first one) never runs later, after a resume, say."""
    slurm = NodeSlurm({}, [])
    claims = Claims()
    action = DrainAction("drain", DrainSettings(max_drained="2", timeout=0.2))
    ctx = ActionContext(_event("xid", "GPU-3"), (), "n1", slurm, time.time, claims=claims)  # type: ignore[arg-type]
    with claims.serial("drain"), pytest.raises(ActionError, match=r"another drain still under way after 0.2s"):
        action.run(ctx)
    assert slurm.calls == []
