"""The agent's small HTTP endpoints.

- TCP (`agent.listen`, 127.0.0.1:9721 by default), read-only: /metrics, /healthz, and /status with check names,
  subjects, statuses and times only (trainguard.agent.status): any local user can connect there, and summaries and
  details carry other users' log lines and names.
- The local control socket (`control.sock` in the runtime or state directory, mode 0660, group of the agent): the
  same, /status with every detail, the operator commands (POST /ack, /silence, /clear), recorded with the peer's
  uid, and `trainguard selftest`'s (POST /selftest starts one, GET /selftest follows it). The kernel lets only the
  agent's group open it; SO_PEERCRED checks the peer again (root, the agent's user, or a member of its group).
Both are served by trainguard.agent.server: bounded in connections, time per request and threads.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import pwd
import socket
import struct
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from trainguard.agent.metrics import CONTENT_TYPE, exposition
from trainguard.agent.server import BACKLOG, MAX_BODY, TCP_BACKLOG, BoundedServer, connection_cap
from trainguard.agent.status import status_document
from trainguard.core.logs import kv
from trainguard.core.text import one_line
from trainguard.core.units import parse_duration
from trainguard.pipeline.engine import Engine, OperatorError
from trainguard.pipeline.incidents import Operator

log = logging.getLogger("trainguard.http")


def _peer_credentials(allowed: Callable[[int, int], bool]) -> Callable[[socket.socket, Any], Any]:
    """The control socket's peer as the handler's "address": its (pid, uid, gid) from the kernel (SO_PEERCRED); None
    (refused) unless `allowed`."""

    def peer(conn: socket.socket, _address: Any) -> tuple[int, int, int] | None:
        pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if allowed(uid, gid):
            return pid, uid, gid
        log.warning("control socket: peer refused", extra=kv(pid=pid, uid=uid, gid=gid))
        return None

    return peer


def _serving(handler: type[BaseHTTPRequestHandler]) -> Callable[[bytes, Any], bytes]:
    """A complete request in, the whole reply out: the handler reads and writes memory, never the socket (the
    server's loop does both, non-blocking)."""

    def handle(request: bytes, peer: Any) -> bytes:
        return handler(request, peer, None).wfile.getvalue()  # type: ignore[arg-type, attr-defined]

    return handle


def healthz_text(healthy: bool, pending: list[str]) -> str:
    """/healthz: the engine's liveness, and which checks are still on their first run (up and serving, not yet
    judged: a slow first round never makes the agent unhealthy)."""
    if not healthy:
        return "engine not making progress\n"
    return f"ok; first run pending: {', '.join(pending)}\n" if pending else "ok\n"


def may_control(uid: int, gid: int) -> bool:
    """Root, the agent's own user, or a member of the agent's group (primary or supplementary)."""
    if uid in (0, os.geteuid()) or gid == os.getegid():
        return True
    try:
        pw = pwd.getpwuid(uid)
        return os.getegid() in os.getgrouplist(pw.pw_name, pw.pw_gid)
    except (KeyError, OSError):
        return False


def operator(uid: int, body: dict[str, Any]) -> Operator:
    """Who sent a command (the peer's uid from the kernel), and why (its `reason`)."""
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = f"uid {uid}"
    return Operator(name, uid, one_line(str(body.get("reason") or ""), 500))


def operate(engine: Engine, path: str, body: dict[str, Any], uid: int) -> str:
    """One operator command (POST /ack, /silence, /clear on the control socket) by the peer `uid`; what was done."""
    target = body.get("target")
    if not isinstance(target, str) or not target:
        raise ValueError("target: expected CHECK or CHECK/SUBJECT")
    who = operator(uid, body)
    if path == "/ack":
        events = engine.acknowledge(target, who)
        return f"acknowledged {len(events)} incident(s) of {target}" + ("" if events else ": acknowledged already")
    if path == "/silence":
        duration = parse_duration(body.get("for"))
        if duration <= 0:
            raise ValueError("for: a silence needs a duration, e.g. '2h'")
        silence = engine.silence(target, duration, who)
        return f"silenced {silence.target} until {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(silence.until))}"
    if path == "/clear":
        events = engine.clear(target, who)
        return f"cleared {target}" + ("" if events else " (no incident was firing; its history is forgotten)")
    raise ValueError(f"unknown command {path}: expected /ack, /silence or /clear")


def _handler(engine: Engine, details: bool) -> type[BaseHTTPRequestHandler]:
    metrics = exposition(engine.snapshot)

    class Handler(BaseHTTPRequestHandler):
        server_version = "trainguard"

        def setup(self) -> None:  # `request`: the request's bytes, read whole by the server's loop
            self.rfile = io.BytesIO(self.request)  # type: ignore[arg-type]
            self.wfile = io.BytesIO()

        def finish(self) -> None:
            pass

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(200, metrics(), CONTENT_TYPE)
            elif path == "/healthz":
                healthy = engine.healthy()
                self._reply(200 if healthy else 503, healthz_text(healthy, engine.pending()).encode())
            elif path == "/status":
                self._reply(200, json.dumps(status_document(engine, details), indent=1).encode(), "application/json")
            elif path == "/selftest" and details:  # the control socket's: hops carry the channels' answers
                test = engine.selftest_status()
                self._reply(200 if test else 404, json.dumps(test or {"error": "no self-test has run"}).encode(),
                            "application/json")
            elif path == "/":
                self._reply(200, b"trainguard: /metrics /healthz /status\n")
            else:
                self._reply(404, b"not found\n")

        def do_POST(self) -> None:
            if not details:  # TCP: anyone on the host can connect
                self._reply(405, b"read-only endpoint: operator commands go over the control socket\n")
                return
            pid, uid, _ = self.client_address
            path = self.path.split("?", 1)[0]
            try:
                body = json.loads(self.rfile.read(min(int(self.headers.get("Content-Length") or 0), MAX_BODY)) or b"{}")
                body = body if isinstance(body, dict) else {}
                if path == "/selftest":  # the document of the test it starts (pipeline/selftest.py)
                    reply: dict[str, Any] = engine.selftest(operator(uid, body), body.get("kmsg") is True,
                                                            exposition(engine.snapshot))
                    done = f"self-test {reply['id']} started"
                else:
                    done = operate(engine, path, body, uid)
                    reply = {"done": done}
            except (OperatorError, ValueError, OSError) as exc:
                self._reply(400, json.dumps({"error": str(exc)}).encode(), "application/json")
                return
            log.warning("operator command", extra=kv(command=self.path, uid=uid, pid=pid, done=done))
            self._reply(200, json.dumps(reply).encode(), "application/json")

        do_PUT = do_DELETE = do_PATCH = do_POST  # noqa: N815

        def _reply(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            client = self.client_address[0] if details is False else "local"
            log.debug("http request", extra=kv(client=client, request=format % args))

    return Handler


# Workers per server and connection caps: a scrape renders in milliseconds; a clear may wait for a check's run, so
# the control socket keeps more workers free for `trainguard status` meanwhile. The caps stay below a quarter of
# RLIMIT_NOFILE (server.connection_cap); the unit's LimitNOFILE counts them.
HTTP_WORKERS, HTTP_CAP = 2, 256
CONTROL_WORKERS, CONTROL_CAP = 4, 32


class HttpEndpoint:
    """The TCP endpoint: /status without details."""

    def __init__(self, engine: Engine, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, port), family=family, backlog=TCP_BACKLOG)
        self._server = BoundedServer(sock, _serving(_handler(engine, details=False)), "http", HTTP_WORKERS,
                                     connection_cap(HTTP_CAP))
        self.address = sock.getsockname()[:2]
        self._thread = threading.Thread(target=self._server.serve_until_stopped, name="http", daemon=True)

    def start(self) -> None:
        self._thread.start()
        log.info("listening", extra=kv(address=f"{self.address[0]}:{self.address[1]}",
                                       max_connections=self._server.cap))

    def stop(self) -> None:
        self._server.stop(self._thread)


MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL


class ControlSocket:
    """The local socket: root and the agent's group only; /status with details."""

    def __init__(self, engine: Engine, path: Path) -> None:
        if len(os.fsencode(path)) > MAX_SOCKET_PATH:
            raise OSError(errno.ENAMETOOLONG, f"socket path longer than {MAX_SOCKET_PATH} bytes", str(path))
        self.path = path
        try:
            if path.is_socket():
                path.unlink()  # left by an agent that was killed: nobody listens on it
        except OSError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(path))
            sock.listen(BACKLOG)
        except OSError:
            sock.close()
            raise
        self._server = BoundedServer(sock, _serving(_handler(engine, details=True)), "control", CONTROL_WORKERS,
                                     connection_cap(CONTROL_CAP), _peer_credentials(may_control), MAX_BODY)
        os.chmod(path, 0o660)  # under UMask=0077 it would be 0600: the group could not connect
        self._thread = threading.Thread(target=self._server.serve_until_stopped, name="control", daemon=True)

    def start(self) -> None:
        self._thread.start()
        log.info("control socket", extra=kv(path=self.path))

    def stop(self) -> None:
        self._server.stop(self._thread)
        try:
            self.path.unlink()
        except OSError:
            pass
