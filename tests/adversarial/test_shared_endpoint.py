"""The agent's HTTP endpoint is shared by every local account: one of them holds 2,000 slow connections and the
agent still answers /healthz and /metrics at once, stays under its descriptor cap, and still turns an XID into a
signal to another user's job; nothing another user wrote in their private log reaches them through any TCP path."""

from __future__ import annotations

import os
import pwd
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.conftest import (
    AgentProcess,
    control_status,
    free_port,
    require_root,
    require_tool,
    unique_bus,
    wait_until,
    xid79,
)
from tests.slurm_cluster import JOB_USER, OTHER_USER, ensure_user
from trainguard.agent.http import HTTP_CAP

SLOW = 2000
# One byte on each connection every 2 s, never the blank line that ends a request; a connection the agent cut is
# opened again (the attacker keeps up the pressure). Ends when its stdin closes.
ATTACKER = """
import errno, select, socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
def connect():
    s = socket.socket()
    s.setblocking(False)
    s.connect_ex(("127.0.0.1", port))
    return s
socks = [connect() for _ in range(n)]
print("open", flush=True)
while not select.select([sys.stdin], [], [], 2.0)[0]:
    for i, s in enumerate(socks):
        try:
            s.send(b"G")
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            if exc.errno != errno.ENOTCONN:  # still connecting: the listen backlog was full
                s.close()
                socks[i] = connect()
"""


def as_user(user: str) -> list[str]:
    return [require_tool("setpriv"), f"--reuid={user}", f"--regid={user}", "--init-groups"]


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def threads(pid: int) -> int:
    return int(next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if line.startswith("Threads:")))


class Job:
    """A training process of JOB_USER, started by `start()`, that writes a line for each SIGUSR1 it gets."""

    def __init__(self, run: Path) -> None:
        self.run = run
        self.marker = f"endpointjob-{uuid.uuid4().hex[:8]}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        code = ("import signal, time\n"
                f"def got(*_):\n    with open({str(self.run / 'signals')!r}, 'a') as f: f.write('USR1\\n')\n"
                "signal.signal(signal.SIGUSR1, got)\n"
                "while True: time.sleep(60)\n")
        self.proc = subprocess.Popen([*as_user(JOB_USER), sys.executable, "-c", code, self.marker])

    def signals(self) -> int:
        path = self.run / "signals"
        return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.fixture
def job() -> Iterator[Job]:
    require_root()
    ensure_user(JOB_USER)
    ensure_user(OTHER_USER)
    run = Path(tempfile.mkdtemp(prefix="trainguard-endpoint-", dir="/tmp"))
    run.chmod(0o755)
    shutil.chown(run, JOB_USER, JOB_USER)
    job = Job(run)
    yield job
    if job.proc is not None:
        job.proc.kill()
        job.proc.wait()
    shutil.rmtree(run, ignore_errors=True)


def agent_config(tmp_path: Path, port: int, job: Job, more: str) -> Path:
    """The agent's config: its state, its port, the job as a process job of JOB_USER, then `more`."""
    path = tmp_path / "trainguard.toml"
    path.write_text(f'[agent]\nstate_dir = "{tmp_path / "state"}"\nlisten = "127.0.0.1:{port}"\n'
                    '[jobs]\nsources = ["process"]\nrefresh = "0s"\n'
                    f'[jobs.processes.trainer]\ncmdline = "{job.marker}"\nuser = "{JOB_USER}"\n{more}\n'
                    '[notifiers.console]\n')
    return path


def test_2000_slow_connections_of_another_user_exhaust_nothing(
        tmp_path: Path, kmsg: Any, job: Job, agent_process: Callable[..., AgentProcess]) -> None:
    port = free_port()
    config = agent_config(tmp_path, port, job, '[checks.xid]\nactions = { critical = ["signal"] }\n[checks.memory]')
    # the limit the agent had (no LimitNOFILE in the unit then): the cap must hold well inside it
    agent = agent_process(config, wrapper=[require_tool("prlimit"), "--nofile=1024:1024", "--"])
    agent.wait_for("msg=ready")
    agent.wait_for("check=xid", timeout=20)
    # The XIDs the kernel's buffer already held (earlier tests', this boot's) fire at the agent's start, and would
    # signal the job: it starts once they have, and only the XID written below is its.
    time.sleep(2)
    job.start()
    assert agent.proc is not None
    pid = agent.proc.pid
    url = f"http://127.0.0.1:{port}"
    assert requests.get(url + "/healthz", timeout=5).status_code == 200
    time.sleep(1)
    base_fds, base_threads = fds(pid), threads(pid)

    attacker = subprocess.Popen([require_tool("prlimit"), f"--nofile={SLOW + 100}:{SLOW + 100}", "--",
                                 *as_user(OTHER_USER), sys.executable, "-c", ATTACKER, str(port), str(SLOW)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert attacker.stdout is not None and attacker.stdout.readline().strip() == "open"
        most = 0
        for _ in range(20):  # the connections pile up to the cap as the agent accepts them
            most = max(most, fds(pid))
            time.sleep(0.1)
        latencies: dict[str, list[float]] = {"/healthz": [], "/metrics": []}
        for _ in range(8):
            for path, seen in latencies.items():
                t0 = time.monotonic()
                assert requests.get(url + path, timeout=5).status_code == 200
                seen.append(time.monotonic() - t0)
                most = max(most, fds(pid))
            time.sleep(0.25)
        bus = unique_bus()
        written = time.monotonic()
        kmsg.write(xid79(bus))
        # this XID's signal, logged by the agent and received by the job (the kernel log is the machine's: another
        # test may write XIDs meanwhile)
        acted = re.compile(rf"action=signal outcome=ok incident=\S+ check=xid subject=pci:{bus}\b")
        wait_until(lambda: acted.search(agent.output()) and job.signals() > 0, 10,
                   what="USR1 delivered to the job while the endpoint is held")
        signalled = time.monotonic() - written
        most = max(most, fds(pid))
        assert attacker.poll() is None, "the attacker gave up"
    finally:
        attacker.kill()
        attacker.wait()
    # the attack was real (the agent held connections up to its cap), and the cap held
    assert most >= base_fds + HTTP_CAP * 3 // 4, (most, base_fds)
    assert most <= base_fds + HTTP_CAP + 16, (most, base_fds)
    for path, seen in latencies.items():
        assert statistics.median(seen) < 0.1 and max(seen) < 1.0, (path, [round(s * 1000) for s in seen])
    assert signalled < 5.0
    wait_until(lambda: fds(pid) <= base_fds + 2 and threads(pid) <= base_threads + 2, 10,
               what=f"fds and threads back to baseline ({base_fds}, {base_threads})")
    assert requests.get(url + "/healthz", timeout=5).status_code == 200
    assert "http connections cut" in agent.output() and "Traceback" not in agent.output()


SECRET = f"TOPSECRET-{uuid.uuid4().hex[:8]}"
CRASH = ("Traceback (most recent call last):\n  File \"train.py\", line 12, in <module>\n    connect()\n"
         f"RuntimeError: could not connect to postgres://tgjob:{SECRET}@db.internal/prod\n")
READER = """
import socket, sys
for path in sys.argv[2:]:
    with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5) as s:
        s.sendall(f"GET {path} HTTP/1.0\\r\\n\\r\\n".encode())
        print(b"".join(iter(lambda: s.recv(65536), b"")).decode(errors="replace"))
"""


def test_a_secret_in_one_users_private_log_never_reaches_another_over_tcp(
        tmp_path: Path, job: Job, agent_process: Callable[..., AgentProcess]) -> None:
    job.start()
    home = Path(pwd.getpwnam(JOB_USER).pw_dir)
    home.chmod(0o700)
    log = home / f"secret-{uuid.uuid4().hex[:6]}.log"
    log.write_text("step 1 loss=2.0\n")
    log.chmod(0o600)
    shutil.chown(log, JOB_USER, JOB_USER)
    port = free_port()
    config = agent_config(tmp_path, port, job,
                          f'logs = ["{log}"]\n[checks.training_log]\ninterval = "1s"\njitter = "0s"')
    try:
        agent = agent_process(config)
        agent.wait_for("msg=ready")
        with log.open("a") as f:
            f.write(CRASH)
        agent.wait_for("event=fired check=training_log subject=process:trainer", timeout=20)
        paths = ["/", "/metrics", "/healthz", "/status", "/status?details=1", "/nope", "/../state/control.sock"]
        read = subprocess.run([*as_user(OTHER_USER), sys.executable, "-c", READER, str(port), *paths],
                              capture_output=True, text=True, timeout=30, cwd="/")
        assert read.returncode == 0, read.stderr
        assert SECRET not in read.stdout and "postgres://" not in read.stdout
        # what the other user does see: the incident's check, subject and status, with its summary left out
        assert '"check": "training_log"' in read.stdout and '"subject": "process:trainer"' in read.stdout
        assert read.stdout.count("HTTP/1.0 200") == 5 and "HTTP/1.0 404" in read.stdout
        full = control_status(tmp_path / "state")  # root, over the control socket: the whole text
        [incident] = [i for i in full["incidents"] if i["check"] == "training_log"]
        assert SECRET in incident["summary"] or SECRET in str(incident["details"]), incident
    finally:
        log.unlink(missing_ok=True)
