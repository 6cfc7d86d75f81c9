"""Actions and process jobs that need no SLURM: switch-file safety, pid identity, exec, process sources."""

from __future__ import annotations

import ast
import contextlib
import json
import os
import pwd
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, require_root, require_tool, wait_until
from tests.slurm_cluster import JOB_USER, ensure_user
from trainguard.actions.base import (
    ActionAnsweredError,
    ActionContext,
    ActionError,
    ActionSkippedError,
    each_job,
    each_job_at_once,
)
from trainguard.actions.exec import ExecAction, ExecSettings
from trainguard.actions.signal import SignalAction, SignalSettings, signal_process
from trainguard.actions.switch import create_switch
from trainguard.agent.configfile import ConfigError, parse_config
from trainguard.checks.base import ActionBinding
from trainguard.core.events import Event, EventKind
from trainguard.core.model import Result, Status
from trainguard.install import Installer
from trainguard.jobs.catalog import JobCatalog, JobView
from trainguard.jobs.model import Job, ProcessRef
from trainguard.jobs.settings import JobsSettings, ProcessJobSettings
from trainguard.jobs.slurm import SlurmClient
from trainguard.node.access import Identity
from trainguard.notifiers.text import actions_done, headline
from trainguard.pipeline.engine import Engine, OperatorError
from trainguard.pipeline.incidents import IncidentPolicy, IncidentTracker, Operator
from trainguard.pipeline.responder import (
    HANDED,
    LISTS_KEY,
    RESUME_WITHIN_S,
    STOPPED,
    Responder,
    _brief,
    event_jobs,
)
from trainguard.pipeline.store import Store, open_read_only
from trainguard.registry import Registry
from trainguard.trainer import Trainer


def ev(**details: object) -> Event:
    return Event(EventKind.FIRED, "inc1", "check", "subj", Status.CRITICAL, "summary text", "node1", time.time(),
                 time.time(), details=dict(details))


def ctx(*jobs: Job) -> ActionContext:
    return ActionContext(ev(), jobs, "node1", SlurmClient(), time.time)


@pytest.fixture
def user_dir() -> Iterator[tuple[Path, Identity, int]]:
    """A directory owned by the unprivileged job user, as a job's switch dir is, somewhere the user can reach
    (pytest's own temp dirs are private to root)."""
    require_root()
    ensure_user(JOB_USER)
    pw = pwd.getpwnam(JOB_USER)
    base = Path(tempfile.mkdtemp(prefix="trainguard-switch-", dir="/tmp"))
    base.chmod(0o755)
    d = base / "switches"
    d.mkdir()
    os.chown(d, pw.pw_uid, pw.pw_gid)
    yield d, Identity.of_uid(pw.pw_uid), pw.pw_gid
    shutil.rmtree(base, ignore_errors=True)


def test_switch_created_atomically_as_the_user(user_dir: tuple[Path, Identity, int]) -> None:
    d, me, gid = user_dir
    path = create_switch(str(d), "save", me, gid, {"reason": "leak"})
    st = os.lstat(path)
    assert (st.st_uid, st.st_gid) == (me.uid, gid)
    assert Path(path).read_text().strip() == '{"reason": "leak"}'
    assert [p.name for p in d.iterdir()] == ["save"]  # no temporary file left behind
    create_switch(str(d), "save", me, gid, {"again": True})  # an existing switch of the user is replaced


SWITCH = ("import sys\nfrom trainguard.actions.switch import create_switch\n"
          "from trainguard.node.access import Identity\n"
          "print(create_switch(sys.argv[1], 'save', Identity.of_uid(int(sys.argv[2])), int(sys.argv[3]), {}))\n")


def switch_as(directory: Path, uid: int, gid: int, *privileges: str) -> subprocess.CompletedProcess[str]:
    """create_switch in a process with the given setpriv options (a user, capabilities)."""
    return subprocess.run([require_tool("setpriv"), *privileges, sys.executable, "-c", SWITCH, str(directory), str(uid),
                           str(gid)], capture_output=True, text=True, timeout=30, cwd=REPO)


def test_a_failed_switch_leaves_no_temporary_file(user_dir: tuple[Path, Identity, int]) -> None:
    """Without CAP_CHOWN (as under a system call filter that denies chown) the attempt fails and the user's directory
    is left as it was."""
    d, me, gid = user_dir
    proc = switch_as(d, me.uid, gid, "--bounding-set=-chown", "--inh-caps=-chown")
    assert proc.returncode != 0 and "Operation not permitted" in proc.stderr, proc.stderr
    assert list(d.iterdir()) == []
    proc = switch_as(d / ".trainguard", me.uid, gid, "--bounding-set=-chown", "--inh-caps=-chown")
    assert proc.returncode != 0 and "cannot hand switch dir" in proc.stderr, proc.stderr
    assert list(d.iterdir()) == []  # nor a switch dir it could not hand over


def test_switch_as_the_service_user_with_the_dropin_capabilities(user_dir: tuple[Path, Identity, int]) -> None:
    """Under the unit the agent is `trainguard`, not root: with systemd/switch-files.conf's capabilities it makes the
    missing switch dir (owned by itself at first) and hands dir and file to the job's user."""
    d, me, gid = user_dir
    uid = me.uid
    Installer().ensure_user()
    d.chmod(0o700)  # the user's own directory: reached through CAP_DAC_OVERRIDE
    caps = "-all,+dac_override,+chown"
    proc = switch_as(d / ".trainguard", uid, gid, "--reuid=trainguard", "--regid=trainguard", "--init-groups",
                     f"--inh-caps={caps}", f"--ambient-caps={caps}", f"--bounding-set={caps}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"{d}/.trainguard/save"
    assert os.stat(d / ".trainguard").st_uid == uid and os.stat(d / ".trainguard" / "save").st_uid == uid


def test_symlink_attack_is_refused(user_dir: tuple[Path, Identity, int], tmp_path: Path) -> None:
    d, me, gid = user_dir
    victim = tmp_path / "victim"
    victim.write_text("root's precious file\n")
    (d / "save").symlink_to(victim)
    with pytest.raises(ActionError, match="exists as a symlink"):
        create_switch(str(d), "save", me, gid, {})
    assert victim.read_text() == "root's precious file\n"
    assert os.stat(victim).st_uid == 0


def test_hard_link_attack_is_refused(user_dir: tuple[Path, Identity, int], tmp_path: Path) -> None:
    d, me, gid = user_dir
    victim = tmp_path / "victim"
    victim.write_text("secret\n")
    os.link(victim, d / "stop")
    with pytest.raises(ActionError, match="hard link"):
        create_switch(str(d), "stop", me, gid, {})
    assert victim.read_text() == "secret\n" and os.stat(victim).st_uid == 0


def test_switch_dir_swapped_for_a_symlink_is_refused(user_dir: tuple[Path, Identity, int], tmp_path: Path) -> None:
    d, me, gid = user_dir
    target = tmp_path / "etc-like"
    target.mkdir()
    link = d.parent / "linked"
    link.symlink_to(target)
    with pytest.raises(ActionError, match="is a symlink: refused"):
        create_switch(str(link), "stop", me, gid, {})
    assert list(target.iterdir()) == []


def test_switch_dir_of_another_user_is_refused(user_dir: tuple[Path, Identity, int]) -> None:
    d, me, gid = user_dir
    foreign = d.parent / "foreign"
    foreign.mkdir()
    os.chown(foreign, 12345, 12345)
    with pytest.raises(ActionError, match="belongs to uid 12345"):
        create_switch(str(foreign), "stop", me, gid, {})


def test_missing_switch_dir_is_created_for_the_user(user_dir: tuple[Path, Identity, int]) -> None:
    d, me, gid = user_dir
    path = create_switch(str(d / ".trainguard"), "save", me, gid, {})
    assert os.stat(d / ".trainguard").st_uid == me.uid and os.stat(path).st_uid == me.uid


def test_switch_dir_that_is_a_file(user_dir: tuple[Path, Identity, int]) -> None:
    d, me, gid = user_dir
    (d / "afile").write_text("")
    with pytest.raises(ActionError, match="is not a directory"):
        create_switch(str(d / "afile"), "save", me, gid, {})


def test_jobs_of_one_directory_acted_on_at_once_share_the_switch_dir_made_for_them(
        user_dir: tuple[Path, Identity, int]) -> None:
    """Two jobs submitted from one directory (an array's tasks) restarted at once: each turn finds the switch dir
    missing and makes it; the one that loses the race uses the winner's, once handed to the user."""
    d, me, gid = user_dir
    for attempt in range(10):
        missing = d / f"sw{attempt}"
        start = threading.Barrier(4)
        made: list[str] = []

        def write(name: str, missing: Path = missing, start: threading.Barrier = start, made: list[str] = made) -> None:
            start.wait(10)
            made.append(create_switch(str(missing), name, me, gid, {}))

        threads = [threading.Thread(target=write, args=(f"restart.{n}",)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert sorted(Path(m).name for m in made) == [f"restart.{n}" for n in range(4)], (attempt, made)
        assert os.stat(missing).st_uid == me.uid


def _jobs(*ids: str, uid: int | None = None) -> list[Job]:
    """Jobs of one user (`uid`), or each of a user of its own (uid 2000 + its id) when none is given."""
    return [Job(key=f"slurm:{i}", source="slurm", name="t", state="RUNNING", job_id=i,
                uid=uid if uid is not None else 2000 + int(i)) for i in ids]


def test_each_job_at_once_never_makes_a_job_wait_for_another() -> None:
    """The first job's turn waits until the second's is over: one after another (each_job), it waits in vain."""

    def first_waits_for_second(wait_s: float) -> Callable[[Job], str]:
        second_done = threading.Event()

        def act(job: Job) -> str:
            if job.job_id == "1":
                assert second_done.wait(wait_s), "the second job waited for the first"
                return "one done"
            second_done.set()
            return "two done"

        return act

    # in the order given, not as they ended
    assert each_job_at_once(_jobs("1", "2"), first_waits_for_second(30)) == "one done; two done"
    with pytest.raises(AssertionError, match="the second job waited for the first"):
        each_job(_jobs("1", "2"), first_waits_for_second(0.5))


def test_one_users_many_jobs_wait_in_their_own_lane_never_another_users() -> None:
    """User A's eight jobs are listed first and each waits until user B's one job is over: B's turn never waits for
    theirs (a lane per user), while A's own jobs take their turns one after another."""
    b_done, order = threading.Event(), []

    def act(job: Job) -> str:
        if job.uid == 1:
            assert b_done.wait(30), "user B's job waited for user A's"
        else:
            b_done.set()
        order.append(job.job_id)
        return str(job.job_id)

    a_jobs = _jobs(*[str(n) for n in range(8)], uid=1)
    assert each_job_at_once([*a_jobs, *_jobs("8", uid=2)], act) == "; ".join(str(n) for n in range(9))
    assert order == ["8", *[str(n) for n in range(8)]]


def test_users_past_the_lanes_share_them_in_turn() -> None:
    """Five users, two lanes: never more than two turns at once, every job done."""
    lock, running, most = threading.Lock(), [0], [0]

    def act(job: Job) -> str:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        return str(job.job_id)

    ids = [str(n) for n in range(5)]
    assert each_job_at_once(_jobs(*ids), act, lanes=2) == "; ".join(ids)
    assert most[0] <= 2


@pytest.mark.parametrize(("outcomes", "raised", "text"), [
    ({"1": ActionError("refused"), "2": "done 2"}, None, "done 2; job 1 (t): refused"),
    ({"1": ActionSkippedError("none"), "2": ActionSkippedError("gone")}, ActionSkippedError, "job 1 (t): none; job 2 (t): gone"),
    ({"1": ActionAnsweredError("did"), "2": ActionAnsweredError("did")}, ActionAnsweredError, "job 1 (t): did; job 2 (t): did"),
    ({"1": ActionAnsweredError("did"), "2": ActionSkippedError("gone")}, ActionSkippedError, "job 1 (t): did; job 2 (t): gone"),
    ({"1": ActionError("refused"), "2": ActionSkippedError("gone")}, ActionError, "job 1 (t): refused; job 2 (t): gone"),
])
def test_each_job_at_once_combines_the_outcomes_as_each_job(outcomes: dict[str, str | ActionError],
                                                           raised: type[ActionError] | None, text: str) -> None:
    def act(job: Job) -> str:
        outcome = outcomes[job.job_id or ""]
        if isinstance(outcome, ActionError):
            raise outcome
        return outcome

    for each in (each_job, each_job_at_once):
        if raised is None:
            assert each(_jobs("1", "2"), act) == text
            continue
        with pytest.raises(ActionError) as error:
            each(_jobs("1", "2"), act)
        assert type(error.value) is raised and str(error.value) == text, (each, error.value)


def test_a_bug_in_one_jobs_turn_fails_the_action_once_every_turn_is_over() -> None:
    """Not an ActionError: raised as each_job raises it, and the runner fails the action with it. The other job's
    turn is not cut short (a thread cannot be stopped): the action ends after it."""
    ended: list[str] = []

    def act(job: Job) -> str:
        if job.job_id == "1":
            raise KeyError("a bug")
        time.sleep(0.2)
        ended.append("2")
        return "done 2"

    with pytest.raises(KeyError, match="a bug"):
        each_job_at_once(_jobs("1", "2"), act)
    assert ended == ["2"]
    with pytest.raises(KeyError, match="a bug"):
        each_job(_jobs("1", "2"), act)


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_recycled_pid_is_never_signalled(sleeper: subprocess.Popen[bytes]) -> None:
    real = ProcessRef.of(sleeper.pid)
    assert real is not None and real.matches()
    impostor = ProcessRef(sleeper.pid, real.create_time - 3600)  # same pid, another process's start time
    with pytest.raises(ActionError, match="no longer the job's process"):
        signal_process(impostor, "TERM", 0)
    assert sleeper.poll() is None
    for pid in (1, os.getpid()):
        with pytest.raises(ActionError, match="refusing to signal"):
            signal_process(ProcessRef(pid, 0.0), "TERM", 0)


def test_signal_process_job_with_escalation(sleeper: subprocess.Popen[bytes]) -> None:
    # SIGCONT leaves the process running, so only the escalation can end it.
    ref = ProcessRef.of(sleeper.pid)
    assert ref is not None
    job = Job(key="process:t", source="process", name="t", state="RUNNING", uid=os.getuid(), processes=(ref,))
    action = SignalAction("sig", SignalSettings(signal="CONT", then="KILL", grace=0.3))
    assert action.run(ctx(job)) == f"SIGCONT -> pid {sleeper.pid}"
    assert sleeper.wait(timeout=5) == -9  # escalated to SIGKILL after the grace period


def test_signal_to_a_job_that_already_exited_is_not_a_failure() -> None:
    """The stop switch's usual story: the trainer saw the file and exited before the agent relayed it. Nothing was
    left to signal, and that is the outcome, not an error; a job with one rank left gets that one signalled."""
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    ref = ProcessRef.of(done.pid)
    done.wait()
    gone = ref or ProcessRef(done.pid, 0.0)
    job = Job(key="process:t", source="process", name="t", state="RUNNING", uid=os.getuid(), processes=(gone,))
    action = SignalAction("signal", SignalSettings(signal="CONT"))
    with pytest.raises(ActionSkippedError) as skipped:  # nothing was signalled: skipped, neither done nor failed
        action.run(ctx(job))
    assert str(skipped.value) == f"process job t: had already exited (pid {done.pid}): nothing to signal"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        alive = ProcessRef.of(live.pid)
        assert alive is not None
        mixed = replace(job, processes=(gone, alive))
        assert action.run(ctx(mixed)) == f"SIGCONT -> pid {live.pid}, pid {done.pid} had already exited"
    finally:
        live.kill()
        live.wait()


def test_process_source_by_cmdline_and_pidfile(sleeper: subprocess.Popen[bytes], tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    child = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep(60)  # {marker}"])
    pidfile = tmp_path / "train.pid"
    pidfile.write_text(f"{sleeper.pid}\n")
    try:
        settings = JobsSettings(sources=["process"], processes={
            "by-cmd": ProcessJobSettings(cmdline=marker, user="root"),
            "by-pid": ProcessJobSettings(pidfile=pidfile, user="root"),
            "absent": ProcessJobSettings(cmdline="no-such-process-" + marker[::-1], user="root")})
        view = JobCatalog(settings, "node1").view()
        jobs = {j.name: j for j in view.jobs}
        assert [p.pid for p in jobs["by-cmd"].processes] == [child.pid]
        assert [p.pid for p in jobs["by-pid"].processes] == [sleeper.pid]
        assert jobs["absent"].state == "ABSENT" and not jobs["absent"].active
    finally:
        child.kill()
        child.wait()


def test_actions_that_ask_for_the_jobs_at_once_share_one_fresh_listing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel log replayed with 200 GPUs' faults starts 200 actions at once, each asking for the jobs now: callers
    waiting together share a listing begun after they asked (two in all), instead of 200 listings (and their SLURM
    calls) in a row that held the XID check's results, and an operator's `trainguard clear`, behind them."""
    from trainguard.jobs.process import ProcessSource

    listings: list[float] = []
    real = ProcessSource.jobs

    def slow(self: ProcessSource) -> Any:
        listings.append(time.monotonic())
        time.sleep(0.2)
        return real(self)

    monkeypatch.setattr(ProcessSource, "jobs", slow)
    catalog = JobCatalog(JobsSettings(sources=["process"], processes={
        "trainer": ProcessJobSettings(cmdline="no-such-process-" + uuid.uuid4().hex, user="root")}), "node1",
        clock=time.monotonic)  # a view's `taken`: when its listing began
    catalog.view(fresh=True)
    assert len(listings) == 1
    served: list[tuple[float, float]] = []  # per caller: when it asked, when the listing it got began
    start = threading.Event()

    def ask() -> None:
        start.wait(10)
        asked = time.monotonic()
        served.append((asked, catalog.view(fresh=True).taken))

    threads = [threading.Thread(target=ask) for _ in range(50)]
    for t in threads:
        t.start()
    start.set()
    for t in threads:
        t.join(30)
    assert len(served) == 50
    assert all(began >= asked for asked, began in served)  # each caller's listing began after it asked
    # The first asks' listing, one for those that asked during it, and one per group of threads the scheduler
    # woke late: a few, where each asking alone made 50.
    assert len(listings) <= 10, len(listings)
    before = len(listings)
    catalog.view(fresh=True)
    assert len(listings) == before + 1  # asked alone: a listing of its own


def test_exec_action_gets_the_incident(tmp_path: Path) -> None:
    out = tmp_path / "env.txt"
    action = ExecAction("hook", ExecSettings(command=["sh", "-c", f'echo "$TRAINGUARD_STATUS $TRAINGUARD_SUMMARY" > {out}'],
                                             timeout=5))
    assert action.run(ctx()) == "exited 0"
    assert out.read_text() == "CRITICAL summary text\n"
    slow = ExecAction("slow", ExecSettings(command=["sleep", "5"], timeout=0.2))
    with pytest.raises(ActionError, match=r"timed out after 0\.2s"):
        slow.run(ctx())
    with pytest.raises(ActionError, match="command not found"):
        ExecAction("x", ExecSettings(command=["/nonexistent/cmd"])).run(ctx())


def test_actions_run_once_per_incident_with_audit_and_dry_run(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    marker = tmp_path / "ran"
    raw = {"agent": {"state_dir": str(tmp_path), "listen": ""}, "jobs": {"sources": []},
           "actions": {"hook": {"type": "exec", "command": ["sh", "-c", f"echo x >> {marker}"]},
                       "pretend": {"type": "drain", "dry_run": True}},
           "checks": {"disk": {"paths": ["/"], "free_critical": "100%", "actions": {"critical": ["hook", "pretend"]}}}}
    engine = Engine(parse_config(raw, "t.toml"), store=Store(None))
    try:
        with caplog.at_level("WARNING"):
            for _ in range(3):
                engine.run_round()
                for t in engine.responder.threads:
                    t.join(5)
        assert marker.read_text() == "x\n"  # fired once, not on every bad sample
        [incident] = engine.tracker.incidents()
        assert [(a["action"], a["outcome"]) for a in incident.actions] == [("hook", "ok"), ("pretend", "dry_run")]
        assert incident.actions[1]["detail"].startswith("would drain node")
        assert any(r.getMessage() == "action" and r.__dict__["kv"]["outcome"] == "dry_run" for r in caplog.records)
    finally:
        engine.stop()


def test_an_action_with_nothing_to_act_on_is_skipped_and_never_said_done(tmp_path: Path,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    """An idle node's fault: no job to signal, requeue, switch or hold. Each of those is `skipped` with its reason
    (not `failed`, which would list as a failure in `trainguard status`; not `ok`, which the alert would state as
    done: "job requeued", "array held"); an action that acted (the hook) is still said."""
    marker = tmp_path / "ran"
    no_slurm = tmp_path / "no-slurm"  # a node without SLURM: nothing to drain, and nothing failed
    raw = {"agent": {"state_dir": str(tmp_path), "listen": ""}, "jobs": {"sources": [], "slurm_bin_dir": str(no_slurm)},
           "actions": {"hook": {"type": "exec", "command": ["sh", "-c", f"echo x >> {marker}"]},
                       "save": {"type": "switch", "switch": "save"}},
           "checks": {"disk": {"paths": ["/"], "free_critical": "100%",
                               "actions": {"critical": ["signal", "save", "requeue", "hold-array", "drain", "hook"]}}}}
    engine = Engine(parse_config(raw, "t.toml"), store=Store(None))
    try:
        with caplog.at_level("INFO"):
            engine.run_round()
            for t in engine.responder.threads:
                t.join(10)
        [incident] = engine.tracker.incidents()
        outcomes = {a["action"]: (a["outcome"], a["detail"]) for a in incident.actions}
        assert outcomes == {"signal": ("skipped", "no job on this node to signal"),
                            "save": ("skipped", "no job on this node to switch"),
                            "requeue": ("skipped", "no SLURM job on this node: nothing to requeue"),
                            "hold-array": ("skipped", "not an array job: nothing pending to stop"),
                            "drain": ("skipped", "drain: no SLURM on this node (sinfo not installed (not found on "
                                                 "PATH))"),
                            "hook": ("ok", "exited 0")}
        skipped = [r for r in caplog.records if r.getMessage() == "action" and r.__dict__["kv"]["outcome"] == "skipped"]
        assert len(skipped) == 5 and all(r.levelname == "INFO" for r in skipped)  # not an ERROR at 3 a.m.
        fired = Event(EventKind.FIRED, incident.id, "disk", "/", Status.CRITICAL, "/: full", "n1", 1.0, 1.0,
                      details={"actions_taken": incident.actions})
        assert actions_done(fired) == ["hook done"]
        assert headline([fired]) == "CRITICAL n1: /: full — hook done"
    finally:
        engine.stop()


def test_an_action_in_flight_at_shutdown_finishes_before_the_agent_stops(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A fault that fires a second before `systemctl stop`: its incident is saved as fired, so the next start does
    not fire it again; the drain or requeue under way must finish now (within the grace), or be logged as cut short
    (and taken up at the next start: the test after this one)."""
    marker = tmp_path / "ran"

    def engine_with(command: str) -> Engine:
        raw = {"agent": {"state_dir": str(tmp_path), "listen": ""}, "jobs": {"sources": []},
               "actions": {"hook": {"type": "exec", "command": ["sh", "-c", command], "timeout": "20s"}},
               "checks": {"disk": {"paths": ["/"], "free_critical": "100%", "actions": {"critical": ["hook"]}}}}
        return Engine(parse_config(raw, "t.toml"), store=Store(None))

    engine = engine_with(f"sleep 1; echo x >> {marker}")
    engine.run_round()
    assert [t.is_alive() for t in engine.responder.threads] == [True]
    with caplog.at_level("INFO"):
        engine.stop()
    assert marker.read_text() == "x\n"
    [incident] = engine.tracker.incidents()
    assert [(a["action"], a["outcome"]) for a in incident.actions] == [("hook", "ok")]
    [waited] = [r for r in caplog.records if r.getMessage() == "actions finished before shutdown"]
    assert waited.__dict__["kv"]["actions"] == 1
    # Stopped: no action starts any more (it would be cut short unseen), and an operator's command is refused.
    with caplog.at_level("INFO"):
        assert engine.responder.handle(ev(), engine.checks["disk"].settings.actions) is None
    assert any(r.getMessage() == "action not started: the agent is stopping" for r in caplog.records)
    with pytest.raises(OperatorError, match="the agent is stopping"):
        engine.clear(f"disk/{incident.subject}", Operator("root", 0, "fixed"))

    caplog.clear()
    with caplog.at_level("INFO"):
        engine_with("true").stop()  # nothing ran: nothing said about actions
    assert not [r for r in caplog.records if "actions" in r.getMessage()]

    engine = engine_with(f"sleep 1.5; echo y >> {marker}")
    engine.run_round()
    caplog.clear()
    t0 = time.monotonic()
    with caplog.at_level("INFO"):
        engine.stop(grace=0.3)
        assert time.monotonic() - t0 < 1.2  # bounded by the grace, not by the action's own timeout
        [cut] = [r for r in caplog.records if r.getMessage() == "actions still running at shutdown; cut short"]
        assert cut.levelname == "ERROR" and cut.__dict__["kv"]["threads"].startswith("actions-")
        [thread] = engine.responder.threads
        thread.join(10)
    assert marker.read_text() == "x\ny\n"  # the process (outside the unit's stop here) ran on
    # Its outcome came back after the stop: handed over for the engine a reload builds next, and then the store
    # closed; nothing failed in the dying thread.
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        "actions still running at shutdown; cut short"]
    with pytest.raises(sqlite3.ProgrammingError, match="closed"):
        engine.store.get("x")


class _Recorded(ExecAction):
    """An action that says it ran (`ran`), and waits on `hold` when asked to (a requeue waiting for the ranks)."""

    ran: list[str]
    hold: threading.Event | None = None

    def run(self, ctx: ActionContext) -> str:
        self.ran.append(self.name)
        if self.hold is not None and self.ran.count(self.name) == 1:
            self.hold.wait(30)
        return "done"


def _engine_with(tmp_path: Path, ran: list[str], critical: list[str], hold: str = "",
                 release: threading.Event | None = None) -> Engine:
    """An engine whose disk check fires at once with `critical` bound (stand-ins for signal, requeue and an exec
    hook; the `requeue` resumes), on a state dir that outlives it; `hold` names the action that waits on `release`."""
    raw = {"agent": {"state_dir": str(tmp_path), "listen": ""}, "jobs": {"sources": []},
           "actions": {name: {"type": "exec", "command": ["true"], "timeout": "60s"}
                       for name in ("signal", "requeue", "notify")},
           "checks": {"disk": {"paths": ["/"], "free_critical": "100%", "actions": {"critical": critical}}}}
    built = Engine(parse_config(raw, "t.toml"), store=Store(tmp_path / "state"))
    built.responder.process = uuid.uuid4().hex  # each its own process: the first is cut short as by a crash
    for name in ("signal", "requeue", "notify"):
        kind = type(name, (_Recorded,), {"ran": ran, "hold": release if name == hold else None,
                                         "resumes": name == "requeue", "__qualname__": "_Recorded"})
        built.responder.actions[name] = kind(name, ExecSettings(command=["true"], timeout=60))
    return built


def _cut(tmp_path: Path, ran: list[str], critical: list[str], hold: str, release: threading.Event) -> None:
    """Fire, wait until `hold` is under way, and stop the agent: the list is cut short there."""
    first = _engine_with(tmp_path, ran, critical, hold, release)
    first.run_round()
    wait_until(lambda: hold in ran, 10, what=f"{hold} under way")
    first.stop(grace=0.2)


def test_a_list_cut_short_by_a_stop_is_taken_up_at_the_next_start(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """`systemctl restart` while a requeue waits minutes for the ranks to save: they save and exit, and a job nobody
    requeues leaves the queue. The next start takes the list up at the action cut short (a requeue: safe to repeat)
    and goes on with those after it, which never began; what ran before is not run again."""
    ran: list[str] = []
    release = threading.Event()  # the first agent's requeue waits on it until the test ends (the process "died")
    try:
        _cut(tmp_path, ran, ["signal", "requeue", "notify"], "requeue", release)
        assert ran == ["signal", "requeue"]
        second = _engine_with(tmp_path, ran, ["signal", "requeue", "notify"])
        with caplog.at_level("INFO"):
            second.start()
            wait_until(lambda: len(ran) == 4, 10, what="the list taken up")
            for thread in second.responder.threads:
                thread.join(10)
            second.stop()
        assert ran == ["signal", "requeue", "requeue", "notify"]
        [incident] = second.tracker.incidents()
        assert [(a["action"], a["outcome"]) for a in incident.actions] == [
            ("signal", "ok"), ("requeue", "ok"), ("notify", "ok")]
        [taken] = [r for r in caplog.records
                   if r.getMessage() == "action list cut short by the agent's stop or crash; taken up"]
        assert taken.__dict__["kv"]["actions"] == "requeue,notify"

        third = _engine_with(tmp_path, ran, ["signal", "requeue", "notify"])  # taken up once: nothing is left
        third.start()
        third.stop()
        assert len(ran) == 4
    finally:
        release.set()


@pytest.mark.parametrize("case", ["cut_signal", "unbound", "too_old"])
def test_a_list_cut_short_is_not_taken_up_where_that_is_not_safe(tmp_path: Path, case: str) -> None:
    """A signal cut short may or may not have been sent: it is not sent twice, and the requeue after it does not run
    (it would end the job unsaved). An action the operator took out of the check's binding before the restart, or a
    list cut longer ago than RESUME_WITHIN_S (the agent was down, not restarted), is not taken up either. Each
    is recorded on the incident as interrupted."""
    ran: list[str] = []
    release = threading.Event()
    try:
        held = "signal" if case == "cut_signal" else "requeue"
        _cut(tmp_path, ran, ["signal", "requeue"], held, release)
        second = _engine_with(tmp_path, ran, ["signal"] if case == "unbound" else ["signal", "requeue"])
        if case == "too_old":
            second.responder.clock = lambda: time.time() + RESUME_WITHIN_S + 60
        second.start()
        time.sleep(0.5)
        second.stop()
        assert ran == ["signal"] if case == "cut_signal" else ran == ["signal", "requeue"]
        [incident] = second.tracker.incidents()
        [interrupted] = [a for a in incident.actions if a["outcome"] == "interrupted"]
        assert interrupted["action"] == held, incident.actions
        assert interrupted["detail"] == {  # why, as it was
            "cut_signal": "cut short by the agent's stop or crash; not run again at start (not safe to repeat), nor "
                          "the actions after it",
            "unbound": "cut short at the agent's stop or crash; not taken up (no longer bound as it was)",
            "too_old": "cut short at the agent's stop or crash; not taken up (cut more than 600s ago)"}[case]
    finally:
        release.set()


def test_a_list_taken_up_acts_on_the_jobs_it_was_about(tmp_path: Path) -> None:
    """On the jobs the cut list was about: as listed now where the same life still runs here (its processes to wait
    for), as they were where they ended meanwhile or live a later life (the requeue reads the record by id and leaves
    a job whose life moved on alone), and never on a job that started here since. An incident that is over by the
    next start is not taken up."""
    seen: list[tuple[Job, ...]] = []

    class Requeue(ExecAction):
        resumes = True

        def run(self, ctx: ActionContext) -> str:
            seen.append(ctx.jobs)
            return "requeued"

    class Catalog:
        def __init__(self, *jobs: Job) -> None:
            self.jobs, self.slurm, self.node = jobs, SlurmClient(), "node1"

        def view(self, max_age: float | None = None, fresh: bool = False) -> JobView:
            return JobView(self.jobs)

    def responder(catalog: Catalog, store: Store, firing: bool = True) -> Responder:
        config = parse_config({"agent": {"state_dir": str(tmp_path), "listen": ""}, "jobs": {"sources": []},
                               "actions": {"requeue": {"type": "exec", "command": ["true"]}}}, "t.toml")
        tracker = IncidentTracker(store, "node1", time.time)
        if firing:
            tracker.observe("xid", [Result("xid", "pci:0000:3b:00", Status.CRITICAL, "XID 79", {})],
                            IncidentPolicy(), True, lambda event: ())
        built = Responder(config, Registry(), catalog, tracker, state=store)  # type: ignore[arg-type]
        built.actions["requeue"] = Requeue("requeue", ExecSettings(command=["true"]))
        return built

    bound = {"xid": ActionBinding(critical=["requeue"])}

    def bindings(event: Event) -> ActionBinding | None:  # the engine's: what the event's check binds to it
        return bound.get(event.check)

    ended = Job(key="slurm:7", source="slurm", name="t", state="RUNNING", job_id="7", uid=1001, user="u",
                on_this_node=True, restarts=2, requeue=True)
    running, relived = replace(ended, key="slurm:8", job_id="8"), replace(ended, key="slurm:10", job_id="10")
    store = Store(tmp_path / "state")
    first = responder(Catalog(ended, running, relived), store)
    [incident] = first.tracker.incidents()
    event = Event(EventKind.FIRED, incident.id, "xid", incident.subject, Status.CRITICAL, "XID 79", "node1",
                  time.time(), time.time())
    cut = {"event": event.to_dict(), "names": ["requeue"], "next": 0, "started": True, "at": time.time(),
           "kinds": {"requeue": "Requeue"}, "jobs": [_brief(ended), _brief(running), _brief(relived)]}
    first._keep("cut", cut)  # as a list cut short leaves it
    later = replace(running, processes=(ProcessRef(1, 2.0),))
    newcomer = replace(ended, key="slurm:9", job_id="9")
    second = responder(Catalog(later, newcomer, replace(relived, restarts=3, processes=later.processes)), store)
    [thread] = second.resume(bindings)
    thread.join(10)
    [jobs] = seen
    assert [j.job_id for j in jobs] == ["7", "8", "10"]  # not job 9, which started here since
    assert (jobs[0].uid, jobs[0].restarts, jobs[0].requeue, jobs[0].processes) == (1001, 2, True, ())
    assert jobs[1] == later  # the same life, still here: its processes to wait for
    assert (jobs[2].restarts, jobs[2].processes) == (2, ())  # its next life runs here: the record says so

    done = {**cut, "next": 1, "started": False}  # every action had returned; only the list's removal was cut
    second._keep("cut", done)
    assert responder(Catalog(), store).resume(bindings) == []

    other = Store(tmp_path / "other")  # an agent whose incident was over by its next start
    responder(Catalog(), other, firing=False)._keep("cut", cut)
    assert responder(Catalog(), other, firing=False).resume(bindings) == []  # nothing is called for any more
    assert len(seen) == 1

    # Cut before its jobs were listed (a restart waits up to RECORD_WAIT_S for a job's record first): the list is
    # kept from its start with no jobs named, and the next start lists them itself.
    gate = threading.Event()

    class Waiting(Catalog):
        def view(self, max_age: float | None = None, fresh: bool = False) -> JobView:
            gate.wait(10)
            return super().view(max_age, fresh)

    third = Store(tmp_path / "third")
    cutting = responder(Waiting(later), third)
    [cut_incident] = cutting.tracker.incidents()
    cut_event = replace(event, incident_id=cut_incident.id)
    runner = threading.Thread(target=cutting._run_all, args=(cut_event, ["requeue"]), daemon=True)
    runner.start()
    try:
        wait_until(lambda: [e["jobs"] for e in json.loads(third.get(LISTS_KEY) or "{}").values()] == [None], 5,
                   what="the list kept while its jobs are listed")
        [thread] = responder(Catalog(later, newcomer), third).resume(bindings)
        thread.join(10)
        assert seen[-1] == (later, newcomer)  # listed now, as the cut list would have
    finally:
        gate.set()
        runner.join(10)


def test_unknown_action_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"checks.disk.actions.critical: unknown action 'nuke' \(defined: "):
        parse_config({"checks": {"disk": {"actions": {"critical": ["nuke"]}}}}, "t.toml")
    with pytest.raises(ConfigError, match=r"checks.hang.fs_actions.critical: unknown action 'nuke' \(defined: "):
        parse_config({"checks": {"hang": {"fs_actions": {"critical": ["nuke"]}}}}, "t.toml")
    with pytest.raises(ConfigError, match=r"actions\.bad\.signal: unknown signal 'SIGFOO'"):
        parse_config({"actions": {"bad": {"type": "signal", "signal": "SIGFOO"}}}, "t.toml")


def test_trainer_helper(tmp_path: Path) -> None:
    t = Trainer(switch_dir=tmp_path / "sw")
    assert not t.should_save() and not t.should_stop()
    t.heartbeat(7, loss=1.5, lr=float("nan"))
    beat = json.loads((tmp_path / "sw" / "heartbeat.json").read_text())
    assert beat["step"] == 7 and beat["metrics"] == {"loss": 1.5, "lr": "nan"} and beat["pid"] == os.getpid()
    (tmp_path / "sw" / "save").touch()
    assert t.should_save() and not t.should_stop()
    t.saved()
    assert not (tmp_path / "sw" / "save").exists() and not t.should_save()
    (tmp_path / "sw" / "stop").touch()
    assert t.should_stop() and t.should_save()


def test_trainer_signals(tmp_path: Path) -> None:
    script = ("import os, signal, sys; sys.path.insert(0, sys.argv[1]); from trainguard.trainer import Trainer; "
              "t = Trainer(switch_dir=sys.argv[2]).install(); os.kill(os.getpid(), signal.SIGUSR2); "
              "print(t.should_save(), t.should_stop()); os.kill(os.getpid(), signal.SIGUSR1); "
              "print(t.should_save(), t.should_stop(), t.last_signal)")
    out = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent.parent), str(tmp_path)],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    assert out.splitlines() == ["True False", "True True SIGUSR1"]


def test_trainer_last_signal_is_the_pending_requests(tmp_path: Path) -> None:
    """A SIGUSR2 save that was answered (saved()) is not the reason of a later stop through the switch file."""
    script = ("import os, signal, sys, pathlib; sys.path.insert(0, sys.argv[1]); from trainguard.trainer import Trainer; "
              "t = Trainer(switch_dir=sys.argv[2]).install(); os.kill(os.getpid(), signal.SIGUSR2); "
              "print(t.last_signal); t.saved(); pathlib.Path(sys.argv[2], 'stop').touch(); "
              "print(t.should_stop(), t.last_signal); os.kill(os.getpid(), signal.SIGUSR1); t.saved(); "
              "print(t.should_stop(), t.last_signal)")
    (tmp_path / "sw").mkdir()
    out = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent.parent), str(tmp_path / "sw")],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    assert out.splitlines() == ["SIGUSR2", "True None", "True SIGUSR1"]


def test_trainer_is_stdlib_only() -> None:
    """Module-level imports are the standard library's; the job's own torch is imported inside flight_recorder()."""
    tree = ast.parse((Path(__file__).parent.parent / "trainguard" / "trainer.py").read_text())

    def roots(nodes: list[ast.stmt] | list[ast.AST]) -> set[str]:
        return {(alias.name if isinstance(n, ast.Import) else n.module or "").split(".")[0]
                for n in nodes if isinstance(n, (ast.Import, ast.ImportFrom)) for alias in n.names}

    top = roots(tree.body)
    assert top <= set(sys.stdlib_module_names) | {"__future__"}, top - set(sys.stdlib_module_names)
    assert roots(list(ast.walk(tree))) - top == {"torch"}


def test_sacct_history_lines() -> None:
    from trainguard.jobs.slurm import HISTORY_FIELDS, parse_history

    def line(*fields: str) -> str:
        assert len(fields) == len(HISTORY_FIELDS)
        return "\x1f".join(fields)

    task = parse_history(line("4243", "4242_7", "llm | pretrain", "CANCELLED by 0", "0:15", "2026-11-20T10:00:00",
                              "2026-11-20T12:30:00", "alice", "None"))
    assert task is not None
    assert (task.key, task.job_id, task.array_job_id, task.array_task_id) == ("slurm:4243", "4243", "4242", "7")
    assert (task.name, task.state, task.exit_code, task.user, task.reason) == (
        "llm | pretrain", "CANCELLED", "0:15", "alice", None)
    assert task.end_time is not None and task.start_time is not None and task.end_time - task.start_time == 9000
    assert task.label() == "job 4242_7 (4243, llm | pretrain)"

    pending = parse_history(line("99", "99", "x", "PENDING", "0:0", "Unknown", "Unknown", "bob", "Dependency"))
    assert pending is not None and pending.end_time is None and pending.reason == "Dependency"
    assert parse_history("garbage without separators") is None


class _LateRecords:
    """A catalog whose job is listed before its record came (requeued onto this node: seen by its prolog), and whose
    record comes once asked to settle."""

    def __init__(self, comes: bool) -> None:
        self.comes = comes
        self.settled: float | None = None
        self.incomplete = Job(key="slurm:5", source="slurm", name="", state="RUNNING", job_id="5", on_this_node=True,
                              extra={"incomplete": "not yet known to the agent: asking slurmctld"})

    def view(self, fresh: bool = False) -> JobView:
        known = replace(self.incomplete, name="t", switch_dir="/home/u/.trainguard", extra={})
        return JobView(jobs=(known if self.settled and self.comes else self.incomplete,))

    def settle(self, timeout: float, listed: bool = False) -> None:
        self.settled = timeout


@pytest.mark.parametrize("comes", [True, False])
def test_an_action_waits_for_the_record_of_a_slurm_job_listed_before_it(comes: bool) -> None:
    """Issue 24's run: a job requeued onto a node was acted on before its record came, with no switch dir, so a
    restart took it for a job without the relaunch loop and requeued it. The record is waited for (bounded); a record
    that does not come leaves the job as listed."""
    catalog = _LateRecords(comes)
    event = ev(job_key="slurm:5")
    [job] = event_jobs(catalog, event, record_wait=2.0)  # type: ignore[arg-type]
    assert catalog.settled == 2.0
    assert (job.switch_dir, "incomplete" in job.extra) == (("/home/u/.trainguard", False) if comes else (None, True))
    [job] = event_jobs(_LateRecords(comes), ev())  # type: ignore[arg-type]
    assert job.key == "slurm:5"  # every job of this node, when the incident names none
    unasked = _LateRecords(comes)
    [job] = event_jobs(unasked, event, record_wait=0.0)  # type: ignore[arg-type]
    assert unasked.settled is None and "incomplete" in job.extra  # an action that needs no record acts on the listing


def test_only_the_actions_that_need_a_record_wait_for_it(tmp_path: Path) -> None:
    """A restart or a switch needs the job's switch dir: they wait for its record; a drain or an exec acts on the
    job as listed, at once."""
    raw = {"agent": {"state_dir": str(tmp_path / "state"), "node_name": "n2", "listen": ""},
           "jobs": {"sources": ["slurm"]}, "checks": {}, "notifiers": {"console": {}},
           "actions": {"restart": {"type": "restart"}, "save": {"type": "switch"},
                       "note": {"type": "exec", "command": ["true"]}}}
    engine = Engine(parse_config(raw, "test.toml"))
    try:
        for names, waits in ((["note", "drain"], False), (["drain", "restart"], True), (["save"], True)):
            engine.responder.catalog = catalog = _LateRecords(True)  # type: ignore[assignment]
            [job] = engine.responder.jobs_for(ev(job_key="slurm:5"), names)
            assert (catalog.settled is not None, "incomplete" in job.extra) == (waits, not waits), names
    finally:
        engine.store.close()


def test_the_trainer_holds_its_own_arrays_pending_tasks_once_on_a_stop_switch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop switch: rank 0 of an array task holds the pending tasks (squeue, then scontrol uhold, as the agent's
    hold-array does) before it exits, once; not without the switch, not outside an array, not on another rank, not
    with TRAINGUARD_HOLD_ARRAY=0."""
    calls, bin_dir = tmp_path / "calls", tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text(f'#!/bin/sh\necho "squeue $*" >> {calls}\necho "2-5%1"\n')
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "scontrol $*" >> {calls}\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    for var in ("RANK", "SLURM_PROCID", "TRAINGUARD_HOLD_ARRAY"):
        monkeypatch.delenv(var, raising=False)
    switch = tmp_path / "sw"
    switch.mkdir()

    def stop_seen(**env: str) -> str:
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            calls.unlink(missing_ok=True)
            trainer = Trainer(switch_dir=switch)
            trainer.should_stop()
            trainer.should_stop()  # once per process, however often the loop asks
            return calls.read_text() if calls.exists() else ""

    assert stop_seen(SLURM_ARRAY_JOB_ID="77") == ""  # no switch: nothing
    (switch / "stop").touch()
    assert stop_seen(SLURM_ARRAY_JOB_ID="77") == ("squeue --noheader --jobs=77 --states=PENDING --format=%K\n"
                                                  "scontrol uhold 77_[2-5]\n")
    assert stop_seen() == ""  # not an array task
    assert stop_seen(SLURM_ARRAY_JOB_ID="77", RANK="1") == ""  # rank 0 holds for all
    assert stop_seen(SLURM_ARRAY_JOB_ID="77", TRAINGUARD_HOLD_ARRAY="0") == ""  # the user's burn-through
    assert stop_seen(SLURM_ARRAY_JOB_ID="77;rm -rf") == ""  # an id is digits


@pytest.mark.parametrize(("held", "how", "ago"), [("requeue", HANDED, 0.0), ("signal", HANDED, 0.0),
                                                ("requeue", HANDED, RESUME_WITHIN_S + 60),
                                                ("requeue", STOPPED, RESUME_WITHIN_S + 60)])
def test_a_reload_in_the_middle_of_a_list_runs_each_action_once_and_records_what_ran(
        tmp_path: Path, held: str, how: str, ago: float, caplog: pytest.LogCaptureFixture) -> None:
    """`systemctl reload` while a list's action waits (a requeue for the ranks' save): the old engine's thread goes on
    in the process with that action, and begins no other; the new engine on the same state neither runs it again nor
    calls it cut short (a signal: not safe to repeat), records what it did once handed over, and runs the rest. That
    action may have run longer than RESUME_WITHIN_S (a diag at its standard level, a requeue's wait): a reload's list
    is taken up all the same, handed over or stopped between two actions (its action ended within the stop's grace)."""
    ran: list[str] = []
    release = threading.Event()
    first = _engine_with(tmp_path, ran, ["signal", "requeue", "notify"], held, release)

    def release_at_the_stop() -> None:
        wait_until(lambda: first.responder._closing, 10, what="the reload's stop")
        release.set()

    try:
        first.run_round()
        wait_until(lambda: held in ran, 10, what=f"{held} under way")
        if how == STOPPED:
            threading.Thread(target=release_at_the_stop, daemon=True).start()
        first.stop(grace=0.2 if how == HANDED else 10)  # the reload: the old engine stops, its action still under way
        second = _engine_with(tmp_path, ran, ["signal", "requeue", "notify"])
        second.responder.process = first.responder.process  # the same process
        second.responder.clock = lambda: time.time() + ago
        with caplog.at_level("INFO"):
            second.start()
            if how == HANDED:
                time.sleep(0.5)
                assert ran == ["signal", "requeue"][:["signal", "requeue"].index(held) + 1]  # nothing again, nor more
            release.set()
            wait_until(lambda: len(second.tracker.incidents()[0].actions) == 3, 10, what="the rest of the list")
            for thread in second.responder.threads:
                thread.join(10)
        assert ran == ["signal", "requeue", "notify"]
        assert [(a["action"], a["outcome"]) for a in second.tracker.incidents()[0].actions] == [
            ("signal", "ok"), ("requeue", "ok"), ("notify", "ok")]
        [taken] = [r for r in caplog.records if r.getMessage() == f"action list {how}; taken up"]
        assert taken.__dict__["kv"]["actions"] == ("requeue,notify" if held == "signal" else "notify")
        second.stop()
        third = _engine_with(tmp_path, ran, ["signal", "requeue", "notify"])  # nothing is left to take up
        third.start()
        third.stop()
        assert ran == ["signal", "requeue", "notify"]
        with contextlib.closing(open_read_only(tmp_path / "state")) as conn:  # nor any hand-over key, empty or not
            assert conn.execute("SELECT key FROM kv WHERE key LIKE 'responder.handover/%'").fetchall() == []
    finally:
        release.set()
