"""Thresholds as data: where a free amount sits against its WARNING and CRITICAL floors."""

from __future__ import annotations

from dataclasses import dataclass

from trainguard.core.model import Status
from trainguard.core.units import Limit


@dataclass(frozen=True)
class Floors:
    """Free amount must stay above these; each a percent of the total or an absolute amount."""

    warning: Limit | None
    critical: Limit | None

    def evaluate(self, free: float, total: float) -> tuple[Status, Limit | None]:
        """The status and the floor that was crossed (None when OK)."""
        if self.critical is not None and free < self.critical.resolve(total):
            return Status.CRITICAL, self.critical
        if self.warning is not None and free < self.warning.resolve(total):
            return Status.WARNING, self.warning
        return Status.OK, None
