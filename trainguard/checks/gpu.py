"""GpuCheck: every GPU answers NVML, none is lost, the count is as expected, temperature is sane."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pydantic import Field

from trainguard.agent.logs import kv
from trainguard.checks.base import Check, CheckContext, CheckSettings
from trainguard.model import Result, Sample, Status
from trainguard.nvml import GpuState, Nvml, NvmlUnavailableError
from trainguard.units import format_bytes

log = logging.getLogger("trainguard.checks.gpu")


class GpuSettings(CheckSettings):
    expected_count: int | None = Field(None, ge=0, description="CRITICAL when fewer GPUs answer; unset: no count check.")
    temperature_warning: int = Field(85, description="WARNING at or above this GPU temperature (Celsius).")
    temperature_critical: int = Field(92, description="CRITICAL at or above this GPU temperature (Celsius).")


def evaluate(gpu: GpuState, s: GpuSettings) -> tuple[Status, str]:
    label = f"GPU {gpu.index}"
    if gpu.lost:
        return Status.CRITICAL, f"{label} lost ({gpu.error}); reset or reboot needed"
    if gpu.error:
        return Status.UNKNOWN, f"{label}: NVML error: {gpu.error}"
    t = gpu.temperature_c
    if t is not None and t >= s.temperature_critical:
        return Status.CRITICAL, f"{label} at {t}°C, at or above the {s.temperature_critical}°C critical threshold"
    if t is not None and t >= s.temperature_warning:
        return Status.WARNING, f"{label} at {t}°C, at or above the {s.temperature_warning}°C warning threshold"
    mem = (f", {format_bytes(gpu.memory_used)} of {format_bytes(gpu.memory_total)} used"
           if gpu.memory_total is not None and gpu.memory_used is not None else "")
    temp = f", {t}°C" if t is not None else ""
    return Status.OK, f"{label} {gpu.name}{mem}{temp}"


class GpuCheck(Check):
    Settings = GpuSettings
    settings: GpuSettings

    def __init__(self, name: str, settings: CheckSettings, context: CheckContext) -> None:
        super().__init__(name, settings, context)
        self.nvml: Nvml = context.extras.get("nvml") or Nvml()
        self._reported_unavailable = False

    def run(self) -> Sequence[Result]:
        try:
            gpus = self.nvml.gpus()
        except NvmlUnavailableError as exc:
            if not self._reported_unavailable:  # one log line, not a traceback per run
                log.warning("GPU checks off", extra=kv(reason=str(exc)))
                self._reported_unavailable = True
            return [self.result("nvml", Status.UNKNOWN, str(exc))]
        self._reported_unavailable = False
        results = []
        for gpu in gpus:
            status, summary = evaluate(gpu, self.settings)
            labels = {"gpu": str(gpu.index), "uuid": gpu.uuid}
            samples = [Sample("trainguard_gpu_up", 0 if gpu.lost or gpu.error else 1, labels,
                              "1 if the GPU answers NVML, 0 if it is lost or erroring.")]
            for metric, value, help_text in (
                ("trainguard_gpu_memory_total_bytes", gpu.memory_total, "GPU framebuffer memory."),
                ("trainguard_gpu_memory_used_bytes", gpu.memory_used, "GPU framebuffer memory in use."),
                ("trainguard_gpu_temperature_celsius", gpu.temperature_c, "GPU core temperature."),
            ):
                if value is not None:
                    samples.append(Sample(metric, value, labels, help_text))
            details = {"index": gpu.index, "uuid": gpu.uuid, "name": gpu.name, "bus_id": gpu.bus_id,
                       "memory_total_bytes": gpu.memory_total, "memory_used_bytes": gpu.memory_used,
                       "temperature_c": gpu.temperature_c}
            results.append(self.result(gpu.uuid or f"gpu{gpu.index}", status, summary, details, samples))
        expected = self.settings.expected_count
        if expected is not None:
            answering = sum(1 for g in gpus if not g.lost)
            status = Status.CRITICAL if answering < expected else Status.OK
            results.append(self.result("count", status, f"{answering} of {expected} expected GPUs answering",
                                       {"answering": answering, "expected": expected}))
        return results
