"""What on a GPU can make a job's steps slower, in words: fail-slow evidence for the job_pace check.

Each rule reads one NVML fact against a limit the GPU itself reports (its maximum SM clock, its enforced power limit,
its slowdown temperature, its maximum PCIe link), so no number here is a model's: a busy GPU held below its clock by
a hardware slowdown, thermal or power brake, or the software power cap; a link trained below its width or generation,
or replaying; ECC and row-remap faults; another process on the GPU (who, and its share of the card's memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from trainguard.core.units import format_bytes
from trainguard.gpu.health import gpu_faults
from trainguard.gpu.nvml import SLOWDOWN_REASONS, Clocks, GpuState, PcieLink

REASON_WORDS = {"sw_power_cap": "software power cap", "hw_slowdown": "HW slowdown", "sw_thermal": "thermal slowdown",
                "hw_thermal": "HW thermal slowdown", "hw_power_brake": "power brake"}
NEAR_SLOWDOWN_C = 5  # within this of its slowdown temperature, a GPU is about to slow itself
AT_POWER_LIMIT = 0.98  # drawing this share of its enforced limit: the power cap is what holds its clock
MAX_OTHERS = 3  # other processes named per GPU (their count is said whole)
BUSY = 10  # GPU busy percent above which a lower PCIe generation is a fault (an idle GPU lowers it to save power)


@dataclass(frozen=True)
class GpuEvidence:
    index: int
    clock_ratio: float | None  # SM clock / its maximum
    reasons: tuple[str, ...]  # SLOWDOWN_REASONS names active now
    said: tuple[str, ...]  # each fact in words

    def describe(self) -> str:
        return f"GPU {self.index}: " + ", ".join(self.said)


def co_tenant(pid: int, command: str, user: str, used: int | None, total: int | None) -> str:
    """Another process on a job's GPU in words: who, and the memory it holds there (NVML gives no per-process
    utilisation here: its share of the card's memory is the share said)."""
    held = f" {format_bytes(used)}" + (f", {used / total:.0%} of its memory" if total else "") if used else ""
    return f"pid {pid} ({command}, user {user}){held}"


def reasons(mask: int | None) -> tuple[str, ...]:
    return tuple(name for bit, name in sorted(SLOWDOWN_REASONS.items()) if mask and mask & bit)


def gpu_evidence(index: int, clocks: Clocks | None, pcie: PcieLink | None = None, state: GpuState | None = None,
                 replays: int = 0, others: Sequence[str] = (), count: int | None = None) -> GpuEvidence:
    """What on GPU `index` can slow a job: `replays` are the PCIe replays since the last look, `others` the other
    processes on it, each in words (`co_tenant`; `count` of them in all when only some are named)."""
    said: list[str] = []
    ratio = None
    active: tuple[str, ...] = ()
    if clocks is not None:
        if clocks.sm_mhz is not None and clocks.sm_max_mhz:
            ratio = clocks.sm_mhz / clocks.sm_max_mhz
        active = reasons(clocks.reasons)
        if active:
            clock = f" (SM clock {clocks.sm_mhz} of {clocks.sm_max_mhz} MHz)" if ratio is not None else ""
            said.append(" and ".join(REASON_WORDS[r] for r in active) + clock)
        if clocks.temperature_c is not None and clocks.slowdown_c and \
                clocks.temperature_c >= clocks.slowdown_c - NEAR_SLOWDOWN_C:
            said.append(f"temperature {clocks.temperature_c} C (slows itself at {clocks.slowdown_c} C)")
        if clocks.power_w is not None and clocks.power_limit_w and clocks.power_w >= AT_POWER_LIMIT * clocks.power_limit_w:
            said.append(f"power at its limit ({clocks.power_w:.0f} of {clocks.power_limit_w:.0f} W)")
    if pcie is not None:
        if pcie.width is not None and pcie.width_max and pcie.width < pcie.width_max:
            said.append(f"PCIe link x{pcie.width} of x{pcie.width_max}")
        if pcie.generation is not None and pcie.generation_max and pcie.generation < pcie.generation_max and \
                (pcie.utilization or 0) >= BUSY:
            said.append(f"PCIe gen {pcie.generation} of {pcie.generation_max}")
        if replays > 0:
            said.append(f"{replays} PCIe replays")
    if state is not None:
        said.extend(gpu_faults(state))
    count = len(others) if count is None else count
    if others:
        said.append(("another process on it: " if count == 1 else f"{count} other processes on it: ")
                    + "; ".join(list(others)[:MAX_OTHERS]))
    return GpuEvidence(index, ratio, active, tuple(said))
