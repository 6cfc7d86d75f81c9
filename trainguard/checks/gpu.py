"""GpuCheck: every GPU answers NVML, none is lost, the count is as expected, temperature is sane."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from trainguard.checks.base import ActionBinding, CheckContext, CheckIdle, CheckSettings, NvmlCheck
from trainguard.core.model import Metric, Result, Status, worst
from trainguard.core.settings import Duration, Field
from trainguard.core.units import format_bytes, format_duration
from trainguard.gpu.health import unreachable
from trainguard.gpu.nvml import CLOCK_EVENTS, GpuState, NvmlUnavailableError

COUNT_KEY = "gpu.max_count"

_GPU = ("gpu", "uuid")
UP = Metric("trainguard_gpu_up", "1 if the GPU answers NVML, 0 if it is lost or erroring.", _GPU)
MEMORY_TOTAL = Metric("trainguard_gpu_memory_total_bytes", "GPU framebuffer memory.", _GPU)
MEMORY_USED = Metric("trainguard_gpu_memory_used_bytes", "GPU framebuffer memory in use.", _GPU)
TEMPERATURE = Metric("trainguard_gpu_temperature_celsius", "GPU core temperature.", _GPU)
ECC_VOLATILE = Metric("trainguard_gpu_ecc_uncorrected_volatile", "Uncorrected ECC errors since the driver loaded.", _GPU)
ECC_AGGREGATE = Metric("trainguard_gpu_ecc_uncorrected_aggregate", "Uncorrected ECC errors over the GPU's lifetime.", _GPU)
RETIRED_PENDING = Metric("trainguard_gpu_retired_pages_pending", "1 if retired pages await a reset.", _GPU)
REMAP_PENDING = Metric("trainguard_gpu_row_remap_pending", "1 if a row remap awaits a GPU reset.", _GPU)
REMAP_FAILED = Metric("trainguard_gpu_row_remap_failed", "1 if a row remap failed (hardware fault).", _GPU)
CLOCK_EVENT = Metric("trainguard_gpu_clock_event_active", "1 while this clock slowdown reason is active.", (*_GPU, "reason"))
COUNT = Metric("trainguard_gpu_count", "GPUs answering NVML.")
EXPECTED = Metric("trainguard_gpu_expected_count", "GPUs this node should have.")
METRICS = (UP, MEMORY_TOTAL, MEMORY_USED, TEMPERATURE, ECC_VOLATILE, ECC_AGGREGATE, RETIRED_PENDING, REMAP_PENDING,
           REMAP_FAILED, CLOCK_EVENT, COUNT, EXPECTED)

log = logging.getLogger("trainguard.checks.gpu")


class GpuSettings(CheckSettings):
    expected_count: int | None = Field(None, ge=0, description="CRITICAL when fewer GPUs answer; unset: the most "
                                                               "ever seen on this node.")
    temperature_warning: int = Field(85, description="WARNING at or above this GPU temperature (Celsius).")
    temperature_critical: int = Field(92, description="CRITICAL at or above this GPU temperature (Celsius).")
    throttle_for: Duration = Field(300.0, ge=0, description="WARNING when a hardware or thermal slowdown lasts this long.")
    actions: ActionBinding = Field(default_factory=lambda: ActionBinding(critical=["signal", "drain", "requeue"]))


def evaluate(gpu: GpuState, s: GpuSettings, throttled_for: float = 0.0) -> tuple[Status, str]:
    """The worst finding on one GPU, most severe first; every finding is listed in the summary."""
    label = f"GPU {gpu.index}"
    broken = unreachable(gpu)
    if broken is not None:
        return broken
    findings: list[tuple[Status, str]] = []
    if gpu.remap_failed:
        findings.append((Status.CRITICAL, "row remapping failed: hardware fault, RMA the GPU"))
    if gpu.ecc_uncorrected_volatile:
        findings.append((Status.CRITICAL, f"{gpu.ecc_uncorrected_volatile} uncorrected ECC errors since the driver "
                                          "loaded: reset the GPU"))
    if gpu.remap_pending:
        findings.append((Status.WARNING, "row remapping pending: reset the GPU once its job ends"))
    if gpu.retired_pages_pending:
        findings.append((Status.WARNING, "retired pages pending: reset the GPU once its job ends"))
    t = gpu.temperature_c
    if t is not None and t >= s.temperature_critical:
        findings.append((Status.CRITICAL, f"at {t}°C, at or above the {s.temperature_critical}°C critical threshold"))
    elif t is not None and t >= s.temperature_warning:
        findings.append((Status.WARNING, f"at {t}°C, at or above the {s.temperature_warning}°C warning threshold"))
    reasons = throttle_names(gpu.clock_event_reasons)
    if reasons and throttled_for >= s.throttle_for:
        findings.append((Status.WARNING, f"clocks slowed ({', '.join(reasons)}) for {format_duration(throttled_for)}"))
    if findings:
        status = worst(f[0] for f in findings)
        return status, f"{label}: " + "; ".join(text for _, text in sorted(findings, key=lambda f: -f[0].severity))
    mem = (f", {format_bytes(gpu.memory_used)} of {format_bytes(gpu.memory_total)} used"
           if gpu.memory_total is not None and gpu.memory_used is not None else "")
    temp = f", {t}°C" if t is not None else ""
    return Status.OK, f"{label} {gpu.name}{mem}{temp}"


def throttle_names(mask: int | None) -> list[str]:
    return [name for bit, name in CLOCK_EVENTS.items() if mask and mask & bit]


class GpuCheck(NvmlCheck):
    Settings = GpuSettings
    metrics = METRICS
    settings: GpuSettings

    def __init__(self, name: str, settings: CheckSettings, context: CheckContext) -> None:
        super().__init__(name, settings, context)
        self._throttled_since: dict[str, float] = {}

    def run(self) -> Sequence[Result]:
        try:
            gpus = self.nvml.gpus()
        except NvmlUnavailableError as exc:
            return [self._without_nvml(str(exc))]
        now = self.context.clock()
        results = [self._one(gpu, now) for gpu in gpus]
        results.append(self._count(gpus))
        return results

    def _one(self, gpu: GpuState, now: float) -> Result:
        key = gpu.uuid or str(gpu.index)
        if throttle_names(gpu.clock_event_reasons):
            since = self._throttled_since.setdefault(key, now)
        else:
            self._throttled_since.pop(key, None)
            since = now
        status, summary = evaluate(gpu, self.settings, now - since)
        labels = {"gpu": str(gpu.index), "uuid": gpu.uuid}
        samples = [UP(0 if gpu.lost or gpu.error else 1, labels)]
        for metric, value in ((MEMORY_TOTAL, gpu.memory_total), (MEMORY_USED, gpu.memory_used),
                              (TEMPERATURE, gpu.temperature_c), (ECC_VOLATILE, gpu.ecc_uncorrected_volatile),
                              (ECC_AGGREGATE, gpu.ecc_uncorrected_aggregate), (RETIRED_PENDING, gpu.retired_pages_pending),
                              (REMAP_PENDING, gpu.remap_pending), (REMAP_FAILED, gpu.remap_failed)):
            if value is not None:
                samples.append(metric(float(value), labels))
        if gpu.clock_event_reasons is not None:
            for bit, reason in CLOCK_EVENTS.items():
                samples.append(CLOCK_EVENT(1 if gpu.clock_event_reasons & bit else 0, {**labels, "reason": reason}))
        details = {"index": gpu.index, "uuid": gpu.uuid, "serial": gpu.serial, "name": gpu.name, "bus_id": gpu.bus_id,
                   "lost": gpu.lost,  # with the pending remaps and retirements: what the ledger sees a reset clear
                   "memory_total_bytes": gpu.memory_total, "memory_used_bytes": gpu.memory_used,
                   "temperature_c": gpu.temperature_c, "ecc_uncorrected_volatile": gpu.ecc_uncorrected_volatile,
                   "ecc_uncorrected_aggregate": gpu.ecc_uncorrected_aggregate, "remap_pending": gpu.remap_pending,
                   "remap_failed": gpu.remap_failed, "retired_pages_pending": gpu.retired_pages_pending,
                   "clock_events": throttle_names(gpu.clock_event_reasons)}
        return self.result(gpu.uuid or f"gpu{gpu.index}", status, summary, details, samples)

    def _without_nvml(self, reason: str) -> Result:
        """No NVML: idle on a node that never had GPUs; CRITICAL where GPUs are configured or were seen here (the
        driver failed to load after a reboot, or was unloaded), since the node can no longer run GPU jobs."""
        expected = self.settings.expected_count
        source = "configured"
        if expected is None:
            expected, source = int(self.context.state.get(COUNT_KEY) or 0), "seen on this node"
        if expected <= 0:
            raise CheckIdle(reason)
        return self.result("count", Status.CRITICAL, f"0 of {expected} GPUs answering ({expected} {source}): {reason}",
                           {"answering": 0, "expected": expected, "source": source, "nvml": reason},
                           [COUNT(0), EXPECTED(expected)])

    def _count(self, gpus: list[GpuState]) -> Result:
        """Fewer GPUs than configured, or than this node ever had: one fell off the bus or out of the driver."""
        answering = sum(1 for g in gpus if not g.lost and not g.error)
        expected = self.settings.expected_count
        source = "configured"
        if expected is None:
            state = self.context.state
            seen = int(state.get(COUNT_KEY) or 0)
            if len(gpus) > seen:
                state.put(COUNT_KEY, str(len(gpus)))
            expected, source = max(seen, len(gpus)), "seen on this node"
        status = Status.CRITICAL if answering < expected else Status.OK
        return self.result("count", status, f"{answering} of {expected} GPUs answering ({expected} {source})",
                           {"answering": answering, "expected": expected, "source": source},
                           [COUNT(answering), EXPECTED(expected)])
