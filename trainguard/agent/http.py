"""The agent's small HTTP endpoint: /metrics, /healthz, /status. Read-only: no endpoint changes state."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from trainguard.agent.metrics import build_registry
from trainguard.agent.status import status_document
from trainguard.core.logs import kv
from trainguard.pipeline.engine import Engine

log = logging.getLogger("trainguard.http")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def healthz_text(healthy: bool, pending: list[str]) -> str:
    """/healthz: the engine's liveness, and which checks are still on their first run (up and serving, not yet
    judged: a slow first round never makes the agent unhealthy)."""
    if not healthy:
        return "engine not making progress\n"
    return f"ok; first run pending: {', '.join(pending)}\n" if pending else "ok\n"


class HttpEndpoint:
    def __init__(self, engine: Engine, host: str, port: int) -> None:
        registry = build_registry(engine.snapshot)

        class Handler(BaseHTTPRequestHandler):
            server_version = "trainguard"
            timeout = 10  # a client that stalls mid-request can't hold a thread forever

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    healthy = engine.healthy()
                    self._reply(200 if healthy else 503, healthz_text(healthy, engine.pending()).encode())
                elif path == "/status":
                    self._reply(200, json.dumps(status_document(engine), indent=1).encode(), "application/json")
                elif path == "/":
                    self._reply(200, b"trainguard: /metrics /healthz /status\n")
                else:
                    self._reply(404, b"not found\n")

            def do_POST(self) -> None:
                self._reply(405, b"read-only endpoint\n")

            do_PUT = do_DELETE = do_PATCH = do_POST  # noqa: N815

            def _reply(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                log.debug("http request", extra=kv(client=self.client_address[0], request=format % args))

        self._server = _Server((host, port), Handler)
        self.address = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="http", daemon=True)

    def start(self) -> None:
        self._thread.start()
        log.info("listening", extra=kv(address=f"{self.address[0]}:{self.address[1]}"))

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
