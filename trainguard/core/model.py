"""The shared vocabulary: statuses, metric samples and check results."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


class Status(enum.IntEnum):
    """Nagios status codes. The integer is the exit code, not the severity: see `severity`."""

    OK = 0
    WARNING = 1
    CRITICAL = 2
    UNKNOWN = 3

    @property
    def severity(self) -> int:
        """Severity order: OK < UNKNOWN < WARNING < CRITICAL."""
        return _SEVERITY[self]

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> Status:
        try:
            return cls[text.strip().upper()]
        except KeyError:
            raise ValueError(f"invalid status {text!r}: expected one of ok, unknown, warning, critical") from None


_SEVERITY = {Status.OK: 0, Status.UNKNOWN: 1, Status.WARNING: 2, Status.CRITICAL: 3}


def worst(statuses: Iterable[Status]) -> Status:
    """The most severe status, OK for none."""
    return max(statuses, key=lambda s: s.severity, default=Status.OK)


def _freeze(mapping: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True)
class Metric:
    """A metric's metadata, declared once beside the code that measures it: the name Prometheus shows (counters end
    in `_total`), its help text and its label names. Calling it makes a sample: `FREE(3.0, {"path": "/"})`."""

    name: str
    help: str
    labels: tuple[str, ...] = ()
    counter: bool = False

    def __post_init__(self) -> None:
        if not self.name.startswith("trainguard_") or self.counter != self.name.endswith("_total"):
            raise ValueError(f"metric {self.name}: names start with trainguard_, and end in _total exactly for counters")

    def __call__(self, value: float, labels: Mapping[str, object] | None = None) -> Sample:
        return Sample(self, value, {k: str(v) for k, v in (labels or {}).items()})


@dataclass(frozen=True)
class Sample:
    """One value of a declared metric that a check exposes on /metrics. Its labels are exactly the declared ones."""

    metric: Metric
    value: float
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        labels = {k: str(v) for k, v in self.labels.items()}
        if set(labels) != set(self.metric.labels):
            raise ValueError(f"metric {self.metric.name}: labels {sorted(labels)}, declared {sorted(self.metric.labels)}")
        object.__setattr__(self, "labels", _freeze(labels))

    @property
    def name(self) -> str:
        return self.metric.name


@dataclass(frozen=True)
class Result:
    """What one check observed about one subject in one run."""

    check: str
    subject: str
    status: Status
    summary: str
    details: Mapping[str, Any] = field(default_factory=dict)
    samples: tuple[Sample, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "details", _freeze(self.details))
        object.__setattr__(self, "samples", tuple(self.samples))

    def to_dict(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "subject": self.subject,
            "status": self.status.name,
            "summary": self.summary,
            "details": dict(self.details),
        }
