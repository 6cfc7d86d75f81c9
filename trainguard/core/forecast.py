"""Robust trend and time-to-limit forecasts over a window of recent samples.

Shared by every check that forecasts exhaustion (disk, quotas, memory leaks) so the maths lives once.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass


def theil_sen_slope(points: list[tuple[float, float]]) -> float | None:
    """Median of pairwise slopes: a trend that a few outliers (a checkpoint write, a deleted file) cannot bend."""
    slopes = [
        (v2 - v1) / (t2 - t1)
        for i, (t1, v1) in enumerate(points)
        for t2, v2 in points[i + 1 :]
        if t2 > t1
    ]
    return statistics.median(slopes) if slopes else None


@dataclass(frozen=True)
class Forecast:
    slope_per_s: float
    seconds_to_limit: float | None  # None: the trend does not reach the limit

    @property
    def eta_metric(self) -> float:
        """seconds_to_limit for /metrics: +Inf when the trend never reaches the limit, so the series exists."""
        return math.inf if self.seconds_to_limit is None else self.seconds_to_limit

    def within(self, horizon_s: float) -> bool:
        return self.seconds_to_limit is not None and self.seconds_to_limit <= horizon_s


class SeriesWindow:
    """The last `size` (time, value) samples of one series."""

    def __init__(self, size: int = 30, min_points: int = 5, min_span_s: float = 60.0) -> None:
        self._points: deque[tuple[float, float]] = deque(maxlen=size)
        self.min_points = min_points
        self.min_span_s = min_span_s

    def add(self, when: float, value: float) -> None:
        if self._points and when <= self._points[-1][0]:
            return
        self._points.append((when, value))

    def __len__(self) -> int:
        return len(self._points)

    def trend(self) -> float | None:
        """Robust slope per second; None until the window holds `min_points` over `min_span_s`."""
        points = list(self._points)
        if len(points) < self.min_points or points[-1][0] - points[0][0] < self.min_span_s:
            return None
        return theil_sen_slope(points)

    @property
    def last(self) -> float | None:
        return self._points[-1][1] if self._points else None

    def forecast_down_to(self, limit: float) -> Forecast | None:
        """When the series, falling at its robust trend, reaches `limit` (e.g. free bytes reaching 0)."""
        slope = self.trend()
        if slope is None or self.last is None:
            return None
        current = self.last
        if slope >= 0 or current <= limit:
            return Forecast(slope, 0.0 if current <= limit else None)
        return Forecast(slope, (current - limit) / -slope)

    def forecast_growth_into(self, headroom: float) -> Forecast | None:
        """When the series, rising at its robust trend, has used up `headroom` more (e.g. a leak reaching a limit)."""
        slope = self.trend()
        if slope is None:
            return None
        if headroom <= 0:
            return Forecast(slope, 0.0)
        return Forecast(slope, headroom / slope if slope > 0 else None)
