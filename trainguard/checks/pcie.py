"""PcieCheck: each GPU's PCIe link runs at its maximum width and (while the GPU is busy) generation, and its replay
counter grows slower than its limit.

A link that trained at x8 instead of x16, or at Gen3 in a Gen5 slot, halves host-device bandwidth (data loading,
checkpoints, GPUDirect RDMA) without any error: WARNING. Replays are link-level retransmissions; many of them are a
marginal riser, cable or slot, often before the GPU falls off the bus (XID 79). Idle on a node without NVML.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trainguard.checks.base import CheckContext, CheckSettings, NvmlCheck
from trainguard.core.counters import CounterWindow
from trainguard.core.model import Metric, Result, Sample, Status, worst
from trainguard.core.settings import Duration, Field, NonNegativeInt
from trainguard.core.units import format_duration
from trainguard.gpu.nvml import PcieLink, Reading

_GPU = ("gpu", "uuid")
GENERATION = Metric("trainguard_gpu_pcie_link_generation", "PCIe generation the GPU's link runs at now.", _GPU)
GENERATION_MAX = Metric("trainguard_gpu_pcie_link_generation_max",
                        "Highest PCIe generation this GPU can run in its slot.", _GPU)
WIDTH = Metric("trainguard_gpu_pcie_link_width", "PCIe lanes the GPU's link runs on now.", _GPU)
WIDTH_MAX = Metric("trainguard_gpu_pcie_link_width_max", "PCIe lanes this GPU can run on in its slot.", _GPU)
REPLAYS = Metric("trainguard_gpu_pcie_replays_total", "PCIe replays (link-level retransmissions) of the GPU's link.",
                 _GPU, counter=True)
METRICS = (GENERATION, GENERATION_MAX, WIDTH, WIDTH_MAX, REPLAYS)


class PcieSettings(CheckSettings):
    busy_utilization: int = Field(50, ge=0, le=100, description="A link below its maximum generation counts only "
                                  "while the GPU is at least this busy (percent): an idle GPU lowers its link speed "
                                  "to save power.")
    error_window: Duration = Field(3600.0, gt=0, description="The window the replay counter's growth is summed over.")
    replay_max: NonNegativeInt = Field(480, description="WARNING when replays grow by more than this within "
                                       "error_window (8 a minute: the most NVIDIA's DCGM lets pass).")


def evaluate(index: int, link: PcieLink, replays_grown: int, s: PcieSettings) -> tuple[Status, str]:
    findings: list[tuple[Status, str]] = []
    if link.width is not None and link.width_max is not None and link.width < link.width_max:
        findings.append((Status.WARNING, f"PCIe link at x{link.width} of x{link.width_max}: a degraded link (reseat the "
                                         "GPU, check its riser or slot); host transfers run at a fraction of their speed"))
    busy = link.utilization is not None and link.utilization >= s.busy_utilization
    if link.generation is not None and link.generation_max is not None and link.generation < link.generation_max \
            and busy:
        findings.append((Status.WARNING, f"PCIe Gen{link.generation} of Gen{link.generation_max} while "
                                         f"{link.utilization}% busy: the link trained down"))
    if replays_grown > s.replay_max:
        findings.append((Status.WARNING, f"PCIe replays +{replays_grown} in {format_duration(s.error_window)} (limit "
                                         f"{s.replay_max}): a marginal link, often before the GPU falls off the bus"))
    if findings:
        return worst(f[0] for f in findings), f"GPU {index}: " + "; ".join(t for _, t in findings)
    gen = f"Gen{link.generation}" if link.generation is not None else "Gen?"
    width = f"x{link.width}" if link.width is not None else "x?"
    return Status.OK, f"GPU {index}: PCIe {gen} {width}"


class PcieCheck(NvmlCheck):
    Settings = PcieSettings
    metrics = METRICS
    settings: PcieSettings

    def __init__(self, name: str, settings: CheckSettings, context: CheckContext) -> None:
        super().__init__(name, settings, context)
        self.window = CounterWindow(self.settings.error_window, interval=self.settings.interval)

    def run(self) -> Sequence[Result]:
        readings = self.present(self.nvml_read(self.nvml.pcie))
        now = self.context.clock()
        self.window.keep(r.gpu.uuid for r in readings)
        return [self.unanswered(r) or self._one(r, now) for r in readings]

    def _one(self, reading: Reading[PcieLink], now: float) -> Result:
        gpu, link = reading.gpu, reading.value or PcieLink(None, None, None, None, None, None)
        grown = 0
        if link.replays is not None:
            self.window.update(gpu.uuid, link.replays, now)
            grown = self.window.increase(gpu.uuid, now)
        labels = self.gpu_labels(reading)
        samples: list[Sample] = [metric(value, labels) for metric, value in (
            (GENERATION, link.generation), (GENERATION_MAX, link.generation_max), (WIDTH, link.width),
            (WIDTH_MAX, link.width_max), (REPLAYS, link.replays)) if value is not None]
        status, summary = evaluate(gpu.index, link, grown, self.settings)
        details: dict[str, Any] = {"index": gpu.index, "uuid": gpu.uuid, "bus_id": gpu.bus_id,
                                   "generation": link.generation, "generation_max": link.generation_max,
                                   "width": link.width, "width_max": link.width_max, "replays": link.replays,
                                   "replays_in_window": grown, "utilization": link.utilization}
        return self.result(gpu.uuid or f"gpu{gpu.index}", status, summary, details, samples)
