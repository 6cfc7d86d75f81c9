"""Alerts posted to a real Alertmanager (Debian's prometheus-alertmanager) appear with their labels, and resolve."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tests.peers import alertmanager_alerts, alertmanager_server
from tests.test_engine import REGISTRY, Flaky
from tests.test_notifiers import event
from trainguard.agent.configfile import parse_config
from trainguard.core.events import Event, EventKind
from trainguard.core.model import Status
from trainguard.notifiers.alertmanager import AlertmanagerNotifier, AlertmanagerSettings
from trainguard.pipeline.engine import Engine


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[str]:
    with alertmanager_server(tmp_path) as url:
        yield url


alerts = alertmanager_alerts


def test_incident_appears_with_labels_and_resolves(alertmanager: str, tmp_path: Path) -> None:
    raw = {"agent": {"state_dir": str(tmp_path / "state"), "node_name": "node1", "cluster": "c1", "listen": ""},
           "jobs": {"sources": []},
           "checks": {"flaky": {"interval": "1h", "jitter": 0}},
           "notifiers": {"am": {"type": "alertmanager", "urls": [alertmanager], "resend_interval": "1s",
                                "runbook_url": "https://runbooks.example/{check}"}}}
    engine = Engine(parse_config(raw, "test.toml", REGISTRY), REGISTRY)
    Flaky.status = Status.CRITICAL
    engine.start()
    try:
        [firing] = wait_until(lambda: alerts(alertmanager), 15, what="the alert in Alertmanager")  # type: ignore[misc]
        assert firing["labels"] == {"alertname": "trainguard_flaky", "severity": "critical", "node": "node1",
                                    "layer": "node", "type": "flaky", "cluster": "c1",
                                    "check": "flaky", "subject": "thing"}
        assert firing["annotations"]["summary"] == "thing is CRITICAL"
        assert firing["annotations"]["runbook_url"] == "https://runbooks.example/flaky"
        assert firing["status"]["state"] == "active"
        Flaky.status = Status.OK
        engine.run_check("flaky")
        wait_until(lambda: not alerts(alertmanager), 15, what="the alert resolved")
    finally:
        Flaky.status = Status.OK
        engine.stop()


def test_firing_alerts_are_restated_with_ends_at_ahead(alertmanager: str) -> None:
    notifier = AlertmanagerNotifier("am", AlertmanagerSettings.model_validate(
        {"urls": ["http://127.0.0.1:1", alertmanager], "resend_interval": "1s"}))  # one member down: still sent
    firing = [event(7)]
    notifier.start(lambda: firing)
    try:
        [alert] = wait_until(lambda: alerts(alertmanager), 10, what="the restated alert")  # type: ignore[misc]
        assert alert["labels"]["subject"] == "pci:0000:07:00" and alert["labels"]["severity"] == "critical"
        assert alert["endsAt"] > alert["startsAt"]
    finally:
        notifier.stop()


def test_an_escalation_ends_the_alert_of_the_lower_severity(alertmanager: str) -> None:
    notifier = AlertmanagerNotifier("am", AlertmanagerSettings.model_validate({"urls": [alertmanager]}))
    notifier.deliver([event(7, Status.WARNING)])
    wait_until(lambda: [a["labels"]["severity"] for a in alerts(alertmanager)] == ["warning"], 10, what="the warning")
    fired = event(7, Status.WARNING)
    escalated = Event(EventKind.ESCALATED, fired.incident_id, fired.check, fired.subject, Status.CRITICAL,
                      fired.summary, fired.node, fired.at + 1, fired.since, previous=Status.WARNING)
    notifier.deliver([escalated])
    wait_until(lambda: [a["labels"]["severity"] for a in alerts(alertmanager)] == ["critical"], 10,
               what="only the critical alert active")
