"""Email through a real SMTP server in the test process (aiosmtpd) with STARTTLS and authentication."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_until
from tests.peers import SMTP_PASSWORD, SMTP_USER, Mailbox, smtp_server
from tests.test_notifiers import event
from trainguard.notifiers.base import NotifierError
from trainguard.notifiers.email import EmailNotifier, EmailSettings
from trainguard.pipeline.dispatch import Dispatcher
from trainguard.pipeline.store import Store

USER, PASSWORD = SMTP_USER, SMTP_PASSWORD


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture
def smtp(tmp_path: Path) -> Iterator[tuple[Mailbox, int, Path]]:
    with smtp_server(tmp_path) as server:
        yield server


def settings(port: int, cert: Path, **extra: Any) -> EmailSettings:
    return EmailSettings.model_validate({"host": "localhost", "port": port, "security": "starttls", "ca_file": str(cert),
                                         "username": USER, "password": PASSWORD, "from": "trainguard@gpu-node-17",
                                         "to": ["oncall@example.org"], **extra})


def test_message_arrives_with_subject_parts_and_headers(smtp: tuple[Mailbox, int, Path]) -> None:
    mailbox, port, cert = smtp
    done = [{"action": "signal", "outcome": "ok"}, {"action": "drain", "outcome": "ok"}]
    EmailNotifier("mail", settings(port, cert)).deliver([event(3, actions_taken=done), event(4)])
    [msg] = mailbox.messages
    # RFC 2047 encodes the dash; decoding may double the space around it
    assert " ".join(msg["Subject"].split()) == (
        "[trainguard] CRITICAL gpu-node-17: GPU 3 fell off the bus (XID 79) — job signalled, node drained (+1 more)")
    assert msg["To"] == "oncall@example.org" and msg["From"] == "trainguard@gpu-node-17"
    assert msg["Date"] and msg["Message-ID"].endswith("@gpu-node-17>")
    assert msg.is_multipart() and [p.get_content_type() for p in msg.iter_parts()] == ["text/plain", "text/html"]
    text = msg.get_body(("plain",)).get_content()  # type: ignore[union-attr]
    assert "FIRED CRITICAL xid/pci:0000:03:00" in text and "actions: job signalled, node drained" in text


def test_wrong_password_is_a_clear_error_and_the_message_is_kept(smtp: tuple[Mailbox, int, Path],
                                                                   tmp_path: Path) -> None:
    mailbox, port, cert = smtp
    notifier = EmailNotifier("mail", settings(port, cert, password="wrong", group_window="0s"))
    with pytest.raises(NotifierError) as failed:
        notifier.deliver([event(1)])
    assert not failed.value.permanent
    assert str(failed.value).startswith(f"smtp localhost: authentication failed for user {USER}: 535")
    assert "wrong" not in str(failed.value)

    store = Store(tmp_path)
    dispatcher = Dispatcher(store, {"mail": notifier})
    store.save(outbox=[("mail", event(1).to_dict())])
    assert dispatcher.deliver_pending("mail") is not None  # a retry is scheduled
    assert store.outbox_stats()["mail"][0] == 1 and not mailbox.messages
    store.close()


def test_plain_connection_to_a_starttls_only_server_fails_clearly(smtp: tuple[Mailbox, int, Path]) -> None:
    _, port, cert = smtp
    with pytest.raises(NotifierError) as failed:
        EmailNotifier("mail", settings(port, cert, security="none")).deliver([event(1)])
    assert "smtp localhost" in str(failed.value)


def test_dispatcher_delivers_grouped_email(smtp: tuple[Mailbox, int, Path], tmp_path: Path) -> None:
    mailbox, port, cert = smtp
    store = Store(tmp_path)
    dispatcher = Dispatcher(store, {"mail": EmailNotifier("mail", settings(port, cert, group_window="0.5s"))})
    store.save(outbox=[("mail", event(i).to_dict()) for i in range(10)])
    dispatcher.start()
    try:
        wait_until(lambda: mailbox.messages, 10, what="the email")
        assert len(mailbox.messages) == 1 and mailbox.messages[0]["Subject"].endswith("(+9 more)")
    finally:
        dispatcher.stop()
        store.close()
