"""Training logs read like an expert: a corpus of real-format messages, the incremental reader, and the check."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from trainguard.checks import training_log
from trainguard.checks.base import CheckContext
from trainguard.checks.training_log import TrainingLogCheck, TrainingLogSettings
from trainguard.core.model import Status
from trainguard.core.state import ScopedState
from trainguard.gpu.nvml import GpuProcess, GpuState, Nvml
from trainguard.jobs.catalog import JobCatalog, JobView
from trainguard.jobs.model import Job
from trainguard.jobs.settings import JobsSettings, ProcessJobSettings
from trainguard.logscan.context import pick_gpu
from trainguard.logscan.diagnose import diagnose_cuda
from trainguard.logscan.reader import LogTail, look
from trainguard.logscan.signatures import BUILTIN, Scanner
from trainguard.node.access import Identity
from trainguard.pipeline.store import Store

from .conftest import wait_until
from .helpers.fake_nvml import FakeGpu, FakeNvml, NVMLError
from .slurm_cluster import SlurmCluster
from .test_messages import CORPUS

MiB, GiB = 2**20, 2**30

def corpus(section: str, name: str) -> str:
    entry = CORPUS[section][name]
    return "\n".join(entry["lines"]) if "lines" in entry else entry["text"]

ROOT = Identity(0)  # the tests' own files: read with root's authority


# Real messages (tests/data/messages/corpus.toml says where each came from): the fragmentation OOM of an H100 run,
# and NCCL watchdog timeouts of an old and a recent release.
OOM_H100 = corpus("oom", "current_fragmentation_h100")
NCCL_OLD = CORPUS["nccl"]["old_one_rank"]["lines"][0]
NCCL_NEW = CORPUS["nccl"]["v24_four_ranks"]["lines"][0]


def test_cuda_errors_are_classed() -> None:
    assertion, _, error = CORPUS["cuda"]["device_assert"]["lines"]
    d = diagnose_cuda(error, assertion)
    assert not d.hardware and d.fields["condition"] == "t >= 0 && t < n_classes"
    assert d.fields["kernel"] == "nll_loss_forward_reduce_cuda_kernel_2d"
    for name in ("ecc", "ecc_terminate", "launch_failure", "launch_failure_thc", "launch_failure_thc_check",
                 "launch_failure_terminate"):
        assert diagnose_cuda(corpus("cuda", name)).hardware, name
    for name in ("illegal_address", "illegal_address_runtime"):
        d = diagnose_cuda(corpus("cuda", name))
        assert not d.hardware and d.fields["error"] == "illegal memory access", name


def lines(*text: str) -> bytes:
    return ("\n".join(text) + "\n").encode()


def names(data: bytes) -> list[str]:
    return [h.signature.name for h in Scanner(BUILTIN).scan(data)]


def test_scanner_finds_each_class_and_nothing_in_lookalikes() -> None:
    data = lines("step 10 loss=2.3012", OOM_H100, "INFO info: 3 nanoseconds", NCCL_NEW, "step 11 loss=nan",
                 "{'loss': inf, 'lr': 0.1}", "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536",
                 "Current loss scale already at minimum - cannot decrease scale anymore",
                 "RuntimeError: CUDA error: an illegal memory access was encountered")
    assert names(data) == ["cuda_oom", "nccl_timeout", "nan_loss", "nan_loss", "fp16_overflow", "loss_scale_min",
                           "cuda_error"]
    lookalikes = lines("MemoryError: out of memory", "the host is out of memory, killing worker",
                       "DataLoader worker (pid 4242) is killed by signal: Killed. out of memory?",
                       "docs: what to do when you run out of memory on the GPU", "loss=0.0nan_guard disabled",
                       "finance dataset", "INFO nan-checks enabled")
    assert names(lookalikes) == []


def test_reader_rotation_truncation_recreate_and_restart(tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    log.write_bytes(b"a\nb\npartial")
    tail = LogTail(str(log), ROOT)
    assert b"".join(c for c in tail.read()) == b"a\nb\n"  # the partial line waits for its newline
    with log.open("ab") as f:
        f.write(b" line\nc\n")
    saved = tail.position
    restarted = LogTail(str(log), ROOT, saved)  # as after an agent restart
    assert b"".join(c for c in restarted.read()) == b"partial line\nc\n"
    log.rename(tmp_path / "train.log.1")
    log.write_bytes(b"new\n")
    assert b"".join(c for c in restarted.read()) == b"new\n"
    log.write_bytes(b"x\n")  # truncated and rewritten (same inode, smaller)
    assert b"".join(c for c in restarted.read()) == b"x\n"
    log.unlink()
    assert list(restarted.read()) == []
    log.write_bytes(b"recreated\n")
    assert b"".join(c for c in restarted.read()) == b"recreated\n"
    fifo = tmp_path / "fifo.log"
    os.mkfifo(fifo)
    assert list(LogTail(str(fifo), ROOT).read()) == []  # not opened: no blocking, no side effects


def test_reader_cuts_a_200mb_line_and_tolerates_binary(tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    with log.open("wb") as f:
        f.write(b"before\n")
        for _ in range(200):
            f.write(b"x" * MiB)  # 200 MB, no newline yet
    tail = LogTail(str(log), ROOT)
    got = b"".join(c for c in tail.read())
    assert got.startswith(b"before\n") and len(got) <= len(b"before\n") + MiB + 1
    with log.open("ab") as f:
        f.write(b"yyy\n\xff\xfe\x00 junk CUDA out of memory. Tried to allocate 1.00 GiB \xc3\n")
    rest = b"".join(c for c in tail.read(limit=1 << 30))
    assert not rest.startswith(b"x") and b"yyy" not in rest  # the tail of the long line is skipped
    [hit] = Scanner(BUILTIN).scan(rest)
    assert hit.signature.name == "cuda_oom" and "\ufffd" in hit.line


@pytest.fixture
def trainer(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    marker = f"logjob-{uuid.uuid4().hex[:8]}"
    # the job sees GPUs 1,0,3,2 as its CUDA ordinals 0-3, as under SLURM's GPU binding
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", marker],
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": "1,0,3,2"})
    yield marker, tmp_path / "rank-logs"
    proc.kill()
    proc.wait()


def check(tmp_path: Path, marker: str, store: Store, nvml: FakeNvml | None = None) -> TrainingLogCheck:
    jobs = JobCatalog(JobsSettings(sources=["process"], refresh=0, processes={
        "trainer": ProcessJobSettings(cmdline=marker, user="root", logs=[str(tmp_path / "rank-logs" / "*.log")],
                                      switch_dir=str(tmp_path / "switch"))}), "node1")
    return TrainingLogCheck("logs", TrainingLogSettings(), CheckContext(
        "node1", tmp_path, jobs=jobs, state=ScopedState(store, "check/logs"),
        nvml=Nvml(nvml or FakeNvml(init_error=NVMLError))))


def test_check_reports_the_diagnosis_once_and_remembers_it(tmp_path: Path, trainer: tuple[str, Path]) -> None:
    marker, logs = trainer
    logs.mkdir()
    store = Store(tmp_path / "state")
    (logs / "rank0.log").write_bytes(lines("step 100 loss=1.2", NCCL_NEW))
    (logs / "rank3.log").write_bytes(lines("step 100 loss=1.2", OOM_H100))
    [result] = check(tmp_path, marker, store).run()
    assert result.status is Status.CRITICAL
    assert result.summary.startswith("process job trainer: CUDA out of memory (fragmentation) on GPU 0")
    assert "PYTORCH_ALLOC_CONF=expandable_segments:True" in result.summary
    assert "then ALLREDUCE #1580 timed out on rank 0" in result.summary
    assert [f["signature"] for f in result.details["findings"]] == ["nccl_timeout", "cuda_oom"]

    again = check(tmp_path, marker, store)  # a restarted agent: positions and findings kept, nothing re-read
    [same] = again.run()
    assert same.status is Status.CRITICAL and len(same.details["findings"]) == 2


def test_two_jobs_naming_one_log_each_read_all_of_it(tmp_path: Path, trainer: tuple[str, Path]) -> None:
    """A log template resolves from what users choose ({workdir}, {name}): a second job whose template lands on the
    first job's log reads it with its own position, and never consumes lines before the first job saw them."""
    marker, logs = trainer
    other = f"logjob-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", other])
    try:
        logs.mkdir()
        shared = str(logs / "*.log")
        store = Store(tmp_path / "state")

        def both() -> TrainingLogCheck:
            jobs = JobCatalog(JobsSettings(sources=["process"], refresh=0, processes={
                name: ProcessJobSettings(cmdline=m, user="root", logs=[shared]) for name, m in
                (("first", marker), ("second", other))}), "node1")
            return TrainingLogCheck("logs", TrainingLogSettings(), CheckContext(
                "node1", tmp_path, jobs=jobs, state=ScopedState(store, "check/logs"),
                nvml=Nvml(FakeNvml(init_error=NVMLError))))

        (logs / "train.log").write_bytes(lines("step 1 loss=1.2"))
        first = both()
        assert {r.subject: r.status for r in first.run()} == {"process:first": Status.OK, "process:second": Status.OK}
        with (logs / "train.log").open("ab") as f:
            f.write(lines("step 2 loss=1.1", OOM_H100))
        results = {r.subject: r for r in first.run()}
        assert {k: r.status for k, r in results.items()} == {"process:first": Status.CRITICAL,
                                                             "process:second": Status.CRITICAL}
        assert all(r.details["findings"][0]["signature"] == "cuda_oom" for r in results.values())
        saved = ScopedState(store, "check/logs").load_json("logscan.positions")
        assert set(saved) == {"process:first", "process:second"}  # one position per job and log

        with (logs / "train.log").open("ab") as f:  # a restarted agent reads on from each job's own position
            f.write(lines("step 3 loss=1.0", NCCL_NEW))
        results = {r.subject: r for r in both().run()}
        for r in results.values():
            assert sorted(f["signature"] for f in r.details["findings"]) == ["cuda_oom", "nccl_timeout"], r.subject
    finally:
        proc.kill()
        proc.wait()


def logs_check_of(tmp_path: Path, job: list[Job], store: Store | None = None) -> TrainingLogCheck:
    """The log check over one SLURM job (`job[0]`, which a test may replace between runs)."""
    made = TrainingLogCheck("logs", TrainingLogSettings(), CheckContext(
        "node1", tmp_path, jobs=JobCatalog(JobsSettings(sources=[], refresh=0), "node1"),
        state=ScopedState(store or Store(None), "check/logs"), nvml=Nvml(FakeNvml(init_error=NVMLError))))
    made.view = lambda: JobView((job[0],))  # type: ignore[method-assign]
    return made


@pytest.mark.parametrize(("written_in_this_life", "looked_late"), [(False, False), (True, False), (True, True)])
def test_a_node_meeting_a_requeued_job_skips_an_appended_log_its_earlier_lives_wrote(
        tmp_path: Path, written_in_this_life: bool, looked_late: bool) -> None:
    """The requeue placed the job's next life on a node that never ran it. Its StdOut is appended to
    (`--open-mode=append`): the earlier life's OOM, dealt with by that life's requeue, is not this life's. Looked at
    within EARLY_S of the life's start (the source's news wakes the check), the log is read from where it ended then,
    even if the life wrote a line before the look (that line is the cost); looked at later, a log this life wrote to
    is read from its start (the earlier lines cannot be told apart)."""
    log = tmp_path / "slurm-5.out"
    log.write_bytes(lines("step 10 loss=1.2", OOM_H100))
    earlier = time.time() - 60
    os.utime(log, (earlier, earlier))  # the first life ended a minute ago
    start = time.time() - (30 if looked_late else 1)
    if written_in_this_life:
        with log.open("ab") as f:
            f.write(lines("step 0 loss=2.3"))
    job = [Job(key="slurm:5", source="slurm", name="t", state="RUNNING", job_id="5", uid=0, on_this_node=True,
               restarts=1, start_time=start, log_paths=(str(log),))]
    logs = logs_check_of(tmp_path, job)
    [result] = logs.run()
    assert result.status is (Status.CRITICAL if looked_late else Status.OK), result.summary
    with log.open("ab") as f:  # what this life writes from now on is read in either case
        f.write(lines("step 1 loss=nan", "step 2 loss=nan", "step 3 loss=nan", "step 4 loss=nan", "step 5 loss=nan"))
    [result] = logs.run()
    assert "nan_loss" in [f["signature"] for f in result.details["findings"]], result.details
    assert ("cuda_oom" in [f["signature"] for f in result.details["findings"]]) is looked_late


@pytest.mark.parametrize("restarts", [0, 1])
def test_a_log_looked_at_before_the_job_wrote_is_read_from_there(tmp_path: Path, restarts: int) -> None:
    """The node hears of the job (its prolog, its first process) before its record says which life it is in: where
    its logs end is noted then. A log another job (or an earlier life) appended to is read from there once the
    record came, whatever the job wrote meanwhile: its own lines are read, the other's are not."""
    log = tmp_path / "train.log"  # `--output=train.log --open-mode=append`, as the job before it had
    log.write_bytes(lines("step 10 loss=1.2", OOM_H100))
    earlier = time.time() - 60
    os.utime(log, (earlier, earlier))
    job = [Job(key="slurm:5", source="slurm", name="t", state="RUNNING", job_id="5", uid=0, on_this_node=True,
               log_paths=(str(log),), extra={"incomplete": "asking slurmctld", "record_pending": True})]
    logs = logs_check_of(tmp_path, job)
    assert logs.run() == []  # not read: its life is on its way; but looked at
    with log.open("ab") as f:  # the job starts writing: three NaN losses in a row (nan_limit), the first in two writes
        f.write(b"step 0 loss=2.3\nstep 1 lo")
    with log.open("ab") as f:
        f.write(lines("ss=nan", "step 2 loss=nan", "step 3 loss=nan"))
    job[0] = replace(job[0], restarts=restarts, start_time=time.time() - 30, extra={})  # started before the look
    [result] = logs.run()
    signatures = [f["signature"] for f in result.details["findings"]]
    assert "cuda_oom" not in signatures, result.details
    assert result.status is Status.CRITICAL, result.summary  # three in a row (nan_limit): every line of its own read

    # A log recreated since the look (SLURM's default open mode truncates it) is this job's alone: read from its start
    fresh = tmp_path / "fresh.log"
    fresh.write_bytes(lines("step 10 loss=1.2", "the job before it"))
    os.utime(fresh, (earlier, earlier))
    job[0] = replace(job[0], key="slurm:6", job_id="6", restarts=None, start_time=None, log_paths=(str(fresh),),
                     extra={"incomplete": "asking slurmctld", "record_pending": True})
    assert logs.run() == []
    fresh.unlink()
    fresh.write_bytes(lines("step 0 loss=2.3", OOM_H100))
    job[0] = replace(job[0], restarts=restarts, start_time=time.time() - 30, extra={})
    [result] = logs.run()
    assert [f["signature"] for f in result.details["findings"]] == ["cuda_oom"], result.details


def test_a_later_lifes_own_log_made_after_the_start_is_read_whole(tmp_path: Path) -> None:
    """The early look reads on from where a later life's StdOut ended, even if the life wrote there first; a log of
    the check's own templates that the life made (`rank0.log`, after its start) is all the life's own."""
    out = tmp_path / "slurm-5.out"
    out.write_bytes(lines("step 10 loss=1.2"))
    own = tmp_path / "rank0.log"
    own.write_bytes(lines("step 0 loss=2.3", OOM_H100))
    job = [Job(key="slurm:5", source="slurm", name="t", state="RUNNING", job_id="5", uid=0, on_this_node=True,
               restarts=1, start_time=time.time() - 1, log_paths=(str(out),))]
    logs = TrainingLogCheck("logs", TrainingLogSettings(logs=[str(own)]), CheckContext(
        "node1", tmp_path, jobs=JobCatalog(JobsSettings(sources=[], refresh=0), "node1"),
        state=ScopedState(Store(None), "check/logs"), nvml=Nvml(FakeNvml(init_error=NVMLError))))
    logs.view = lambda: JobView((job[0],))  # type: ignore[method-assign]
    [result] = logs.run()
    assert [(f["signature"], f["path"]) for f in result.details["findings"]] == [("cuda_oom", str(own))], result.details


def test_a_log_that_fails_to_be_looked_at_blinds_no_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's `--output` on a file system that answers EIO: that job's log is read (or fails) on its own; the
    check goes on for the others."""
    bad, good = tmp_path / "bad.out", tmp_path / "good.out"
    bad.write_bytes(lines("step 0 loss=2.3"))
    good.write_bytes(lines("step 0 loss=2.3", OOM_H100))
    real = training_log.look

    def failing(identity: Identity, path: str) -> object:
        if path == str(bad):
            raise OSError(5, "Input/output error", path)
        return real(identity, path)

    monkeypatch.setattr(training_log, "look", failing)
    jobs = tuple(Job(key=f"slurm:{n}", source="slurm", name="t", state="RUNNING", job_id=str(n), uid=0,
                     on_this_node=True, restarts=0, start_time=time.time() - 1, log_paths=(str(path),))
                 for n, path in ((5, bad), (6, good)))
    logs = TrainingLogCheck("logs", TrainingLogSettings(), CheckContext(
        "node1", tmp_path, jobs=JobCatalog(JobsSettings(sources=[], refresh=0), "node1"),
        state=ScopedState(Store(None), "check/logs"), nvml=Nvml(FakeNvml(init_error=NVMLError))))
    logs.view = lambda: JobView(jobs)  # type: ignore[method-assign]
    results = {r.subject: r for r in logs.run()}
    assert results["slurm:5"].status is Status.OK and results["slurm:6"].status is Status.CRITICAL


def test_a_log_looked_at_late_and_not_written_since_the_start_is_read_from_its_end(tmp_path: Path) -> None:
    """A first life whose log another job appended to and that has written nothing yet: read from its end."""
    log = tmp_path / "train.log"
    log.write_bytes(lines("step 10 loss=1.2", OOM_H100))
    earlier = time.time() - 60
    os.utime(log, (earlier, earlier))
    job = [Job(key="slurm:5", source="slurm", name="t", state="RUNNING", job_id="5", uid=0, on_this_node=True,
               restarts=0, start_time=time.time() - 30, log_paths=(str(log),))]
    logs = logs_check_of(tmp_path, job)
    assert logs.run()[0].status is Status.OK
    with log.open("ab") as f:
        f.write(lines("step 0 loss=2.3", OOM_H100))
    assert [f["signature"] for f in logs.run()[0].details["findings"]] == ["cuda_oom"]


def test_a_tail_begins_where_it_was_looked_at_while_the_file_is_the_same(tmp_path: Path) -> None:
    log = tmp_path / "a.log"
    log.write_bytes(b"the job before\nthis job's fir")
    seen = look(ROOT, str(log))
    assert seen is not None and seen.size == log.stat().st_size and not seen.ends_line()
    assert look(ROOT, str(tmp_path / "missing.log")) is None
    with log.open("ab") as f:
        f.write(b"st line\nthis job's second line\n")
    # looked at mid-line in the reader's own write (`cut`): the rest of that line is not read, as after a line cut at
    # max_line; not the reader's own: what follows the look is a line
    assert b"".join(LogTail(str(log), ROOT, begin=seen, cut=True).read()) == b"this job's second line\n"
    assert b"".join(LogTail(str(log), ROOT, begin=seen).read()) == b"st line\nthis job's second line\n"
    # rewritten in place (same inode, longer than the look, other first bytes): this file is read from its start
    log.write_bytes(b"a new file, longer than the one looked at\n")
    assert b"".join(LogTail(str(log), ROOT, begin=seen).read()) == b"a new file, longer than the one looked at\n"
    # shorter than the look: read from its start as well
    log.write_bytes(b"short\n")
    assert b"".join(LogTail(str(log), ROOT, begin=seen).read()) == b"short\n"
    # truncated in place and written again with the same first bytes (the same banner), past where the look ended
    log.write_bytes(b"banner\nthe life before: CUDA error\n")
    seen = look(ROOT, str(log))
    assert seen is not None and seen.ends_line()
    log.write_bytes(b"banner\nthis life, its own lines\n")
    assert b"".join(LogTail(str(log), ROOT, begin=seen).read()) == b"banner\nthis life, its own lines\n"
    # looked at where a line ended: what follows is read whole, whether or not `cut`
    log.write_bytes(b"banner\nthe life before: CUDA error\n")
    seen = look(ROOT, str(log))
    with log.open("ab") as f:
        f.write(b"this life\n")
    assert seen is not None and b"".join(LogTail(str(log), ROOT, begin=seen, cut=True).read()) == b"this life\n"


def test_positions_saved_per_path_by_an_earlier_version_are_read_on(tmp_path: Path,
                                                                   trainer: tuple[str, Path]) -> None:
    marker, logs = trainer
    logs.mkdir()
    log = logs / "rank0.log"
    log.write_bytes(lines("step 1 loss=1.2", OOM_H100))
    tail = LogTail(str(log), ROOT)
    assert b"".join(tail.read()).count(b"\n") == 2 and tail.position is not None
    store = Store(tmp_path / "state")
    state = ScopedState(store, "check/logs")
    state.save_json("logscan.positions", {str(log): tail.position.to_list()})  # the earlier layout
    with log.open("ab") as f:
        f.write(lines("step 2 loss=1.1"))
    [result] = check(tmp_path, marker, store).run()
    assert result.status is Status.OK  # the OOM before the saved position is not read again
    assert state.load_json("logscan.positions") == {
        "process:trainer": {str(log): [tail.position.dev, tail.position.ino, log.stat().st_size, 0,
                                       tail.position.head]},
        str(log): tail.position.to_list()}  # kept while a job here names the log: another may not have read it yet


def test_an_earlier_versions_position_waits_for_a_job_that_did_not_read_in_the_first_round(tmp_path: Path) -> None:
    """After the upgrade the job's record is on its way (or its source failed): its logs are not read in the first
    round, and the earlier version's position must still be there in the next, or the log is read from its start
    and what was dealt with before the upgrade fires again."""
    log = tmp_path / "slurm-5.out"
    log.write_bytes(lines("step 1 loss=1.2", OOM_H100))
    tail = LogTail(str(log), ROOT)
    assert b"".join(tail.read()) and tail.position is not None
    store = Store(tmp_path / "state")
    ScopedState(store, "check/logs").save_json("logscan.positions", {str(log): tail.position.to_list()})
    job = Job(key="slurm:5", source="slurm", name="t", state="RUNNING", job_id="5", uid=0, on_this_node=True,
              log_paths=(str(log),), extra={"incomplete": "asking slurmctld", "record_pending": True})

    def logs_check() -> TrainingLogCheck:  # each round as after a restart of the agent: state from the store
        made = TrainingLogCheck("logs", TrainingLogSettings(), CheckContext(
            "node1", tmp_path, jobs=JobCatalog(JobsSettings(sources=[], refresh=0), "node1"),
            state=ScopedState(store, "check/logs"), nvml=Nvml(FakeNvml(init_error=NVMLError))))
        made.view = lambda: JobView((job,))  # type: ignore[method-assign]
        return made

    assert logs_check().run() == []  # not read: its life is on its way
    job = replace(job, restarts=0, start_time=time.time() - 3600, extra={})
    [result] = logs_check().run()
    assert result.status is Status.OK, result.summary  # read on from the earlier version's position


@pytest.mark.parametrize("restarts", [0, 1])
def test_a_job_new_to_the_node_waits_for_its_record_before_its_first_read(tmp_path: Path, restarts: int) -> None:
    """Its record says which life it is in: a later one's appended log is read from the end of the earlier lives'
    lines, the first life's from its start."""
    log = tmp_path / "slurm-5.out"
    log.write_bytes(lines("step 10 loss=1.2", OOM_H100))
    if restarts:  # the earlier life's lines, a minute old; the first life's were written as it started
        earlier = time.time() - 60
        os.utime(log, (earlier, earlier))
    job = [Job(key="slurm:5", source="slurm", name="t", state="RUNNING", job_id="5", uid=0, on_this_node=True,
               log_paths=(str(log),), extra={"incomplete": "asking slurmctld", "record_pending": True})]
    logs = logs_check_of(tmp_path, job)
    assert logs.run() == []
    job[0] = replace(job[0], restarts=restarts, start_time=time.time() - 1, extra={})
    [result] = logs.run()
    assert result.status is (Status.CRITICAL if restarts == 0 else Status.OK), result.summary


def test_a_crash_on_one_rank_leads_over_the_others_timeouts(tmp_path: Path, trainer: tuple[str, Path]) -> None:
    marker, logs = trainer
    logs.mkdir()
    (logs / "all.log").write_bytes(lines(
        "[rank1]: step 7 loss=1.0", "[rank2]: Traceback (most recent call last):", '[rank2]:   File "train.py", line 8',
        "[rank2]: RuntimeError: CUDA error: an illegal memory access was encountered",
        NCCL_OLD))
    [result] = check(tmp_path, marker, Store(None)).run()
    assert result.status is Status.CRITICAL
    findings = {f["signature"]: f for f in result.details["findings"]}
    assert findings["traceback"]["title"] == ("the job crashed: RuntimeError: CUDA error: an illegal memory access "
                                              "was encountered")
    assert findings["traceback"]["rank"] == "2" and findings["nccl_timeout"]["fields"]["rank"] == 0
    assert result.summary.startswith("process job trainer (rank 2): CUDA error: illegal memory access")
    assert "then ALLREDUCE #96120 timed out on rank 0" in result.summary


def test_nan_losses_count_in_a_row_across_reads(tmp_path: Path, trainer: tuple[str, Path]) -> None:
    marker, logs = trainer
    logs.mkdir()
    log = logs / "rank0.log"
    log.write_bytes(lines("step 1 loss=nan", "step 2 loss=2.31", "step 3 loss=nan", "step 4 loss=nan"))
    watch = check(tmp_path, marker, Store(None))
    [result] = watch.run()
    assert result.status is Status.WARNING and "NaN/Inf loss, 2 in a row (3 in all)" in result.summary
    with log.open("ab") as f:
        f.write(lines("step 5 loss=2.2"))  # a finite loss read on its own ends the streak
    watch.run()
    with log.open("ab") as f:
        f.write(lines("step 6 loss=nan", "{'loss': nan, 'step': 7}"))
    [result] = watch.run()
    assert result.status is Status.WARNING and "2 in a row (5 in all)" in result.summary
    with log.open("ab") as f:
        f.write(lines("step 8 loss: NaN"))
    [result] = watch.run()
    assert result.status is Status.CRITICAL and "3 in a row (6 in all)" in result.summary


def _relaunch_line(tmp_path: Path) -> str:
    """The line the trainer helper's relaunch loop prints when a restart request makes it start the command again:
    the real loop, run once with a command that asks for one restart in its first launch."""
    sw = tmp_path / "loop-sw"
    sw.mkdir()
    ask_once = ("import json, os, sys; p = os.path.join(sys.argv[1], 'restart.77')\n"
                "if not os.path.exists(p + '.asked'):\n"
                "    open(p + '.asked', 'w').close(); open(p, 'w').write(json.dumps({'reason': 'NaN loss in 3 steps'}))")
    proc = subprocess.run([sys.executable, "-m", "trainguard.trainer", "relaunch", "--switch-dir", str(sw), "--",
                           sys.executable, "-c", ask_once, str(sw)], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parent.parent, env={**os.environ, "SLURM_JOB_ID": "77"})
    [line] = [line for line in proc.stderr.splitlines() if line.startswith("trainguard relaunch:")]
    assert proc.returncode == 0 and line.endswith("starting it again"), proc.stderr
    return line


def test_a_restart_in_place_by_the_relaunch_loop_drops_the_earlier_starts_findings(tmp_path: Path,
                                                                                   trainer: tuple[str, Path]) -> None:
    """Every node of the job reads its log, and only the one whose agent ran the restart forgets what it learned:
    the loop's line says on every node that what came before is the earlier start's. A NaN after it counts anew."""
    marker, logs = trainer
    logs.mkdir()
    relaunch = _relaunch_line(tmp_path)
    log = logs / "rank0.log"
    log.write_bytes(lines("step 1 loss=nan", "step 2 loss=nan", "step 3 loss=nan"))
    watch = check(tmp_path, marker, Store(None))
    [result] = watch.run()
    assert result.status is Status.CRITICAL and "3 in a row" in result.summary
    with log.open("ab") as f:  # what a rank prints about the cancel, then the loop, then the new start
        f.write(lines("[rank1]: RuntimeError: NCCL communicator was aborted", relaunch, "step 2 loss=1.9"))
    [result] = watch.run()
    assert result.status is Status.OK, result.summary
    with log.open("ab") as f:  # in one read: the new start's NaNs, the loop again, one NaN of the start after it
        f.write(lines("step 3 loss=nan", "step 4 loss=nan", "step 5 loss=nan", relaunch, "step 3 loss=nan"))
    [result] = watch.run()
    assert result.status is Status.WARNING and "1 in a row (1 in all)" in result.summary, result.summary


def test_with_several_logs_what_the_others_said_in_the_restarts_round_is_the_earlier_starts(
        tmp_path: Path, trainer: tuple[str, Path]) -> None:
    """Per-rank logs beside the batch log that holds the loop's line: no order across files, so the other files'
    lines read in the round of the restart are taken as the earlier start's (the cancelled ranks' errors); later
    rounds count as before."""
    marker, logs = trainer
    logs.mkdir()
    relaunch = _relaunch_line(tmp_path)
    (logs / "batch.log").write_bytes(lines("step 1 loss=nan", "step 2 loss=nan", "step 3 loss=nan"))
    watch = check(tmp_path, marker, Store(None))
    [result] = watch.run()
    assert result.status is Status.CRITICAL
    with (logs / "batch.log").open("ab") as f:
        f.write(lines(relaunch, "step 3 loss=1.9"))
    (logs / "rank1.log").write_bytes(lines("[rank1]: RuntimeError: NCCL communicator was aborted on rank 1.", NCCL_NEW))
    [result] = watch.run()
    assert result.status is Status.OK, result.summary
    with (logs / "rank1.log").open("ab") as f:
        f.write(lines("[rank1]: RuntimeError: CUDA error: an illegal memory access was encountered"))
    [result] = watch.run()
    assert result.status is Status.CRITICAL and "illegal memory access" in result.summary, result.summary


def test_only_the_loops_own_line_is_a_restart(tmp_path: Path, trainer: tuple[str, Path]) -> None:
    """Quoted by a rank (not at the line's start), or the loop saying it will not start again: no restart."""
    marker, logs = trainer
    logs.mkdir()
    relaunch = _relaunch_line(tmp_path)
    (logs / "rank0.log").write_bytes(lines(
        "step 1 loss=nan", "step 2 loss=nan", "step 3 loss=nan", f"[rank0]: {relaunch}", f"x{relaunch}",
        "trainguard relaunch: restart asked after 10 restarts (--max-restarts 10): not starting python again"))
    [result] = check(tmp_path, marker, Store(None)).run()
    assert result.status is Status.CRITICAL and "3 in a row" in result.summary, result.summary


def test_nan_loss_from_the_heartbeat(tmp_path: Path, trainer: tuple[str, Path]) -> None:
    from trainguard.trainer import Trainer

    marker, logs = trainer
    logs.mkdir()
    beat = Trainer(switch_dir=tmp_path / "switch")
    watch = check(tmp_path, marker, Store(None))
    beat.heartbeat(10, loss=1.5)
    assert watch.run()[0].status is Status.OK
    for step in (11, 12):
        beat.heartbeat(step, loss=float("nan"))
        [result] = watch.run()
        watch.run()  # the same step again is not one more
    assert result.status is Status.WARNING and "2 in a row" in result.summary
    beat.heartbeat(13, loss=float("inf"))
    [result] = watch.run()
    assert result.status is Status.CRITICAL and "3 in a row" in result.summary


@pytest.mark.parametrize(("before", "expected"), [
    ("step 3 loss=9.1", "at step 3: static sizing (first steps)"),
    (" iteration      500/  500000 | loss 2.1", "mid-run at step 500: a growing working set"),
])
def test_oom_step_comes_from_the_step_lines(tmp_path: Path, trainer: tuple[str, Path], before: str,
                                            expected: str) -> None:
    marker, logs = trainer
    logs.mkdir()
    log = logs / "rank3.log"
    log.write_bytes(lines(before, "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536"))
    watch = check(tmp_path, marker, Store(None))
    watch.run()
    with log.open("ab") as f:  # the OOM comes in a later read than the step line
        f.write(lines(OOM_H100))
    [result] = watch.run()
    assert expected in result.summary


def test_oom_names_the_other_processes_and_faults_of_that_gpu(tmp_path: Path, trainer: tuple[str, Path]) -> None:
    marker, logs = trainer
    logs.mkdir()
    [job_pid] = [p.pid for p in psutil.process_iter(["cmdline"]) if marker in (p.info["cmdline"] or [])]
    gpus = [FakeGpu(f"GPU-{i}0000000-0000-0000-0000-000000000000", processes=[(job_pid, 70 * GiB)]) for i in range(4)]
    gpus[1].processes.append((os.getpid(), 6 * GiB))  # ordinal 0 is GPU 1 for this job (CUDA_VISIBLE_DEVICES)
    gpus[1].remap = (0, 1, 1, 0)
    (logs / "rank0.log").write_bytes(lines(corpus("oom", "reserved_outside")))
    [result] = check(tmp_path, marker, Store(None), FakeNvml(gpus)).run()
    [finding] = result.details["findings"]
    assert finding["gpu"]["index"] == 1 and finding["gpu"]["faults"] == ["row remapping pending"]
    me = psutil.Process()
    assert finding["gpu"]["other_processes"] == [{"pid": os.getpid(), "bytes": 6 * GiB, "command": me.name(),
                                                  "user": me.username(), "job": None}]
    # the message leaves 10.6 GiB of the card to others; NVML names who holds it now
    assert finding["fields"]["diagnosis"] == "not this job's working set" and finding["fields"]["cause"] == "co-tenant"
    assert f"pid {os.getpid()} ({me.name()}, user {me.username()}) 6.0 GiB" in result.summary
    assert "GPU faults: row remapping pending" in result.summary and "(GPU 1 on this node)" in result.summary
    assert "do not cut the batch size" in result.summary


def test_an_oom_that_filled_the_card_itself_is_no_co_tenants_doing(tmp_path: Path, trainer: tuple[str, Path]) -> None:
    """NVML shows another process on the GPU now, but the message says this process held all but the free memory
    when it failed: the lever stays the job's own (fragmentation here)."""
    marker, logs = trainer
    logs.mkdir()
    [job_pid] = [p.pid for p in psutil.process_iter(["cmdline"]) if marker in (p.info["cmdline"] or [])]
    gpus = [FakeGpu(f"GPU-{i}0000000-0000-0000-0000-000000000000", processes=[(job_pid, 70 * GiB)]) for i in range(4)]
    gpus[1].processes.append((os.getpid(), 6 * GiB))
    (logs / "rank0.log").write_bytes(lines(OOM_H100))
    [result] = check(tmp_path, marker, Store(None), FakeNvml(gpus)).run()
    [finding] = result.details["findings"]
    assert finding["fields"]["diagnosis"] == "fragmentation" and finding["fields"]["others_bytes"] < 64 * MiB


def test_pick_gpu_maps_the_cuda_ordinal() -> None:
    gpus = [GpuState(i, f"GPU-{i}abc", "H100", f"0000:0{i}:00", processes=(GpuProcess(100 + i, GiB),)) for i in range(4)]
    assert pick_gpu(gpus, 1, {999}, ["3", "2"]).index == 2
    assert pick_gpu(gpus, 0, {999}, ["GPU-1a"]).index == 1  # UUID prefixes work too
    assert pick_gpu(gpus, 0, {103}, None).index == 3  # no mapping: the one GPU the job holds
    assert pick_gpu(gpus, 2, {999}, None).index == 2  # the job sees every GPU: ordinal = index
    assert pick_gpu(gpus, 5, {100, 101}, ["0", "1"]) is None  # can't be told


@pytest.mark.parametrize("traceback", [True, False])
def test_a_failed_slurm_job_gets_its_exit_code_and_final_exception(slurm: SlurmCluster, tmp_path: Path,
                                                                   traceback: bool) -> None:
    header = "echo 'Traceback (most recent call last):'; echo '  File \"train.py\", line 9, in <module>'; " \
        if traceback else ""
    jobs = JobCatalog(JobsSettings(sources=["slurm"], refresh=0), slurm.node)
    job_id = slurm.submit(f"echo 'step 1 loss=2.0'; {header}echo 'ValueError: bad shard 7'; sleep 2; exit 3",
                          name=f"tg-exit-{uuid.uuid4().hex[:6]}")
    # the agent sees the job run on its node, then end; what it ended with comes from the controller, once
    wait_until(lambda: jobs.view().by_key(f"slurm:{job_id}"), 20, what="the job found on this node")
    slurm.wait_state(job_id, ("FAILED",))
    wait_until(lambda: getattr(jobs.view().by_key(f"slurm:{job_id}"), "state", None) == "FAILED", 20,
               what="the job's final state")
    watch = TrainingLogCheck("logs", TrainingLogSettings(), CheckContext(
        slurm.node, tmp_path, jobs=jobs, nvml=Nvml(FakeNvml(init_error=NVMLError))))
    [result] = [r for r in watch.run() if r.subject == f"slurm:{job_id}"]
    assert result.status is Status.CRITICAL
    assert ": the job ended FAILED with exit code 3:0: ValueError: bad shard 7 — " in result.summary
    signatures = [f["signature"] for f in result.details["findings"]]
    assert signatures == (["traceback", "exit"] if traceback else ["exit"])
    [again] = [r for r in watch.run() if r.subject == f"slurm:{job_id}"]
    assert [f["signature"] for f in again.details["findings"]] == signatures  # told once


def test_a_collective_timeout_is_cross_checked_with_the_flight_recorder_dumps(
        tmp_path: Path, trainer: tuple[str, Path]) -> None:
    """Rank 0's Gloo timeout in its log; in the switch dir, the ranks' flight-recorder dumps (real pickles of a
    two-rank Gloo job, tests/data/flight_recorder): the story names rank 1, which never entered the all_reduce."""
    marker, logs = trainer
    logs.mkdir()
    dumps = tmp_path / "switch" / "flight-recorder"
    shutil.copytree(Path(__file__).parent / "data" / "flight_recorder" / "dumps", dumps)
    (logs / "rank0.log").write_bytes(lines("step 3 loss=2.0", corpus("gloo", "timeout")))
    [result] = check(tmp_path, marker, Store(None)).run()
    assert result.status is Status.CRITICAL
    assert result.summary.startswith("process job trainer: a Gloo collective timed out after 2s on rank 0; flight "
                                     "recorder: rank 1 never entered all_reduce #5 (its last: barrier #4); rank 0 "
                                     "waiting — a collective hang"), result.summary
    assert result.details["collectives"]["flight_recorder"]["missing"][0]["rank"] == 1
