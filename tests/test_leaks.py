"""Memory leaks: a real leaking trainer in a memory-limited cgroup is saved before the OOM killer; flat jobs are left alone."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, MemoryCgroup, wait_until
from trainguard.agent.configfile import parse_config
from trainguard.checks.job_memory import JobMemory, JobMemorySettings, evaluate, gather
from trainguard.core.forecast import Forecast
from trainguard.core.model import Status
from trainguard.jobs.model import Job, ProcessRef
from trainguard.node.cgroup import CgroupMemory, memory_limit
from trainguard.node.procfs import ProcFS
from trainguard.node.proctable import ProcessTable, ProcInfo
from trainguard.pipeline.engine import Engine

MiB = 2**20
GiB = 2**30


def memory(used: int, cgroup_limit: int | None = None, cgroup_usage: int = 0, available: int = 10 * GiB) -> JobMemory:
    cg = CgroupMemory(Path("/sys/fs/cgroup/memory/job_1"), 1, cgroup_limit, cgroup_usage) if cgroup_limit else None
    return JobMemory(used, 1, cg, 64 * GiB, available)


@pytest.mark.parametrize(("m", "forecast", "status", "text"), [
    (memory(30 * GiB), Forecast(0.0, None), Status.OK, ""),  # large but flat: no leak
    (memory(30 * GiB), Forecast(1 * MiB, 6 * GiB / MiB), Status.WARNING, "host memory (64.0 GiB) is reached in ~1h"),
    (memory(30 * GiB), None, Status.OK, ""),  # not enough samples yet
    (memory(1 * GiB, 2 * GiB, int(1.5 * GiB)), Forecast(1 * MiB, 512.0), Status.CRITICAL,
     "cgroup v1 memory.limit_in_bytes of /sys/fs/cgroup/memory/job_1 (2.0 GiB) is reached in ~8m32s"),
    (memory(1 * GiB, 2 * GiB, 2 * GiB - 10 * MiB), Forecast(0.0, None), Status.CRITICAL, "below the 3% floor"),
    (memory(1 * GiB, available=int(1.5 * GiB)), Forecast(0.0, None), Status.CRITICAL, "below the 3% floor"),
])
def test_evaluate(m: JobMemory, forecast: Forecast | None, status: Status, text: str) -> None:
    verdict = evaluate(m, forecast, JobMemorySettings())
    assert verdict.status is status
    assert text in verdict.reason


def leak_engine(tmp_path: Path, marker: str, **check: Any) -> Engine:
    raw = {"agent": {"state_dir": str(tmp_path / "state"), "node_name": "node1", "listen": ""},
           "jobs": {"sources": ["process"], "refresh": 0, "processes": {"trainer": {"cmdline": marker, "user": "root"}}},
           "checks": {"leak": {"type": "job_memory", "interval": "0.5s", "jitter": 0, "min_span": "2s", "window": 20,
                               **check}},
           "notifiers": {"console": {}}}
    return Engine(parse_config(raw, "test.toml"))


def test_leaking_trainer_in_a_cgroup_is_saved_before_the_oom_killer(
        tmp_path: Path, memory_cgroup: Callable[[int], MemoryCgroup],
        children: list[subprocess.Popen[str]]) -> None:
    marker = f"leak-{uuid.uuid4().hex[:8]}"
    ckpt = tmp_path / marker
    inside = memory_cgroup(400 * MiB)
    toy = subprocess.Popen(inside([sys.executable, str(REPO / "examples/train_toy.py"), "--steps", "100000",
                                   "--step-time", "0.1", "--fault", "leak", "--fault-at", "10",
                                   "--leak-mb-per-step", "3", "--ckpt-dir", str(ckpt)]), stdout=subprocess.PIPE, text=True)
    assert toy.stdout is not None and toy.stdout.readline().startswith("training start")
    children.append(toy)
    assert memory_limit(toy.pid) is not None and memory_limit(toy.pid).limit == 400 * MiB  # type: ignore[union-attr]
    engine = leak_engine(tmp_path, marker)
    engine.start()
    try:
        out, _ = toy.communicate(timeout=60)
        out = "training start ...\n" + out
        assert toy.returncode == 0, f"exit {toy.returncode} (-9: the OOM killer won)\n{out}"
        assert "stop requested (SIGUSR1)" in out
        assert list(ckpt.glob("ckpt-*.json"))
        [incident] = [i for i in engine.tracker.incidents() if i.check == "leak"]
        assert incident.status is Status.CRITICAL
        assert "memory.limit_in_bytes" in incident.summary or "memory.max" in incident.summary, incident.summary
        assert "is reached in ~" in incident.summary
        wait_until(lambda: next(i for i in engine.tracker.incidents() if i.check == "leak").actions, 5)
    finally:
        engine.stop()


def test_a_leak_under_a_limit_the_jobs_first_process_is_not_under_is_seen(
        tmp_path: Path, memory_cgroup: Callable[[int], MemoryCgroup],
        children: list[subprocess.Popen[str]]) -> None:
    """On the node that runs a SLURM job's batch script, the job's first process is that script, outside the ranks'
    step cgroup (or under no limit at all): the rank that leaks must be judged against the limit it is held to, not
    the host's memory the script sees."""
    marker = f"launcher-{uuid.uuid4().hex[:8]}"
    inside = memory_cgroup(400 * MiB)
    toy = inside([sys.executable, str(REPO / "examples/train_toy.py"), "--steps", "100000", "--step-time", "0.1",
                  "--fault", "leak", "--fault-at", "10", "--leak-mb-per-step", "3", "--ckpt-dir",
                  str(tmp_path / "ckpt")])
    launcher = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; sys.exit(subprocess.call(sys.argv[2:]))",
                                 marker, *toy], stdout=subprocess.PIPE, text=True)
    children.append(launcher)
    assert launcher.stdout is not None and launcher.stdout.readline().startswith("training start")
    outer = memory_limit(launcher.pid)  # the job's first process: not under the rank's limit (a runner's own, if any)
    assert outer is None or outer.path != inside.path
    engine = leak_engine(tmp_path, marker)
    engine.start()
    try:
        wait_until(lambda: [i for i in engine.tracker.incidents() if i.check == "leak" and i.firing], 40,
                   what="the leak seen before the OOM killer")
        [incident] = [i for i in engine.tracker.incidents() if i.check == "leak"]
        assert incident.status is Status.CRITICAL and "is reached in ~" in incident.summary, incident.summary
        assert "memory.limit_in_bytes" in incident.summary or "memory.max" in incident.summary, incident.summary
        assert incident.details["processes"] == 2  # the job's whole tree here; judged by the rank's limit
    finally:
        engine.stop()


def test_large_steady_process_is_no_leak(tmp_path: Path, children: list[subprocess.Popen[str]]) -> None:
    marker = f"steady-{uuid.uuid4().hex[:8]}"
    big = subprocess.Popen([sys.executable, "-c", "import sys, time\nblock = bytearray(b'x') * (300 * 2**20)\n"
                            "print('ready', flush=True)\ntime.sleep(120)", marker], stdout=subprocess.PIPE, text=True)
    children.append(big)
    assert big.stdout is not None and big.stdout.readline().strip() == "ready"
    engine = leak_engine(tmp_path, marker)
    deadline = time.monotonic() + 4
    results = []
    while time.monotonic() < deadline:
        [report] = engine.run_round()
        results.extend(r for r in report.results if r.subject == "process:trainer")
        time.sleep(0.5)
    engine.stop()
    assert results and all(r.status is Status.OK for r in results)
    assert results[-1].details["used_bytes"] > 300 * MiB
    assert results[-1].details["growth_bytes_per_s"] is not None  # the trend was fitted, and is flat
    assert "trend flat" in results[-1].summary, results[-1].summary
    assert not [i for i in engine.tracker.incidents() if i.firing]


@pytest.mark.parametrize("version", [1, 2])
def test_cgroup_limit_is_the_tightest_on_the_path(tmp_path: Path, version: int) -> None:
    """SLURM sets the limit on the job's cgroup; the step below it has none: the job's limit applies."""
    root = tmp_path / "cgroup"
    step = root / "slurm" / "uid_1000" / "job_42" / "step_0"
    step.mkdir(parents=True)
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "777").mkdir()
    if version == 2:
        (proc / "self" / "mountinfo").write_text(f"30 1 0:26 / {root} rw,nosuid - cgroup2 cgroup2 rw\n")
        (proc / "777" / "cgroup").write_text("0::/slurm/uid_1000/job_42/step_0\n")
        limit_file, usage_file, inactive = "memory.max", "memory.current", "inactive_file"
        (step / limit_file).write_text("max\n")
    else:
        (proc / "self" / "mountinfo").write_text(
            f"35 25 0:30 / {root} rw - cgroup cgroup rw,memory\n36 25 0:31 / /x rw - cgroup cgroup rw,cpu\n")
        (proc / "777" / "cgroup").write_text("9:cpu:/\n4:memory:/slurm/uid_1000/job_42/step_0\n")
        limit_file, usage_file, inactive = "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"
        (step / limit_file).write_text("9223372036854771712\n")
    job = step.parent
    (job / limit_file).write_text(f"{8 * GiB}\n")
    (job / usage_file).write_text(f"{5 * GiB}\n")
    (job / "memory.stat").write_text(f"anon 1\n{inactive} {GiB}\n")
    (job.parent / limit_file).write_text(f"{64 * GiB}\n")
    found = memory_limit(777, ProcFS(proc))
    assert found is not None
    assert (found.path, found.version, found.limit, found.usage, found.headroom) == (job, version, 8 * GiB, 4 * GiB,
                                                                                      4 * GiB)
    (job / limit_file).write_text("max\n" if version == 2 else "9223372036854771712\n")
    (job.parent / limit_file).write_text("max\n" if version == 2 else "9223372036854771712\n")
    assert memory_limit(777, ProcFS(proc)) is None  # unlimited all the way up


def _slurm_v2(tmp_path: Path) -> tuple[Path, Path]:
    """A fake cgroup v2 tree as SLURM's task/cgroup lays it out (the job and each step limited alike), and /proc."""
    root, proc = tmp_path / "cgroup", tmp_path / "proc"
    job = root / "system.slice" / "slurmstepd.scope" / "job_7"
    for step, usage in (("step_batch", GiB), ("step_0", 8 * GiB)):
        (job / step / "user").mkdir(parents=True)
        (job / step / "memory.max").write_text(f"{10 * GiB}\n")
        (job / step / "memory.current").write_text(f"{usage}\n")
    (job / "memory.max").write_text(f"{10 * GiB}\n")
    (job / "memory.current").write_text(f"{int(9.5 * GiB)}\n")  # its steps' together
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "mountinfo").write_text(f"30 1 0:26 / {root} rw,nosuid - cgroup2 cgroup2 rw\n")
    return job, proc


def test_the_limit_nearest_to_an_oom_kill_is_the_one_with_the_least_headroom(tmp_path: Path) -> None:
    """The job cgroup and its steps carry the same limit: the job's usage is its steps' together, so the job's limit is
    the one the OOM killer reaches first (2 GiB to the step's own 0.5 GiB more)."""
    job, proc = _slurm_v2(tmp_path)
    (proc / "801").mkdir()
    (proc / "801" / "cgroup").write_text("0::/system.slice/slurmstepd.scope/job_7/step_0/user\n")
    found = memory_limit(801, ProcFS(proc))
    assert found is not None and (found.path, found.limit, found.headroom) == (job, 10 * GiB, GiB // 2)


def test_a_jobs_processes_are_judged_by_limit_and_a_process_gone_is_left_out(tmp_path: Path) -> None:
    """The batch script (step_batch) and the ranks (step_0) are held to one limit, the job's: one group. A launcher
    outside any cgroup limit is a group of its own (the host's memory). A process that exited after the snapshot (its
    cgroup unreadable) is in no group: it must not make a job under cgroup limits answer for the host's memory."""
    job, proc = _slurm_v2(tmp_path)
    cgroups = {800: "0::/system.slice/slurmstepd.scope/job_7/step_batch/user\n",
               801: "0::/system.slice/slurmstepd.scope/job_7/step_0/user\n",
               802: "0::/system.slice/slurmstepd.scope/job_7/step_0/user\n",
               803: "0::/user.slice\n"}
    for pid, text in cgroups.items():
        (proc / str(pid)).mkdir()
        (proc / str(pid) / "cgroup").write_text(text)
    table = ProcessTable({pid: ProcInfo(pid, ppid, 100.0, rss, "x") for pid, ppid, rss in (
        (799, 1, MiB), (800, 799, 2 * MiB), (801, 800, 3 * GiB), (802, 800, 3 * GiB), (803, 799, MiB),
        (804, 799, 50 * GiB))})  # 804: gone by the time its cgroup is read
    top = Job(key="slurm:7", source="slurm", name="t", state="RUNNING", job_id="7",
              processes=(ProcessRef(799, 100.0),))
    groups = {m.cgroup.path if m.cgroup else None: (m.processes, m.used) for m in gather(top, table, proc=ProcFS(proc))}
    assert groups == {job: (3, 2 * MiB + 6 * GiB), None: (1, MiB)}  # 799 and 804: no /proc entry, left out
    (proc / "799").mkdir()
    (proc / "799" / "cgroup").write_text(cgroups[803])
    groups = {m.cgroup.path if m.cgroup else None: (m.processes, m.used) for m in gather(top, table, proc=ProcFS(proc))}
    assert groups == {job: (3, 2 * MiB + 6 * GiB), None: (2, 2 * MiB)}  # the launcher and 803: the host's memory


def test_one_run_reads_the_mounts_and_a_shared_cgroups_limit_once(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Ten jobs under one cgroup (process jobs under the agent's own slice) read /proc/self/mountinfo and the
    cgroup's limit files once a run, not once a job; each job still gets the limit over it."""
    from collections import Counter

    from trainguard.checks import job_memory
    from trainguard.node import cgroup

    job, proc = _slurm_v2(tmp_path)
    for pid in (801, 802):
        (proc / str(pid)).mkdir()
        (proc / str(pid) / "cgroup").write_text("0::/system.slice/slurmstepd.scope/job_7/step_0/user\n")
    reads: Counter[str] = Counter()
    mountinfo, memory_limit_of = ProcFS.mountinfo, cgroup.memory_limit_of
    monkeypatch.setattr(ProcFS, "mountinfo", lambda self: reads.update(["mountinfo"]) or mountinfo(self))
    monkeypatch.setattr(job_memory, "memory_limit_of", lambda *a: reads.update(["limit"]) or memory_limit_of(*a))
    table = ProcessTable({pid: ProcInfo(pid, 1, 100.0, GiB, "x") for pid in (801, 802)})
    jobs = [Job(key=f"process:r{pid}", source="process", name=f"r{pid}", state="RUNNING",
                processes=(ProcessRef(pid, 100.0),)) for pid in (801, 802)]
    node = job_memory.NodeReads(ProcFS(proc))
    found = [gather(j, table, proc=ProcFS(proc), node=node) for j in jobs]
    assert [[(m.cgroup.path if m.cgroup else None, m.processes) for m in ms] for ms in found] == [[(job, 1)]] * 2
    assert reads == {"mountinfo": 1, "limit": 1}
    gather(jobs[0], table, proc=ProcFS(proc))  # without a run's reads: read afresh
    assert reads == {"mountinfo": 2, "limit": 2}
