"""Operating a fleet from the command line: ack, silence and clear through the running agent's control socket
(root and its group only), each recorded with who and why, shown, exported and announced; incidents of a check
taken out of the config resolve."""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO, AgentProcess, free_port, require_root, wait_until
from tests.slurm_cluster import OTHER_USER, ensure_user
from trainguard.agent.configfile import parse_config
from trainguard.core.events import EventKind
from trainguard.pipeline.engine import Engine, OperatorError
from trainguard.pipeline.incidents import Operator
from trainguard.pipeline.store import Store


@pytest.fixture
def base() -> Iterator[Path]:
    """Somewhere every user can search (the refusal test connects as another user)."""
    path = Path(tempfile.mkdtemp(prefix="trainguard-ops-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def agent_config(base: Path, port: int) -> Path:
    watched = base / "watched"
    watched.mkdir(exist_ok=True)
    path = base / "trainguard.toml"
    path.write_text(f"""
[agent]
node_name = "ops"
cluster = "c1"
state_dir = "{base / 'state'}"
listen = "127.0.0.1:{port}"
[checks.scratch]
type = "disk"
paths = ["{watched}"]
interval = "1s"
jitter = 0
free_critical = "100%"
free_warning = "0%"
inodes_free_warning = "0%"
inodes_free_critical = "0%"
repeat_interval = "2s"
[notifiers.console]
""")
    return path


def cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainguard", *args, "--config", str(config)], capture_output=True,
                          text=True, timeout=30, cwd=REPO)


# What a user's own client does: connect to the socket and POST (standard library only: runs as any user).
RAW_ACK = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
except OSError as exc:
    print("connect:", exc.strerror); sys.exit(0)
body = b'{"target": "scratch", "reason": "mine now"}'
try:
    s.sendall(b"POST /ack HTTP/1.0\\r\\nContent-Length: %d\\r\\n\\r\\n" % len(body) + body)
    reply = s.recv(200)
except OSError:
    reply = b""
print("reply:", reply[:20])
"""


def ack_as(user: str, sock: Path) -> str:
    pw = pwd.getpwnam(user)
    out = subprocess.run(["/usr/bin/python3", "-c", RAW_ACK, str(sock)], user=pw.pw_uid, group=pw.pw_gid,
                         extra_groups=[], capture_output=True, text=True, timeout=30, cwd="/")
    return out.stdout.strip() + out.stderr.strip()


def metric(port: int, name: str) -> list[dict[str, str]]:
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return [s.labels for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def socket_status(base: Path) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "trainguard", "status", "--json", "--config",
                          str(base / "trainguard.toml")], capture_output=True, text=True, timeout=30, cwd=REPO)
    return json.loads(out.stdout)


def test_ack_silence_and_clear_through_the_control_socket(base: Path,
                                                          agent_process: Callable[..., AgentProcess]) -> None:
    port = free_port()
    config = agent_config(base, port)
    agent = agent_process(config)
    agent.wait_for("event=fired check=scratch")
    first = re.search(r"event=fired check=scratch subject=\S+ status=CRITICAL incident=(\w+)", agent.output())
    assert first is not None
    subject = str(base / "watched")

    ack = cli(config, "ack", "scratch", "--reason", "looking into it")
    assert ack.returncode == 0 and ack.stdout.strip() == "acknowledged 1 incident(s) of scratch", ack.stderr
    agent.wait_for("event=acknowledged check=scratch")
    assert "acknowledged by root: looking into it" in agent.output()
    [incident] = socket_status(base)["incidents"]
    assert incident["acked"]["by"] == "root" and incident["acked"]["uid"] == 0
    assert metric(port, "trainguard_incident_acknowledged") == [{"check": "scratch", "subject": subject}]
    again = cli(config, "ack", f"scratch{subject}", "--reason", "still mine")  # the path without its leading slash
    assert again.returncode == 0 and again.stdout.strip() == (
        f"acknowledged 0 incident(s) of scratch{subject}: acknowledged already"), again.stderr
    reminders = agent.output().count("event=reminder check=scratch")
    time.sleep(3)  # repeat_interval is 2s: an acknowledged incident sends none
    assert agent.output().count("event=acknowledged check=scratch") == 1  # the second ack announced nothing
    assert agent.output().count("event=reminder check=scratch") == reminders

    silenced = cli(config, "silence", "scratch", "--for", "3s", "--reason", "disk swap")
    assert silenced.returncode == 0 and silenced.stdout.startswith("silenced scratch until "), silenced.stderr
    agent.wait_for("event=silenced check=scratch")
    assert metric(port, "trainguard_incident_silenced") == [{"check": "scratch", "subject": subject}]
    assert socket_status(base)["silences"][0]["reason"] == "disk swap"
    agent.wait_for("event=unsilenced check=scratch", timeout=10)

    cleared = cli(config, "clear", f"scratch/{subject}", "--reason", "moved the data")
    assert cleared.returncode == 0 and cleared.stdout.strip() == f"cleared scratch/{subject}", cleared.stderr
    agent.wait_for("cleared by root: moved the data")
    agent.wait_for("event=fired check=scratch", count=2)  # still full: fires again, as a new incident
    ids = re.findall(r"event=fired check=scratch subject=\S+ status=CRITICAL incident=(\w+)", agent.output())
    assert len(set(ids)) == 2 and ids[0] == first.group(1)
    [firing] = metric(port, "trainguard_incident_firing")
    assert firing == {"check": "scratch", "subject": subject, "type": "disk", "severity": "critical", "job_id": "",
                      "layer": "node", "cluster": "c1"}

    refused = cli(config, "clear", "nosuch/x", "--reason", "r")
    assert refused.returncode == 1 and "no check named 'nosuch'" in refused.stderr
    tcp = requests.post(f"http://127.0.0.1:{port}/ack", json={"target": "scratch"}, timeout=5)
    assert tcp.status_code == 405  # never over TCP


def test_a_command_held_behind_a_checks_run_says_so_rather_than_unreachable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent took the command and waits for the check's run under way (a clear never changes a history mid-run):
    the operator is told it will be done, not that the agent is gone (and so does not run it again)."""
    from trainguard.agent import client

    monkeypatch.setattr(client, "WELL_KNOWN", ())  # this test's socket only, whatever agent runs on this host
    config = parse_config({"agent": {"state_dir": str(tmp_path), "listen": ""}}, "t.toml")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(config.agent.control_path()))
    server.listen(1)
    taken: list[bytes] = []

    def hold() -> None:  # reads the command and, like a check's run lock, answers nothing
        conn, _ = server.accept()
        taken.append(conn.recv(65536))
        time.sleep(1.5)
        conn.close()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        with pytest.raises(client.CommandPendingError, match=r"no answer in 0\.5s: a check's run under way holds "
                                                             r"the command \(it is done when the run ends\)"):
            client.command(config, "/clear", {"target": "xid/pci:0000:01:00", "reason": "r"}, timeout=0.5)
    finally:
        holder.join(5)
        server.close()
    assert taken and taken[0].startswith(b"POST /clear ")
    # Nobody listening on the socket left behind: never sent, so unreachable (not "held").
    with pytest.raises(client.AgentUnreachableError, match=r"control\.sock: .*[Cc]onnection refused"):
        client.command(config, "/clear", {"target": "xid/pci:0000:01:00", "reason": "r"}, timeout=0.5)


def test_a_user_outside_the_agents_group_is_refused(base: Path, agent_process: Callable[..., AgentProcess]) -> None:
    require_root()
    ensure_user(OTHER_USER)
    port = free_port()
    config = agent_config(base, port)
    agent = agent_process(config)
    agent.wait_for("event=fired check=scratch")
    (base / "state").chmod(0o755)
    sock = base / "state" / "control.sock"
    wait_until(sock.exists, 10, what="the control socket")
    assert oct(sock.stat().st_mode & 0o777) == "0o660"
    assert ack_as(OTHER_USER, sock) == "connect: Permission denied"  # the kernel: mode 0660, not their group
    sock.chmod(0o666)  # past the file mode, SO_PEERCRED still refuses the peer
    assert ack_as(OTHER_USER, sock) == "reply: b''"  # connected, then closed (or reset) without an answer
    agent.wait_for("control socket: peer refused")
    assert "event=acknowledged" not in agent.output()
    assert os.stat(sock).st_uid == 0


def test_incidents_of_a_check_no_longer_configured_resolve_on_start(tmp_path: Path) -> None:
    def engine(checks: dict[str, Any]) -> Engine:
        return Engine(parse_config({"agent": {"state_dir": str(tmp_path), "listen": ""}, "jobs": {"sources": []},
                                    "checks": checks, "notifiers": {"console": {}}}, "t.toml"))

    full = {"paths": [str(tmp_path)], "free_critical": "100%", "interval": "60s"}
    first = engine({"old": {"type": "disk", **full}, "memory": {}})
    first.run_round()
    assert [i.check for i in first.tracker.incidents() if i.firing] == ["old"]
    first.store.close()
    second = engine({"memory": {}})
    second.start()
    try:
        assert second.tracker.incidents() == []
        # Only the old check's rows (host memory may fire meanwhile on a busy machine); the first engine's "fired"
        # may still wait in the outbox beside the "resolved", or both may have been delivered already.
        old = [r.event for r in second.store.outbox_group("console", time.time() + 1, 10) if r.event["check"] == "old"]
        resolved = [e["summary"] for e in old if e["kind"] == "resolved"]
        assert resolved in ([], ["the check old is no longer configured"]), old
        assert {e["kind"] for e in old} <= {"fired", "resolved"}, old
    finally:
        second.stop()


def test_a_silence_holds_back_notifications_and_actions_until_it_ends(tmp_path: Path) -> None:
    marker = tmp_path / "acted"
    raw = {"agent": {"state_dir": str(tmp_path), "listen": ""}, "jobs": {"sources": []},
           "actions": {"hook": {"type": "exec", "command": ["sh", "-c", f"echo x >> {marker}"]}},
           "checks": {"scratch": {"type": "disk", "paths": [str(tmp_path)], "free_critical": "100%", "free_warning": "0%",
                                  "actions": {"critical": ["hook"]}}},
           "notifiers": {"console": {}}}
    engine = Engine(parse_config(raw, "t.toml"), store=Store(None))
    who = Operator("alice", 1000, "planned")
    with pytest.raises(OperatorError, match="no check named"):
        engine.silence("nosuch", 60, who)
    silence = engine.silence("scratch", 1.0, who)
    assert silence.target == "scratch"
    engine.run_round()  # the disk is "full" (free_critical 100%): the incident fires under the silence
    [incident] = engine.tracker.incidents()
    assert incident.firing and incident.announced is None and not marker.exists()  # fired, silently
    time.sleep(1.1)
    events = engine.tracker.expire_silences(engine.dispatcher.route)
    assert [e.kind for e in events] == [EventKind.UNSILENCED, EventKind.FIRED]
    engine._emit(events)
    wait_until(marker.exists, 5, what="the action after the silence")
