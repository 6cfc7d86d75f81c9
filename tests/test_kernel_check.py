"""The kernel check: grading per subject, clearing, rates and storms, the first-start policy, the one shared reader,
and records read from the real /dev/kmsg."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tomllib

from tests.conftest import REPO, require, wait_until
from tests.helpers.fake_nvml import FakeGpu, FakeNvml
from tests.test_ledger import SCONTROL, SINFO
from trainguard.actions.slurmctl import DRAIN_TAG, drain_reason
from trainguard.agent.configfile import parse_config
from trainguard.checks.base import CheckContext
from trainguard.checks.kernel import KernelCheck, KernelSettings
from trainguard.checks.xid import XidCheck, XidSettings
from trainguard.core.model import Status
from trainguard.core.state import ScopedState
from trainguard.gpu.faults import XidLedger
from trainguard.gpu.nvml import Nvml
from trainguard.jobs.catalog import JobCatalog
from trainguard.jobs.settings import JobsSettings, ProcessJobSettings
from trainguard.node.kmsg import KernelLog, KernelRecord, LogPoint, strip_prefix
from trainguard.pipeline.engine import Engine
from trainguard.pipeline.store import Store

FIXTURES = tomllib.loads((REPO / "tests" / "data" / "kernel" / "fixtures.toml").read_text())["fixture"]
IB_TREE = REPO / "tests" / "data" / "infiniband" / "sys-class-infiniband-h100"  # a real tree, read-only


def real(klass: str, needle: str) -> list[str]:
    """The lines of the real kernel report (tests/data/kernel/fixtures.toml) of this class holding `needle`."""
    return next(f["text"] for f in FIXTURES if f["class"] == klass and needle in f["text"]).splitlines()


def make(tmp_path: Path, nvml: Nvml | None = None, jobs: JobCatalog | None = None, **settings: Any) -> KernelCheck:
    tmp_path.mkdir(parents=True, exist_ok=True)
    store = Store(tmp_path / "state")
    context = CheckContext("node", tmp_path, jobs=jobs, nvml=nvml or Nvml(FakeNvml([])), xid_history=XidLedger(store),
                           kernel_log=KernelLog(), state=ScopedState(store, "check/kernel"))
    empty = tmp_path / "kmsg-copy"  # a saved kernel log with nothing in it: the one-shot read finds no record
    empty.write_text("")
    return KernelCheck("kernel", KernelSettings(**{"kmsg_path": str(empty), **settings}), context)


def feed(check: KernelCheck, lines: list[str], seq: int = 0, usec: int | None = None) -> None:
    now_usec = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6) if usec is None else usec
    for i, line in enumerate(lines):
        check._on_record(KernelRecord(seq + i, 4, 0, now_usec, line))


def by_subject(check: KernelCheck) -> dict[str, Any]:
    return {r.subject: r for r in check.run() if r.subject != "kernel-log"}


def test_a_fatal_aer_is_a_node_fault_on_its_device(tmp_path: Path) -> None:
    check = make(tmp_path)
    feed(check, ["pcieport 0000:00:02.0: AER: Uncorrected (Fatal) error received: 0000:3b:00.0",
                 "pcieport 0000:00:02.0: PCIe Bus Error: severity=Uncorrected (Fatal), type=Transaction Layer, "
                 "(Receiver ID)"])
    result = by_subject(check)["pci:0000:3b:00.0"]
    assert result.status is Status.CRITICAL
    assert result.details["events"][0]["node_fault"] and "node fault: PCIe AER uncorrected fatal" in result.summary
    assert KernelSettings().actions.critical == ["signal", "drain", "requeue"]


def test_corrected_errors_are_counted_then_a_trend_then_a_storm(tmp_path: Path) -> None:
    check = make(tmp_path)
    line = "pcieport 0000:00:1c.5: AER: Corrected error received: 0000:00:1c.5"
    feed(check, [line])
    assert by_subject(check)["pci:0000:00:1c.5"].status is Status.OK  # one line: a counter
    feed(check, [line] * 20, seq=10)
    trend = by_subject(check)["pci:0000:00:1c.5"]
    assert trend.status is Status.WARNING and "trend: 21" in trend.summary
    feed(check, [line] * 1000, seq=100)
    assert "storm" in by_subject(check)["pci:0000:00:1c.5"].summary


def test_a_flood_of_corrected_errors_is_one_result_per_device(tmp_path: Path) -> None:
    check = make(tmp_path)
    devices = ["0000:17:00.0", "0000:3b:00.0", "0000:86:00.0"]
    lines = [f"pcieport {d}: AER: Corrected error received: {d}" for d in devices]
    feed(check, [lines[i % 3] for i in range(100_000)])
    results = by_subject(check)
    assert sorted(results) == [f"pci:{d}" for d in devices]
    assert all(r.status is Status.WARNING and r.details["events"][0]["count"] == 33334 - (i > 0)
               for i, r in enumerate(results.values()))


def test_nfs_not_responding_clears_when_the_server_is_ok(tmp_path: Path) -> None:
    check = make(tmp_path)
    feed(check, ["nfs: server 100.73.159.36 not responding, still trying"])
    assert by_subject(check)["nfs:100.73.159.36"].status is Status.WARNING
    feed(check, ["nfs: server 100.73.159.36 OK"], seq=5)
    assert by_subject(check)["nfs:100.73.159.36"].status is Status.OK
    quiet = make(tmp_path / "other")
    feed(quiet, ["nfs: server 100.73.159.36 OK"])  # the OK alone is no event
    assert by_subject(quiet) == {}


def test_a_window_counts_from_when_the_kernel_logged_it(tmp_path: Path) -> None:
    check = make(tmp_path)
    now = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)
    feed(check, ["INFO: task loader:4242 blocked for more than 120 seconds."], usec=max(now - 7200 * 10**6, 0))
    feed(check, ["INFO: task python:4343 blocked for more than 120 seconds."], seq=9)
    results = by_subject(check)
    assert results["task:python"].status is Status.WARNING
    if now > 7200 * 10**6:  # the node has been up long enough for a record two hours old
        assert results["task:loader"].status is Status.OK


def test_a_crash_of_many_ranks_is_one_subject_not_one_per_process(tmp_path: Path) -> None:
    """A 512-rank job whose ranks all segfault (or are all OOM-killed, or all hang) is one incident per command
    name with its count, not one alert per pid: one user's crash must not page the on-call 512 times."""
    check = make(tmp_path)
    feed(check, [f"python[{4000 + i}]: segfault at 0 ip 00007f3a1c2b3c4d sp 00007ffd5e6f7a80 error 4 in "
                 f"libnccl.so.2[7f3a1c000000+1000000]" for i in range(512)])
    results = by_subject(check)
    assert list(results) == ["process:python"]
    [event] = results["process:python"].details["events"]
    assert event["count"] == 512 and results["process:python"].status is Status.WARNING


def test_first_start_policy_reports_old_node_faults_without_acting(tmp_path: Path) -> None:
    check = make(tmp_path)
    check.ledger.mark_first_start(lambda: LogPoint(100, 0))
    feed(check, ["NVRM: GPU 0000:0a:00.0: RmInitAdapter failed! (0x24:0x72:1568)"], seq=50)
    feed(check, ["NVRM: GPU 0000:0b:00.0: RmInitAdapter failed! (0x24:0x72:1568)"], seq=150)
    results = by_subject(check)
    old, new = results["pci:0000:0a:00.0"], results["pci:0000:0b:00.0"]
    assert old.status is Status.WARNING and "before trainguard started" in old.summary
    assert new.status is Status.CRITICAL


def test_a_read_only_remount_is_critical_only_on_a_critical_mount(tmp_path: Path) -> None:
    check = make(tmp_path)
    feed(check, ["EXT4-fs (tgnosuchdev9): Remounting filesystem read-only"])
    assert by_subject(check)["fs:tgnosuchdev9"].status is Status.WARNING  # not mounted here: no node fault
    root = next(line.split()[-2] for line in Path("/proc/self/mountinfo").read_text().splitlines()
                if line.split()[4] == "/")
    dev = Path(root).name
    feed(check, [f"EXT4-fs ({dev}): Remounting filesystem read-only"], seq=2)
    if root.startswith("/dev/"):
        assert by_subject(check)[f"fs:{dev}"].status is Status.CRITICAL


def test_events_survive_a_restart_on_the_same_boot(tmp_path: Path) -> None:
    check = make(tmp_path)
    feed(check, ["XFS (dm-4): I/O Error Detected. Shutting down filesystem"])
    check.run()
    again = make(tmp_path)
    assert "fs:dm-4" in by_subject(again)


def test_the_xid_and_kernel_checks_share_one_reader(tmp_path: Path) -> None:
    store = Store(tmp_path / "state")
    context = CheckContext("node", tmp_path, xid_history=XidLedger(store), kernel_log=KernelLog())
    fifo = tmp_path / "kmsg"
    fifo.write_text("")
    xid = XidCheck("xid", XidSettings(kmsg_path=str(fifo)), context)
    kernel = KernelCheck("kernel", KernelSettings(kmsg_path=str(fifo)), context)
    assert xid.follower is kernel.follower
    assert kernel._xid_reads()  # the fallen-off-the-bus lines are the xid check's to act on


def test_records_from_the_real_kmsg_reach_the_result(kmsg: Any, tmp_path: Path) -> None:
    server = f"tgtest-{random.randint(0, 1 << 30):x}"
    store = Store(tmp_path / "state")
    context = CheckContext("node", tmp_path, xid_history=XidLedger(store), kernel_log=KernelLog())
    check = KernelCheck("kernel", KernelSettings(), context)
    check.start(lambda: None)
    try:
        wait_until(check.follower.caught_up.is_set, 10, what="replay")
        kmsg.write(f"nfs: server {server} not responding, still trying")
        wait_until(lambda: f"nfs:{server}" in by_subject(check), 10, what="the event")
        assert by_subject(check)[f"nfs:{server}"].status is Status.WARNING
        kmsg.write(f"nfs: server {server} OK")  # and leave nothing active for later tests on this boot
        wait_until(lambda: by_subject(check)[f"nfs:{server}"].status is Status.OK, 10, what="the clear")
        assert check.follower.source == "kmsg"
    finally:
        check.stop()


def test_an_oom_kill_names_the_slurm_job_and_task_from_its_memory_cgroup(tmp_path: Path) -> None:
    check = make(tmp_path)
    feed(check, ["python invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0, oom_score_adj=0",
                 "oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0-1,oom_memcg=/slurm/"
                 "uid_1000/job_4242,task_memcg=/slurm/uid_1000/job_4242/step_0/task_3,task=python,pid=31337,uid=1000",
                 "Memory cgroup out of memory: Killed process 31337 (python) total-vm:60000000kB, "
                 "anon-rss:56623104kB, file-rss:0kB, shmem-rss:0kB, UID:1000 pgtables:1372kB oom_score_adj:0"])
    result = by_subject(check)["process:python"]
    assert result.status is Status.WARNING
    assert "job 4242 task 3 (python, pid 31337) killed: OOM kill" in result.summary
    assert result.details["events"][0]["names"]["memcg"].endswith("task_3")


def test_a_real_oom_kill_read_through_the_real_reader_names_the_job(kmsg: Any, tmp_path: Path,
                                                                     memory_cgroup: Any) -> None:
    tag = f"tgoom{random.randint(0, 1 << 30):x}"
    cgroup = memory_cgroup(48 << 20)
    gate = tmp_path / "go"
    victim = subprocess.Popen(cgroup([sys.executable, "-c", f"# {tag}\nimport os, time\n"
                                      f"while not os.path.exists({str(gate)!r}): time.sleep(0.02)\n"
                                      "b = [bytearray(1 << 20) for _ in range(512)]\ntime.sleep(30)"]))
    try:
        jobs = JobCatalog(JobsSettings(sources=["process"], refresh=0, processes={
            "trainer": ProcessJobSettings(cmdline=tag, user="root")}), "node1")
        wait_until(lambda: any(p.pid == victim.pid for j in jobs.view().jobs for p in j.processes), 10,
                   what="the job listing the victim")
        store = Store(tmp_path / "state")
        context = CheckContext("node1", tmp_path, xid_history=XidLedger(store), kernel_log=KernelLog(), jobs=jobs)
        check = KernelCheck("kernel", KernelSettings(), context)
        check.start(lambda: None)
        try:
            wait_until(check.follower.caught_up.is_set, 10, what="replay")
            gate.write_text("")  # the victim allocates past its memory cgroup's limit: the kernel kills it
            assert victim.wait(timeout=30) == -9
            subject = f"process:{Path(sys.executable).name}"
            wait_until(lambda: subject in by_subject(check), 10, what="the OOM kill's result")
            result = by_subject(check)[subject]
            assert result.status is Status.WARNING
            assert "job trainer (python" in result.summary.replace(Path(sys.executable).name, "python")
            names = result.details["events"][0]["names"]
            assert names["job"] == "process:trainer" and names["pid"] == str(victim.pid)
            assert names.get("constraint", "CONSTRAINT_MEMCG") == "CONSTRAINT_MEMCG"
        finally:
            check.stop()
    finally:
        victim.kill()
        victim.wait()


def test_a_node_fault_runs_the_bound_actions_with_the_drain_reason_naming_it(tmp_path: Path) -> None:
    """The engine end to end through a FIFO standing in for /dev/kmsg: the fault's record, the kernel check's
    CRITICAL, the incident, the bound action, and the summary a drain would give as its reason."""
    fifo = tmp_path / "kmsg"
    os.mkfifo(fifo)
    recorder = tmp_path / "actions"
    raw = {"agent": {"state_dir": str(tmp_path / "state"), "node_name": "node1", "listen": ""},
           "checks": {"kernel": {"kmsg_path": str(fifo), "actions": {"critical": ["record"]}}},
           "notifiers": {},
           "actions": {"record": {"type": "exec", "command": [
               "sh", "-c", f'echo "$TRAINGUARD_SUBJECT|$TRAINGUARD_SUMMARY" >> {recorder}']}}}
    engine = Engine(parse_config(raw, "test.toml"))
    writer = os.open(fifo, os.O_RDWR)  # held open: the follower never sees the writer go
    engine.start()
    try:
        usec = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)
        os.write(writer, f"3,1,{usec},-;nvme nvme7: Device not ready; aborting reset\n".encode())
        wait_until(lambda: recorder.exists() and recorder.read_text(), 20, what="the bound action")
        subject, summary = recorder.read_text().splitlines()[0].split("|", 1)
        assert subject == "nvme:nvme7"
        assert drain_reason(summary).startswith(f"{DRAIN_TAG} kernel: nvme_reset_failed nvme:nvme7: node fault: "
                                                "NVMe controller lost")
    finally:
        engine.stop()
        os.close(writer)


def test_an_operator_clear_forgets_the_subject(tmp_path: Path) -> None:
    check = make(tmp_path)
    feed(check, ["[11483.115530] nvme nvme2: Device not ready; aborting reset"])
    assert by_subject(check)["nvme:nvme2"].status is Status.CRITICAL
    check.clear("nvme:nvme2", time.time())
    assert "nvme:nvme2" not in by_subject(check) and "nvme:nvme2" not in by_subject(make(tmp_path))
    feed(check, ["[11508.697971] nvme nvme2: Device not ready; aborting reset"], seq=3)
    assert by_subject(check)["nvme:nvme2"].status is Status.CRITICAL  # a new one fires as new


# devices, mounts and jobs ------------------------------------------------------------------------------------------
@pytest.fixture
def two_jobs() -> Iterator[tuple[JobCatalog, subprocess.Popen[bytes], subprocess.Popen[bytes]]]:
    """Two process jobs of this node, each a real process: `trainer` (on the GPU that fails) and `other`."""
    marks = [f"tg-kernel-{name}-{uuid.uuid4().hex[:8]}" for name in ("trainer", "other")]
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", m]) for m in marks]
    jobs = JobCatalog(JobsSettings(sources=["process"], refresh=0, processes={
        name: ProcessJobSettings(cmdline=m, user="root") for name, m in zip(("trainer", "other"), marks, strict=True)}),
        "node1")
    try:
        wait_until(lambda: len(jobs.view().on_node()) == 2, 10, what="both jobs listed")
        yield jobs, procs[0], procs[1]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def gpus_on(bus: str, trainer: int, other: int) -> FakeNvml:
    """GPU 1 on `bus` used by `trainer`, GPU 0 by `other` (NVML's compute processes)."""
    return FakeNvml([FakeGpu("GPU-00000000-0000-4000-8000-000000000018", serial="1652823054967",
                             bus_id=b"00000000:18:00.0", processes=[(other, 1 << 30)]),
                     FakeGpu("GPU-00000001-0000-4000-8000-000000000003", serial="1652823054968",
                             bus_id=f"0000{bus.upper()}".encode(), processes=[(trainer, 1 << 30)])])


def test_an_aer_error_on_a_gpu_names_the_gpu_and_the_job_using_it(tmp_path: Path, two_jobs: Any) -> None:
    jobs, trainer, other = two_jobs
    line = real("aer_fatal", "Multiple Uncorrected (Fatal) error received: 0000:00:03.0")
    check = make(tmp_path, Nvml(gpus_on("0000:00:03.0", trainer.pid, other.pid)), jobs)
    feed(check, line)
    result = by_subject(check)["pci:0000:00:03.0"]
    assert result.status is Status.CRITICAL
    assert result.details["device"] == {"kind": "gpu", "label": "GPU 1 (serial 1652823054968)", "index": 1,
                                        "uuid": "GPU-00000001-0000-4000-8000-000000000003",
                                        "serial": "1652823054968", "bus_id": "0000:00:03"}
    assert result.details["jobs"] == ["process job trainer"] and result.details["job_key"] == "process:trainer"
    assert result.summary.startswith("kernel: aer_fatal GPU 1 (serial 1652823054968) pci:0000:00:03.0 (used by "
                                     "process job trainer): node fault: PCIe AER uncorrected fatal")


def test_an_hca_and_an_nvme_are_named_by_their_device_names(tmp_path: Path) -> None:
    ib = tmp_path / "infiniband"
    shutil.copytree(IB_TREE, ib)
    nvme = tmp_path / "nvme"
    (nvme / "nvme2" / "nvme2n1" / "nvme2n1p1").mkdir(parents=True)  # the controller's sysfs layout, namespaces inside
    for name, pci, where in (("mlx5_0", "0000:5e:00.0", ib), ("nvme2", "0000:03:00.0", nvme)):
        (tmp_path / "pci" / pci).mkdir(parents=True)
        (where / name / "device").symlink_to(tmp_path / "pci" / pci)
    check = make(tmp_path / "check", infiniband_root=str(ib), nvme_root=str(nvme))
    feed(check, real("mlx5_health", "health compromised") + real("nvme_reset_failed", "nvme nvme2:")
         + real("aer_corrected", "nvme 0000:03:00.0"))
    results = by_subject(check)
    hca, lost, aer = results["pci:0000:5e:00.0"], results["nvme:nvme2"], results["pci:0000:03:00.0"]
    assert hca.details["device"]["hca"] == "mlx5_0" and hca.summary.startswith(
        "kernel: mlx5_health HCA mlx5_0 pci:0000:5e:00.0: node fault: mlx5 device health compromised")
    assert lost.details["device"]["block_devices"] == ["nvme2n1", "nvme2n1p1"]
    assert lost.summary.startswith("kernel: nvme_reset_failed NVMe nvme2 (nvme2n1) nvme:nvme2: node fault")
    assert aer.status is Status.OK and aer.details["device"]["controller"] == "nvme2"  # one corrected: a counter
    assert "jobs" not in hca.details  # no job known to use it: the actions act on the node's jobs


def root_device() -> tuple[str, str]:
    """The kernel's name of the block device the root file system is mounted from, and its source."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if left.split()[4] == "/":
            source = right.split()[1]
            return Path(os.path.realpath(source)).name, source
    raise AssertionError("no root mount")


def test_a_file_system_error_names_the_mount_points_on_its_device(tmp_path: Path) -> None:
    dev, source = root_device()
    require(source.startswith("/dev/"), f"the root file system on a block device (here: {source})")
    check = make(tmp_path)
    # Real lines, for the device this machine's root really is mounted from
    feed(check, [x.replace("xvda9", dev) for x in real("ext4_error", "xvda9") + real("fs_readonly", "xvda9")])
    result = by_subject(check)[f"fs:{dev}"]
    assert result.status is Status.CRITICAL and "/" in result.details["mounts"]
    assert result.summary.startswith(f"kernel: fs_readonly fs:{dev} on /")
    assert "ext4 error" in result.summary  # both events of the device, the worst first


def test_an_uncorrected_machine_check_drains_the_node_with_the_event_as_its_reason(tmp_path: Path) -> None:
    """The engine end to end with the real drain action against a scripted scontrol and sinfo (tests/test_ledger.py's
    stand-in: it keeps the node's state and drain reason in a file): a real MCE report through a FIFO for /dev/kmsg."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", SCONTROL), ("sinfo", SINFO)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    fifo = tmp_path / "kmsg"
    os.mkfifo(fifo)
    raw = {"agent": {"state_dir": str(tmp_path / "state"), "node_name": "node1", "listen": ""},
           "jobs": {"sources": [], "slurm_bin_dir": str(bin_dir)},
           "checks": {"kernel": {"kmsg_path": str(fifo), "actions": {"critical": ["drain"]}}}, "notifiers": {}}
    engine = Engine(parse_config(raw, "test.toml"), notifiers={})
    writer = os.open(fifo, os.O_RDWR)
    engine.start()
    try:
        usec = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)
        follower = engine.checks["kernel"].follower  # type: ignore[attr-defined]
        for seq, line in enumerate(real("mce_uncorrected", "Bank 4: a600000000020408"), 1):
            os.write(writer, f"2,{seq},{usec},-;{strip_prefix(line)}\n".encode())
            wait_until(lambda n=seq: follower.records >= n, 10, what="the record read")  # a FIFO read: one record
        state = bin_dir / "node.state"
        wait_until(lambda: state.exists() and state.read_text().startswith("IDLE+DRAIN"), 20, what="the drain")
        reason = state.read_text().splitlines()[1]
        assert reason.startswith("trainguard: kernel: mce_uncorrected CPU 0 bank 4: node fault: machine check, "
                                 "uncorrected (until the node reboots): mce: [Hardware Error]: CPU 0: Machine Check: 0 Bank 4")
        assert len(reason) <= 200
    finally:
        engine.stop()
        os.close(writer)


def test_a_fatal_aer_on_a_gpu_drains_and_acts_on_the_job_using_it_only(tmp_path: Path, two_jobs: Any) -> None:
    """The engine end to end (a FIFO for /dev/kmsg, the scripted NVML): the actions get the one job whose process
    uses the GPU, and the drain reason names the fault."""
    _, trainer, other = two_jobs
    fifo = tmp_path / "kmsg"
    os.mkfifo(fifo)
    recorder = tmp_path / "actions"
    raw = {"agent": {"state_dir": str(tmp_path / "state"), "node_name": "node1", "listen": ""},
           "jobs": {"sources": ["process"], "refresh": "0s", "processes": {
               name: {"cmdline": p.args[-1], "user": "root"} for name, p in (("trainer", trainer), ("other", other))}},
           "checks": {"kernel": {"kmsg_path": str(fifo), "actions": {"critical": ["record"]}}},
           "notifiers": {},
           "actions": {"record": {"type": "exec", "command": [
               "sh", "-c", f'echo "$TRAINGUARD_JOB_IDS|$TRAINGUARD_SUMMARY" >> {recorder}']}}}
    engine = Engine(parse_config(raw, "test.toml"), nvml=Nvml(gpus_on("0000:00:03.0", trainer.pid, other.pid)))
    writer = os.open(fifo, os.O_RDWR)
    engine.start()
    try:
        usec = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)
        [line] = real("aer_fatal", "Multiple Uncorrected (Fatal) error received: 0000:00:03.0")
        os.write(writer, f"3,1,{usec},-;{strip_prefix(line)}\n".encode())
        wait_until(lambda: recorder.exists() and recorder.read_text(), 20, what="the bound action")
        job_ids, summary = recorder.read_text().splitlines()[0].split("|", 1)
        assert job_ids == "process:trainer"
        assert drain_reason(summary).startswith(f"{DRAIN_TAG} kernel: aer_fatal GPU 1 (serial 1652823054968)")
    finally:
        engine.stop()
        os.close(writer)


def test_a_one_shot_run_grades_by_the_same_windows_and_says_what_it_cannot_know(tmp_path: Path) -> None:
    """`trainguard check` reads the buffer once: each window counts from the record's kernel timestamp (a hung task
    two hours old is over), and the check says which records it saw and what a one-shot read cannot know."""
    saved = tmp_path / "kmsg-copy"
    now = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)
    old = now - 7200 * 10**6
    hung, nfs = real("hung_task", "jfsmount")[0], real("nfs_not_responding", "not responding")[0]
    saved.write_text(f"4,120,{max(old, 0)},-;{hung}\n4,121,{now},-;{strip_prefix(nfs)}\n")
    results = {r.subject: r for r in make(tmp_path / "check", kmsg_path=str(saved)).run()}
    head = results.pop("kernel-log")
    assert head.details["one_shot"] and head.details["first_seq"] == 120 and head.details["records"] == 2
    assert "the 120 older records were overwritten" in head.summary and "operator clears" in head.summary
    assert [r.status for r in results.values() if r.subject.startswith("nfs:")] == [Status.WARNING]
    if old > 0:  # the node has been up long enough for a record two hours old
        assert results["task:jfsmount"].status is Status.OK
