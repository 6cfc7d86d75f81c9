"""Inputs that crashed or hung the agent before: each config of the list ends in exit 2 with one line, and the HTTP
endpoint takes a burst of connections at once, clients that hang up without a traceback, and cuts a slow client at
its request's deadline."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import REPO, AgentProcess, free_port
from trainguard.agent.server import REQUEST_DEADLINE_S

NESTED = "[" * 500 + "]" * 500
CASES = {
    "a size with 400 digits": f'[checks.disk]\nfree_warning = "{"1" * 400}GiB"\n',
    "type = []": "[checks.disk]\ntype = []\n",
    "arrays nested 500 deep": f"[agent]\nnode_name = {NESTED}\n",
    "a 5000-digit integer": f"[checks.gpu]\nexpected_count = {'1' * 5000}\n",
    "interval = 9999999d": '[checks.disk]\ninterval = "9999999d"\n',
    "notifier timeout = inf": "[notifiers.console]\ntimeout = inf\n",
}


def validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainguard", "validate", "--config", str(path)], capture_output=True,
                          text=True, timeout=30, cwd=REPO)


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_config_exits_2_with_one_line(tmp_path: Path, case: str) -> None:
    path = tmp_path / "trainguard.toml"
    path.write_text(CASES[case])
    proc = validate(path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith(f"trainguard: config error in {path}: ") and len(lines[0]) < 400
    assert "Traceback" not in proc.stderr


def test_a_fifo_or_a_device_as_the_config_is_an_error_not_a_hang(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero")):
        t0 = time.monotonic()
        proc = validate(path)
        assert proc.returncode == 2 and "not a regular file" in proc.stderr and time.monotonic() - t0 < 20


def _config(tmp_path: Path, port: int) -> Path:
    path = tmp_path / "trainguard.toml"
    path.write_text(f'[agent]\nstate_dir = "{tmp_path / "state"}"\nlisten = "127.0.0.1:{port}"\n'
                    '[checks.memory]\n[notifiers.console]\n')
    return path


def test_a_burst_of_connections_is_queued_not_dropped(tmp_path: Path,
                                                       agent_process: Callable[..., AgentProcess]) -> None:
    port = free_port()
    agent = agent_process(_config(tmp_path, port))
    agent.wait_for("msg=ready")
    socks = []
    t0 = time.monotonic()
    for _ in range(100):  # connected all at once, before the server accepts any: they wait in the listen backlog
        s = socket.socket()
        s.settimeout(5)
        s.connect(("127.0.0.1", port))
        socks.append(s)
    connected = time.monotonic() - t0
    for s in socks:
        s.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
    answers = [s.recv(64) for s in socks]
    for s in socks:
        s.close()
    assert all(a.startswith(b"HTTP/1.0 200") for a in answers)
    # with a backlog of 5, connects beyond it wait for the kernel's SYN retry: a second each
    assert connected < 0.9, f"100 connects took {connected:.2f}s"


def test_a_client_that_hangs_up_leaves_no_traceback(tmp_path: Path,
                                                    agent_process: Callable[..., AgentProcess]) -> None:
    port = free_port()
    agent = agent_process(_config(tmp_path, port))
    agent.wait_for("msg=ready")
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST on close
        s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        s.close()
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
    assert s.recv(64).startswith(b"HTTP/1.0 200")
    s.close()
    time.sleep(0.5)
    assert "Traceback" not in agent.output() and "BrokenPipe" not in agent.output()


def test_a_client_sending_a_byte_a_second_is_cut_at_the_whole_requests_deadline(
        tmp_path: Path, agent_process: Callable[..., AgentProcess]) -> None:
    """The deadline is for the whole request, not per read: each byte within a second of the last one, and the agent
    still closes the connection REQUEST_DEADLINE_S after its accept, with no answer."""
    port = free_port()
    agent = agent_process(_config(tmp_path, port))
    agent.wait_for("msg=ready")
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    t0 = time.monotonic()
    cut = None
    for byte in b"GET /healthz HTTP/1.0\r\nX-Slow: " + b"x" * 20:
        try:
            s.sendall(bytes([byte]))
        except OSError:  # the agent closed it: the next send after its FIN is refused
            cut = time.monotonic() - t0
            break
        time.sleep(0.5)
    s.close()
    assert cut is not None and REQUEST_DEADLINE_S <= cut < REQUEST_DEADLINE_S + 3, cut
