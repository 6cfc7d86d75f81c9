"""Training logs read like an expert: a corpus of real-format messages, the incremental reader, and the check."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from trainguard.checks.base import CheckContext
from trainguard.checks.training_log import TrainingLogCheck, TrainingLogSettings
from trainguard.core.model import Status
from trainguard.core.state import ScopedState
from trainguard.gpu.nvml import GpuProcess, GpuState, Nvml
from trainguard.jobs.catalog import JobCatalog
from trainguard.jobs.settings import JobsSettings, ProcessJobSettings
from trainguard.logscan.context import pick_gpu
from trainguard.logscan.diagnose import FRAGMENTATION_ADVICE, TRUE_OOM_ADVICE, diagnose_cuda, diagnose_nccl, diagnose_oom
from trainguard.logscan.reader import LogTail
from trainguard.logscan.signatures import BUILTIN, Scanner
from trainguard.node.access import Identity
from trainguard.pipeline.store import Store

from .conftest import wait_until
from .helpers.fake_nvml import FakeGpu, FakeNvml, NVMLError
from .slurm_cluster import SlurmCluster

MiB, GiB = 2**20, 2**30

OOM_CACHED = ("RuntimeError: CUDA out of memory. Tried to allocate 12.50 MiB (GPU 0; 10.92 GiB total capacity; "
              "8.57 MiB already allocated; 9.28 GiB free; 4.68 MiB cached)")
OOM_RESERVED = ("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 1; 39.59 GiB total capacity; "
                "30.12 GiB already allocated; 1.02 GiB free; 36.20 GiB allowed; 36.54 GiB reserved in total by "
                "PyTorch) If reserved memory is >> allocated memory try setting max_split_size_mb to avoid "
                "fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF")
OOM_21 = ("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 496.00 MiB. GPU 0 has a total capacty "
          "of 14.75 GiB of which 235.06 MiB is free. Process 20398 has 14.52 GiB memory in use. Of the allocated "
          "memory 14.06 GiB is allocated by PyTorch, and 330.42 MiB is reserved by PyTorch but unallocated. If "
          "reserved but unallocated memory is large try setting max_split_size_mb to avoid fragmentation.  See "
          "documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF")
OOM_22_FRAG = ("[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB. GPU 3 has a total "
               "capacity of 79.15 GiB of which 1.06 GiB is free. Process 4121 has 2.00 GiB memory in use. Including "
               "non-PyTorch memory, this process has 76.07 GiB memory in use. Of the allocated memory 69.86 GiB is "
               "allocated by PyTorch, with 1.00 GiB allocated in private pools (e.g., CUDA Graphs), and 5.63 GiB is "
               "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
               "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")
NCCL_OLD = ("[E ProcessGroupNCCL.cpp:737] [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=469508, "
            "OpType=ALLREDUCE, Timeout(ms)=1800000) ran for 1802212 milliseconds before timing out.")
NCCL_NEW = ("[rank0]:[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective operation "
            "timeout: WorkNCCL(SeqNum=1580, OpType=ALLREDUCE, NumelIn=466119168, NumelOut=466119168, "
            "Timeout(ms)=600000) ran for 600060 milliseconds before timing out.")

ROOT = Identity(0)  # the tests' own files: read with root's authority


@pytest.mark.parametrize(("text", "fields", "kind"), [
    (OOM_CACHED, {"gpu": 0, "tried": int(12.5 * MiB), "form": "cached", "reserved_unallocated": 0}, "true OOM"),
    (OOM_RESERVED, {"gpu": 1, "tried": 2 * GiB, "allowed": int(36.2 * GiB), "form": "reserved"}, "fragmentation"),
    (OOM_21, {"gpu": 0, "tried": 496 * MiB, "free": int(235.06 * MiB), "form": "2.1+",
              "reserved_unallocated": int(330.42 * MiB)}, "true OOM"),
    (OOM_22_FRAG, {"gpu": 3, "tried": int(1.5 * GiB), "this_process": int(76.07 * GiB),
                   "processes": [{"pid": 4121, "bytes": 2 * GiB}], "private_pools": GiB}, "fragmentation"),
    ("THCudaCheck FAIL file=/pytorch/aten/src/THC/THCCachingAllocator.cpp line=66 error=2 : out of memory",
     {"form": "THC"}, "OOM"),
])
def test_cuda_oom_forms(text: str, fields: dict[str, object], kind: str) -> None:
    d = diagnose_oom(text)
    for key, value in fields.items():
        assert d.fields.get(key) == value, (key, d.fields)
    assert d.fields["diagnosis"] == kind
    assert d.advice == (FRAGMENTATION_ADVICE if kind == "fragmentation" else TRUE_OOM_ADVICE)
    if kind == "fragmentation":
        assert "expandable_segments:True" in d.advice and "do not cut the batch size" in d.advice


def test_nccl_forms() -> None:
    old, new = diagnose_nccl(NCCL_OLD), diagnose_nccl(NCCL_NEW)
    assert old.fields == {"rank": 1, "seq": 469508, "op": "ALLREDUCE", "timeout_ms": 1800000, "ran_ms": 1802212}
    assert new.fields["rank"] == 0 and new.fields["seq"] == 1580
    assert new.title == "NCCL collective timeout on rank 0: ALLREDUCE #1580 ran 600s (timeout 600s)"


def test_cuda_errors_are_classed() -> None:
    assertion = ("/pytorch/aten/src/ATen/native/cuda/Loss.cu:257: nll_loss_forward_reduce_cuda_kernel_2d: block: "
                 "[0,0,0], thread: [4,0,0] Assertion `t >= 0 && t < n_classes` failed.")
    d = diagnose_cuda("RuntimeError: CUDA error: device-side assert triggered", assertion)
    assert not d.hardware and d.fields["condition"] == "t >= 0 && t < n_classes"
    assert d.fields["kernel"] == "nll_loss_forward_reduce_cuda_kernel_2d"
    assert diagnose_cuda("RuntimeError: CUDA error: uncorrectable ECC error encountered").hardware
    assert not diagnose_cuda("RuntimeError: CUDA error: an illegal memory access was encountered").hardware


def lines(*text: str) -> bytes:
    return ("\n".join(text) + "\n").encode()


def names(data: bytes) -> list[str]:
    return [h.signature.name for h in Scanner(BUILTIN).scan(data)]


def test_scanner_finds_each_class_and_nothing_in_lookalikes() -> None:
    data = lines("step 10 loss=2.3012", OOM_22_FRAG, "INFO info: 3 nanoseconds", NCCL_NEW, "step 11 loss=nan",
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
    (logs / "rank3.log").write_bytes(lines("step 100 loss=1.2", OOM_22_FRAG))
    [result] = check(tmp_path, marker, store).run()
    assert result.status is Status.CRITICAL
    assert result.summary.startswith("process job trainer (rank 3): CUDA out of memory (fragmentation) on GPU 3")
    assert "PYTORCH_ALLOC_CONF=expandable_segments:True" in result.summary
    assert "then NCCL collectives timed out on rank 0" in result.summary
    assert [f["signature"] for f in result.details["findings"]] == ["nccl_timeout", "cuda_oom"]

    again = check(tmp_path, marker, store)  # a restarted agent: positions and findings kept, nothing re-read
    [same] = again.run()
    assert same.status is Status.CRITICAL and len(same.details["findings"]) == 2


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
    assert findings["traceback"]["rank"] == "2" and findings["nccl_timeout"]["fields"]["rank"] == 1
    assert result.summary.startswith("process job trainer (rank 2): CUDA error: illegal memory access")
    assert "then NCCL collectives timed out on rank 1" in result.summary


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
        f.write(lines(OOM_22_FRAG))
    [result] = watch.run()
    assert expected in result.summary


def test_oom_names_the_other_processes_and_faults_of_that_gpu(tmp_path: Path, trainer: tuple[str, Path]) -> None:
    marker, logs = trainer
    logs.mkdir()
    [job_pid] = [p.pid for p in psutil.process_iter(["cmdline"]) if marker in (p.info["cmdline"] or [])]
    gpus = [FakeGpu(f"GPU-{i}0000000-0000-0000-0000-000000000000", processes=[(job_pid, 70 * GiB)]) for i in range(4)]
    gpus[2].processes.append((os.getpid(), 6 * GiB))  # ordinal 3 is GPU 2 for this job (CUDA_VISIBLE_DEVICES)
    gpus[2].remap = (0, 1, 1, 0)
    (logs / "rank3.log").write_bytes(lines(OOM_22_FRAG))
    [result] = check(tmp_path, marker, Store(None), FakeNvml(gpus)).run()
    [finding] = result.details["findings"]
    assert finding["gpu"]["index"] == 2 and finding["gpu"]["faults"] == ["row remapping pending"]
    assert finding["gpu"]["other_processes"] == [{"pid": os.getpid(), "bytes": 6 * GiB,
                                                  "command": psutil.Process().name()}]
    assert f"GPU 2 also held by pid {os.getpid()} ({psutil.Process().name()}) 6.0 GiB" in result.summary
    assert "GPU 2 faults: row remapping pending" in result.summary


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
