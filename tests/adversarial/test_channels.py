"""A summary carries text a job's user wrote (an exception line, a job name): no character in it may break a
channel, inject a header or a mention, or leak a secret; a message a channel chokes on never blocks the others."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.peers import SMTP_PASSWORD, SMTP_USER, Mailbox, slack_emulator, smtp_server
from tests.test_notifiers import event
from trainguard.actions.base import ActionContext
from trainguard.actions.exec import ExecAction, ExecSettings
from trainguard.actions.slurmctl import drain_reason
from trainguard.core.events import Event
from trainguard.core.logs import format_fields
from trainguard.jobs.slurm import SlurmClient
from trainguard.notifiers.base import Notifier, NotifierError, NotifierSettings
from trainguard.notifiers.email import EmailNotifier, EmailSettings
from trainguard.notifiers.http import post_json, redact, redact_url
from trainguard.notifiers.slack import SlackNotifier, SlackSettings, slack_message
from trainguard.pipeline.dispatch import Dispatcher
from trainguard.pipeline.store import Store

HOSTILE = "RuntimeError: boom\r\nBcc: everyone@example.org\x0bnext\x85line\u2028sep\u2029para\x00nul <!channel> &"

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture
def smtp(tmp_path: Path) -> Iterator[tuple[Mailbox, int, Path]]:
    with smtp_server(tmp_path) as server:
        yield server


def hostile_event() -> Event:
    return dataclasses.replace(event(1), summary=HOSTILE)


def test_an_email_with_every_kind_of_line_break_goes_out_as_one_header(smtp: tuple[Mailbox, int, Path]) -> None:
    mailbox, port, cert = smtp
    settings = EmailSettings.model_validate({"host": "localhost", "port": port, "security": "starttls",
                                             "ca_file": str(cert), "username": SMTP_USER, "password": SMTP_PASSWORD,
                                             "from": "trainguard@n", "to": ["oncall@example.org"]})
    EmailNotifier("mail", settings).deliver([hostile_event()])
    [msg] = mailbox.messages
    subject = msg["Subject"]
    assert "Bcc" not in msg and "\n" not in subject and "\r" not in subject and "boom" in subject
    assert msg["To"] == "oncall@example.org"
    body = msg.get_body(("plain",)).get_content()  # type: ignore[union-attr]
    assert "\x00" not in body and "boom" in body


def test_slack_never_turns_log_text_into_a_mention() -> None:
    message = slack_message([hostile_event()], mention="<!here>")
    sections = [b["text"]["text"] for b in message["attachments"][0]["blocks"] if b["type"] == "section"]
    assert "<!channel>" not in message["text"] and "&lt;!channel&gt;" in message["text"]
    assert message["text"].startswith("<!here> ")  # the configured mention still works
    assert all("<!channel>" not in s and "&amp;" in s for s in sections)


def test_a_slack_message_with_hostile_text_is_delivered() -> None:
    with slack_emulator() as receiver:
        SlackNotifier("slack", SlackSettings.model_validate({"webhook_url": receiver.url})).deliver([hostile_event()])
        [posted] = receiver.posts
        assert "boom" in posted["json"]["text"]


@pytest.mark.parametrize("secret", ["SECRET TOKEN", "tok/en+with=odd&chars", "T0K3N\"q'uote"])
def test_secrets_are_redacted_in_every_spelling(secret: str) -> None:
    from urllib.parse import quote, quote_plus

    for spelled in (secret, quote(secret, safe=""), quote_plus(secret), quote(secret), repr(secret)[1:-1]):
        assert secret not in redact(f"error at https://hooks/{spelled}/x", secret)
        assert spelled not in redact(f"error at https://hooks/{spelled}/x", secret)


def test_redaction_never_raises_on_a_url_urlsplit_rejects() -> None:
    bad = "http://[::1/services/SECRET"
    assert redact_url(f"cannot connect to {bad}", bad) == "cannot connect to <redacted>"


def test_a_percent_encoded_webhook_token_stays_out_of_the_error() -> None:
    with slack_emulator() as receiver:
        base = receiver.url.split("/services/")[0]
        url = base + "/services/T0/B0/SECRET%20TOKEN"
        # a rejection that echoes the request, in both spellings
        receiver.script = [(404, "no_service: /services/T0/B0/SECRET%20TOKEN (SECRET TOKEN)", {})]
        with pytest.raises(NotifierError) as caught:
            post_json(url, {"text": "x"}, 5, "slack")
        assert caught.value.permanent and "404" in str(caught.value)
        assert "SECRET" not in str(caught.value) and "TOKEN" not in str(caught.value)
    with pytest.raises(NotifierError) as refused:  # nothing listens: requests quotes the URL in its error
        post_json("http://127.0.0.1:9/services/T0/B0/SECRET%20TOKEN", {"text": "x"}, 2, "slack")
    assert "SECRET" not in str(refused.value) and "TOKEN" not in str(refused.value)


def test_drain_reasons_log_fields_and_exec_environments_are_one_printable_line(tmp_path: Path) -> None:
    reason = drain_reason(HOSTILE)
    assert reason.startswith("trainguard: RuntimeError: boom") and reason.isprintable() and '"' not in reason
    line = format_fields({"summary": HOSTILE})
    assert "\n" not in line and "\r" not in line and "\u2028" not in line and "\x00" not in line
    out = tmp_path / "summary"
    action = ExecAction("hook", ExecSettings(command=["sh", "-c", f'printf %s "$TRAINGUARD_SUMMARY" > {out}'],
                                             timeout=5))
    ctx = ActionContext(hostile_event(), (), "node1", SlurmClient(), time.time)
    assert action.run(ctx) == "exited 0"  # a NUL in the summary would have made exec() refuse
    assert out.read_text().startswith("RuntimeError: boom") and "\x00" not in out.read_text()


class Choking(Notifier):
    """Crashes (not a NotifierError) on one message, delivers the others."""

    def __init__(self) -> None:
        super().__init__("choking", NotifierSettings())
        self.sent: list[str] = []

    def send(self, event: Event) -> None:
        if event.incident_id == "inc0001":
            raise ValueError("cannot encode this")
        self.sent.append(event.incident_id)

    def deliver(self, events: Sequence[Event]) -> None:
        for e in events:
            self.send(e)


def test_a_message_a_channel_chokes_on_is_dropped_and_the_next_ones_go_out(tmp_path: Path) -> None:
    store = Store(None)
    channel = Choking()
    dispatcher = Dispatcher(store, {"choking": channel})
    store.save(outbox=[("choking", event(1).to_dict()), ("choking", event(2).to_dict())], now=time.time())
    deadline = time.monotonic() + 30
    while store.outbox_stats() and time.monotonic() < deadline:
        wait = dispatcher.deliver_pending("choking")
        if wait:
            time.sleep(min(wait, 8))
    assert channel.sent == ["inc0002"]
    assert dispatcher.stats["choking"].dropped == 1 and store.outbox_stats() == {}
