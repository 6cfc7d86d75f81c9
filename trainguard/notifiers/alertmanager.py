"""AlertmanagerNotifier: POST /api/v2/alerts, so grouping, silences and inhibition work across the cluster.

Like Prometheus, it restates every firing alert every `resend_interval` with an `endsAt` a few
intervals ahead: if the agent dies, Alertmanager resolves its alerts by itself instead of keeping
them forever; a resolved incident is posted with `endsAt` set to when it resolved.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any

from trainguard.core.events import Event, EventKind, jobs_of
from trainguard.core.logs import kv
from trainguard.core.settings import Duration, Field
from trainguard.notifiers.base import GroupNotifier, NotifierError, NotifierSettings
from trainguard.notifiers.http import post_json
from trainguard.notifiers.text import actions_done, clean, event_line

log = logging.getLogger("trainguard.notifiers.alertmanager")


class AlertmanagerSettings(NotifierSettings):
    urls: list[str] = Field(min_length=1, description="Alertmanager base URLs (all of an HA cluster).")
    resend_interval: Duration = Field(60.0, gt=0, description="How often firing alerts are restated.")
    runbook_url: str = Field("", description="Runbook link; {check} and {subject} are filled in.")


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


def alert(event: Event, s: AlertmanagerSettings, now: float, job_id: str = "") -> dict[str, Any]:
    labels = {"alertname": f"trainguard_{event.check}", "severity": event.status.name.lower(), "node": event.node,
              "check": event.check, "subject": event.subject}
    for key in ("cluster", "layer", "type"):
        if event.details.get(key):
            labels[key] = str(event.details[key])
    if job_id:
        labels["job_id"] = job_id
    if event.details.get("test") is True:  # `trainguard selftest`: a receiver can route or inhibit test alerts
        labels["test"] = "true"
    gpu = event.details.get("index")
    if gpu is not None:
        labels["gpu"] = str(gpu)
    done = actions_done(event)
    annotations = {"summary": event.summary,
                   "description": event_line(event) + (f"; actions: {', '.join(done)}" if done else "")}
    if s.runbook_url:
        annotations["runbook_url"] = s.runbook_url.format(check=event.check, subject=event.subject)
    resolved = event.kind is EventKind.RESOLVED
    return {"labels": labels, "annotations": annotations, "startsAt": _iso(event.since),
            "endsAt": _iso(event.at if resolved else now + 4 * s.resend_interval)}


def alerts_for(event: Event, s: AlertmanagerSettings, now: float) -> list[dict[str, Any]]:
    """The event's alerts (one per job it concerns); an escalation also ends the alerts of the severity it
    replaces, which Alertmanager (severity being a label) would otherwise keep active beside the new ones until
    their endsAt."""
    event = clean(event)  # labels and annotations: one line each, whatever a job's user wrote
    out = []
    for job in jobs_of(event.details) or [""]:
        current = alert(event, s, now, job)
        if event.kind is EventKind.ESCALATED and event.previous is not None and event.previous is not event.status:
            out.append({**current, "labels": {**current["labels"], "severity": event.previous.name.lower()},
                        "endsAt": _iso(event.at)})
        out.append(current)
    return out


def silence_for(event: Event) -> dict[str, Any]:
    """The Alertmanager silence matching what `trainguard silence` silenced on this node."""
    event = clean(event)
    s = event.details.get("silence") or {}
    matchers = [{"name": "node", "value": event.node, "isRegex": False, "isEqual": True},
                {"name": "check", "value": str(s.get("check", event.check)), "isRegex": False, "isEqual": True}]
    if s.get("subject"):
        matchers.append({"name": "subject", "value": str(s["subject"]), "isRegex": False, "isEqual": True})
    return {"matchers": matchers, "startsAt": _iso(event.at), "endsAt": _iso(float(s.get("until", event.at + 3600))),
            "createdBy": f"trainguard ({s.get('by', '?')})", "comment": str(s.get("reason") or "silenced with trainguard")}


class AlertmanagerNotifier(GroupNotifier):
    Settings = AlertmanagerSettings
    settings: AlertmanagerSettings

    def __init__(self, name: str, settings: NotifierSettings) -> None:
        super().__init__(name, settings)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def deliver(self, events: Sequence[Event]) -> str | None:
        now = datetime.now(timezone.utc).timestamp()
        payload = [a for e in events if not e.kind.operator for a in alerts_for(e, self.settings, now)]
        answers = []
        if payload:
            answers.append(self._post("/api/v2/alerts", payload))
        for event in events:  # a trainguard silence is an Alertmanager silence too: it keeps the fleet view quiet
            if event.kind is EventKind.SILENCED:
                answers.append(self._post("/api/v2/silences", silence_for(event)))
        return "; ".join(answers) or None

    def _post(self, path: str, payload: Any) -> str:
        errors, answers = [], []
        for url in self.settings.urls:  # every member of an HA pair gets it; one accepting is enough
            try:
                response = post_json(url.rstrip("/") + path, payload, self.settings.timeout, f"alertmanager {url}")
                answers.append(f"{url}: HTTP {response.status_code}")
            except NotifierError as exc:
                errors.append(exc)
        if len(errors) == len(self.settings.urls):
            raise errors[0]
        return ", ".join(answers)

    def start(self, firing: Callable[[], list[Event]]) -> None:
        def loop() -> None:
            while not self._stop.wait(self.settings.resend_interval):
                events = [e for e in firing() if self.accepts(e)]
                if not events:
                    continue
                try:
                    self.deliver(events)
                except NotifierError as exc:
                    log.warning("restating firing alerts failed", extra=kv(channel=self.name, error=str(exc)))

        self._thread = threading.Thread(target=loop, name=f"restate-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
