"""GpuMemoryCheck: each GPU's memory trend forecast against its total, and who holds the memory.

Every compute process on a GPU (NVML, host pids) is mapped to the job it belongs to; one that
belongs to no known job (a leaked earlier run, a co-tenant) is reported with pid, user and command,
because it silently shrinks the next job's budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psutil

from trainguard.checks.base import CheckContext, CheckSettings, NvmlCheck
from trainguard.core.forecast import Forecast, SeriesWindow
from trainguard.core.model import Metric, Result, Status, worst
from trainguard.core.settings import Duration, Field, Size, SizeLimit, StatusName
from trainguard.core.thresholds import Floors
from trainguard.core.units import format_bytes, format_duration, parse_size
from trainguard.gpu.health import unreachable
from trainguard.gpu.nvml import GpuState
from trainguard.jobs.model import Job
from trainguard.jobs.tree import job_pids
from trainguard.node.users import UserNames

SECONDS_TO_FULL = Metric("trainguard_gpu_memory_seconds_to_full",
                         "Forecast time until the GPU's memory is full at the current trend (+Inf: never).", ("gpu", "uuid"))
PROCESS_MEMORY = Metric("trainguard_gpu_process_memory_bytes", "GPU memory held by one process.",
                        ("gpu", "uuid", "pid", "job_id"))
METRICS = (SECONDS_TO_FULL, PROCESS_MEMORY)


class GpuMemorySettings(CheckSettings):
    interval: Duration = Field(30.0, gt=0, description="Time between samples.")
    warn_horizon: Duration = Field(2 * 3600.0, gt=0, description="WARNING when a GPU is forecast full within this.")
    crit_horizon: Duration = Field(20 * 60.0, gt=0, description="CRITICAL when a GPU is forecast full within this.")
    floor: SizeLimit | None = Field(None, description="CRITICAL below this much free GPU memory. Off by default: "
                                                      "caching allocators keep GPUs nearly full by design.")
    window: int = Field(40, ge=3, le=1000, description="Samples the trend is fitted over.")
    min_span: Duration = Field(300.0, ge=0, description="No forecast before the samples span this long.")
    unknown_process: StatusName = Field(Status.WARNING, description="Status of GPU memory held by no known job.")
    unknown_min: Size = Field(parse_size("256MiB"), description="Ignore unknown processes holding less than this.")


@dataclass(frozen=True)
class Holder:
    pid: int
    used: int | None
    job: Job | None
    user: str | None
    command: str

    def describe(self) -> str:
        owner = self.job.label() if self.job else f"no known job, user {self.user or '?'}: {self.command[:80]}"
        used = format_bytes(self.used) if self.used is not None else "unknown amount"
        return f"pid {self.pid} ({owner}) {used}"


def holders(gpu: GpuState, owner_of: dict[int, Job], names: UserNames) -> list[Holder]:
    out = []
    for p in gpu.processes or ():
        user, command = None, "?"
        try:
            proc = psutil.Process(p.pid)
            user, command = names.name(proc.uids().real), " ".join(proc.cmdline()) or proc.name()
        except psutil.Error:
            pass
        out.append(Holder(p.pid, p.used, owner_of.get(p.pid), user, command))
    return out


@dataclass(frozen=True)
class Verdict:
    status: Status
    reasons: tuple[str, ...]


def evaluate(gpu: GpuState, forecast: Forecast | None, found: list[Holder], jobs_known: bool,
             s: GpuMemorySettings) -> Verdict:
    broken = unreachable(gpu)
    if broken is not None:
        return Verdict(broken[0], (broken[1],))
    statuses, reasons = [Status.OK], []
    total, used = gpu.memory_total, gpu.memory_used
    if total is not None and used is not None:
        status, floor = Floors(None, s.floor).evaluate(total - used, total)
        if floor is not None:
            statuses.append(status)
            reasons.append(f"{format_bytes(total - used)} free, below the {floor.describe(in_bytes=True)} floor")
    if forecast is not None and forecast.seconds_to_limit is not None:
        eta = forecast.seconds_to_limit
        status = Status.CRITICAL if eta <= s.crit_horizon else Status.WARNING if eta <= s.warn_horizon else Status.OK
        if status is not Status.OK:
            statuses.append(status)
            reasons.append(f"growing {format_bytes(forecast.slope_per_s)}/s: full in ~{format_duration(eta)}")
    if jobs_known:
        strays = [h for h in found if h.job is None and (h.used is None or h.used >= s.unknown_min)]
        if strays:
            statuses.append(s.unknown_process)
            reasons.append("memory held outside any known job: " + "; ".join(h.describe() for h in strays))
    return Verdict(worst(statuses), tuple(reasons))


def summarize(gpu: GpuState, v: Verdict, found: list[Holder]) -> str:
    if gpu.lost or gpu.error:
        return v.reasons[0]
    mem = (f"{format_bytes(gpu.memory_used)} of {format_bytes(gpu.memory_total)} used"
           if gpu.memory_total is not None and gpu.memory_used is not None else "memory not reported")
    jobs = sorted({h.job.label() for h in found if h.job})
    head = f"GPU {gpu.index}: {mem}" + (f" by {', '.join(jobs)}" if jobs else "")
    return "; ".join((head, *v.reasons))


class GpuMemoryCheck(NvmlCheck):
    layer = "job"

    Settings = GpuMemorySettings
    metrics = METRICS
    settings: GpuMemorySettings

    def __init__(self, name: str, settings: CheckSettings, context: CheckContext) -> None:
        super().__init__(name, settings, context)
        self._windows: dict[str, SeriesWindow] = {}

    def _owners(self) -> tuple[dict[int, Job], bool]:
        """pid -> job over every job here; False when jobs aren't known (no source, or a source failing)."""
        if self.context.jobs is None:
            return {}, False
        view = self.context.jobs.view()
        table = self.context.processes.get()
        owner_of = {pid: job for job in view.on_node() for pid in job_pids(job, table)}
        return owner_of, not view.errors

    def run(self) -> Sequence[Result]:
        gpus = self.gpus()
        owner_of, jobs_known = self._owners()
        now = self.context.clock()
        results = []
        for gpu in gpus:
            key = gpu.uuid or str(gpu.index)
            window = self._windows.setdefault(key, SeriesWindow(self.settings.window, 3, self.settings.min_span))
            forecast = None
            if gpu.memory_total is not None and gpu.memory_used is not None:
                window.add(now, gpu.memory_used)
                forecast = window.forecast_growth_into(gpu.memory_total - gpu.memory_used)
            found = holders(gpu, owner_of, self.context.user_names)
            verdict = evaluate(gpu, forecast, found, jobs_known, self.settings)
            results.append(self._result(gpu, verdict, forecast, found))
        return results

    def _result(self, gpu: GpuState, v: Verdict, forecast: Forecast | None, found: list[Holder]) -> Result:
        labels = {"gpu": str(gpu.index), "uuid": gpu.uuid}
        samples = []
        if forecast is not None:
            samples.append(SECONDS_TO_FULL(forecast.eta_metric, labels))
        for h in found:
            if h.used is not None:
                samples.append(PROCESS_MEMORY(h.used, {**labels, "pid": h.pid,
                                                       "job_id": (h.job.job_id or h.job.name) if h.job else ""}))
        owners = {h.job.key for h in found if h.job}
        details: dict[str, Any] = {
            "index": gpu.index, "uuid": gpu.uuid, "memory_total_bytes": gpu.memory_total,
            "memory_used_bytes": gpu.memory_used, "growth_bytes_per_s": forecast.slope_per_s if forecast else None,
            "seconds_to_full": forecast.seconds_to_limit if forecast else None,
            "processes": [{"pid": h.pid, "used_bytes": h.used, "job_key": h.job.key if h.job else None,
                           "user": h.user, "command": h.command[:200]} for h in found]}
        if len(owners) == 1:  # actions bound to this check act on the one job using the GPU
            details["job_key"] = owners.pop()
        return self.result(gpu.uuid or f"gpu{gpu.index}", v.status, summarize(gpu, v, found), details, samples)
