"""The epilog gate on a shared node: another job's GPUs, processes, baseline and /dev/shm files are not the ending
job's (`slurm-epilog --check` as slurmd runs it, with the scripted NVML, real processes of the test users)."""

from __future__ import annotations

import json
import os
import pwd
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import require_tool, wait_until
from tests.slurm_cluster import ensure_user
from tests.test_gates import gate, job_env, job_user, leftovers, prolog_config, start_as
from trainguard.agent import gates
from trainguard.node.procfs import ProcFS

__all__ = ["job_user", "leftovers"]  # the fixtures, shared with tests/test_gates.py

OTHER_USER = "tgother"
GPU0, GPU1 = "GPU-00000000-0000-4000-8000-000000000000", "GPU-00000001-0000-4000-8000-000000000000"


@pytest.fixture
def other_user(job_user: int) -> int:
    ensure_user(OTHER_USER)
    return pwd.getpwnam(OTHER_USER).pw_uid


def running(*procs: subprocess.Popen[bytes]) -> None:
    """Each has exec'd its program (setpriv's environment is the program's: the mark is readable from the start)."""
    wait_until(lambda: all(Path(f"/proc/{p.pid}/environ").exists() for p in procs), 5)
    time.sleep(0.2)


def fail_line(done: subprocess.CompletedProcess[str]) -> str:
    return next((x for x in done.stderr.splitlines() if "FAIL" in x), "")


def test_another_jobs_gpu_processes_and_memory_are_not_the_ending_jobs(
        tmp_path: Path, job_user: int, other_user: int, leftovers: list[subprocess.Popen[bytes]]) -> None:
    """A CPU-only job (slurmd sets no SLURM_JOB_GPUS) ends while another user's job trains on both GPUs: nothing is
    the ending job's. A job on GPU 1 shared with another user's job and with another job of its own user (MPS,
    shards): their processes and the memory they hold are not its leftovers."""
    assert gate("slurm-prolog", tmp_path, job_env("300", job_user), "--check", "--config",
                str(prolog_config(tmp_path)), "--checks", "gpu").returncode == 0
    theirs = start_as(other_user, ["sleep", "300"], {"SLURM_JOB_ID": "390"})
    mine_elsewhere = start_as(job_user, ["sleep", "301"], {"SLURM_JOB_ID": "391"})
    leftovers.extend([theirs, mine_elsewhere])
    running(theirs, mine_elsewhere)
    procs = f"0:{theirs.pid}:{4 << 30},1:{theirs.pid}:{4 << 30},1:{mine_elsewhere.pid}:{2 << 30}"
    done = gate("slurm-epilog", tmp_path, job_env("301", job_user, TRAINGUARD_FAKE_GPU_PROCS=procs),
                "--check", "--grace", "0.3s", "--tmp", str(tmp_path))
    assert done.returncode == 0, done.stderr
    done = gate("slurm-epilog", tmp_path, job_env("302", job_user, SLURM_JOB_GPUS="1", TRAINGUARD_FAKE_GPU_PROCS=procs),
                "--check", "--grace", "0.3s", "--tmp", str(tmp_path))
    assert done.returncode == 0, done.stderr


def test_the_baseline_is_kept_per_gpu_and_a_gpu_without_one_is_said(tmp_path: Path, job_user: int) -> None:
    """Job A's prolog finds both GPUs idle; job B's prolog finds GPU 0 busy (A's): GPU 0 keeps A's baseline. A job's
    epilog on a GPU with no baseline says which GPU was not compared."""
    config = str(prolog_config(tmp_path))
    assert gate("slurm-prolog", tmp_path, job_env("310", job_user), "--check", "--config", config,
                "--checks", "gpu").returncode == 0
    busy = f"0:{os.getpid()}:{1 << 30}"  # GPU 0 in use: 2 GiB idle plus 1 GiB of job A's process
    assert gate("slurm-prolog", tmp_path, job_env("311", job_user, TRAINGUARD_FAKE_GPU_PROCS=busy), "--check",
                "--config", config, "--checks", "gpu").returncode == 0
    baseline = json.loads((tmp_path / "gates" / "gpu-baseline.json").read_text())["used"]
    assert baseline == {GPU0: 2 << 30, GPU1: 3 << 30}
    (tmp_path / "gates" / "gpu-baseline.json").write_text(json.dumps({"at": time.time(), "used": {GPU1: 3 << 30}}))
    done = gate("slurm-epilog", tmp_path, job_env("312", job_user, SLURM_JOB_GPUS="0,1"), "--check", "--grace", "0s",
                "--tmp", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert ("job 312: GPU 0: no memory baseline (the prolog gate records it while the GPU is idle): memory not "
            "compared") in done.stderr
    assert "GPU 1: no memory baseline" not in done.stderr


def test_dev_shm_files_a_running_process_of_the_user_holds_are_not_charged(
        job_user: int, leftovers: list[subprocess.Popen[bytes]]) -> None:
    """The user's other job, still running, holds one segment open and has another mapped (its descriptor closed):
    those are its own. The file nobody holds is what the ending job left."""
    with tempfile.TemporaryDirectory(prefix="tg-shm-") as name:
        shm = Path(name)
        shm.chmod(0o755)
        files = {n: shm / n for n in ("nccl-open", "nccl-mapped", "left")}
        for path in files.values():
            path.write_bytes(b"x" * (3 << 20))
            os.chown(path, job_user, -1)
        hold = ("import mmap, sys, time\nopened = open(sys.argv[1], 'rb')\nwith open(sys.argv[2], 'rb') as f:\n"
                "    m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\nprint('ready', flush=True)\ntime.sleep(300)")
        other_job = subprocess.Popen(
            [require_tool("setpriv"), f"--reuid={job_user}", f"--regid={pwd.getpwuid(job_user).pw_gid}",
             "--clear-groups", sys.executable, "-c", hold, str(files["nccl-open"]), str(files["nccl-mapped"])],
            env={"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "399"}, stdout=subprocess.PIPE, start_new_session=True)
        leftovers.append(other_job)
        assert other_job.stdout is not None and other_job.stdout.readline() == b"ready\n"
        tmp = shm / "gate"
        tmp.mkdir()
        done = gate("slurm-epilog", tmp, job_env("320", job_user), "--check", "--tmp", str(shm), "--shm-max", "2MiB")
        assert done.returncode == 2, done.stderr
        assert (f"{shm}: the job's user left 3.0 MiB in 1 file(s) (over 2.0 MiB): {files['left']} (3.0 MiB)"
                in fail_line(done)), done.stderr
        # the pids of the user's processes that hold any file: others of the test user's may run on a shared machine
        held = re.search(re.escape(f"{shm}: 2 file(s) of the job's user (6.0 MiB) held open or mapped by its running "
                                   "processes (pid ") + r"([\d, ]+)\): not counted", done.stderr)
        assert held is not None and str(other_job.pid) in held[1].split(", "), done.stderr


def test_the_tmp_walk_skips_other_users_private_dirs_and_says_when_it_was_cut(
        job_user: int, other_user: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another user's private directory full of files cannot use up the walk before the job's files (it cannot hold
    them: it is not entered). Entries of other users past the cap stop the walk, and that is said, over the limit
    or not."""
    monkeypatch.setattr(gates, "WALK_MAX", 10)
    with tempfile.TemporaryDirectory(prefix="tg-shm-") as name:
        shm = Path(name)
        mine, theirs = shm / "a-job", shm / "b-other"
        for folder, uid in ((mine, job_user), (theirs, other_user)):
            folder.mkdir(mode=0o700)
            os.chown(folder, uid, -1)
        for i in range(30):
            (theirs / f"f{i}").touch()
            os.chown(theirs / f"f{i}", other_user, -1)
        left = mine / "left"
        left.write_bytes(b"x" * (3 << 20))
        os.chown(left, job_user, -1)
        failures, notes = gates.job_files(job_user, [str(shm)], 2 << 20, ProcFS())
        assert failures == [f"{shm}: the job's user left 3.0 MiB in 1 file(s) (over 2.0 MiB): {left} (3.0 MiB)"]
        assert notes == []
        for i in range(30):
            (shm / f"g{i}").touch()
            os.chown(shm / f"g{i}", other_user, -1)
        failures, notes = gates.job_files(job_user, [str(shm)], 4 << 20, ProcFS())
        assert (failures, notes) == ([], [f"{shm}: walk cut at 10 entries of other users: the job's user's files "
                                          "after it not counted"])


class _Holder(ProcFS):
    """One live process of `uid` per pid in `pids`, holding `paths` open; each look at a process takes `slow`."""

    def __init__(self, uid: int, paths: set[str], pids: int = 1, slow: float = 0.0) -> None:
        self.uid, self.paths, self.count, self.slow = uid, paths, pids, slow

    def pids(self) -> list[int]:
        return list(range(1000, 1000 + self.count))

    def real_uid(self, pid: int) -> int | None:
        time.sleep(self.slow)
        return self.uid

    def open_paths(self, pid: int) -> set[str]:
        return self.paths

    def mapped_files(self, pid: int) -> set[tuple[int, int]]:
        return set()


def test_held_files_are_set_apart_in_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Thousands of the user's files, all held by a running job: each is compared about once, not with every other
    held file (that was quadratic: 300,000 held files kept a node COMPLETING for minutes)."""
    compared = [0]

    class Counted(str):
        __hash__ = str.__hash__

        def __eq__(self, other: object) -> bool:
            compared[0] += 1
            return str.__eq__(self, other)

    names = [f"/dev/shm/nccl-{i}" for i in range(2000)]
    monkeypatch.setattr(gates, "_user_files", lambda *_: [(4096, Counted(n), (1, i)) for i, n in enumerate(names)])
    failures, notes = gates.job_files(1234, ["/dev/shm"], 1, _Holder(1234, set(names)))
    assert failures == []
    assert notes == ["/dev/shm: 2000 file(s) of the job's user (7.8 MiB) held open or mapped by its running processes "
                     "(pid 1000): not counted"]
    assert compared[0] <= 2 * len(names)


def test_a_cut_look_at_held_files_is_said_and_charges_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The look at what the user's processes hold has its own deadline; when it is cut, files that a running job may
    hold are not charged to the job that ended: they are said to be unchecked."""
    monkeypatch.setattr(gates, "HELD_S", 0.05)
    monkeypatch.setattr(gates, "_user_files", lambda *_: [(3 << 20, "/dev/shm/seg", (1, 2))])
    failures, notes = gates.job_files(1234, ["/dev/shm"], 2 << 20, _Holder(1234, set(), pids=3, slow=0.1))
    assert failures == []
    assert notes == ["/dev/shm: the look at what the job's user's processes hold was cut after 0.05s: 1 file(s) of the "
                     "user (3.0 MiB) not checked, not counted"]


def _owned(path: Path, uid: int, size: int = 0) -> Path:
    path.write_bytes(b"x" * size)
    os.chown(path, uid, -1)
    return path


def test_the_tmp_walk_enters_no_symlink_swapped_in_for_a_listed_dir(
        tmp_path: Path, job_user: int, other_user: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another user's writable directory is listed, then swapped for a symlink to the job user's files elsewhere
    before the walk enters it (other users' directories are entered last): the walk does not follow it, and those
    files are not charged to the job."""
    shm, scratch = tmp_path / "shm", tmp_path / "scratch"
    swapped, mine = shm / "d", shm / "mine"
    for folder, uid in ((shm, 0), (scratch, job_user), (swapped, other_user), (mine, job_user)):
        folder.mkdir()
        folder.chmod(0o777)
        os.chown(folder, uid, -1)
    _owned(scratch / "big", job_user, 3 << 20)
    _owned(mine / "small", job_user)
    clock, calls = time.monotonic, [0]

    def swapping() -> float:
        """Call 1 sets the deadline, 2 and 3 are the top's two entries, 4 the first entry of the user's own dir."""
        calls[0] += 1
        if calls[0] == 4:
            swapped.rename(shm / "was-d")
            swapped.symlink_to(scratch)
        return clock()

    monkeypatch.setattr(gates.time, "monotonic", swapping)
    failures, notes = gates.job_files(job_user, [str(shm)], 2 << 20, ProcFS())
    monkeypatch.undo()
    assert calls[0] >= 4 and swapped.is_symlink()
    assert (failures, notes) == ([], [])


def test_the_tmp_walk_does_not_enter_another_filesystem(
        tmp_path: Path, job_user: int, tmpfs: Callable[..., Path]) -> None:
    """A mount below the tmp dir (a user cannot make one, but a hung NFS mount must not hang the epilog) is not
    entered: only the top's filesystem is walked."""
    shm = tmp_path / "shm"
    shm.mkdir()
    mounted = tmpfs(size="8m", parent=shm)
    os.chown(mounted, job_user, -1)
    _owned(mounted / "big", job_user, 3 << 20)
    left = _owned(shm / "left", job_user, 1 << 20)
    failures, notes = gates.job_files(job_user, [str(shm)], 512 << 10, ProcFS())
    assert (failures, notes) == ([f"{shm}: the job's user left 1.0 MiB in 1 file(s) (over 512.0 KiB): {left} (1.0 MiB)"],
                                 [])


class _Marked(ProcFS):
    """Processes of one user whose /proc/PID/cgroup and environ texts are given."""

    def __init__(self, texts: dict[int, tuple[str, str]]) -> None:
        self.texts = texts

    def cgroup(self, pid: int) -> str | None:
        return self.texts[pid][0]

    def read_text(self, pid: int | str, name: str) -> str | None:
        return self.texts[int(pid)][1] if name == "environ" else None


def test_a_jobs_cgroup_mark_is_read_as_slurm_names_it_and_job_1_is_not_job_12() -> None:
    """The epilog reads a process's cgroup as the kernel checks do (`job_of_cgroup`, v1 and v2): job 1's epilog
    takes none of job 12's processes, whose environment is unreadable (a zombie), nor a `job_1` a user made."""
    v1_12 = "12:memory:/slurm/uid_1000/job_12/step_0/task_0\n4:freezer:/slurm/uid_1000/job_12/step_0\n"
    v1_1 = "12:memory:/slurm/uid_1000/job_1\n4:freezer:/slurm/uid_1000/job_1\n"  # a path may stop at the job
    v2_12 = "0::/system.slice/slurmstepd.scope/job_12/step_0/user/task_0\n"
    v2_1 = "0::/system.slice/n3_slurmstepd.scope/job_1/step_batch/user/task_0\n"
    own = "0::/user.slice/user-1000.slice/user@1000.service/app.slice/job_1/x\n"
    proc = _Marked({1: (v1_12, ""), 2: (v2_12, ""), 3: (v1_1, ""), 4: (v2_1, ""), 5: (own, ""),
                    6: (own, "SLURM_JOB_ID=1\0"), 7: (v2_12, "SLURM_JOB_ID=1\0"), 8: ("0::/\n", "HOME=/\0")})
    assert [gates._job_mark(proc, pid, "1") for pid in range(1, 9)] == [
        None, None, "in the job's cgroup", "in the job's cgroup", "", "SLURM_JOB_ID=1", "SLURM_JOB_ID=1", None]
    assert [gates._job_mark(proc, pid, "12") for pid in (1, 2, 3)] == ["in the job's cgroup"] * 2 + [None]
