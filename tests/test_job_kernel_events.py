"""The kernel's word in a job's own story: an OOM kill names the rank it killed (training_log, job_liveness), and a
hang whose ranks wait on a file system that stopped answering names that file system (hang)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import tomllib

from tests.conftest import HungMount, wait_until
from trainguard.agent.configfile import parse_config
from trainguard.checks.base import ActionBinding, CheckContext
from trainguard.checks.disk import DiskCheck, DiskSettings
from trainguard.checks.hang import CAUSE_KIND, FILE_SYSTEM, FsCause, HangCheck, HangSettings, blocked_waits, fs_cause
from trainguard.checks.job_liveness import JobLivenessCheck, LivenessSettings
from trainguard.checks.training_log import TrainingLogCheck, TrainingLogSettings
from trainguard.core.budget import Deadline, OverBudgetError
from trainguard.core.events import Event, EventKind
from trainguard.core.model import Status
from trainguard.core.state import ScopedState
from trainguard.gpu.nvml import Nvml
from trainguard.jobs.catalog import JobCatalog, JobView
from trainguard.jobs.kernelnotes import REWAKE_S, FsWait, JobProcess, KernelNotes, clock_time, fs_wait
from trainguard.jobs.model import Job
from trainguard.jobs.settings import JobsSettings, ProcessJobSettings
from trainguard.node.kmsg import KernelLog, KernelRecord, LogPoint, strip_prefix
from trainguard.node.mounts import Mount, parse_mountinfo, read_mounts
from trainguard.node.procfs import ProcFS
from trainguard.node.proctable import ProcessTable, read_table
from trainguard.pipeline.engine import Engine
from trainguard.pipeline.store import Store

from .helpers.fake_nvml import FakeNvml, NVMLError

# A SLURM task's kill by its job's memory cgroup limit, and a kill for the host's memory, as kernels print them
# (tests/data/kernel/fixtures.toml holds the cited originals of these forms)
MEMCG_KILL = [
    "python invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0, oom_score_adj=0",
    "oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0-1,oom_memcg=/slurm/uid_1000/"
    "job_4242,task_memcg=/slurm/uid_1000/job_4242/step_0/task_3,task=python,pid={pid},uid=1000",
    "Memory cgroup out of memory: Killed process {pid} (python) total-vm:60000000kB, anon-rss:56623104kB, "
    "file-rss:0kB, shmem-rss:0kB, UID:1000 pgtables:1372kB oom_score_adj:0"]
HOST_KILL = [
    "oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0-1,global_oom,task_memcg=/user.slice,"
    "task=python,pid={pid},uid=1000",
    "Out of memory: Killed process {pid} (python) total-vm:61000000kB, anon-rss:56623104kB, file-rss:0kB, "
    "shmem-rss:0kB, UID:1000 pgtables:1372kB oom_score_adj:0"]
ROOT_CAUSE = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2025-05-21_15:43:03
  host      : node1
  rank      : 11 (local_rank: 3)
  exitcode  : -9 (pid: {pid})
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID {pid}
============================================================
"""


def feed(notes: KernelNotes, lines: list[str], pid: int) -> None:
    usec = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)
    for i, line in enumerate(lines):
        notes.feed(KernelRecord(i, 4, 0, usec, line.format(pid=pid)))


def logs_check(tmp_path: Path, job: Job, **settings: Any) -> TrainingLogCheck:
    empty = tmp_path / "kmsg-copy"  # a saved kernel log with nothing in it: the one-shot read adds nothing
    empty.write_text("")
    made = TrainingLogCheck("logs", TrainingLogSettings(kmsg_path=str(empty), **settings), CheckContext(
        "node1", tmp_path, jobs=JobCatalog(JobsSettings(sources=[], refresh=0), "node1"), kernel_log=KernelLog(),
        state=ScopedState(Store(None), "check/logs"), nvml=Nvml(FakeNvml(init_error=NVMLError))))
    made.view = lambda: JobView((job,))  # type: ignore[method-assign]
    return made


def slurm_job(tmp_path: Path, **fields: Any) -> Job:
    return Job("slurm:4242", "slurm", "train", "RUNNING", job_id="4242", user="root", uid=0, on_this_node=True,
               start_time=time.time() - 60, stdout=str(tmp_path / "out.log"), log_paths=(str(tmp_path / "out.log"),),
               **fields)


def test_a_kill_by_the_jobs_memory_cgroup_is_the_rank_torchrun_names_in_the_jobs_story(tmp_path: Path) -> None:
    """The kill names the SLURM job in its memory cgroup; torchrun's root cause names the pid's rank."""
    pid = random.randint(100_000, 4_000_000)
    (tmp_path / "out.log").write_text("step 100 loss=1.2\n" + ROOT_CAUSE.format(pid=pid))
    check = logs_check(tmp_path, slurm_job(tmp_path))
    feed(check.notes, MEMCG_KILL, pid)
    [result] = check.run()
    kill = check.notes.kills(job_id="4242")[0]
    assert result.status is Status.CRITICAL
    assert result.summary.startswith(f"job 4242 (train): rank 11 killed by the kernel OOM killer (memory cgroup "
                                     f"limit, 54.0 GiB anon) at {clock_time(kill.when)}"), result.summary
    lead = next(f for f in result.details["findings"] if f["signature"] == "oom_kill")
    assert lead["fields"]["pid"] == pid and lead["fields"]["memcg"].endswith("/task_3")
    assert "memory cgroup" in result.details["next_step"]
    assert [f["signature"] for f in result.details["findings"]].count("oom_kill") == 1


def test_a_host_memory_kill_names_the_rank_its_pid_had_while_it_lived(tmp_path: Path) -> None:
    """A kill outside SLURM's cgroups: the pid the job's processes had, with the rank read from its environment."""
    job = slurm_job(tmp_path)
    (tmp_path / "out.log").write_text("step 1 loss=1.0\n")
    check = logs_check(tmp_path, job)
    check.run()
    pid = random.randint(100_000, 4_000_000)
    check.notes.remember(job.key, job.name, {pid: JobProcess("3")})  # what the check told while they lived
    feed(check.notes, HOST_KILL, pid)
    [result] = check.run()
    assert "rank 3 killed by the kernel OOM killer (host memory, 54.0 GiB anon) at" in result.summary
    assert "host memory" in result.details["next_step"]


def test_a_kill_logged_before_the_agents_first_start_is_told_not_acted_on(tmp_path: Path) -> None:
    (tmp_path / "out.log").write_text("step 1 loss=1.0\n")
    check = logs_check(tmp_path, slurm_job(tmp_path))
    feed(check.notes, MEMCG_KILL, random.randint(100_000, 4_000_000))
    check.context.xid_history.mark_first_start(lambda: LogPoint(10, int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)))
    [result] = check.run()
    assert result.status is Status.WARNING
    assert "task 3 (pid " in result.summary and "(logged before trainguard started: reported, not acted on)" in \
        result.summary


def test_a_kill_before_the_jobs_start_or_of_another_jobs_pid_is_not_its_own(tmp_path: Path) -> None:
    check = logs_check(tmp_path, slurm_job(tmp_path, restarts=0))
    (tmp_path / "out.log").write_text("step 1 loss=1.0\n")
    feed(check.notes, HOST_KILL, 12345)  # no job named: its pid was never one of the job's
    [result] = check.run()
    assert result.status is Status.OK and "OOM" not in result.summary


def test_the_liveness_of_a_job_down_after_an_oom_kill_says_so(tmp_path: Path) -> None:
    jobs = JobCatalog(JobsSettings(sources=["process"], refresh=0, processes={
        "trainer": ProcessJobSettings(cmdline=f"no-such-process-{random.random()}", user="root")}), "node1")
    empty = tmp_path / "kmsg-copy"
    empty.write_text("")
    check = JobLivenessCheck("alive", LivenessSettings(names=["trainer"], kmsg_path=str(empty)),
                             CheckContext("node1", tmp_path, jobs=jobs, kernel_log=KernelLog()))
    pid = random.randint(100_000, 4_000_000)
    check.context.kernel_notes.remember("process:trainer", "trainer", {pid: JobProcess("0")})
    feed(check.context.kernel_notes, HOST_KILL, pid)
    [result] = check.run()
    assert result.status is Status.CRITICAL
    assert "; rank 0 killed by the kernel OOM killer (host memory, 54.0 GiB anon) at " in result.summary
    assert result.details["oom_kills"][0]["pid"] == pid


# The kernel's record of a DataLoader worker's kill (its rank then raised `DataLoader worker (pid 61138) is killed by
# signal: Killed.`), from tests/data/kernel/fixtures.toml (Ace3Z/LeMonkey, track B debugging, failure 8): the poster
# wrapped it after the command name, the kernel prints it as one line
WORKER_KILL = ["Out of memory: Killed process {pid} (pt_data_worker) total-vm:79272196kB, anon-rss:43230644kB"]
# A rank's worker as ps shows it: forked (or spawned) by its rank, with the rank's environment
WORKER_CODE = "import os, sys, time\nif os.fork() == 0:\n    time.sleep(30)\n    os._exit(0)\ntime.sleep(30)\n"


def test_a_killed_dataloader_worker_is_its_ranks_worker_and_the_rank_is_not_said_dead(tmp_path: Path) -> None:
    """torchrun (SLURM_PROCID only) starts rank 3 (RANK=3), which starts its DataLoader worker (RANK=3 too, its
    parent the rank): the kernel's kill of the worker is the worker's, of rank 3; the rank lives on."""
    job = slurm_job(tmp_path)
    (tmp_path / "out.log").write_text("step 1 loss=1.0\n")
    check = logs_check(tmp_path, job)
    launcher, rank, worker = (random.randint(100_000, 4_000_000) + i for i in range(3))
    ranks = ("3", "0", "", "", "3")
    check.notes.remember(job.key, job.name, {launcher: JobProcess("0", 1, "torchrun", ("", "0", "", "", "")),
                                             rank: JobProcess("3", launcher, "python", ranks),
                                             worker: JobProcess("3", rank, "python", ranks)})
    feed(check.notes, WORKER_KILL, worker)
    [result] = check.run()
    assert result.status is Status.CRITICAL  # the job's own memory problem still
    assert f"job 4242 (train): a DataLoader worker of rank 3 (pid {worker}, pt_data_worker) killed by the kernel OOM " \
        "killer (host memory, 41.2 GiB anon) at " in result.summary, result.summary
    assert "rank 3 killed" not in result.summary
    lead = next(f for f in result.details["findings"] if f["signature"] == "oom_kill")
    assert lead["fields"]["worker"] is True and lead["advice"].startswith("A worker of the rank, not the rank")
    feed(check.notes, HOST_KILL, rank)  # the rank itself (python, its parent torchrun): the rank
    assert [k.who() for k in check.notes.kills(job.key)] == [f"a DataLoader worker of rank 3 (pid {worker}, "
                                                             "pt_data_worker)", "rank 3"]


def test_an_older_pytorchs_worker_is_told_by_its_parent_and_a_wrapper_is_not_a_rank() -> None:
    """Real processes: a rank (RANK=3) forks a worker (`python`: an older PyTorch does not rename it), whose kill is
    a subprocess's of rank 3; a wrapper shell (SLURM_PROCID=3) runs the rank as its child, which is the rank."""
    notes, proc = KernelNotes(), ProcFS()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK",
                                                            "LOCAL_RANK")}
    rank = subprocess.Popen([sys.executable, "-c", WORKER_CODE], env={**env, "RANK": "3"})
    shell = subprocess.Popen(["sh", "-c", f"{sys.executable} -c 'import time; time.sleep(30)'; :"],
                             env={**env, "SLURM_PROCID": "3"})

    def settled() -> ProcessTable | None:  # the rank forked, the shell's child runs python
        table = read_table()
        pids = table.descendants([rank.pid, shell.pid])
        return table if len(pids) == 4 and all(table.procs[p].comm != "sh" for p in pids if p != shell.pid) else None

    try:
        table = wait_until(settled, 10, what="the worker and the wrapped rank")
        assert isinstance(table, ProcessTable)
        pids = table.descendants([rank.pid, shell.pid])
        notes.remember("slurm:7", "train", {p: JobProcess.read(table.procs[p], proc) for p in pids})
        worker, wrapped = (p for p in pids if p not in (rank.pid, shell.pid))
        for pid in (worker, wrapped, rank.pid):
            feed(notes, HOST_KILL, pid)
        assert {k.pid: k.who() for k in notes.kills("slurm:7")} == {
            worker: f"a subprocess of rank 3 (pid {worker}, python)", wrapped: "rank 3", rank.pid: "rank 3"}
    finally:
        for p in (rank, shell):
            p.kill()
            p.wait()


def test_a_real_oom_kill_by_a_real_memory_cgroup_is_the_jobs_alert_naming_the_rank_within_a_second(
        kmsg: Any, tmp_path: Path, memory_cgroup: Any) -> None:
    """The agent end to end: a rank (RANK=3 in its environment) in a memory cgroup allocates past its limit and the
    kernel kills it; the kill, read through the node's one kernel log reader, wakes training_log (its interval is a
    minute) and the job's incident runs its bound action naming the rank, within 1 s of the kill."""
    del kmsg  # the real /dev/kmsg, readable and under the test lock
    tag = f"tgoomjob{random.randint(0, 1 << 30):x}"
    gate, recorder = tmp_path / "go", tmp_path / "alerts"
    cgroup = memory_cgroup(48 << 20)
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", tag])  # lives on, as torchrun
    rank = subprocess.Popen(cgroup([sys.executable, "-c", f"# {tag}\nimport os, time\n"
                                    f"while not os.path.exists({str(gate)!r}): time.sleep(0.02)\n"
                                    "b = [bytearray(1 << 20) for _ in range(512)]\ntime.sleep(30)"]),
                            env={**os.environ, "RANK": "3"})
    wait_until(lambda: Path(f"/proc/{rank.pid}/cmdline").read_bytes().count(tag.encode()), 10, what="the rank")
    engine = Engine(parse_config({
        "agent": {"state_dir": str(tmp_path / "state"), "node_name": "node1", "listen": ""},
        "jobs": {"sources": ["process"], "refresh": "0s",
                 "processes": {"trainer": {"cmdline": tag, "user": "root"}}},
        "checks": {"training_log": {"interval": "60s", "actions": {"critical": ["record"]}}},
        "notifiers": {},
        "actions": {"record": {"type": "exec", "command": [
            "sh", "-c", f'echo "$(date +%s.%N)|$TRAINGUARD_SUMMARY" >> {recorder}']}}}, "test.toml"))
    engine.start()
    try:
        wait_until(lambda: getattr(engine.shared.kernel_notes.known_pids("process:trainer").get(rank.pid), "rank", None)
                   == "3", 10, what="the rank's pid known with its rank")
        gate.write_text("")  # the rank allocates past its memory cgroup's limit: the kernel kills it
        assert rank.wait(timeout=30) == -9
        killed = time.time()
        wait_until(lambda: recorder.exists() and recorder.read_text(), 10, what="the job's alert")
        when, summary = recorder.read_text().splitlines()[0].split("|", 1)
        assert summary.startswith("process job trainer: rank 3 killed by the kernel OOM killer (memory cgroup "
                                  "limit"), summary
        assert float(when) - killed < 1.0, f"alerted {float(when) - killed:.2f}s after the kill"
    finally:
        engine.stop()
        for proc in (rank, launcher):
            proc.kill()
            proc.wait()


def nfs_line(klass: str, server: str) -> str:
    """The kernel's text of a real line of the fixtures of `klass` (`nfs_not_responding`: `nfs: server X not
    responding, still trying`; `nfs_ok`: `nfs: server X OK`), naming `server`."""
    fixtures = tomllib.loads((Path(__file__).parent / "data" / "kernel" / "fixtures.toml").read_text())["fixture"]
    real = next(f for f in fixtures if f["class"] == klass and "server" in f.get("names", {}))
    return strip_prefix(real["text"]).replace(real["names"]["server"], server)


def nfs_not_responding(server: str) -> str:
    return nfs_line("nfs_not_responding", server)


def hang_check(tmp_path: Path, marker: str, kmsg: Path) -> HangCheck:
    jobs = JobCatalog(JobsSettings(sources=["process"], refresh=0, processes={
        "trainer": ProcessJobSettings(cmdline=marker, user="root")}), "node1")
    return HangCheck("hang", HangSettings(stale_after=0.5, flight_recorder=False, kmsg_path=str(kmsg)),
                     CheckContext("node1", tmp_path, jobs=jobs, kernel_log=KernelLog()))


def hung_result(check: HangCheck) -> Any:
    check.run()  # the job's progress signals start now
    time.sleep(0.6)
    [result] = check.run()
    assert result.status is Status.CRITICAL
    return result


def test_a_hang_whose_rank_waits_on_a_mount_that_stopped_answering_names_it(
        tmp_path: Path, hung_mount: HungMount, children: list[subprocess.Popen[str]]) -> None:
    """A rank reads a file of a FUSE mount whose reads never return (D state). Without a kernel record the hang names
    the mount its open file lies on, which does not answer a statfs; with the kernel's `nfs: server X not
    responding` for the mount's server (a real line, through a FIFO standing in for /dev/kmsg), it names that."""
    marker = f"tgfsjob{random.randint(0, 1 << 30):x}"
    data = hung_mount.mountpoint / "data"
    rank = subprocess.Popen([sys.executable, "-c", "import sys; open(sys.argv[1], 'rb').read(10)", str(data),
                             marker], env={**os.environ, "RANK": "0"}, text=True)
    children.append(rank)
    wait_until(lambda: psutil.Process(rank.pid).status() == psutil.STATUS_DISK_SLEEP, 10, what="the rank in D state")
    fifo = tmp_path / "kmsg"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR)  # held open: the follower never sees the writer go
    where = f"fuse {hung_mount.server}:/export at {hung_mount.mountpoint}"
    silent = hang_check(tmp_path / "a", marker, fifo)
    told = hang_check(tmp_path / "b", marker, fifo)
    try:
        result = hung_result(silent)
        assert result.summary.startswith(f"process job trainer: cause: rank 0 waits in D state on {where} (seen in "
                                         f"its open file {data}): it does not answer (a statfs still blocked after "
                                         "1s)"), result.summary
        assert "bring its server" in result.details["next_step"]
        # a statfs that blocks is said, but drains nothing: a local account can slow a shared mount's statfs
        assert result.details[CAUSE_KIND] is None and "scope" not in result.details

        told.start(lambda: None)
        assert told.kernel is not None
        os.write(writer, f"4,1,{int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)},-;"
                         f"{nfs_not_responding(hung_mount.server)}\n".encode())
        wait_until(lambda: told.kernel is not None and told.kernel.follower.records >= 1, 10, what="the record read")
        result = hung_result(told)
        since = told.context.kernel_notes.trouble(next(m for m in read_mounts() if m.mountpoint == str(
            hung_mount.mountpoint)))
        assert since is not None
        assert result.summary.startswith(f"process job trainer: cause: rank 0 waits in D state on {where}: the kernel "
                                         f"says NFS server not responding (nfs {hung_mount.server}) since "
                                         f"{clock_time(since.since)}"), result.summary
        assert result.details["cause"] and "server stopped answering" in result.details["next_step"]
        assert result.details[CAUSE_KIND] == FILE_SYSTEM  # the kernel's word: its `fs_actions` run, not a restart
        assert result.details["scope"] == "node"  # said on this node even where another owns the job
    finally:
        told.stop()
        silent.stop()
        os.close(writer)
        hung_mount.abort()  # the rank's read returns: it ends


def test_fs_stale_after_answers_a_rank_blocked_on_a_mount_the_kernel_says_is_dead_before_stale_after(
        tmp_path: Path, hung_mount: HungMount, children: list[subprocess.Popen[str]]) -> None:
    """`fs_stale_after`: a rank blocked in D state on a mount, idle past `fs_stale_after` (0.5 s) and far from its
    `stale_after` (an hour), is hung once the kernel says the mount's server is not responding (a real line through a
    FIFO standing in for /dev/kmsg), which wakes the started check; before the kernel's word the job keeps its
    `stale_after`, and once hung it stays hung after the kernel's `OK` while it makes no progress; a job idle as long
    but blocked on nothing stays OK while the kernel says so."""
    marker = f"tgfsearly{random.randint(0, 1 << 30):x}"
    rank = subprocess.Popen([sys.executable, "-c", "import sys; open(sys.argv[1], 'rb').read(10)",
                             str(hung_mount.mountpoint / "data"), f"{marker}-blocked"], env={**os.environ, "RANK": "0"},
                            text=True)
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"{marker}-idle"], text=True)
    children.extend([rank, idle])
    wait_until(lambda: psutil.Process(rank.pid).status() == psutil.STATUS_DISK_SLEEP, 10, what="the rank in D state")
    fifo = tmp_path / "kmsg"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR)
    jobs = JobCatalog(JobsSettings(sources=["process"], refresh=0, processes={
        "blocked": ProcessJobSettings(cmdline=f"{marker}-blocked", user="root"),
        "idle": ProcessJobSettings(cmdline=f"{marker}-idle", user="root")}), "node1")
    check = HangCheck("hang", HangSettings(stale_after=3600, fs_stale_after=0.5, flight_recorder=False, stacks=False,
                                           kmsg_path=str(fifo)),
                      CheckContext("node1", tmp_path, jobs=jobs, kernel_log=KernelLog()))
    woken = threading.Event()

    def kernel_says(line: str) -> None:
        woken.clear()
        os.write(writer, f"4,1,{int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)},-;{line}\n".encode())

    def statuses() -> dict[str, Any]:
        return {r.subject.removeprefix("process:"): r for r in check.run()}

    check.start(woken.set)
    try:
        statuses()  # the jobs' progress signals start now
        time.sleep(0.6)
        assert {k: r.status for k, r in statuses().items()} == {"blocked": Status.OK, "idle": Status.OK}
        idle = check.progress(jobs.view().jobs[0], [], time.time())
        assert check._deadline(idle, 3600, check._early(3600, idle), time.time()) > 3000
        kernel_says(nfs_not_responding(hung_mount.server))
        assert woken.wait(10), "the kernel's record woke the check"
        found = statuses()
        blocked = found["blocked"]
        assert blocked.status is Status.CRITICAL, blocked.summary
        assert blocked.details[CAUSE_KIND] == FILE_SYSTEM and blocked.details["scope"] == "node"
        assert blocked.details["stale_after"] == 0.5
        assert blocked.summary.startswith(f"process job blocked: cause: rank 0 waits in D state on fuse "
                                          f"{hung_mount.server}:/export at {hung_mount.mountpoint}: the kernel says "
                                          "NFS server not responding"), blocked.summary
        assert found["idle"].status is Status.OK  # idle as long, but blocked on nothing
        kernel_says(nfs_line("nfs_ok", hung_mount.server))
        wait_until(lambda: check.kernel is not None and not check.kernel.notes.troubled(), 10, what="the OK read")
        # the rank is still blocked and the job has not progressed: the same hang, not resolved (its alert would say
        # the job progresses) nor fired again at the next blip, its evidence kept
        again = statuses()
        assert again["blocked"].status is Status.CRITICAL and again["idle"].status is Status.OK
        assert again["blocked"].summary.split("; no progress")[0] == blocked.summary.split("; no progress")[0]
        assert again["blocked"].details[CAUSE_KIND] == FILE_SYSTEM and again["blocked"].details["stale_after"] == 0.5
    finally:
        check.stop()
        os.close(writer)
        hung_mount.abort()


def test_fs_stale_after_wakes_the_hang_check_on_a_dead_file_system_never_on_an_oom_kill(tmp_path: Path) -> None:
    """An OOM kill changes nothing the hang check decides: a job's user who OOM-kills their own processes in a loop
    must not run it back to back (the log check, which tells kills, is still woken by each). A file system the
    kernel says stopped answering wakes it; said again, at most once a minute (news to a job that stalled since)."""
    empty = tmp_path / "kmsg-copy"
    empty.write_text("")
    context = CheckContext("node1", tmp_path, jobs=JobCatalog(JobsSettings(sources=[], refresh=0), "node1"),
                           kernel_log=KernelLog())
    check = HangCheck("hang", HangSettings(fs_stale_after=60, kmsg_path=str(empty)), context)
    assert check.kernel is not None
    notes, woken, told = check.kernel.notes, [], []
    stop = notes.listen(lambda: told.append("kill or fs"))
    check.start(lambda: woken.append("hang"))
    try:
        feed(notes, MEMCG_KILL, random.randint(100_000, 4_000_000))
        assert told and woken == []
        now = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)
        said = now - int((REWAKE_S + 1) * 1e6)  # kernel time: the outage first said over a minute ago
        for seq, usec in enumerate((said, said + 1000)):  # said again at once: no news
            notes.feed(KernelRecord(seq, 4, 0, usec, nfs_not_responding("fs1")))
        assert woken == ["hang"]
        notes.feed(KernelRecord(2, 4, 0, now, nfs_not_responding("fs1")))  # a minute on, said again: news to a job
        assert woken == ["hang", "hang"]                                     # that stalled since
    finally:
        check.stop()
        stop()


def test_an_outage_said_every_few_seconds_wakes_the_checks_once_a_minute_and_a_replayed_record_never() -> None:
    """The kernel may say dead servers again every few seconds while their outage lasts (each newly stalled request's
    major timeout): a job that stalled since must still be woken for, once a minute, however many servers it names
    (each still wakes them when first said); a record of earlier (a second reader's replay) is no news."""
    notes, woken = KernelNotes(), []
    notes.listen(lambda: woken.append("fs"), kills=False)
    start = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6) - 400_000_000  # kernel time, 400 s ago
    said = [start + k * 10_000_000 for k in range(31)]  # fs1 and fs2 in turn every 10 s for 300 s
    for seq, usec in enumerate(said):
        notes.feed(KernelRecord(seq, 4, 0, usec, nfs_not_responding(f"fs{seq % 2 + 1}")))
    assert len(woken) == 2 + int((said[-1] - said[1]) / 1e6 // REWAKE_S)  # each first word, then once a minute
    woken.clear()
    for seq, usec in enumerate((start + 1_000_000, said[-1] + 1_000_000), start=len(said)):  # replayed, then live
        notes.feed(KernelRecord(seq, 4, 0, usec, nfs_not_responding("fs1")))
    assert woken == []


def test_a_hang_on_a_dead_file_system_whose_capture_failed_still_runs_fs_actions(
        tmp_path: Path, children: list[subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    """`fs_stale_after` found the job's ranks on a dead mount, and capturing its stacks raised (that run UNKNOWN): the
    next run's hang keeps the dead file system it was found for (`fs_actions`: a restart in place would hang again in
    it), not a capture that names no cause."""
    marker = f"tgfscapture{random.randint(0, 1 << 30):x}"
    children.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker], text=True))
    empty = tmp_path / "kmsg-copy"
    empty.write_text("")
    jobs = JobCatalog(JobsSettings(sources=["process"], refresh=0, processes={
        "trainer": ProcessJobSettings(cmdline=marker, user="root")}), "node1")
    check = HangCheck("hang", HangSettings(stale_after=3600, fs_stale_after=0.5, flight_recorder=False,
                                           kmsg_path=str(empty)),
                      CheckContext("node1", tmp_path, jobs=jobs, kernel_log=KernelLog()))
    dead = FsCause("rank 0 waits in D state on nfs fs1:/export at /data: the kernel says NFS server not responding",
                   "bring the server back", True)
    assert [r.status for r in check.run()] == [Status.OK]  # its progress signals start now
    time.sleep(0.6)
    monkeypatch.setattr(check, "_dead_mount", lambda *args: dead)  # idle past fs_stale_after, on a dead mount

    def explode(*args: Any) -> Any:
        raise ValueError("py-spy said something odd")

    monkeypatch.setattr(check.dumper, "dump", explode)
    results = check.run()
    assert [r.status for r in results] == [Status.UNKNOWN] and "py-spy said something odd" in results[0].summary
    [result] = check.run()
    assert result.status is Status.CRITICAL and result.details[CAUSE_KIND] == FILE_SYSTEM, result.summary
    assert f"cause: {dead.text}" in result.summary and check.actions_for(
        Event(EventKind.FIRED, "i1", "hang", result.subject, result.status, result.summary, "node1", 0.0, 0.0,
              details=result.details)) == check.settings.fs_actions


def test_the_look_at_a_jobs_blocked_processes_keeps_to_the_jobs_budget() -> None:
    """`fs_stale_after` looks at an idle job's processes at each run while the kernel says a file system is dead: how
    many sit in D state holding how many files is its user's choice, so the look keeps to the job's budget (the run
    says the job over budget, as for its progress signals) and other jobs are still watched."""
    me = psutil.Process()
    assert blocked_waits([me], ProcFS(), []) == []  # running: not blocked
    with pytest.raises(OverBudgetError):
        blocked_waits([me, me], ProcFS(), [], Deadline.after(-1.0))


def fake_proc(tmp_path: Path, pid: int, stack: str, files: dict[str, str]) -> ProcFS:
    """A /proc with one process: its kernel stack and its open files (fd -> path) and working directory."""
    root = tmp_path / "proc"
    (root / str(pid) / "fd").mkdir(parents=True)
    (root / str(pid) / "stack").write_text(stack)
    (root / str(pid) / "wchan").write_text("0")
    for fd, target in files.items():
        os.symlink(target, root / str(pid) / ("cwd" if fd == "cwd" else f"fd/{fd}"))
    return ProcFS(root)


LUSTRE = Mount("/lustre/scratch", "10.0.0.1@o2ib:/scratch", "lustre", "0:51")
NFS = Mount("/home", "fs1:/export/home", "nfs4", "0:52")
MOUNTS = [Mount("/", "/dev/sda1", "ext4", "8:1"), NFS, LUSTRE]


def test_the_mount_a_blocked_process_waits_on_is_the_one_its_kernel_stack_names(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, 42, "[<0>] rpc_wait_bit_killable+0x1e/0xa0\n[<0>] nfs4_do_open+0x2c/0x40\n",
                     {"3": "/lustre/scratch/run/shard-7.bin", "4": "/home/alice/train.log", "cwd": "/home/alice"})
    wait = fs_wait(42, MOUNTS, proc)
    assert wait is not None and wait.mount == NFS and wait.how == ("its kernel stack (rpc_...) and its open file "
                                                                   "/home/alice/train.log")
    quiet = fake_proc(tmp_path / "b", 43, "[<0>] folio_wait_bit_common+0x110/0x310\n",
                      {"3": "/lustre/scratch/run/shard-7.bin"})
    found = fs_wait(43, MOUNTS, quiet)
    assert found is not None and found.mount == LUSTRE and found.how == "its open file /lustre/scratch/run/shard-7.bin"
    assert fs_wait(44, MOUNTS, fake_proc(tmp_path / "c", 44, "", {"3": "/tmp/x"})) is None


def test_a_lustre_target_the_kernel_lost_is_the_cause_and_a_blocked_rank_on_no_mount_gets_the_likely_one() -> None:
    notes = KernelNotes()
    usec = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)
    notes.feed(KernelRecord(1, 4, 0, usec, "Lustre: scratch-OST0003-osc-ffff8e0b6c5e1000: Connection to scratch-OST0003 "
                                           "(at 10.0.0.3@o2ib) was lost; in progress operations using this service "
                                           "will wait for recovery to complete"))
    assert notes.trouble(LUSTRE) is not None and notes.trouble(NFS) is None
    waits = [("rank 0", FsWait(7, LUSTRE, "its open file /lustre/scratch/x")), ("rank 1", FsWait(8, LUSTRE, "x"))]
    cause = fs_cause(waits, notes, MOUNTS, lambda m: None)
    assert cause is not None and cause.down
    assert cause[0].startswith("rank 0, rank 1 wait in D state on lustre 10.0.0.1@o2ib:/scratch at /lustre/scratch: "
                               "the kernel says Lustre connection lost (lustre scratch-OST0003) since "), cause[0]
    likely = fs_cause([("pid 9", None)], notes, MOUNTS, lambda m: None)
    assert likely is not None and "likely what they wait on" in likely[0] and "/lustre/scratch" in likely[0]
    assert not likely.down  # a guess: said, never drained on
    # without a kernel record, whether a statfs of the mount answers says if it is down
    answered = fs_cause(waits, KernelNotes(), MOUNTS, lambda m: None)
    assert answered is not None and "it answers now" in answered.text and not answered.down
    stuck = fs_cause(waits, KernelNotes(), MOUNTS, lambda m: "a statfs still blocked after 1s")
    assert stuck is not None and "it does not answer" in stuck.text and not stuck.down  # the kernel's word only
    assert fs_cause([("pid 9", None)], KernelNotes(), MOUNTS, lambda m: None) is None
    notes.feed(KernelRecord(2, 4, 0, usec + 1, "Lustre: scratch-OST0003-osc-ffff8e0b6c5e1000: Connection restored to "
                                               "10.0.0.3@o2ib (at 10.0.0.3@o2ib)"))
    assert notes.trouble(LUSTRE) is None


def test_fs_stale_after_takes_only_the_kernels_word_since_the_jobs_last_progress() -> None:
    """A soft mount's `nfs: server X not responding, timed out` need not be followed by `OK` (the kernel prints `OK` for
    a task that retried on, and rate-limits both): its record may stay on. A job that progressed since then and
    now reads that mount (in D state a moment, as any read of NFS is) is not hung on the kernel's old word at
    `fs_stale_after` (drained, requeued: a checkpoint loaded for minutes would be, at every start); at `stale_after`
    the record still names the cause. A stall after the kernel's line: its word counts."""
    notes = KernelNotes()
    usec = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)
    notes.feed(KernelRecord(1, 5, 0, usec, "nfs: server fs1 not responding, timed out"))
    said = time.time()
    waits = [("rank 0", FsWait(7, NFS, "its open file /home/ckpt.pt"))]
    assert notes.troubled() and not notes.troubled(said + 60)
    stale = fs_cause(waits, notes, MOUNTS, lambda m: None, since=said + 60)
    assert stale is not None and not stale.down and "it answers now" in stale.text
    for cause in (fs_cause(waits, notes, MOUNTS, lambda m: None), fs_cause(waits, notes, MOUNTS, lambda m: None,
                                                                           since=said - 200)):
        assert cause is not None and cause.down and "the kernel says NFS server timed out (nfs fs1)" in cause.text


# /proc/self/mountinfo on this VM (Linux 6.18.44, 2026-11-29): tests/helpers/hangfs.py mounted by uid 1001 through
# fusermount3, and by root (fusepy, allow_other)
USERS_FUSE, ROOTS_FUSE = parse_mountinfo(
    "44 27 0:41 / /tmp/ufuse.ixDM/m rw,nosuid,nodev,relatime - fuse srv9:/export rw,user_id=1001,group_id=1001\n"
    "43 27 0:40 / /tmp/hfsexp.WX42/m rw,relatime - fuse fs7:/export rw,user_id=0,group_id=0,allow_other\n")


def test_a_fuse_mount_a_user_made_never_reads_as_the_nodes_dead_file_system() -> None:
    """A user's own FUSE mount that stops answering (a statfs blocks, or the kernel names a server of its name) is
    the cause of their hang, but not the node's fault: it keeps `actions` and is never statfs'd; a root's mount of the
    same kind is down when the kernel says its server is."""
    assert (USERS_FUSE.made_by, ROOTS_FUSE.made_by, NFS.made_by) == (1001, None, None)
    waits = [("rank 0", FsWait(7, USERS_FUSE, "its open file /tmp/ufuse.ixDM/m/data"))]
    def never(m: Mount) -> str:
        raise AssertionError(f"statfs of {m.mountpoint}: its user decides how long that takes")

    stuck = fs_cause(waits, KernelNotes(), [USERS_FUSE], never)
    assert stuck is not None and not stuck.down and stuck.text.endswith("mounted by uid 1001, not the node's")
    notes = KernelNotes()
    notes.feed(KernelRecord(1, 4, 0, int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6),
                            nfs_not_responding("srv9")))
    told = fs_cause(waits, notes, [USERS_FUSE], lambda m: None)
    assert told is not None and "kernel says" not in told.text and not told.down  # an NFS server of its name
    notes.feed(KernelRecord(2, 4, 0, int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6), nfs_not_responding("fs7")))
    roots = fs_cause([("rank 0", FsWait(7, ROOTS_FUSE, "x"))], notes, [ROOTS_FUSE], lambda m: None)
    assert roots is not None and roots.down


def test_a_hang_on_a_file_system_that_does_not_answer_runs_its_fs_actions(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine runs the actions a check binds to each event (`Check.actions_for`): the hang check's `fs_actions`
    for a hang whose result found a file system that does not answer (also when its incident escalates to it from
    UNKNOWN), its `actions` for any other hang; every other check its `actions`, whatever the details say."""
    ran = tmp_path / "ran"

    def hook(name: str) -> dict[str, Any]:
        return {"type": "exec", "command": ["sh", "-c", f'echo "{name} $TRAINGUARD_SUBJECT" >> {ran}'], "timeout": 10}

    raw = {"agent": {"state_dir": str(tmp_path), "listen": ""}, "jobs": {"sources": []},
           "actions": {"plain": hook("plain"), "dead-mount": hook("dead-mount")},
           "checks": {"hang": {"kernel_log": False, "actions": {"critical": ["plain"]},
                               "fs_actions": {"critical": ["dead-mount"]}}}}
    engine = Engine(parse_config(raw, "t.toml"), store=Store(None))
    hang = engine.checks["hang"]
    down = {CAUSE_KIND: FILE_SYSTEM}
    rounds = [[hang.result("job:a", Status.CRITICAL, "a: no progress", {"job_key": "job:a", CAUSE_KIND: None}),
               hang.result("job:b", Status.CRITICAL, "b: cause: rank 0 waits on /data", {"job_key": "job:b", **down}),
               hang.result("job:c", Status.UNKNOWN, "c: hang check failed", {"job_key": "job:c"})],
              [hang.result("job:c", Status.CRITICAL, "c: cause: rank 0 waits on /data", {"job_key": "job:c", **down})]]
    try:
        for results in rounds:
            monkeypatch.setattr(hang, "run", lambda results=results: results)
            engine.run_round()
            for t in engine.responder.threads:
                t.join(10)
        assert sorted(ran.read_text().splitlines()) == ["dead-mount job:b", "dead-mount job:c", "plain job:a"]
    finally:
        engine.stop()
    event = Event(EventKind.FIRED, "i1", "hang", "job:b", Status.CRITICAL, "b", "node1", 1.0, 1.0, details=down)
    assert hang.actions_for(event) == ActionBinding(critical=["dead-mount"])
    context = CheckContext("node1", tmp_path)
    unset = HangCheck("hang", HangSettings(kernel_log=False, fs_actions=None), context)
    assert unset.actions_for(event) == unset.settings.actions  # None: the hang's own actions
    assert HangSettings().fs_actions == ActionBinding(critical=["signal", "drain", "requeue"])
    disk = DiskCheck("disk", DiskSettings(actions=ActionBinding(critical=["drain"])), context)
    assert disk.actions_for(event) is disk.settings.actions  # the hook's default: the check's one binding
