"""The notifier interface: `send(event)` returns on success or raises `NotifierError`; `deliver(events)` may return
the peer's answer in a few words (`trainguard selftest` shows it)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar

from trainguard.core.events import Event, EventKind, job_of
from trainguard.core.model import Status
from trainguard.core.settings import Duration, Field, SettingsModel, StatusName


class NotifierSettings(SettingsModel):
    type: str | None = Field(None, description="Notifier type; defaults to the table name.")
    enabled: bool = True
    min_severity: StatusName = Field(Status.WARNING, description="Least severe status this channel receives.")
    send_resolved: bool = Field(True, description="Whether to announce resolved incidents.")
    timeout: Duration = Field(10.0, gt=0, description="Time allowed for one delivery attempt.")
    group_window: Duration = Field(0.0, ge=0, description="Events within this window go out as one message.")
    retry_max: Duration = Field(600.0, gt=0, description="Longest wait between retries (backoff doubles up to it).")
    max_age: Duration = Field(24 * 3600.0, gt=0, description="A message still undelivered after this is dropped.")
    max_group: int = Field(100, ge=1, le=1000, description="At most this many events in one message.")
    checks: list[str] = Field(default_factory=list, description="Only events of these checks; empty: all.")
    exclude_checks: list[str] = Field(default_factory=list, description="Never events of these checks.")
    match: dict[str, str] = Field(default_factory=dict, description="Only events whose labels (check, subject, node, "
                                                                    "status, job) equal all of these.")
    exclude_match: dict[str, str] = Field(default_factory=dict, description="Never events whose labels equal all "
                                                                            "of these.")


def event_labels(event: Event) -> dict[str, str]:
    """What routing rules match on."""
    labels = {"check": event.check, "subject": event.subject, "node": event.node, "status": event.status.name.lower()}
    job = job_of(event.details)
    if job:
        labels["job"] = job
    return labels


class NotifierError(Exception):
    """A failed delivery. `permanent` ones (bad credentials, a rejected payload) are not retried."""

    def __init__(self, message: str, *, permanent: bool = False, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.permanent = permanent
        self.retry_after = retry_after


class Notifier(ABC):
    Settings: ClassVar[type[NotifierSettings]] = NotifierSettings

    def __init__(self, name: str, settings: NotifierSettings) -> None:
        self.name = name
        self.settings = settings

    def accepts(self, event: Event) -> bool:
        return self.refusal(event) is None

    def refusal(self, event: Event) -> str | None:
        """The routing rule that keeps `event` from this channel (`min_severity`, `exclude_checks`, ...), or None."""
        s = self.settings
        if event.kind is EventKind.RESOLVED and not s.send_resolved:
            return "send_resolved"
        if s.checks and event.check not in s.checks:
            return "checks"
        if event.check in s.exclude_checks:
            return "exclude_checks"
        labels = event_labels(event)
        if any(labels.get(k) != v for k, v in s.match.items()):
            return "match"
        if s.exclude_match and all(labels.get(k) == v for k, v in s.exclude_match.items()):
            return "exclude_match"
        # What an operator did goes wherever the check's incidents go, whatever the incident's severity.
        if not event.kind.operator and event.status.severity < s.min_severity.severity:
            return "min_severity"
        return None

    @abstractmethod
    def send(self, event: Event) -> None:
        """Deliver one event within `settings.timeout`, or raise NotifierError."""

    def start(self, firing: Callable[[], list[Event]]) -> None:  # noqa: B027 - optional hook
        """Channels that restate what is firing (Alertmanager) start their thread here; `firing()` lists it."""

    def stop(self) -> None:  # noqa: B027 - optional hook
        """Stop what `start` started."""

    def deliver(self, events: Sequence[Event]) -> str | None:
        """Deliver a group of events (those within `group_window`); channels that can, send one message. Returns
        what the peer answered, where the channel has one (None otherwise)."""
        for event in events:
            self.send(event)
        return None


class GroupNotifier(Notifier):
    """A channel that sends one message for a whole group of events (Slack, email, webhooks, Alertmanager)."""

    def send(self, event: Event) -> None:
        self.deliver([event])

    @abstractmethod
    def deliver(self, events: Sequence[Event]) -> str | None:
        """Deliver the group as one message within `settings.timeout`, or raise NotifierError; the peer's answer."""
