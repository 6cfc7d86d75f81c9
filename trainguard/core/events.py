"""Events: the transitions of an incident that notifiers announce and actions respond to."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trainguard.core.model import Status


class EventKind(str, enum.Enum):
    FIRED = "fired"
    ESCALATED = "escalated"
    REMINDER = "reminder"
    RESOLVED = "resolved"
    # What an operator did (trainguard ack / silence / clear), announced like the rest; actions never follow them.
    ACKNOWLEDGED = "acknowledged"
    SILENCED = "silenced"
    UNSILENCED = "unsilenced"

    @property
    def operator(self) -> bool:
        return self in _OPERATOR


def job_of(details: Mapping[str, Any]) -> str | None:
    """The incident's own job (its id, else the job's key), as channels show and route on it; None when it has none."""
    job = details.get("job_id") or details.get("job_key")
    return str(job) if job else None


def jobs_of(details: Mapping[str, Any]) -> list[str]:
    """The jobs an incident is about: its own job; for a fault of the node's hardware, each job that ran on the node
    when it was seen (`jobs_here`); none for the node's own resources. Alerts carry one copy per job, so that a
    job's alerts from all its nodes group together, and its hardware fault inhibits its hangs on the other nodes."""
    job = job_of(details)
    return [job] if job else [str(j) for j in details.get("jobs_here") or ()]


_OPERATOR = frozenset({EventKind.ACKNOWLEDGED, EventKind.SILENCED, EventKind.UNSILENCED})


@dataclass(frozen=True)
class Event:
    kind: EventKind
    incident_id: str
    check: str
    subject: str
    status: Status  # for RESOLVED: the most severe status the incident announced
    summary: str
    node: str
    at: float
    since: float  # when the condition started
    previous: Status | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "incident_id": self.incident_id,
            "check": self.check,
            "subject": self.subject,
            "status": self.status.name,
            "previous": self.previous.name if self.previous is not None else None,
            "summary": self.summary,
            "node": self.node,
            "at": self.at,
            "since": self.since,
            "details": self.details,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Event:
        return cls(
            kind=EventKind(data["kind"]),
            incident_id=data["incident_id"],
            check=data["check"],
            subject=data["subject"],
            status=Status[data["status"]],
            previous=Status[data["previous"]] if data.get("previous") else None,
            summary=data["summary"],
            node=data["node"],
            at=float(data["at"]),
            since=float(data["since"]),
            details=dict(data.get("details") or {}),
        )
