"""JobMemoryCheck: a job's memory trend, forecast against the limit the OOM killer enforces.

The limit is the job's cgroup memory limit when it runs under one (SLURM task/cgroup), else the
host's memory: the job can grow by what is available. The growth rate is a Theil-Sen slope over
the last samples, so a checkpoint's spike does not bend it and a large but flat job is no leak.
The default CRITICAL response is the save-and-exit request, before the OOM killer takes the run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil

from trainguard.checks.base import ActionBinding, CheckContext, CheckSettings, JobCheck
from trainguard.core.forecast import Forecast, SeriesWindow
from trainguard.core.model import Metric, Result, Status
from trainguard.core.settings import Duration, Field, SizeLimit
from trainguard.core.thresholds import Floors
from trainguard.core.units import format_bytes, format_duration, parse_size_limit
from trainguard.jobs.model import Job
from trainguard.jobs.tree import job_pids
from trainguard.node.cgroup import CgroupMemory, memory_key, memory_limit_of
from trainguard.node.procfs import ProcFS
from trainguard.node.proctable import ProcessTable

_JOB = ("job_id", "name")
USED = Metric("trainguard_job_memory_bytes", "Memory of the job's processes here (RSS or PSS).", _JOB)
LIMIT = Metric("trainguard_job_memory_limit_bytes", "The limit the job's memory is held to: its cgroup's, else the host's.",
               _JOB)
HEADROOM = Metric("trainguard_job_memory_headroom_bytes", "Memory the job can still take before the OOM killer.", _JOB)
SECONDS_TO_LIMIT = Metric("trainguard_job_memory_seconds_to_limit",
                          "Forecast time until the job's memory reaches its limit at the current trend (+Inf: never).", _JOB)
METRICS = (USED, LIMIT, HEADROOM, SECONDS_TO_LIMIT)


class JobMemorySettings(CheckSettings):
    interval: Duration = Field(30.0, gt=0, description="Time between samples.")
    warn_horizon: Duration = Field(2 * 3600.0, gt=0, description="WARNING when the limit is forecast within this.")
    crit_horizon: Duration = Field(20 * 60.0, gt=0, description="CRITICAL when the limit is forecast within this.")
    floor: SizeLimit = Field(parse_size_limit("3%"), description="CRITICAL when the headroom left is below this "
                                                                 "(percent of the limit, or a size).")
    window: int = Field(40, ge=3, le=1000, description="Samples the trend is fitted over.")
    min_span: Duration = Field(300.0, ge=0, description="No forecast before the samples span this long.")
    pss: bool = Field(False, description="Measure PSS instead of RSS (shared pages counted once; costlier).")
    names: list[str] = Field(default_factory=list, description="Only jobs of these names; empty: every job here.")
    actions: ActionBinding = Field(default_factory=lambda: ActionBinding(critical=["signal"]))


@dataclass(frozen=True)
class JobMemory:
    used: int  # RSS (or PSS) of the job's process tree
    processes: int
    cgroup: CgroupMemory | None
    host_total: int
    host_available: int

    @property
    def limit(self) -> int:
        return self.cgroup.limit if self.cgroup else self.host_total

    @property
    def headroom(self) -> int:
        """How much more the job can take before the OOM killer: what its cgroup or the host has left."""
        return self.cgroup.headroom if self.cgroup else self.host_available

    @property
    def tracked(self) -> int:
        """The figure the trend is fitted on: what the limit is enforced against."""
        return self.cgroup.usage if self.cgroup else self.used

    def limit_text(self) -> str:
        return self.cgroup.describe() if self.cgroup else "host memory"


class NodeReads:
    """What one run reads once for all its jobs, when a job first needs it: the node's mounts, its memory, and the
    limit over each cgroup seen (ten jobs under one cgroup read /proc/self/mountinfo, /proc/meminfo and the cgroup's
    files once, not ten times)."""

    def __init__(self, proc: ProcFS) -> None:
        self._proc = proc
        self._memory: tuple[int, int] | None = None
        self._mountinfo: str | None = None
        self._limits: dict[tuple[str | None, str | None], CgroupMemory | None] = {}

    @property
    def memory(self) -> tuple[int, int]:
        """The host's (total, available) memory."""
        if self._memory is None:
            vm = psutil.virtual_memory()
            self._memory = (vm.total, vm.available)
        return self._memory

    def limit(self, key: tuple[str | None, str | None], cgroup_text: str) -> CgroupMemory | None:
        """The limit over a process with this /proc/PID/cgroup text (`key`: its `memory_key`)."""
        if self._mountinfo is None:
            self._mountinfo = self._proc.mountinfo() or ""
        if key not in self._limits:
            self._limits[key] = memory_limit_of(cgroup_text, self._mountinfo) if self._mountinfo else None
        return self._limits[key]


def gather(job: Job, table: ProcessTable, pss: bool = False, proc: ProcFS | None = None,
           node: NodeReads | None = None) -> list[JobMemory]:
    """The job's memory from the shared snapshot (RSS), or PSS read per process (smaps_rollup: costlier), one figure
    per limit its processes are held to. The OOM killer acts per cgroup: a launcher outside the ranks' cgroup, or
    steps limited apart from each other, are each judged against their own limit; processes under none are judged
    against the host's memory. A process gone since the snapshot (its cgroup unreadable) is left out. Empty when
    the job has no process here. `node`: this run's reads shared with the other jobs (read afresh when None)."""
    pids = job_pids(job, table)
    if not pids:
        return []
    proc = proc or ProcFS()
    by_key: dict[tuple[str | None, str | None], tuple[str, list[int]]] = {}  # memory paths -> (cgroup text, pids)
    for pid in pids:
        text = proc.cgroup(pid)
        if text is not None:
            by_key.setdefault(memory_key(text), (text, []))[1].append(pid)
    node = node or NodeReads(proc)
    groups: dict[Path | None, tuple[CgroupMemory | None, list[int]]] = {}  # one per limit: a job's steps may share it
    for key, (text, members) in by_key.items():
        limit = node.limit(key, text)
        where = limit.path if limit is not None else None
        groups[where] = (limit, groups.get(where, (limit, []))[1] + members)
    total, available = node.memory
    return [JobMemory(_used(members, table, pss), len(members), limit, total, available)
            for limit, members in groups.values()]


def _used(pids: list[int], table: ProcessTable, pss: bool) -> int:
    if not pss:
        return table.rss(pids)
    used = 0
    for pid in pids:
        try:
            used += psutil.Process(pid).memory_full_info().pss
        except psutil.Error:
            continue
    return used


@dataclass(frozen=True)
class Verdict:
    status: Status
    forecast: Forecast | None
    reason: str
    floor: bool = False  # the headroom left is below the floor


def _nearest_kill(judged: tuple[JobMemory, Verdict]) -> tuple[int, bool, float, int]:
    """Which of a job's limits speaks: the worst status; then one below its floor; then the sooner forecast (of a
    WARNING or CRITICAL: a trend too slow to alert on would make the figures shown jump between limits); then the
    least headroom."""
    m, v = judged
    eta = v.forecast.seconds_to_limit if v.forecast is not None and v.status is not Status.OK else None
    return v.status.severity, v.floor, -(eta if eta is not None else math.inf), -m.headroom


def evaluate(m: JobMemory, forecast: Forecast | None, s: JobMemorySettings) -> Verdict:
    status, floor = Floors(None, s.floor).evaluate(m.headroom, m.limit)
    if floor is not None:
        return Verdict(status, forecast, f"only {format_bytes(m.headroom)} left under the {m.limit_text()} "
                                         f"({format_bytes(m.limit)}), below the {floor.describe(in_bytes=True)} floor",
                       floor=True)
    if forecast is None or forecast.seconds_to_limit is None:
        return Verdict(Status.OK, forecast, "")
    eta = forecast.seconds_to_limit
    text = (f"growing {format_bytes(forecast.slope_per_s)}/s: the {m.limit_text()} ({format_bytes(m.limit)}) is "
            f"reached in ~{format_duration(eta)}")
    if eta <= s.crit_horizon:
        return Verdict(Status.CRITICAL, forecast, text)
    if eta <= s.warn_horizon:
        return Verdict(Status.WARNING, forecast, text)
    return Verdict(Status.OK, forecast, "")


def summarize(job: Job, m: JobMemory, v: Verdict) -> str:
    size = f"{format_bytes(m.used)} in {m.processes} process{'es' if m.processes != 1 else ''}"
    if v.reason:
        return f"{job.label()}: {size}; {v.reason}; save and restart it before the OOM killer ends it"
    trend = ""
    if v.forecast is not None:
        trend = "flat" if abs(v.forecast.slope_per_s) < 1024 else f"{format_bytes(v.forecast.slope_per_s)}/s"
        trend = f", trend {trend}"
    return f"{job.label()}: {size}{trend}, {format_bytes(m.headroom)} headroom under the {m.limit_text()}"


class JobMemoryCheck(JobCheck):
    Settings = JobMemorySettings
    metrics = METRICS
    settings: JobMemorySettings

    def __init__(self, name: str, settings: CheckSettings, context: CheckContext) -> None:
        super().__init__(name, settings, context)
        self._windows: dict[tuple[str, str], SeriesWindow] = {}  # (job, its limit's cgroup or "") -> series

    def run(self) -> Sequence[Result]:
        view = self.view()
        now = self.context.clock()
        results = self.source_errors(view)
        seen = set()
        table = self.context.processes.get()
        node = NodeReads(self.context.proc)
        for job in self.jobs_here(view, self.settings.names):
            judged = []
            for m in gather(job, table, self.settings.pss, self.context.proc, node):
                key = (job.key, str(m.cgroup.path) if m.cgroup else "")  # a series per limit
                seen.add(key)
                window = self._windows.setdefault(key, SeriesWindow(self.settings.window, 3, self.settings.min_span))
                window.add(now, m.tracked)
                verdict = evaluate(m, window.forecast_growth_into(m.headroom), self.settings)
                judged.append((m, verdict))
            if judged:  # the limit nearest to an OOM kill speaks for the job, with the job's totals
                m, verdict = max(judged, key=_nearest_kill)
                used, processes = sum(g.used for g, _ in judged), sum(g.processes for g, _ in judged)
                results.append(self._result(job, replace(m, used=used, processes=processes), verdict))
        for key in set(self._windows) - seen:  # the job (or its processes under that limit) ended: the series too
            del self._windows[key]
        return results

    def clear(self, subject: str, at: float) -> None:
        """The job's processes started afresh (restarted in place) or the operator says the cause is fixed: the
        growth of the processes gone is not the new ones', so the series start again."""
        for key in [k for k in self._windows if k[0] == subject]:
            del self._windows[key]

    def _result(self, job: Job, m: JobMemory, v: Verdict) -> Result:
        labels = {"job_id": job.job_id or job.name, "name": job.name}
        samples = [USED(m.used, labels), LIMIT(m.limit, labels), HEADROOM(m.headroom, labels)]
        eta = v.forecast.seconds_to_limit if v.forecast else None
        if v.forecast is not None:
            samples.append(SECONDS_TO_LIMIT(v.forecast.eta_metric, labels))
        details: dict[str, Any] = {
            "job_key": job.key, "job_id": job.job_id, "used_bytes": m.used, "processes": m.processes,
            "limit_bytes": m.limit, "limit": m.limit_text(), "headroom_bytes": m.headroom, "tracked_bytes": m.tracked,
            "growth_bytes_per_s": v.forecast.slope_per_s if v.forecast else None, "seconds_to_limit": eta}
        return self.result(job.key, v.status, summarize(job, m, v), details, samples)
