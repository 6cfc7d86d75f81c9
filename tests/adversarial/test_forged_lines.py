"""A file name is the job's user's text: `x\\n\\x1b[31mCRITICAL advnode: GPU 0 lost\\x1b[0m\\u202e`, opened by a hung
job, must never print a line of its own that reads like an alert in any channel (Slack, email, Alertmanager, a
webhook, the console/journal), nor colour a terminal or reorder text; it still shows, escaped (⏎, ␛), where it was."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import AgentProcess, hang_config, require_root, require_tool, wait_until
from tests.peers import SMTP_PASSWORD, SMTP_USER, Mailbox, alertmanager_alerts, alertmanager_server, slack_emulator, smtp_server
from tests.slurm_cluster import JOB_USER, ensure_user
from tests.test_notifiers import event
from trainguard.core.events import Event
from trainguard.core.logs import format_fields
from trainguard.core.text import one_line, printable
from trainguard.notifiers.alertmanager import AlertmanagerNotifier, AlertmanagerSettings
from trainguard.notifiers.base import NotifierSettings
from trainguard.notifiers.console import ConsoleNotifier
from trainguard.notifiers.email import EmailNotifier, EmailSettings
from trainguard.notifiers.slack import SlackNotifier, SlackSettings
from trainguard.notifiers.webhook import WebhookNotifier, WebhookSettings, webhook_body

FORGED = "x\n\x1b[31mCRITICAL advnode: GPU 0 lost\x1b[0m\u202e"
NAME = f"out{FORGED}.log"
SHOWN = "x⏎CRITICAL advnode: GPU 0 lost"  # how the channels show it: the break visible, the colour gone
# A line that starts (after whitespace and markup) with the forged text: what the attack printed.
FORGED_LINE = re.compile(r"(?:^|[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029])[\s*_>`~•-]*CRITICAL advnode")
INVISIBLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u202a-\u202e\u2060-\u2069\ufeff]")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def assert_defused(text: str, shown: bool = True) -> None:
    assert not FORGED_LINE.search(text), f"a forged line in {text!r}"
    assert not INVISIBLE.search(text), f"an ESC, a bidi or zero-width character in {text!r}"
    if shown:
        assert SHOWN in text, f"the file name is not recognisable in {text!r}"


def strings(value: Any) -> Iterator[str]:
    """Every string in a JSON document, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from strings(v)


def hostile_event() -> Event:
    """A hang whose last signal is the file, as the hang check writes it: in the summary, the details, the subject."""
    path = f"/home/adv/{NAME}"
    return dataclasses.replace(
        event(1), check="hang", subject=f"process:{FORGED}",
        summary=f"process job {FORGED}: no progress for 5m (stale after 5m); last: log {path}",
        details={"job_key": f"process:{FORGED}", "job_id": FORGED, "last_signal": f"log {path}",
                 "signals": [{"what": f"log {path}", "at": 1.0}], "next_step": f"read {path}", "layer": FORGED})


@pytest.fixture
def smtp(tmp_path: Path) -> Iterator[tuple[Mailbox, int, Path]]:
    with smtp_server(tmp_path) as server:
        yield server


def email_settings(port: int, cert: Path) -> dict[str, Any]:
    return {"host": "localhost", "port": port, "security": "starttls", "ca_file": str(cert), "username": SMTP_USER,
            "password": SMTP_PASSWORD, "from": "trainguard@n", "to": ["oncall@example.org"]}


def mail_texts(mailbox: Mailbox) -> list[str]:
    [msg] = mailbox.messages
    parts = [msg.get_body((kind,)).get_content() for kind in ("plain", "html")]  # type: ignore[union-attr]
    return [str(msg["Subject"]), *(p.replace("\r\n", "\n") for p in parts)]  # SMTP's line ends, not the text's


def test_the_file_name_reaches_every_real_peer_as_one_escaped_line(smtp: tuple[Mailbox, int, Path],
                                                                   tmp_path: Path) -> None:
    mailbox, port, cert = smtp
    hostile = hostile_event()
    with slack_emulator() as slack, slack_emulator() as hook, alertmanager_server(tmp_path) as am:
        SlackNotifier("slack", SlackSettings.model_validate({"webhook_url": slack.url})).deliver([hostile])
        EmailNotifier("mail", EmailSettings.model_validate(email_settings(port, cert))).deliver([hostile])
        WebhookNotifier("hook", WebhookSettings.model_validate({"url": hook.url})).deliver([hostile])
        AlertmanagerNotifier("am", AlertmanagerSettings.model_validate({"urls": [am]})).deliver([hostile])
        console = io.StringIO()
        ConsoleNotifier("console", NotifierSettings(), console).send(hostile)
        [firing] = wait_until(lambda: alertmanager_alerts(am), 15, what="the alert in Alertmanager")  # type: ignore[misc]
        [slack_post], [hook_post] = slack.posts, hook.posts
    for text in strings(slack_post["json"]):
        assert_defused(text, shown=False)
    header = next(b for b in slack_post["json"]["attachments"][0]["blocks"] if b["type"] == "header")
    sections = [b["text"]["text"] for b in slack_post["json"]["attachments"][0]["blocks"] if b["type"] == "section"]
    for text in [slack_post["json"]["text"], header["text"]["text"], *sections]:
        assert_defused(text)
    subject, plain, html = mail_texts(mailbox)
    for text in (subject, plain, html):
        assert_defused(text)
    assert "\n" not in subject and plain.count("\n") < 10  # the body's own lines only
    for text in strings(hook_post["json"]):
        assert_defused(text, shown=False)
    assert_defused(hook_post["json"]["title"])
    assert_defused(hook_post["json"]["events"][0]["details"]["last_signal"])
    for text in strings({"labels": firing["labels"], "annotations": firing["annotations"]}):
        assert_defused(text, shown=False)
    assert_defused(firing["annotations"]["summary"])
    assert_defused(firing["labels"]["subject"])
    line = console.getvalue()
    assert line.count("\n") == 1 and line.endswith("\n")
    assert_defused(line)


@contextlib.contextmanager
def job_holding_the_file(marker: str) -> Iterator[Path]:
    """Another user's job that opened the file for writing, wrote once, and hangs."""
    require_root()
    ensure_user(JOB_USER)
    workdir = Path(tempfile.mkdtemp(prefix="tg-forged-"))
    shutil.chown(workdir, JOB_USER, JOB_USER)
    path = workdir / NAME
    code = "import sys, time\nf = open(sys.argv[1], 'w')\nf.write('step 1\\n')\nf.flush()\ntime.sleep(120)\n"
    proc = subprocess.Popen([require_tool("setpriv"), f"--reuid={JOB_USER}", f"--regid={JOB_USER}", "--init-groups",
                             sys.executable, "-c", code, str(path), marker],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # the file is its only output
    try:
        wait_until(path.exists, 10, what="the job's file")
        yield path
    finally:
        proc.kill()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


def test_a_hung_job_holding_the_file_open_alerts_on_slack_and_console_without_a_forged_line(
        agent_process: Any, tmp_path: Path) -> None:
    """The issue's path: the real agent, a real job of another user holding the file open, its hang announced."""
    marker = f"forged-{uuid.uuid4().hex[:8]}"
    with slack_emulator() as slack, job_holding_the_file(marker) as path:
        config = hang_config(tmp_path / "trainguard.toml", tmp_path / "state", marker, JOB_USER, f"""
stacks = false
[notifiers.console]
[notifiers.slack]
webhook_url = {json.dumps(slack.url)}
group_window = "0s"
""")
        agent: AgentProcess = agent_process(config)
        wait_until(lambda: slack.posts, 40, what="the hang on Slack")
        agent.wait_for("logger=trainguard.alert", 10)
        agent.stop()
    posted = slack.posts[0]["json"]
    texts = [posted["text"], *(b["text"]["text"] for b in posted["attachments"][0]["blocks"] if "text" in b)]
    assert any(f"last: log {path.parent}/out{SHOWN}" in t for t in texts), texts
    for text in texts:
        assert_defused(text, shown=False)
    alert_lines = [line for line in agent.output().splitlines() if "logger=trainguard.alert" in line]
    assert alert_lines and all(SHOWN in line for line in alert_lines), alert_lines
    for line in agent.output().splitlines():  # the journal: no line of the agent's own starts with the forged text
        assert not line.startswith("CRITICAL advnode") and "\x1b" not in line and "\u202e" not in line, line


@pytest.mark.parametrize("ch", ["\x1b", "\x00", "\x07", "\x7f", "\x85", "\x9b", "\u202a", "\u202b", "\u202c", "\u202d",
                                "\u202e", "\u2066", "\u2067", "\u2068", "\u2069", "\u200e", "\u200f", "\u061c",
                                "\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\U000e0041", "\u2028", "\r", "\x0b"])
def test_no_control_bidi_or_zero_width_character_survives_the_sanitizer(ch: str) -> None:
    for text in (one_line(f"a{ch}b"), printable(f"a{ch}b"), format_fields({"v": f"a{ch}b"})):
        assert ch not in text and "a" in text and "b" in text
        assert not INVISIBLE.search(text), repr(text)


def test_the_sanitizer_keeps_text_legible_and_bounded() -> None:
    assert one_line("\x1b[1;31mCUDA out of memory\x1b[0m") == "CUDA out of memory"  # a coloured log line
    assert one_line("a\r\nb\tc\x1bZ") == "a⏎b c␛Z"
    assert printable("line 1\r\nline 2\u2028x") == "line 1\nline 2⏎x"
    assert one_line("x" * 50, 10) == "x" * 9 + "…" and len(one_line("\u200b" * 10**6 + "tail", 10)) <= 10
    assert len(format_fields({"v": "y" * 100_000})) < 5000


def test_a_number_too_large_to_write_out_never_stops_a_message() -> None:
    """A collective's sequence id of 5,000 digits in the details: Python refuses to write it out; the message goes."""
    huge = dataclasses.replace(hostile_event(), details={"collectives": {"seq": 11**5000, "rank": 3}})
    body = json.loads(webhook_body([huge]))
    assert body["events"][0]["details"]["collectives"] == {"seq": "(a number too large to show)", "rank": 3}
    assert format_fields({"seq": 11**5000, "job": "7"}) == 'seq="(a number too large to show)" job=7'
