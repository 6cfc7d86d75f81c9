"""The real peers trainguard talks to, started for tests: a Slack webhook emulator, an SMTP server with STARTTLS
and authentication (aiosmtpd), Debian's Alertmanager and Prometheus. Each is a context manager; the fixtures of
the unit tests and the end-to-end stack share them."""

from __future__ import annotations

import contextlib
import email
import email.policy
import json
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import requests

from tests.conftest import free_port, require, require_tool, wait_until

SMTP_USER, SMTP_PASSWORD = "trainguard", "s3cret-pw"


class SlackEmulator:
    """Records every POST (with the time it arrived); answers from `script` (status, body, headers) in turn, then
    200 `ok` (Slack's reply)."""

    def __init__(self) -> None:
        self.posts: list[dict[str, Any]] = []
        self.script: list[tuple[int, str, dict[str, str]]] = []
        self.outage_until = 0.0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if time.monotonic() < receiver.outage_until:
                    status, body, headers = 503, "service unavailable", {}
                elif receiver.script:
                    status, body, headers = receiver.script.pop(0)
                else:
                    status, body, headers = 200, "ok", {}
                    receiver.posts.append({"path": self.path, "headers": dict(self.headers), "raw": raw,
                                           "json": json.loads(raw), "at": time.time()})
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/services/T000/B000/{uuid.uuid4().hex}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def slack_emulator() -> Iterator[SlackEmulator]:
    slack = SlackEmulator()
    try:
        yield slack
    finally:
        slack.close()


class Mailbox:
    def __init__(self) -> None:
        self.messages: list[email.message.EmailMessage] = []
        self.envelopes: list[Any] = []
        self.arrived: list[float] = []

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:  # noqa: N802 - aiosmtpd's name
        self.envelopes.append(envelope)
        self.messages.append(email.message_from_bytes(envelope.content, policy=email.policy.default))  # type: ignore[arg-type]
        self.arrived.append(time.time())
        return "250 OK"


@contextlib.contextmanager
def smtp_server(tmp_path: Path) -> Iterator[tuple[Mailbox, int, Path]]:
    """(mailbox, port, CA certificate): STARTTLS required, then AUTH as SMTP_USER / SMTP_PASSWORD."""
    try:
        import ssl

        from aiosmtpd.controller import Controller
        from aiosmtpd.smtp import AuthResult
    except ImportError as exc:
        require(False, f"needs aiosmtpd: {exc}")
    cert, key = tmp_path / "smtp-cert.pem", tmp_path / "smtp-key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)

    def authenticate(server: Any, session: Any, envelope: Any, mechanism: str, data: Any) -> AuthResult:
        ok = getattr(data, "login", b"") == SMTP_USER.encode() and getattr(data, "password", b"") == SMTP_PASSWORD.encode()
        return AuthResult(success=ok, handled=False)

    mailbox = Mailbox()
    port = free_port()
    controller = Controller(mailbox, hostname="127.0.0.1", port=port, tls_context=context, require_starttls=True,
                            authenticator=authenticate, auth_require_tls=True)
    controller.start()
    try:
        yield mailbox, port, cert
    finally:
        controller.stop()


def http_ok(url: str) -> bool:
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False


@contextlib.contextmanager
def alertmanager_server(tmp_path: Path, config: Path | None = None) -> Iterator[str]:
    """Debian's prometheus-alertmanager on a free port, with `config` (default: routing to a null receiver);
    yields its URL."""
    binary = require_tool("prometheus-alertmanager")
    if config is None:
        config = tmp_path / "am.yml"
        config.write_text('route:\n  receiver: "null"\n  group_wait: 1s\nreceivers:\n  - name: "null"\n')
    port = free_port()
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.path={tmp_path / 'am-data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: http_ok(f"{url}/-/ready"), 20, what="alertmanager ready")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def alertmanager_alerts(url: str) -> list[dict[str, Any]]:
    return [a for a in requests.get(f"{url}/api/v2/alerts", timeout=5).json()
            if a["labels"].get("alertname", "").startswith("trainguard_")]


@contextlib.contextmanager
def prometheus_server(tmp_path: Path, target_port: int, rules: Path | None = None) -> Iterator[str]:
    """Debian's Prometheus scraping one target every second (and evaluating `rules`); yields its URL."""
    binary = require_tool("prometheus")
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text("global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                      + (f"rule_files: ['{rules}']\n" if rules else "")
                      + "scrape_configs:\n  - job_name: trainguard\n"
                      f"    static_configs: [{{targets: ['127.0.0.1:{target_port}']}}]\n")
    with (tmp_path / "prometheus.log").open("wb") as log:
        proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: http_ok(url + "/-/ready"), 30, what="prometheus ready")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def prometheus_query(url: str, expr: str) -> list[Any]:
    body = requests.get(url + "/api/v1/query", params={"query": expr}, timeout=10).json()
    assert body["status"] == "success", f"{expr}: {body}"
    return body["data"]["result"]
