"""Incidents: one state machine per (check, subject), with hysteresis. Alerts are transitions.

    (absent) --bad--> pending --held fire_after / fire_after_runs--> firing --OK--> (resolved, removed)
                                 firing: more severe -> ESCALATED; repeat_interval passed -> REMINDER
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from trainguard.core.events import Event, EventKind
from trainguard.core.model import Result, Status
from trainguard.pipeline.store import Store


@dataclass(frozen=True)
class IncidentPolicy:
    fire_after: float = 0.0
    fire_after_runs: int = 1
    repeat_interval: float = 4 * 3600.0
    alert_on_unknown: bool = True

    def is_problem(self, status: Status) -> bool:
        return status in (Status.WARNING, Status.CRITICAL) or (status is Status.UNKNOWN and self.alert_on_unknown)


@dataclass
class Incident:
    check: str
    subject: str
    status: Status
    summary: str
    since: float
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    bad_runs: int = 1
    firing: bool = False
    fired_at: float | None = None
    announced: Status | None = None  # most severe status announced so far
    last_notified: float | None = None
    details: dict[str, Any] = field(default_factory=dict)
    actions: list[dict[str, Any]] = field(default_factory=list)  # what was done about it, with outcomes

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.name
        data["announced"] = self.announced.name if self.announced else None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Incident:
        data = dict(data)
        data["status"] = Status[data["status"]]
        data["announced"] = Status[data["announced"]] if data.get("announced") else None
        return cls(**data)


@dataclass
class Transition:
    """What one observation changed: rows to write and events to announce."""

    upserts: list[Incident] = field(default_factory=list)
    deletes: list[tuple[str, str]] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)


class IncidentTracker:
    def __init__(self, store: Store, node: str, clock: Callable[[], float]) -> None:
        self._store = store
        self._node = node
        self._clock = clock
        self._lock = threading.Lock()
        self._incidents: dict[tuple[str, str], Incident] = {}
        for data in store.load_incidents():
            try:
                incident = Incident.from_dict(data)
            except (KeyError, TypeError, ValueError):
                continue
            self._incidents[(incident.check, incident.subject)] = incident

    def incidents(self) -> list[Incident]:
        with self._lock:
            return [Incident(**vars(i)) for i in self._incidents.values()]

    def actions_done(self, check: str, subject: str) -> set[str]:
        with self._lock:
            incident = self._incidents.get((check, subject))
            return {a["action"] for a in incident.actions} if incident else set()

    def record_action(self, check: str, subject: str, record: dict[str, Any]) -> None:
        """Attach an action's outcome to its incident (dropped if the incident resolved meanwhile)."""
        with self._lock:
            current = self._incidents.get((check, subject))
            if current is None:
                return
            updated = Incident(**{**vars(current), "actions": [*current.actions, record]})
            self._store.save([updated.to_dict()])
            self._incidents[(check, subject)] = updated

    def firing_by_status(self) -> dict[Status, int]:
        counts = {Status.UNKNOWN: 0, Status.WARNING: 0, Status.CRITICAL: 0}
        with self._lock:
            for incident in self._incidents.values():
                if incident.firing:
                    counts[incident.status] = counts.get(incident.status, 0) + 1
        return counts

    def observe(
        self,
        check: str,
        results: Sequence[Result],
        policy: IncidentPolicy,
        complete: bool,
        route: Callable[[Event], Iterable[str]],
    ) -> list[Event]:
        """Feed one run's results. `complete`: the run succeeded, so a subject it no longer reports is OK.

        State and the outbox rows for the resulting events are written in one transaction before
        memory changes, so a crash never announces twice nor forgets an incident.
        """
        now = self._clock()
        with self._lock:
            change = Transition()
            seen = set()
            for result in results:
                seen.add(result.subject)
                self._step(result, policy, now, change)
            if complete:
                for (c, subject), incident in list(self._incidents.items()):
                    if c == check and subject not in seen:
                        self._resolve(incident, "no longer reported by the check", now, change)
            outbox = [(channel, e.to_dict()) for e in change.events for channel in route(e)]
            self._store.save((i.to_dict() for i in change.upserts), change.deletes, outbox, now)
            for incident in change.upserts:
                self._incidents[(incident.check, incident.subject)] = incident
            for key in change.deletes:
                self._incidents.pop(key, None)
            return change.events

    def _step(self, result: Result, policy: IncidentPolicy, now: float, change: Transition) -> None:
        key = (result.check, result.subject)
        current = self._incidents.get(key)
        if not policy.is_problem(result.status):
            if current is not None:
                self._resolve(current, result.summary, now, change)
            return
        if current is None:
            incident = Incident(result.check, result.subject, result.status, result.summary, since=now,
                                details=dict(result.details))
        else:
            incident = Incident(**vars(current))
            incident.bad_runs += 1
            incident.status, incident.summary, incident.details = result.status, result.summary, dict(result.details)
        if not incident.firing:
            if incident.bad_runs >= policy.fire_after_runs and now - incident.since >= policy.fire_after:
                incident.firing, incident.fired_at = True, now
                self._announce(incident, EventKind.FIRED, None, now, change)
        elif incident.announced is not None and incident.status.severity > incident.announced.severity:
            self._announce(incident, EventKind.ESCALATED, incident.announced, now, change)
        elif incident.last_notified is not None and now - incident.last_notified >= policy.repeat_interval:
            self._announce(incident, EventKind.REMINDER, None, now, change)
        change.upserts.append(incident)

    def _announce(self, incident: Incident, kind: EventKind, previous: Status | None, now: float,
                  change: Transition) -> None:
        if incident.announced is None or incident.status.severity > incident.announced.severity:
            incident.announced = incident.status
        incident.last_notified = now
        change.events.append(self._event(incident, kind, incident.status, incident.summary, previous, now))

    def _resolve(self, incident: Incident, summary: str, now: float, change: Transition) -> None:
        change.deletes.append((incident.check, incident.subject))
        if incident.firing:
            status = incident.announced or incident.status
            change.events.append(self._event(incident, EventKind.RESOLVED, status, summary, incident.status, now))

    def _event(self, incident: Incident, kind: EventKind, status: Status, summary: str,
               previous: Status | None, now: float) -> Event:
        return Event(kind=kind, incident_id=incident.id, check=incident.check, subject=incident.subject,
                     status=status, summary=summary, node=self._node, at=now, since=incident.since,
                     previous=previous, details=dict(incident.details))
