"""Borrowing the agent's hands: a job's user tries to make the agent write or signal where they could not."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import require_root
from tests.slurm_cluster import JOB_USER, OTHER_USER, ensure_user
from trainguard.actions.base import ActionContext, ActionError
from trainguard.actions.signal import SignalAction, SignalSettings
from trainguard.actions.switch import create_switch
from trainguard.agent.configfile import ConfigError, parse_config
from trainguard.core.events import Event, EventKind
from trainguard.core.model import Status
from trainguard.jobs.catalog import JobCatalog
from trainguard.jobs.settings import JobsSettings, ProcessJobSettings
from trainguard.jobs.slurm import SlurmClient
from trainguard.node.access import Identity


@pytest.fixture
def users() -> Iterator[tuple[Path, Identity, Identity]]:
    """A base dir every user can search, and the job user and another user."""
    require_root()
    ensure_user(JOB_USER)
    ensure_user(OTHER_USER)
    base = Path(tempfile.mkdtemp(prefix="trainguard-hands-", dir="/tmp"))
    base.chmod(0o755)
    yield base, Identity.of_uid(pwd.getpwnam(JOB_USER).pw_uid), Identity.of_uid(pwd.getpwnam(OTHER_USER).pw_uid)
    subprocess.run(["umount", "-l", str(base / "full")], capture_output=True, timeout=10)
    shutil.rmtree(base, ignore_errors=True)


def mine(path: Path, who: Identity, mode: int = 0o755) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, who.uid, pwd.getpwuid(who.uid).pw_gid)
    path.chmod(mode)
    return path


def test_a_trailing_slash_does_not_let_a_symlinked_switch_dir_through(users: tuple[Path, Identity, Identity]) -> None:
    base, job, _ = users
    root_dir = base / "roots"
    root_dir.mkdir(mode=0o755)  # root's, not world-writable: the old check accepted it
    home = mine(base / "home", job)
    (home / ".trainguard").symlink_to(root_dir)
    for spelling in (f"{home}/.trainguard/", f"{home}/.trainguard//", f"{home}/.trainguard"):
        with pytest.raises(ActionError, match="is a symlink: refused"):
            create_switch(spelling, "save", job, job.uid, {})
    assert list(root_dir.iterdir()) == []


def test_a_root_owned_switch_dir_is_refused(users: tuple[Path, Identity, Identity]) -> None:
    base, job, _ = users
    work = mine(base / "work", job)
    (work / ".trainguard").mkdir(mode=0o755)  # created by root
    with pytest.raises(ActionError, match="belongs to uid 0, not the job's user"):
        create_switch(str(work / ".trainguard"), "stop", job, job.uid, {})
    assert list((work / ".trainguard").iterdir()) == []


def test_a_dotdot_walk_through_a_directory_the_user_cannot_search_is_refused(
        users: tuple[Path, Identity, Identity]) -> None:
    base, job, _ = users
    work = mine(base / "work", job)
    private = base / "private"
    private.mkdir(mode=0o700)  # root's own, like /root
    target = mine(private / "x" / ".trainguard", job)  # even a dir of the user's in there: not theirs to reach
    path = f"{work}/../private/x/.trainguard"
    with pytest.raises(ActionError, match="not reachable by the job's user"):
        create_switch(path, "stop", job, job.uid, {})
    assert list(target.iterdir()) == []


def test_a_failed_write_leaves_no_temporary_file(users: tuple[Path, Identity, Identity]) -> None:
    base, job, _ = users
    full = base / "full"
    full.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k,nr_inodes=10", "tmpfs", str(full)], check=True, timeout=10)
    mine(full, job)
    (full / "filler").write_bytes(b"x" * 4096)  # the one page this tmpfs has
    with pytest.raises(ActionError, match="No space left"):
        create_switch(str(full), "save", job, job.uid, {"reason": "x" * 100})
    assert sorted(p.name for p in full.iterdir()) == ["filler"]


def test_a_process_job_must_name_its_user() -> None:
    for spec in ({"cmdline": "train\\.py"}, {"pidfile": "/run/train.pid"}):
        with pytest.raises(ConfigError, match=r"jobs\.processes\.trainer\.user: required key is missing"):
            parse_config({"jobs": {"processes": {"trainer": spec}}}, "t.toml")


def test_a_pidfile_naming_another_users_process_signals_nothing(users: tuple[Path, Identity, Identity]) -> None:
    base, job, other = users
    run = mine(base / "run", job)
    victim = subprocess.Popen(["sleep", "60"], user=other.uid,
                              group=pwd.getpwuid(other.uid).pw_gid, extra_groups=[], cwd="/")
    try:
        assert os.stat(f"/proc/{victim.pid}").st_uid == other.uid
        pidfile = run / "train.pid"
        pidfile.write_text(f"{victim.pid}\n")  # what the job's user wrote
        os.chown(pidfile, job.uid, job.uid)
        catalog = JobCatalog(JobsSettings(sources=["process"], refresh=0, processes={
            "trainer": ProcessJobSettings(pidfile=pidfile, user=JOB_USER)}), "node1")
        [found] = catalog.view().jobs
        assert found.uid == job.uid and found.processes == () and found.state == "ABSENT"
        event = Event(EventKind.FIRED, uuid.uuid4().hex[:8], "t", "s", Status.CRITICAL, "x", "node1", time.time(),
                      time.time())
        with pytest.raises(ActionError, match="job has no running process"):
            SignalAction("signal", SignalSettings(signal="TERM")).run(
                ActionContext(event, (found,), "node1", SlurmClient(), time.time))
        assert victim.poll() is None  # the other user's process lives
    finally:
        victim.kill()
        victim.wait()
