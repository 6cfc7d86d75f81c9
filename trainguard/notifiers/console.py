"""One structured line per event on stderr, which journald captures."""

from __future__ import annotations

import sys
from typing import TextIO

from trainguard.core.events import Event
from trainguard.core.logs import format_fields
from trainguard.core.units import format_duration
from trainguard.notifiers.base import Notifier, NotifierError, NotifierSettings
from trainguard.notifiers.text import clean


class ConsoleNotifier(Notifier):
    def __init__(self, name: str, settings: NotifierSettings, stream: TextIO | None = None) -> None:
        super().__init__(name, settings)
        self._stream = stream

    def send(self, event: Event) -> None:
        stream = self._stream or sys.stderr
        event = clean(event)  # then escaped as a log field: what journald keeps is what a reader sees
        line = format_fields({
            "level": "notice",
            "logger": "trainguard.alert",
            "event": event.kind.value,
            "status": event.status.name,
            "node": event.node,
            "check": event.check,
            "subject": event.subject,
            "summary": event.summary,
            "duration": format_duration(event.at - event.since),
            "incident": event.incident_id,
        })
        try:
            stream.write(line + "\n")
            stream.flush()
        except OSError as exc:
            raise NotifierError(f"cannot write to stderr: {exc}") from exc
