"""Talking to a running agent from the command line: its control socket when this user may open it (everything,
details included), else its TCP endpoint (check names, subjects and statuses only)."""

from __future__ import annotations

import errno
import http.client
import json
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from trainguard.pipeline.config import Config

TIMEOUT_S = 5.0
# A clear waits for the check's run under way to end (it never changes a history mid-run): up to the check's own
# `timeout`, which the caller adds, and the time its results take, which this covers.
COMMAND_TIMEOUT_S = 30.0
# Where an installed agent's socket is when this user's own config resolves elsewhere (a group member without
# $RUNTIME_DIRECTORY, whose default state dir is in their home).
WELL_KNOWN = (Path("/run/trainguard/control.sock"), Path("/var/lib/trainguard/control.sock"))


class AgentUnreachableError(Exception):
    pass


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float = TIMEOUT_S) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(str(self._path))
        except OSError:
            sock.close()
            raise
        self.sock = sock


class CommandRefusedError(Exception):
    """The agent understood and refused (no such check, no incident): its message says why."""


class CommandPendingError(Exception):
    """The agent's socket took the command and no answer came in time: a check's run under way holds it (it is done
    when the run ends), or the agent is stuck."""


def _get(conn: http.client.HTTPConnection, path: str, body: dict[str, Any] | None = None) -> Any:
    try:
        if body is None:
            conn.request("GET", path)
        else:
            conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    if resp.status == 400:
        try:
            raise CommandRefusedError(json.loads(raw).get("error") or raw.decode(errors="replace"))
        except ValueError:
            raise CommandRefusedError(raw[:200].decode(errors="replace")) from None
    if resp.status != 200:
        raise AgentUnreachableError(f"HTTP {resp.status}: {raw[:200].decode(errors='replace')}")
    return json.loads(raw)


def command(config: Config, path: str, body: dict[str, Any] | None,
            timeout: float = COMMAND_TIMEOUT_S) -> tuple[Any, str]:
    """An operator command (POST; a GET where `body` is None) over the control socket only: TCP never takes them.
    PermissionError when every socket there is refused this user (root and the agent's group only)."""
    errors, refused = [], []
    for sock_path in control_candidates(config):
        conn = _UnixConnection(sock_path, timeout)
        try:
            if not sock_path.exists():
                continue
            conn.connect()  # a refusal or a full backlog here: the command never reached the agent
        except PermissionError:  # the socket's mode, or its directory's
            refused.append(sock_path)
            continue
        except OSError as exc:
            errors.append(f"{sock_path}: {exc}")
            continue
        try:
            return _get(conn, path, body), str(sock_path)
        except TimeoutError:
            # Sent, and not answered: not "unreachable". Saying so keeps an operator from believing it was dropped.
            held = ("a check's run under way holds the command (it is done when the run ends), or the agent is stuck"
                    if path == "/clear" else "the agent is busy or stuck")  # only a clear waits for a run
            raise CommandPendingError(f"{sock_path}: no answer in {timeout:g}s: {held} "
                                      "(`trainguard status` tells which)") from None
        except (OSError, ValueError, http.client.HTTPException, AgentUnreachableError) as exc:
            errors.append(f"{sock_path}: {exc}")
    if refused and not errors:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(refused[0]))
    errors += [f"{p}: permission denied (root or the agent's group only)" for p in refused]
    raise AgentUnreachableError("; ".join(errors) or "no control socket found (is the agent running here?)")


def control_candidates(config: Config) -> list[Path]:
    return list(dict.fromkeys([config.agent.control_path(), *WELL_KNOWN]))


def fetch(config: Config, path: str, url: str | None = None,
          say: Callable[[str], None] | None = None) -> tuple[Any, str]:
    """GET `path` from the agent: (the decoded JSON, where it came from). The control socket when this user may open
    it, else the TCP endpoint; `say` is told, in one line, when a socket refused this user."""
    errors, refused = [], []
    if url is None:
        for sock_path in control_candidates(config):
            try:
                if not sock_path.is_socket():
                    continue
                return _get(_UnixConnection(sock_path), path), str(sock_path)
            except PermissionError:  # the socket's mode or its directory's: root and the agent's group only
                refused.append(str(sock_path))
            except (OSError, ValueError, http.client.HTTPException, AgentUnreachableError) as exc:
                errors.append(f"{sock_path}: {exc}")
        if not config.agent.listen:
            raise AgentUnreachableError("; ".join(errors + [f"{p}: permission denied" for p in refused])
                                        or "agent.listen is empty and no control socket: pass --url")
        host, port = config.agent.listen_address()
        host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
        if refused and say is not None:
            say(f"the control socket ({', '.join(refused)}) is for root and the trainguard group: asking {url} "
                "over TCP instead (what any local user may see)")
    try:
        parts = urlsplit(url)
        conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=TIMEOUT_S)
        return _get(conn, parts.path.rstrip("/") + path), url
    except (OSError, ValueError, http.client.HTTPException, AgentUnreachableError) as exc:
        raise AgentUnreachableError("; ".join([*errors, f"{url}: {exc}"])) from None
