"""The notifier interface: `send(event)` returns on success or raises `NotifierError`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from pydantic import Field

from trainguard.agent.events import Event, EventKind
from trainguard.model import Status
from trainguard.settings import SettingsModel, StatusName


class NotifierSettings(SettingsModel):
    type: str | None = Field(None, description="Notifier type; defaults to the table name.")
    enabled: bool = True
    min_severity: StatusName = Field(Status.WARNING, description="Least severe status this channel receives.")
    send_resolved: bool = Field(True, description="Whether to announce resolved incidents.")
    timeout: float = Field(10.0, gt=0, description="Seconds allowed for one delivery attempt.")


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
        if event.kind is EventKind.RESOLVED and not self.settings.send_resolved:
            return False
        return event.status.severity >= self.settings.min_severity.severity

    @abstractmethod
    def send(self, event: Event) -> None:
        """Deliver one event within `settings.timeout`, or raise NotifierError."""
