"""Capacity in bytes and inodes with thresholds and a time-to-full forecast: the evaluation disks and quotas share.

A quota is read as a disk-like capacity (its limit is the size, what is left under it is free), so both get the
same floors, the same robust forecast and the same wording.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainguard.checks.base import CheckSettings
from trainguard.core.forecast import Forecast, SeriesWindow
from trainguard.core.model import Metric, Sample, Status, worst
from trainguard.core.settings import CountLimit, Duration, Field, SizeLimit
from trainguard.core.thresholds import Floors
from trainguard.core.units import format_bytes, format_duration, parse_count_limit, parse_size_limit


class CapacitySettings(CheckSettings):
    """Thresholds on a capacity in bytes and inodes, and its forecast: shared by disks and quotas."""

    free_warning: SizeLimit = Field(parse_size_limit("10%"), description="WARNING below this much free space.")
    free_critical: SizeLimit = Field(parse_size_limit("5%"), description="CRITICAL below this much free space.")
    inodes_free_warning: CountLimit = Field(parse_count_limit("10%"), description="WARNING below this many free inodes.")
    inodes_free_critical: CountLimit = Field(parse_count_limit("5%"), description="CRITICAL below this many free inodes.")
    forecast_horizon: Duration = Field(6 * 3600.0, ge=0, description="WARNING when full is predicted within this; 0: off.")
    forecast_samples: int = Field(30, ge=3, description="Recent samples the growth trend is fitted on.")
    forecast_min_span: Duration = Field(300.0, ge=0, description="Samples must span at least this before forecasting.")


@dataclass(frozen=True)
class Usage:
    path: str
    device: str
    fstype: str
    size: int
    avail: int
    files: int
    files_free: int


@dataclass(frozen=True)
class Verdict:
    status: Status
    reasons: tuple[str, ...]


def _pct(part: float, total: float) -> str:
    return f"{100.0 * part / total:.1f}%" if total else "n/a"


def evaluate(u: Usage, s: CapacitySettings, bytes_fc: Forecast | None, inodes_fc: Forecast | None) -> Verdict:
    """`size` or `files` of 0 means no limit on that resource (a quota without one, btrfs inodes)."""
    statuses, reasons = [Status.OK], []
    status, floor = Floors(s.free_warning, s.free_critical).evaluate(u.avail, u.size) if u.size > 0 else (Status.OK, None)
    if floor is not None:
        statuses.append(status)
        reasons.append(f"{format_bytes(u.avail)} free ({_pct(u.avail, u.size)}), below the "
                       f"{floor.describe(in_bytes=True)} {status.label} threshold")
    if u.files > 0:  # btrfs and many network filesystems report no inode limit
        status, floor = Floors(s.inodes_free_warning, s.inodes_free_critical).evaluate(u.files_free, u.files)
        if floor is not None:
            statuses.append(status)
            reasons.append(f"{u.files_free} inodes free ({_pct(u.files_free, u.files)}), below the "
                           f"{floor.describe(in_bytes=False)} {status.label} threshold")
    if s.forecast_horizon > 0 and worst(statuses) is Status.OK:
        for what, fc in (("space", bytes_fc), ("inodes", inodes_fc)):
            if fc is not None and fc.within(s.forecast_horizon) and fc.seconds_to_limit is not None:
                statuses.append(Status.WARNING)
                reasons.append(f"{what} predicted full in {format_duration(fc.seconds_to_limit)} at the current rate")
    return Verdict(worst(statuses), tuple(reasons))


def summarize(u: Usage, v: Verdict) -> str:
    if v.reasons:
        return f"{u.path}: " + "; ".join(v.reasons)
    space = f"{format_bytes(u.avail)} free of {format_bytes(u.size)} ({_pct(u.avail, u.size)})" if u.size else "no byte limit"
    inodes = f", {u.files_free} inodes free ({_pct(u.files_free, u.files)})" if u.files else ""
    return f"{u.path}: {space}{inodes}"


def time_to_full(metric: Metric, labels: dict[str, str], bytes_fc: Forecast | None, inodes_fc: Forecast | None,
                 details: dict[str, Any]) -> list[Sample]:
    """A time-to-full sample per forecast resource (+Inf while it is not filling, so the series exists), and the
    finite ones as `<resource>_time_to_full_s` in the details."""
    samples = []
    for resource, fc in (("bytes", bytes_fc), ("inodes", inodes_fc)):
        if fc is None:
            continue
        samples.append(metric(fc.eta_metric, {**labels, "resource": resource}))
        if fc.seconds_to_limit is not None:
            details[f"{resource}_time_to_full_s"] = round(fc.seconds_to_limit)
    return samples


class CapacityTracker:
    """The recent series of free bytes and inodes per subject, and the verdict on the latest sample."""

    def __init__(self, settings: CapacitySettings) -> None:
        self.settings = settings
        self._windows: dict[tuple[str, str], SeriesWindow] = {}

    def _window(self, key: str, resource: str) -> SeriesWindow:
        if (key, resource) not in self._windows:
            self._windows[(key, resource)] = SeriesWindow(self.settings.forecast_samples, min_points=5,
                                                          min_span_s=self.settings.forecast_min_span)
        return self._windows[(key, resource)]

    def assess(self, key: str, usage: Usage, now: float) -> tuple[Verdict, Forecast | None, Forecast | None]:
        bytes_fc = inodes_fc = None
        if usage.size:
            window = self._window(key, "bytes")
            window.add(now, usage.avail)
            bytes_fc = window.forecast_down_to(0)
        if usage.files:
            window = self._window(key, "inodes")
            window.add(now, usage.files_free)
            inodes_fc = window.forecast_down_to(0)
        return evaluate(usage, self.settings, bytes_fc, inodes_fc), bytes_fc, inodes_fc
