"""`trainguard selftest` against a real agent process: a test record in the real kernel log read by the xid check's
reader, a disk threshold on a scratch directory, a test job's hang (a process the agent starts, which the hang check's
code finds hung, then ended), the incidents, their events to a Slack emulator, a real SMTP server
and Debian's Alertmanager, the series on /metrics, the resolution; everything marked as a test, no action run, nothing
left. A channel that fails is named, and the command exits non-zero. The responder never acts on a test event.

The first test writes one record to /dev/kmsg (not XID-shaped): run under `flock /tmp/trainguard-tests.lock`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import requests

from tests.conftest import REPO, AgentProcess, control_status, free_port, require, require_root, wait_until
from tests.peers import SMTP_PASSWORD, SMTP_USER, Mailbox, SlackEmulator, alertmanager_server, slack_emulator, smtp_server
from trainguard.agent.configfile import parse_config
from trainguard.core.model import Result, Status
from trainguard.pipeline.engine import Engine, OperatorError
from trainguard.pipeline.incidents import Operator
from trainguard.pipeline.runner import RunReport
from trainguard.pipeline.selftest import MARK
from trainguard.pipeline.store import Store

MARKER = "[trainguard selftest]"


@pytest.fixture
def peers(tmp_path: Path) -> Iterator[tuple[SlackEmulator, Mailbox, int, Path]]:
    with slack_emulator() as slack, smtp_server(tmp_path) as (mailbox, port, cert):
        yield slack, mailbox, port, cert


def config(tmp_path: Path, slack: SlackEmulator, smtp_port: int, cert: Path, alertmanager: str = "",
           xid: bool = False) -> Path:
    """An installed-like config: a disk check with an exec action bound to every status that would leave a file if
    an action ran, and with `xid` the xid check, bound to no action (the kernel log is shared with other tests:
    their XIDs fire here too)."""
    (tmp_path / "watched").mkdir(exist_ok=True)
    path = tmp_path / "trainguard.toml"
    am = f'[notifiers.alertmanager]\nurls = ["{alertmanager}"]\n' if alertmanager else ""
    path.write_text(f"""
[agent]
node_name = "st-node"
state_dir = "{tmp_path / 'state'}"
listen = "127.0.0.1:{free_port()}"
[checks.xid]
enabled = {str(xid).lower()}
[checks.xid.actions]
critical = []
[checks.scratch]
type = "disk"
paths = ["{tmp_path / 'watched'}"]
free_warning = "0%"
free_critical = "0%"
[checks.scratch.actions]
warning = ["mark"]
critical = ["mark"]
resolved = ["mark"]
[actions.mark]
type = "exec"
command = ["/bin/sh", "-c", "echo ran >> {tmp_path / 'action-ran'}"]
[notifiers.slack]
webhook_url = "{slack.url}"
group_window = "0s"
[notifiers.email]
host = "127.0.0.1"
port = {smtp_port}
ca_file = "{cert}"
username = "{SMTP_USER}"
password = "{SMTP_PASSWORD}"
from = "trainguard@st-node"
to = ["ops@example.org"]
group_window = "0s"
{am}""")
    return path


def selftest(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainguard", "selftest", "--config", str(path)], capture_output=True,
                          text=True, timeout=60, cwd=REPO)


def started(agent_process: Callable[..., AgentProcess], path: Path) -> AgentProcess:
    agent = agent_process(path)
    agent.wait_for("engine started")
    return agent


def kernel_log_writable() -> None:
    require_root()
    require(os.access("/dev/kmsg", os.W_OK), "needs a writable /dev/kmsg")


def test_selftest_shows_every_hop_marks_everything_runs_no_action_and_leaves_nothing(
        tmp_path: Path, peers: tuple[SlackEmulator, Mailbox, int, Path],
        agent_process: Callable[..., AgentProcess]) -> None:
    kernel_log_writable()
    slack, mailbox, port, cert = peers
    path = config(tmp_path, slack, port, cert, xid=True)
    started(agent_process, path)
    done = selftest(path)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    for hop in ("job      started", "kernel   detected", "disk     detected", "disk     incident", "disk     event",
                "slack delivered", "email delivered", "metrics  metric", "job      detected", "job      incident",
                "job      event", "job      metric", "job      ended", "disk     resolved", "job      resolved",
                "slack resolved delivered", "email resolved delivered", "cleanup  cleanup"):
        assert hop in out, f"{hop!r} not in:\n{out}"
    assert out.count("slack delivered") == 2 and out.count("email delivered") == 2, out  # the job's own firing too
    assert "CRITICAL by the hang check: [trainguard selftest] TEST: process job trainguard-selftest: no progress" in out
    assert 'trainguard_job_hung{job_id="trainguard-selftest",name="trainguard-selftest"} 1' in out, out
    pid = int(re.search(r"test job trainguard-selftest pid (\d+)", out)[1])  # type: ignore[index]
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
    assert "FAILED" not in out and "skipped" not in out, out
    assert "check xid's kernel log reader read the record (kmsg seq" in out, out
    assert "HTTP 200 ok" in out and "250 accepted for 1 recipient(s)" in out, out  # each channel's answer
    assert 'trainguard_check_status{check="selftest"' in out, out
    assert "selftest passed" in out, out
    # both channels got the firing and the resolution, each marked as a test
    tests = [p["json"] for p in slack.posts if MARKER in p["json"]["text"]]
    assert len(tests) >= 2 and any("RESOLVED" in t["text"] or "OK" in t["text"] for t in tests), slack.posts
    hung = [t["text"] for t in tests if "trainguard-selftest" in t["text"]]
    assert any("no progress" in t for t in hung) and any("ended" in t for t in hung), tests  # fired, then resolved
    mails = [m for m in mailbox.messages if MARKER in m["Subject"]]
    assert len(mails) >= 2, [m["Subject"] for m in mailbox.messages]
    assert all("TEST" in m["Subject"] for m in mails)
    # no action ran, nothing is left: no incident, no scratch directory, no message waiting
    assert not (tmp_path / "action-ran").exists()
    status = control_status(tmp_path / "state")
    assert not [i for i in status["incidents"] if i["check"] == "selftest"], status["incidents"]
    assert "selftest" not in status["checks"]
    assert not list((tmp_path / "state").glob("selftest-*"))


def test_a_failing_channel_is_named_and_the_exit_code_says_so(
        tmp_path: Path, peers: tuple[SlackEmulator, Mailbox, int, Path],
        agent_process: Callable[..., AgentProcess]) -> None:
    require_root()
    slack, mailbox, port, cert = peers
    slack.script = [(500, "internal_error", {})] * 20
    path = config(tmp_path, slack, port, cert)
    started(agent_process, path)
    done = selftest(path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "slack delivered" in done.stdout and "FAILED  slack: 500 internal_error" in done.stdout, done.stdout
    assert "kernel   detected                     skipped no configured check follows the kernel log" in done.stdout
    assert "trainguard selftest: FAILED slack delivered: slack: 500 internal_error" in done.stderr, done.stderr
    assert "email delivered" in done.stdout and "250 accepted" in done.stdout, done.stdout
    assert "selftest FAILED" in done.stdout
    assert [m for m in mailbox.messages if MARKER in m["Subject"]]  # the other channel still got it
    assert "undelivered test message(s) dropped from the outbox" in done.stdout, done.stdout
    # the failed channel's test messages are not left to go out later
    slack.script = []
    time.sleep(3)  # past the dispatcher's first retry (2 s)
    assert not [p for p in slack.posts if MARKER in p["json"]["text"]], slack.posts
    assert not [i for i in control_status(tmp_path / "state")["incidents"] if i["check"] == "selftest"]


def test_alertmanager_gets_test_alerts_that_resolve(
        tmp_path: Path, peers: tuple[SlackEmulator, Mailbox, int, Path],
        agent_process: Callable[..., AgentProcess]) -> None:
    require_root()
    slack, _, port, cert = peers
    with alertmanager_server(tmp_path) as url:
        path = config(tmp_path, slack, port, cert, alertmanager=url)
        started(agent_process, path)
        done = selftest(path)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "alertmanager delivered" in done.stdout and "alertmanager resolved delivered" in done.stdout
        alerts = [a for a in requests.get(f"{url}/api/v2/alerts?active=true&inhibited=true&silenced=true"
                                          "&unprocessed=true", timeout=5).json()
                  if a["labels"].get("check") == "selftest"]
        # resolved alerts leave the active list: at most an expired one lingers, never an active test alert
        assert all(a["labels"].get("test") == "true" for a in alerts), alerts
        assert not [a for a in alerts if a["status"]["state"] == "active"], alerts


def test_the_responder_never_acts_on_a_test_event(tmp_path: Path) -> None:
    """The same incident with and without the test mark: the bound action runs only for the real one."""
    ran = tmp_path / "ran"
    conf = parse_config({"agent": {"node_name": "n", "state_dir": str(tmp_path / "state"), "listen": ""},
                         "checks": {"scratch": {"type": "disk", "paths": [str(tmp_path)],
                                                "actions": {"warning": ["mark"]}}},
                         "actions": {"mark": {"type": "exec",
                                              "command": ["/bin/sh", "-c", f"echo $TRAINGUARD_SUBJECT >> {ran}"]}}},
                        "t.toml")
    engine = Engine(conf, store=Store(None), notifiers={})
    now = time.time()

    marked = Result("scratch", "/test", Status.WARNING, f"{MARK} TEST: x", {"test": True})
    real = Result("scratch", "/real", Status.WARNING, "x")
    engine.ingest(RunReport("scratch", now, 0.0, "ok", (marked, real)))
    wait_until(ran.exists, 10, what="the real incident's action")
    engine.responder.finish(10)
    assert ran.read_text().split() == ["/real"]
    assert {i.subject for i in engine.tracker.incidents() if i.firing} == {"/test", "/real"}


def test_one_selftest_at_a_time_in_process_and_nothing_left(tmp_path: Path) -> None:
    """The engine's own path (settings built as pydantic models here): a second self-test is refused while one runs,
    the hops end with the cleanup, and the engine holds nothing of it afterwards."""
    conf = parse_config({"agent": {"node_name": "n", "state_dir": str(tmp_path / "state"), "listen": ""},
                         "checks": {"memory": {}}, "notifiers": {"console": {}}}, "t.toml")
    engine = Engine(conf, store=Store(tmp_path / "state"))
    engine.start()
    try:
        who = Operator("root", 0, "test")
        first = engine.selftest(who, kmsg=False, metrics=lambda: b'trainguard_check_status{check="selftest"} 1\n'
                                b'trainguard_job_hung{name="trainguard-selftest"} 1\n')
        with pytest.raises(OperatorError, match=f"under way already \\(id {first['id']}"):
            engine.selftest(who, kmsg=False, metrics=bytes)
        wait_until(lambda: (engine.selftest_status() or {}).get("done"), 20, what="the self-test's end")
        test = engine.selftest_status()
        assert test is not None and test["ok"], test
        hops = [(h["path"], h["hop"], h["ok"]) for h in test["hops"]]
        assert ("channels", "console delivered", True) in hops and ("cleanup", "cleanup", True) == hops[-1], hops
        assert "selftest" not in engine.checks and "selftest" not in engine.snapshot().checks
        assert not [i for i in engine.tracker.incidents() if i.check == "selftest"]
        assert not list((tmp_path / "state").glob("selftest-*"))
    finally:
        engine.stop()
