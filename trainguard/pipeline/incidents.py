"""Incidents: one state machine per (check, subject), with hysteresis. Alerts are transitions.

    (absent) --bad--> pending --held fire_after / fire_after_runs--> firing --OK--> (resolved, removed)
                                 firing: more severe -> ESCALATED; repeat_interval passed -> REMINDER

Operators act on them (trainguard ack / silence / clear): an acknowledged incident sends no reminders; while a
silence matches an incident nothing of it is announced and no action runs (what fired meanwhile is announced when
the silence ends); a cleared incident resolves at once, and its check forgets the history behind it.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from trainguard.core.events import Event, EventKind
from trainguard.core.model import Result, Status
from trainguard.core.units import format_duration
from trainguard.pipeline.store import Store

ENDED_KEPT = 256  # resolved incidents whose actions are remembered for late messages: a node's recent history
# A firing incident is observed at every run of its check (every few seconds) for as long as it lasts: a row rewritten
# each time costs a SQLite transaction and fsync'd WAL pages per run for nothing. Its lifecycle (what fired, what was
# announced and when, acks, actions) is written the run it changes; what only describes it (summary, details, the run
# count once past fire_after_runs) at most this often, so a restart shows a description at most this old (the next
# run replaces it in memory anyway).
DESCRIPTION_WRITE_INTERVAL = 60.0


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
    acked: dict[str, Any] | None = None  # {"by", "uid", "reason", "at"}: no reminders while set

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


@dataclass(frozen=True)
class Silence:
    """No notification and no action for the incidents of `check` (one `subject`, or all) until `until`."""

    id: str
    check: str
    subject: str | None
    until: float
    by: str
    uid: int
    reason: str
    at: float

    def matches(self, check: str, subject: str) -> bool:
        return self.check == check and (self.subject is None or self.subject == subject)

    @property
    def target(self) -> str:
        return self.check if self.subject is None else f"{self.check}/{self.subject}"


@dataclass(frozen=True)
class Operator:
    """Who asked, and why (the peer's uid from SO_PEERCRED; the name is looked up)."""

    by: str
    uid: int
    reason: str

    def record(self, at: float) -> dict[str, Any]:
        return {"by": self.by, "uid": self.uid, "reason": self.reason, "at": at}


SILENCES_KEY = "operator.silences"


@dataclass
class Transition:
    """What one observation changed: rows to write and events to announce."""

    upserts: list[Incident] = field(default_factory=list)
    deletes: list[tuple[str, str]] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    kept: list[Incident] = field(default_factory=list)  # changed in memory only: the stored row still holds


def _lifecycle(incident: Incident, fire_after_runs: int) -> Incident:
    """What must survive a restart the moment it changes: the incident less its description. The run count counts
    only up to what fire_after_runs needs; past it, it is description."""
    return replace(incident, summary="", details={}, bad_runs=min(incident.bad_runs, fire_after_runs))


class IncidentTracker:
    def __init__(self, store: Store, node: str, clock: Callable[[], float]) -> None:
        self._store = store
        self._node = node
        self._clock = clock
        self._lock = threading.Lock()
        self._incidents: dict[tuple[str, str], Incident] = {}
        # Each incident as last written to the store by this process, and when: what the next run compares with
        # before writing. Empty at start, so each incident read back is written once at its first run: a state disk
        # that filled while the agent was down shows at once (the agent's own state incident), not at the next change.
        self._written: dict[tuple[str, str], tuple[Incident, float]] = {}
        # The actions of incidents that resolved lately, by id: a grouped message sent after its incident resolved
        # (the trainer obeyed the stop switch within the group window) still says what was done. Bounded.
        self._ended: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        for data in store.load_incidents():
            try:
                incident = Incident.from_dict(data)
            except (KeyError, TypeError, ValueError):
                continue
            self._incidents[(incident.check, incident.subject)] = incident
        self._silences: list[Silence] = self._load_silences()

    def _load_silences(self) -> list[Silence]:
        try:
            raw = json.loads(self._store.get(SILENCES_KEY) or "[]")
            return [Silence(**s) for s in raw if isinstance(s, dict)]
        except (ValueError, TypeError):
            return []

    def _save_silences(self) -> None:
        self._store.put(SILENCES_KEY, json.dumps([asdict(s) for s in self._silences]))

    def incidents(self) -> list[Incident]:
        with self._lock:
            return [Incident(**vars(i)) for i in self._incidents.values()]

    def details_of(self, check: str, subject: str) -> dict[str, Any]:
        """The details of the open incident on (check, subject); {} when there is none."""
        with self._lock:
            incident = self._incidents.get((check, subject))
            return dict(incident.details) if incident is not None else {}

    def actions_done(self, check: str, subject: str) -> set[str]:
        with self._lock:
            incident = self._incidents.get((check, subject))
            return {a["action"] for a in incident.actions} if incident else set()

    def actions_of(self, incident_id: str) -> list[dict[str, Any]]:
        """The actions run on an incident, firing or lately resolved."""
        with self._lock:
            live = next((i for i in self._incidents.values() if i.id == incident_id), None)
            return list(live.actions) if live is not None else list(self._ended.get(incident_id, ()))

    def record_action(self, check: str, subject: str, record: dict[str, Any], incident_id: str | None = None) -> None:
        """Attach an action's outcome to its incident; to the list of one lately resolved when it ended meanwhile."""
        with self._lock:
            current = self._incidents.get((check, subject))
            if current is None or (incident_id is not None and current.id != incident_id):
                if incident_id in self._ended:
                    self._ended[incident_id].append(record)
                return
            updated = Incident(**{**vars(current), "actions": [*current.actions, record]})
            self._store.save([updated.to_dict()])
            self._incidents[(check, subject)] = updated
            self._written[(check, subject)] = (updated, self._clock())

    def firing_by_status(self) -> dict[Status, int]:
        counts = {Status.UNKNOWN: 0, Status.WARNING: 0, Status.CRITICAL: 0}
        with self._lock:
            for incident in self._incidents.values():
                if incident.firing:
                    counts[incident.status] = counts.get(incident.status, 0) + 1
        return counts

    def silences(self) -> list[Silence]:
        with self._lock:
            return list(self._silences)

    def silence_of(self, check: str, subject: str, now: float | None = None) -> Silence | None:
        now = self._clock() if now is None else now
        return next((s for s in self._silences if s.until > now and s.matches(check, subject)), None)

    def observe(
        self,
        check: str,
        results: Sequence[Result],
        policy: IncidentPolicy,
        complete: bool,
        route: Callable[[Event], Iterable[str]],
        withheld: frozenset[str] = frozenset(),
    ) -> list[Event]:
        """Feed one run's results. `complete`: the run succeeded, so a subject it no longer reports is OK, except
        the `withheld` ones: reported, but not to be judged this run (their incidents stay as they are).

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
                    if c == check and subject not in seen and subject not in withheld:
                        self._resolve(incident, "no longer reported by the check", now, change)
            return self._commit(change, route, now)

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
        elif (incident.last_notified is not None and now - incident.last_notified >= policy.repeat_interval
              and incident.acked is None):
            self._announce(incident, EventKind.REMINDER, None, now, change)
        (change.upserts if self._must_write(incident, policy, now) else change.kept).append(incident)

    def _must_write(self, incident: Incident, policy: IncidentPolicy, now: float) -> bool:
        """Whether a run's version of an incident goes to the store: on any change of its lifecycle; a change of
        its description only once DESCRIPTION_WRITE_INTERVAL has passed since the last write; nothing unchanged."""
        written = self._written.get((incident.check, incident.subject))
        if written is None:
            return True
        stored, at = written
        runs = policy.fire_after_runs
        if _lifecycle(incident, runs) != _lifecycle(stored, runs):
            return True
        described = (incident.summary, incident.details, incident.bad_runs)
        return described != (stored.summary, stored.details, stored.bad_runs) and now - at >= DESCRIPTION_WRITE_INTERVAL

    def _announce(self, incident: Incident, kind: EventKind, previous: Status | None, now: float,
                  change: Transition) -> None:
        if self.silence_of(incident.check, incident.subject, now) is not None:
            return  # silenced: kept as is, announced (and acted on) when the silence ends
        if incident.announced is None or incident.status.severity > incident.announced.severity:
            incident.announced = incident.status
        incident.last_notified = now
        change.events.append(self._event(incident, kind, incident.status, incident.summary, previous, now))

    def _resolve(self, incident: Incident, summary: str, now: float, change: Transition,
                 details: dict[str, Any] | None = None) -> None:
        change.deletes.append((incident.check, incident.subject))
        # Only what was announced is resolved on the channels (nothing, for one that fired and ended in a silence).
        if incident.firing and incident.announced is not None and self.silence_of(incident.check, incident.subject,
                                                                                 now) is None:
            event = self._event(incident, EventKind.RESOLVED, incident.announced, summary, incident.status, now)
            change.events.append(replace(event, details={**event.details, **(details or {})}) if details else event)

    def _event(self, incident: Incident, kind: EventKind, status: Status, summary: str,
               previous: Status | None, now: float) -> Event:
        return Event(kind=kind, incident_id=incident.id, check=incident.check, subject=incident.subject,
                     status=status, summary=summary, node=self._node, at=now, since=incident.since,
                     previous=previous, details=dict(incident.details))

    # operators ------------------------------------------------------------------------------------------------
    def _commit(self, change: Transition, route: Callable[[Event], Iterable[str]], now: float) -> list[Event]:
        outbox = [(channel, e.to_dict()) for e in change.events for channel in route(e)]
        if change.upserts or change.deletes or outbox:  # a run that changed nothing stored opens no transaction
            self._store.save((i.to_dict() for i in change.upserts), change.deletes, outbox, now)
        for incident in change.upserts:
            self._incidents[(incident.check, incident.subject)] = incident
            self._written[(incident.check, incident.subject)] = (incident, now)
        for incident in change.kept:
            self._incidents[(incident.check, incident.subject)] = incident
        for key in change.deletes:
            self._written.pop(key, None)
            ended = self._incidents.pop(key, None)
            if ended is not None:
                self._ended[ended.id] = list(ended.actions)
                while len(self._ended) > ENDED_KEPT:
                    self._ended.popitem(last=False)
        return change.events

    def _matching(self, check: str, subject: str | None) -> list[Incident]:
        return [i for (c, s), i in self._incidents.items() if c == check and (subject is None or s == subject)]

    def subject_named(self, check: str, subject: str) -> str:
        """The subject an operator meant: `scratch` or `scratch/` is the open incident `/scratch` when no subject is
        named as typed (a disk's subject is its path: `disk//scratch` was the only spelling that matched)."""
        with self._lock:
            if (check, subject) in self._incidents:
                return subject
            path = "/" + subject.strip("/")
            return path if (check, path) in self._incidents else subject

    def _operator_event(self, kind: EventKind, check: str, subject: str, status: Status, summary: str, now: float,
                        event_id: str, details: dict[str, Any]) -> Event:
        return Event(kind=kind, incident_id=event_id, check=check, subject=subject, status=status, summary=summary,
                     node=self._node, at=now, since=now, details=details)

    def acknowledge(self, check: str, subject: str | None, who: Operator,
                    route: Callable[[Event], Iterable[str]]) -> list[Event]:
        """Stop the reminders of the matching incidents; they stay visible. Returns the events (one per incident
        acknowledged now: one acknowledged already is not announced again)."""
        now = self._clock()
        with self._lock:
            change = Transition()
            for current in self._matching(check, subject):
                if current.acked is not None:
                    continue
                incident = Incident(**{**vars(current), "acked": who.record(now)})
                change.upserts.append(incident)
                change.events.append(self._operator_event(
                    EventKind.ACKNOWLEDGED, incident.check, incident.subject, incident.status,
                    f"acknowledged by {who.by}" + (f": {who.reason}" if who.reason else "") + f" ({incident.summary})",
                    now, incident.id, {**incident.details, "acked": incident.acked}))
            return self._commit(change, route, now)

    def silence(self, check: str, subject: str | None, duration: float, who: Operator,
                route: Callable[[Event], Iterable[str]]) -> tuple[Silence, list[Event]]:
        now = self._clock()
        with self._lock:
            silence = Silence(uuid.uuid4().hex[:12], check, subject, now + duration, who.by, who.uid, who.reason, now)
            self._silences = [s for s in self._silences if s.until > now] + [silence]
            self._save_silences()
            worst = max((i.status for i in self._matching(check, subject)), key=lambda s: s.severity,
                        default=Status.OK)
            event = self._operator_event(
                EventKind.SILENCED, check, subject or "*", worst,
                f"silenced by {who.by} for {format_duration(duration)}" + (f": {who.reason}" if who.reason else ""),
                now, silence.id, {"silence": asdict(silence)})
            return silence, self._commit(Transition(events=[event]), route, now)

    def expire_silences(self, route: Callable[[Event], Iterable[str]]) -> list[Event]:
        """Announce the end of silences whose time is up, then what fired or worsened under them."""
        now = self._clock()
        with self._lock:
            ended = [s for s in self._silences if s.until <= now]
            if not ended:
                return []
            self._silences = [s for s in self._silences if s.until > now]
            self._save_silences()
            change = Transition()
            for s in ended:
                change.events.append(self._operator_event(
                    EventKind.UNSILENCED, s.check, s.subject or "*", Status.OK,
                    f"silence by {s.by} ended" + (f" ({s.reason})" if s.reason else ""), now, s.id,
                    {"silence": asdict(s)}))
            for incident in self._incidents.values():
                if not incident.firing or not any(s.matches(incident.check, incident.subject) for s in ended):
                    continue
                if self.silence_of(incident.check, incident.subject, now) is not None:
                    continue  # still under another silence
                updated = Incident(**vars(incident))
                if updated.announced is None:
                    self._announce(updated, EventKind.FIRED, None, now, change)
                elif updated.status.severity > updated.announced.severity:
                    self._announce(updated, EventKind.ESCALATED, updated.announced, now, change)
                else:
                    continue
                change.upserts.append(updated)
            return self._commit(change, route, now)

    def clear(self, check: str, subject: str, who: Operator, route: Callable[[Event], Iterable[str]]) -> list[Event]:
        """The operator says the cause is fixed: the incident resolves now (the check forgets its history: the
        engine asks it to). Whatever is still wrong at the next run fires as a new incident."""
        now = self._clock()
        with self._lock:
            change = Transition()
            current = self._incidents.get((check, subject))
            if current is not None:
                cleared = who.record(now)
                self._resolve(current, f"cleared by {who.by}" + (f": {who.reason}" if who.reason else ""), now,
                              change, {"cleared": cleared})
            return self._commit(change, route, now)

    def resolve_unconfigured(self, configured: Iterable[str], route: Callable[[Event], Iterable[str]]) -> list[Event]:
        """Incidents of checks no longer in the config resolve (at start), instead of firing forever."""
        now = self._clock()
        names = set(configured)
        with self._lock:
            change = Transition()
            for incident in list(self._incidents.values()):
                if incident.check not in names:
                    self._resolve(incident, f"the check {incident.check} is no longer configured", now, change)
            return self._commit(change, route, now)
