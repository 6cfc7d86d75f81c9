"""What on the host can make a job's steps slower: CPU steal and I/O wait (/proc/stat), pressure stall information
(/proc/pressure/{cpu,io,memory}: the share of time some task waited), swapping (/proc/vmstat), and the processes
busy on the job's CPUs: another's (a co-tenant) or the job's own using all its CPUs (a runaway data loader). Read
through ProcFS and the shared process table; the rates are between two samples the caller keeps."""

from __future__ import annotations

import heapq
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from trainguard.core.text import one_line
from trainguard.node.procfs import ProcFS
from trainguard.node.proctable import SAME_PROCESS_S, TICKS, ProcessTable
from trainguard.node.users import UserNames

PSI = ("cpu", "io", "memory")
# Above these, the host is a suspect (thresholds as data): PSI `some avg60` percent, steal and iowait shares of CPU
# time, pages swapped in a second.
LIMITS = {"cpu": 25.0, "io": 25.0, "memory": 10.0, "steal": 0.05, "iowait": 0.20, "swap_in": 100.0}
# Another process is a co-tenant when it used at least this share of the job's CPUs and at least this many CPUs
# between two looks, on CPUs the job may run on; the job's own processes saturate its CPUs from this share.
CO_TENANT = {"share": 0.10, "cpus": 0.5, "own": 0.90}
MAX_NAMED = 3  # processes named per job and run: the only ones whose status is read beyond the shared table
MAX_CPU_LIST = 64  # ranges read of a Cpus_allowed_list (a real one has a few)
MIN_SECONDS = 1.0
JOB_CPU_PIDS = 4  # the job's first processes (its ranks come first) whose allowed CPUs are the job's


@dataclass(frozen=True)
class HostSample:
    when: float
    cpu: tuple[int, int, int] | None  # (total, iowait, steal) jiffies since boot
    swap_in: int | None  # pages swapped in since boot
    psi: dict[str, float]  # resource -> `some avg60` percent


def _psi(text: str | None) -> float | None:
    for line in (text or "").splitlines():
        if line.startswith("some "):
            for part in line.split():
                if part.startswith("avg60="):
                    try:
                        return float(part[6:])
                    except ValueError:
                        return None
    return None


def host_sample(proc: ProcFS, when: float) -> HostSample:
    cpu = None
    for line in (proc.read_text("stat") or "").splitlines()[:1]:
        fields = line.split()
        if fields[:1] == ["cpu"] and len(fields) >= 9 and all(f.isdigit() for f in fields[1:]):
            values = [int(f) for f in fields[1:]]
            cpu = (sum(values[:8]), values[4], values[7])  # user nice system idle iowait irq softirq steal
    swap_in = None
    for line in (proc.read_text("vmstat") or "").splitlines():
        name, _, value = line.partition(" ")
        if name == "pswpin" and value.strip().isdigit():
            swap_in = int(value)
    psi = {r: v for r in PSI if (v := _psi(proc.read_text("pressure", r))) is not None}
    return HostSample(when, cpu, swap_in, psi)


def host_evidence(before: HostSample | None, now: HostSample) -> tuple[list[str], dict[str, float]]:
    """The host's suspects in words, and its gauges (PSI as a ratio, steal and iowait shares, swap-ins a second)."""
    gauges = {r: v / 100 for r, v in now.psi.items()}
    if before is not None and before.cpu and now.cpu and now.cpu[0] > before.cpu[0]:
        total = now.cpu[0] - before.cpu[0]
        gauges["iowait"] = max(0, now.cpu[1] - before.cpu[1]) / total
        gauges["steal"] = max(0, now.cpu[2] - before.cpu[2]) / total
    if before is not None and before.swap_in is not None and now.swap_in is not None and now.when > before.when:
        gauges["swap_in"] = max(0, now.swap_in - before.swap_in) / (now.when - before.when)
    said = []
    for name, value in gauges.items():
        limit = LIMITS[name] / 100 if name in PSI else LIMITS[name]
        if value >= limit:
            said.append({"steal": f"CPU steal {value:.0%}", "iowait": f"I/O wait {value:.0%} of CPU time",
                         "swap_in": f"swapping in {value:.0f} pages/s"}.get(name, f"{name} pressure {value:.0%}"))
    return said, gauges


@dataclass(frozen=True)
class Busy:
    """A process busy on a job's CPUs: `cpus` used between two looks, `share` of the job's CPUs."""

    pid: int
    command: str
    user: str
    cpus: float
    share: float

    def describe(self) -> str:
        return f"pid {self.pid} ({self.command}, user {self.user}) {self.cpus:.1f} CPUs, {self.share:.0%} of the job's"


def cpu_use(before: ProcessTable | None, now: ProcessTable) -> dict[int, float]:
    """The CPUs each process used between two tables of the process snapshot: one pass over `now` (a process that
    started since counts all its time); {} without an earlier table or one less than MIN_SECONDS older (CPU time
    is counted in ticks of 10 ms: over a shorter span one tick reads as a busy CPU)."""
    seconds = now.taken - before.taken if before is not None else 0.0
    if before is None or seconds < MIN_SECONDS:
        return {}
    use = {}
    for pid, info in now.procs.items():
        old = before.procs.get(pid)
        base = old.cpu_ticks if old is not None and abs(old.create_time - info.create_time) < SAME_PROCESS_S else 0
        if info.cpu_ticks > base:
            use[pid] = (info.cpu_ticks - base) / TICKS / seconds
    return use


def cpu_list(text: str) -> frozenset[int] | None:
    """A kernel CPU list (`0-3,8,10-11`) as its CPUs; None when it is not one."""
    cpus: set[int] = set()
    for part in text.strip().split(",")[:MAX_CPU_LIST]:
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()) or len(low) > 5 or len(high) > 5:
            return None
        cpus.update(range(int(low), int(high or low) + 1))
    return frozenset(cpus) or None


def allowed_cpus(proc: ProcFS, pid: int) -> frozenset[int] | None:
    """The CPUs a process may run on (its cpuset and affinity: `Cpus_allowed_list` of its status)."""
    for line in (proc.read_text(pid, "status") or "").splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return cpu_list(line.partition(":")[2])
    return None


def user_name(proc: ProcFS, pid: int, names: UserNames) -> str:
    """The user of a process, for display: its name within `names`' bound, else its uid; "?" when it is gone."""
    uid = proc.real_uid(pid)
    return "?" if uid is None else names.name(uid)


def busy_on_job_cpus(use: Mapping[int, float], table: ProcessTable, job_pids: Collection[int],
                     proc: ProcFS, names: UserNames) -> list[str]:
    """In words: other processes busy on the job's CPUs (at most MAX_NAMED, the busiest), and the job's own
    processes using nearly all its CPUs (the busiest named: a data loader's workers, a rank spinning)."""
    if not use:
        return []
    mine = set(job_pids)
    allowed = [a for p in list(job_pids)[:JOB_CPU_PIDS] if (a := allowed_cpus(proc, p)) is not None]
    job_cpus = frozenset().union(*allowed) if allowed else None
    count = len(job_cpus) if job_cpus else os.cpu_count() or 1
    floor = max(CO_TENANT["cpus"], CO_TENANT["share"] * count)
    said = []
    others = []
    for cpus, pid in heapq.nlargest(MAX_NAMED, ((c, p) for p, c in use.items() if p not in mine and c >= floor)):
        theirs = allowed_cpus(proc, pid)
        if job_cpus is not None and theirs is not None and not theirs & job_cpus:
            continue  # pinned elsewhere: it does not compete with the job's ranks
        others.append(_busy(pid, cpus, count, table, proc, names).describe())
    if others:
        said.append("busy on the job's CPUs: " + "; ".join(others))
    own = sum(use.get(p, 0.0) for p in mine)
    if mine and own >= CO_TENANT["own"] * count:
        top = max(mine, key=lambda p: use.get(p, 0.0))
        said.append(f"the job's own processes use {own:.1f} of its {count} CPUs (busiest: "
                    f"{_busy(top, use.get(top, 0.0), count, table, proc, names).describe()})")
    return said


def _busy(pid: int, cpus: float, count: int, table: ProcessTable, proc: ProcFS, names: UserNames) -> Busy:
    info = table.procs.get(pid)
    return Busy(pid, one_line(info.comm if info is not None else "?", 32), user_name(proc, pid, names), cpus,
                cpus / count)
