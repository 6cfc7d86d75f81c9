"""GpuConfigCheck: the GPUs are set up the way long training runs need: persistence mode on, one VBIOS version per GPU
model on the node, and the driver (and VBIOS) the site expects.

Without persistence mode the driver tears a GPU's state down whenever no process holds it, so each job start pays
the initialisation and settings (clocks, power limits) are lost. Mixed VBIOS versions on one node are a known cause
of hangs in collectives; a driver other than the fleet's is how a half-finished upgrade shows. All WARNING. Idle on a
node without NVML.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainguard.checks.base import CheckSettings, NvmlCheck
from trainguard.core.model import Metric, Result, Status
from trainguard.core.settings import Duration, Field
from trainguard.gpu.nvml import GpuConfig, Reading

_GPU = ("gpu", "uuid")
PERSISTENCE = Metric("trainguard_gpu_persistence_mode", "1 if the GPU's persistence mode is on.", _GPU)
INFO = Metric("trainguard_gpu_info", "Always 1: the GPU's model, VBIOS and the node's driver version as labels.",
              (*_GPU, "name", "vbios", "driver"))
VBIOS_VERSIONS = Metric("trainguard_gpu_vbios_versions", "Distinct VBIOS versions among this node's GPUs of one model.",
                        ("name",))
METRICS = (PERSISTENCE, INFO, VBIOS_VERSIONS)


class GpuConfigSettings(CheckSettings):
    interval: Duration = Field(300.0, gt=0, description="Time between runs: these settings change rarely.")
    persistence: bool = Field(True, description="WARNING for a GPU whose persistence mode is off.")
    expected_driver: str | None = Field(None, description="The driver version this node should run, e.g. "
                                        "'550.54.15'; WARNING when it differs. Unset: not checked.")
    expected_vbios: dict[str, str] = Field(default_factory=dict, description="GPU model -> the VBIOS version it should "
                                           "run, e.g. {'NVIDIA H100 80GB HBM3' = '96.00.99.00.01'}.")


def by_model(configs: Sequence[tuple[str, str | None]]) -> dict[str, set[str]]:
    """(model, vbios) of every GPU -> the VBIOS versions of each model."""
    out: dict[str, set[str]] = {}
    for name, vbios in configs:
        out.setdefault(name, set()).update([vbios] if vbios else [])
    return out


def versions(models: dict[str, set[str]], s: GpuConfigSettings) -> list[tuple[Status, str]]:
    """Drift among GPUs of one model, and VBIOS other than the expected one."""
    findings = []
    for name, seen in sorted(models.items()):
        if len(seen) > 1:
            findings.append((Status.WARNING, f"{name}: mixed VBIOS versions {', '.join(sorted(seen))} on one node: "
                                             "flash them to one version (mixed VBIOS is a known cause of hangs)"))
        wanted = s.expected_vbios.get(name)
        if wanted and seen - {wanted}:
            findings.append((Status.WARNING, f"{name}: VBIOS {', '.join(sorted(seen - {wanted}))}, expected {wanted}"))
    return findings


class GpuConfigCheck(NvmlCheck):
    Settings = GpuConfigSettings
    metrics = METRICS
    settings: GpuConfigSettings

    def run(self) -> Sequence[Result]:
        driver, all_readings = self.nvml_read(self.nvml.config)
        readings = self.present(all_readings)
        results = [self.unanswered(r) or self._one(r, driver or "") for r in readings]
        counts = by_model([(r.gpu.name, r.value.vbios) for r in readings if r.value is not None])
        findings = versions(counts, self.settings)
        if self.settings.expected_driver and driver and driver != self.settings.expected_driver:
            findings.append((Status.WARNING, f"driver {driver}, expected {self.settings.expected_driver}: a node the "
                                             "upgrade missed, or one that got ahead"))
        samples = [VBIOS_VERSIONS(len(seen), {"name": name}) for name, seen in sorted(counts.items())]
        status = Status.WARNING if findings else Status.OK
        vbios = ", ".join(f"{n}: {', '.join(sorted(v))}" for n, v in sorted(counts.items())) or "?"
        summary = "; ".join(t for _, t in findings) if findings else f"driver {driver or '?'}, VBIOS {vbios}"
        results.append(self.result("versions", status, summary, {"driver": driver, "vbios": {
            n: sorted(v) for n, v in counts.items()}}, samples))
        return results

    def _one(self, reading: Reading[GpuConfig], driver: str) -> Result:
        gpu, config = reading.gpu, reading.value or GpuConfig(None, None)
        labels = self.gpu_labels(reading)
        samples = [INFO(1, {**labels, "name": gpu.name, "vbios": config.vbios or "", "driver": driver})]
        if config.persistence is not None:
            samples.append(PERSISTENCE(1 if config.persistence else 0, labels))
        if config.persistence is False and self.settings.persistence:
            status, summary = Status.WARNING, (f"GPU {gpu.index}: persistence mode off: the driver tears the GPU down "
                                               "between jobs; enable nvidia-persistenced")
        else:
            mode = {True: "on", False: "off", None: "unknown"}[config.persistence]
            status, summary = Status.OK, f"GPU {gpu.index}: persistence mode {mode}, VBIOS {config.vbios or '?'}"
        return self.result(gpu.uuid or f"gpu{gpu.index}", status, summary,
                           {"index": gpu.index, "uuid": gpu.uuid, "persistence": config.persistence,
                            "vbios": config.vbios, "driver": driver}, samples)
