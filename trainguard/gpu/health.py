"""How a GPU's NVML state reads to a person: unreachable (lost, erroring) and its memory faults."""

from __future__ import annotations

from trainguard.core.model import Status
from trainguard.gpu.nvml import GpuState


def unreachable(gpu: GpuState) -> tuple[Status, str] | None:
    """A lost GPU is CRITICAL; one NVML can't read is UNKNOWN; None when the GPU answered."""
    if gpu.lost:
        return Status.CRITICAL, f"GPU {gpu.index} lost ({gpu.error}); reset or reboot needed"
    if gpu.error:
        return Status.UNKNOWN, f"GPU {gpu.index}: NVML error: {gpu.error}"
    return None


def gpu_faults(gpu: GpuState) -> list[str]:
    """The faults that make a GPU suspect, in words: shown beside an OOM or a CUDA error on it."""
    faults = []
    if gpu.lost:
        faults.append("lost (fell off the bus)")
    if gpu.ecc_uncorrected_volatile:
        faults.append(f"{gpu.ecc_uncorrected_volatile} uncorrected ECC errors since the driver loaded")
    if gpu.remap_failed:
        faults.append("row remapping failed")
    if gpu.remap_pending:
        faults.append("row remapping pending")
    if gpu.retired_pages_pending:
        faults.append("retired pages pending")
    return faults
