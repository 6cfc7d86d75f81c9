"""A budget per job: the files a log glob opens (the newest N, M entries examined, listed with the job user's
authority), the bytes its logs are read per run (the rest read on next run), and its share of a run's time (a slow job
UNKNOWN, the others still checked in the same run)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainguard.checks.base import CheckContext
from trainguard.checks.hang import HangCheck, HangSettings
from trainguard.checks.training_log import POSITIONS_KEY, TrainingLogCheck, TrainingLogSettings
from trainguard.core.model import Status
from trainguard.core.state import ScopedState
from trainguard.gpu.nvml import Nvml
from trainguard.jobs.catalog import JobCatalog
from trainguard.jobs.model import Job
from trainguard.jobs.settings import JobsSettings, ProcessJobSettings
from trainguard.jobs.tree import job_log_files
from trainguard.node.access import Identity
from trainguard.node.globs import newest_as
from trainguard.pipeline.store import Store

from .conftest import require_root, start_fuse
from .helpers.fake_nvml import FakeNvml, NVMLError
from .test_training_log import OOM_H100

ROOT = Identity(0)
KiB = 1 << 10


def aged(path: Path, mtime: float, text: str = "step 1 loss=1.0\n") -> Path:
    path.write_text(text)
    os.utime(path, (mtime, mtime))
    return path


def test_a_glob_reads_the_newest_files_and_counts_the_rest(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    for i in range(100):
        aged(logs / f"r{i:03}.log", 1000 + i)
    aged(logs / ".hidden.log", 9000)  # `*` matches no leading dot, as glob's
    (logs / "dir.log").mkdir()  # newest, but no file
    os.mkfifo(logs / "fifo.log")
    (logs / "link.log").symlink_to(logs / "r000.log")  # followed (as the user): its target is old
    found = newest_as(ROOT, f"{logs}/*.log", 5, 10_000)
    assert found.paths == tuple(str(logs / f"r{i:03}.log") for i in range(95, 100))
    assert (found.matched, found.examined, found.cut) == (101, 104, False)
    assert newest_as(ROOT, f"{logs}/r0[0-1]?.log", 3, 10_000).paths == tuple(
        str(logs / f"r0{i}.log") for i in (17, 18, 19))
    assert newest_as(ROOT, f"{logs}/[!r]*", 10, 10_000).paths == (str(logs / "link.log"),)

    job = Job(key="process:j", source="process", name="j", state="RUNNING", log_paths=(f"{logs}/*.log",))
    files = job_log_files(job, (), ROOT, keep=5)
    assert len(files.paths) == 5 and files.notes == [f"{logs}/*.log: 101 files match; the newest 5 are read"]


def test_a_glob_examines_at_most_its_cap_of_entries(tmp_path: Path) -> None:
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        for i in range(1500):
            (tmp_path / d / f"{i}.log").touch()
    found = newest_as(ROOT, f"{tmp_path}/a/*.log", 64, 1000)
    assert (found.examined, found.matched, found.cut, len(found.paths)) == (1000, 1000, True, 64)
    across = newest_as(ROOT, f"{tmp_path}/*/*.log", 64, 2000)  # one cap for the whole pattern, directories included
    assert across.examined == 2000 and across.cut and across.matched == 2000 - 2
    assert not newest_as(ROOT, f"{tmp_path}/a/*.log", 64, 1500).cut


def test_a_glob_from_a_hostile_name_never_fails_and_matches_any_file_name(tmp_path: Path) -> None:
    """A job's name or work directory is its user's text: a reversed range (`sbatch --chdir '/home/u/[z-a]'`) matches
    nothing, as in fnmatch, instead of failing the job's checks; names that are not UTF-8 match `*` and `?`."""
    odd = tmp_path / "[z-a]"
    odd.mkdir()
    aged(odd / "r.log", 1000)
    assert newest_as(ROOT, f"{odd}/*.log", 5, 100).paths == ()  # the set matches no name: the literal dir is not it
    assert newest_as(ROOT, f"{tmp_path}/[[]z-a]/*.log", 5, 100).paths == (str(odd / "r.log"),)
    assert newest_as(ROOT, f"{tmp_path}/[!z-a]*/*.log", 5, 100).paths == (str(odd / "r.log"),)
    raw = os.fsencode(str(tmp_path)) + b"/\xff\xfe.log"
    with open(raw, "w") as f:
        f.write("step 1\n")
    os.utime(raw, (2000, 2000))
    aged(tmp_path / "\u00e9.log", 1500)
    assert newest_as(ROOT, f"{tmp_path}/*.log", 5, 100).paths == tuple(sorted(
        [os.fsdecode(raw), str(tmp_path / "\u00e9.log")]))
    assert newest_as(ROOT, f"{tmp_path}/?.log", 5, 100).paths == (str(tmp_path / "\u00e9.log"),)
    assert newest_as(ROOT, f"{tmp_path}/??.log", 5, 100).paths == (os.fsdecode(raw),)


def test_a_glob_lists_only_what_the_jobs_user_may_list() -> None:
    require_root()
    base = Path(tempfile.mkdtemp(prefix="trainguard-globs-", dir="/tmp"))  # pytest's own temp root is private
    try:
        base.chmod(0o755)
        for name, mode in (("open", 0o755), ("private", 0o700), ("search_only", 0o711)):
            d = base / name
            d.mkdir()
            d.chmod(mode)
            aged(d / "train.log", 1000).chmod(0o644)
        user = Identity(54321)  # no such user: "other" bits only
        mine = (str(base / "open" / "train.log"),)
        assert newest_as(user, f"{base}/open/*.log", 8, 100).paths == mine
        assert newest_as(user, f"{base}/private/*.log", 8, 100).paths == ()
        assert newest_as(user, f"{base}/search_only/*.log", 8, 100).paths == ()  # may open a name, not list them
        named = (*mine, str(base / "search_only" / "train.log"))  # a name they give is one they may open
        assert newest_as(user, f"{base}/*/train.log", 8, 100).paths == named
        assert len(newest_as(ROOT, f"{base}/*/train.log", 8, 100).paths) == 3
    finally:
        shutil.rmtree(base, ignore_errors=True)


def log_check(tmp_path: Path, store: Store, logs: dict[str, list[str]], jobs: JobsSettings | None = None,
              **settings: object) -> TrainingLogCheck:
    jobs = jobs or JobsSettings(sources=["process"], refresh=0, processes={
        name: ProcessJobSettings(cmdline=f"no-such-process-{uuid.uuid4().hex}", user="root", logs=paths)
        for name, paths in logs.items()})
    return TrainingLogCheck("logs", TrainingLogSettings(**settings), CheckContext(
        "node1", tmp_path, jobs=JobCatalog(jobs, "node1"), state=ScopedState(store, "check/logs"),
        nvml=Nvml(FakeNvml(init_error=NVMLError))))


def test_a_jobs_read_budget_leaves_the_rest_for_the_next_run(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    steps = "".join(f"step {i} loss=1.0\n" for i in range(40_000))  # ~700 KiB a log
    for name in ("a", "b"):
        (logs / f"{name}.log").write_text(steps)
    (logs / "c.log").write_text(steps + OOM_H100 + "\n")
    store = Store(tmp_path / "state")
    check = log_check(tmp_path, store, {"j": [f"{logs}/*.log"]}, job_read_limit=1024 * KiB)
    [first] = check.run()
    assert first.status is Status.OK and "its logs are behind" in first.summary
    size = sum(p.stat().st_size for p in logs.iterdir())
    assert first.details["behind_bytes"] >= size - 1024 * KiB - 64 * KiB  # what is left, give or take a partial line
    [second] = check.run()
    assert second.status is Status.OK and "its logs are behind" in second.summary  # b's rest, then part of c
    [third] = check.run()
    assert third.status is Status.CRITICAL and "CUDA out of memory" in third.summary
    assert "behind" not in third.summary and "behind_bytes" not in third.details


def test_only_the_cursors_of_the_files_read_are_kept(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    for i in range(6):
        aged(logs / f"r{i}.log", 1000 + i)
    store = Store(tmp_path / "state")
    jobs = JobsSettings(sources=["process"], refresh=0, max_log_files=2, processes={
        "j": ProcessJobSettings(cmdline=f"no-such-process-{uuid.uuid4().hex}", user="root", logs=[f"{logs}/*.log"])})
    check = log_check(tmp_path, store, {}, jobs)
    [result] = check.run()
    assert result.details["logs"] == [f"{logs}/*.log: 6 files match; the newest 2 are read"]
    saved = ScopedState(store, "check/logs").load_json(POSITIONS_KEY)
    assert sorted(saved["process:j"]) == [str(logs / "r4.log"), str(logs / "r5.log")]
    aged(logs / "r0.log", 2000, "step 1 loss=1.0\nstep 2 loss=1.0\n")  # written again: among the newest
    check.run()
    saved = ScopedState(store, "check/logs").load_json(POSITIONS_KEY)
    assert sorted(saved["process:j"]) == [str(logs / "r0.log"), str(logs / "r5.log")]  # r4's cursor dropped


@pytest.fixture
def slow_mount(tmp_path: Path) -> Iterator[Path]:
    """A FUSE mount of 60 files, each stat taking 0.1 s (tests/helpers/slowfs.py)."""
    mnt = tmp_path / "slow"
    proc = start_fuse(mnt, "slowfs.py", "60", "0.1")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False, timeout=10)
    proc.kill()
    proc.wait(timeout=10)


def test_a_slow_jobs_logs_make_it_unknown_and_the_others_are_still_read(tmp_path: Path, slow_mount: Path) -> None:
    honest = tmp_path / "honest.log"
    honest.write_text("step 41 loss=1.1\n" + OOM_H100 + "\n")
    check = log_check(tmp_path, Store(None), {"slow": [f"{slow_mount}/*.log"], "honest": [str(honest)]}, timeout=3)
    t0 = time.monotonic()
    results = {r.subject: r for r in check.run()}
    took = time.monotonic() - t0
    slow, found = results["process:slow"], results["process:honest"]
    assert slow.status is Status.UNKNOWN
    assert "reading its logs took longer than its budget of 1.2s; the other jobs were checked" in slow.summary
    assert found.status is Status.CRITICAL and "CUDA out of memory" in found.summary
    assert took < 3, f"the run took {took:.1f}s, past its timeout"  # the runner would have called it a timeout


def test_a_slow_jobs_progress_signals_make_it_unknown_and_the_others_are_still_watched(
        tmp_path: Path, slow_mount: Path) -> None:
    marker = f"budget-{uuid.uuid4().hex[:8]}"
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"{marker}-{n}"])
             for n in ("slow", "honest")]
    try:
        honest = tmp_path / "honest.log"
        honest.write_text("step 1\n")
        jobs = JobCatalog(JobsSettings(sources=["process"], refresh=0, processes={
            "slow": ProcessJobSettings(cmdline=f"{marker}-slow", user="root", logs=[f"{slow_mount}/*.log"]),
            "honest": ProcessJobSettings(cmdline=f"{marker}-honest", user="root", logs=[str(honest)])}), "node1")
        check = HangCheck("hang", HangSettings(timeout=2, stacks=False), CheckContext(
            "node1", tmp_path, jobs=jobs, state=ScopedState(Store(None), "check/hang")))
        results = {r.subject: r for r in check.run()}
        assert results["process:slow"].status is Status.UNKNOWN
        assert "reading its progress signals took longer than its budget" in results["process:slow"].summary
        assert results["process:honest"].status is Status.OK
        assert f"log {honest}" in results["process:honest"].summary
    finally:
        for p in procs:
            p.kill()
            p.wait()
