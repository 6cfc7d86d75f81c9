"""Alerts posted to a real Alertmanager (Debian's prometheus-alertmanager) appear with their labels, and resolve."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.conftest import free_port, require_tool, wait_until
from tests.test_engine import REGISTRY, Flaky
from tests.test_notifiers import event
from trainguard.agent.config import parse_config
from trainguard.agent.engine import Engine
from trainguard.model import Status
from trainguard.notifiers.alertmanager import AlertmanagerNotifier, AlertmanagerSettings


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[str]:
    binary = require_tool("prometheus-alertmanager")
    config = tmp_path / "am.yml"
    config.write_text('route:\n  receiver: "null"\n  group_wait: 1s\nreceivers:\n  - name: "null"\n')
    port = free_port()
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.path={tmp_path / 'am-data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return requests.get(f"{url}/-/ready", timeout=1).status_code == 200
        except requests.RequestException:
            return False

    try:
        wait_until(ready, 20, what="alertmanager ready")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def alerts(url: str) -> list[dict[str, Any]]:
    return [a for a in requests.get(f"{url}/api/v2/alerts", timeout=5).json()
            if a["labels"].get("alertname", "").startswith("trainguard_")]


def test_incident_appears_with_labels_and_resolves(alertmanager: str, tmp_path: Path) -> None:
    raw = {"agent": {"state_dir": str(tmp_path / "state"), "node_name": "node1", "listen": ""},
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
