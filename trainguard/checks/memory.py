"""MemoryCheck: host available memory and swap against thresholds, top consumers in the details."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psutil

from trainguard.checks.base import Check, CheckSettings
from trainguard.core.model import Metric, Result, Status, worst
from trainguard.core.settings import Field, SizeLimit
from trainguard.core.thresholds import Floors
from trainguard.core.units import format_bytes, parse_size_limit
from trainguard.node.proctable import ProcessTable
from trainguard.node.users import UserNames

TOTAL = Metric("trainguard_memory_total_bytes", "Host memory in bytes.")
AVAILABLE = Metric("trainguard_memory_available_bytes", "Host memory available for new work.")
SWAP_TOTAL = Metric("trainguard_swap_total_bytes", "Swap space in bytes.")
SWAP_FREE = Metric("trainguard_swap_free_bytes", "Free swap in bytes.")
METRICS = (TOTAL, AVAILABLE, SWAP_TOTAL, SWAP_FREE)


class MemorySettings(CheckSettings):
    available_warning: SizeLimit = Field(parse_size_limit("10%"), description="WARNING below this much available memory.")
    available_critical: SizeLimit = Field(parse_size_limit("5%"), description="CRITICAL below this much available memory.")
    swap_free_warning: SizeLimit | None = Field(parse_size_limit("20%"), description="WARNING below this much free swap.")
    swap_free_critical: SizeLimit | None = Field(parse_size_limit("5%"), description="CRITICAL below this much free swap.")
    top: int = Field(5, ge=0, le=50, description="How many of the largest processes to list in the details.")


@dataclass(frozen=True)
class MemoryUsage:
    total: int
    available: int
    swap_total: int
    swap_free: int


def gather() -> MemoryUsage:
    vm, sw = psutil.virtual_memory(), psutil.swap_memory()
    return MemoryUsage(vm.total, vm.available, sw.total, sw.free)


def top_consumers(n: int, table: ProcessTable, names: UserNames) -> list[dict[str, Any]]:
    """The `n` largest processes of the shared snapshot; only their owners and command lines are read."""
    procs = []
    for info in table.largest(n):
        user, cmd = None, info.comm
        try:
            p = psutil.Process(info.pid)
            user, cmd = names.name(p.uids().real), " ".join(p.cmdline()) or info.comm
        except psutil.Error:
            pass
        procs.append({"pid": info.pid, "user": user, "rss_bytes": info.rss, "command": cmd[:200]})
    return procs


def evaluate(u: MemoryUsage, s: MemorySettings) -> tuple[Status, list[str]]:
    statuses, reasons = [Status.OK], []
    status, floor = Floors(s.available_warning, s.available_critical).evaluate(u.available, u.total)
    if floor is not None:
        statuses.append(status)
        reasons.append(f"{format_bytes(u.available)} available of {format_bytes(u.total)}, "
                       f"below the {floor.describe(in_bytes=True)} {status.label} threshold")
    if u.swap_total > 0:
        status, floor = Floors(s.swap_free_warning, s.swap_free_critical).evaluate(u.swap_free, u.swap_total)
        if floor is not None:
            statuses.append(status)
            reasons.append(f"swap {format_bytes(u.swap_free)} free of {format_bytes(u.swap_total)}, "
                           f"below the {floor.describe(in_bytes=True)} {status.label} threshold")
    return worst(statuses), reasons


def summarize(u: MemoryUsage, reasons: list[str], top: list[dict[str, Any]]) -> str:
    if not reasons:
        return f"{format_bytes(u.available)} of {format_bytes(u.total)} available"
    largest = f"; largest: pid {top[0]['pid']} ({top[0]['user']}) {format_bytes(top[0]['rss_bytes'])}" if top else ""
    return "; ".join(reasons) + largest


class MemoryCheck(Check):
    Settings = MemorySettings
    metrics = METRICS
    settings: MemorySettings

    def run(self) -> Sequence[Result]:
        u = gather()
        status, reasons = evaluate(u, self.settings)
        top = top_consumers(self.settings.top, self.context.processes.get(), self.context.user_names)
        samples = [TOTAL(u.total), AVAILABLE(u.available), SWAP_TOTAL(u.swap_total), SWAP_FREE(u.swap_free)]
        details = {"total_bytes": u.total, "available_bytes": u.available, "swap_total_bytes": u.swap_total,
                   "swap_free_bytes": u.swap_free, "top": top}
        return [self.result("host", status, summarize(u, reasons, top), details, samples)]
