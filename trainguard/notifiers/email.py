"""EmailNotifier: smtplib with implicit TLS or STARTTLS and authentication; a text and an HTML part."""

from __future__ import annotations

import html
import smtplib
import ssl
from collections.abc import Sequence
from email.message import EmailMessage
from email.utils import formatdate, make_msgid
from pathlib import Path
from typing import Literal

from trainguard.core.events import Event
from trainguard.core.settings import Duration, Field, SecretStr, model_validator
from trainguard.core.text import one_line, printable
from trainguard.notifiers.base import GroupNotifier, NotifierError, NotifierSettings
from trainguard.notifiers.text import actions_done, clean_all, event_line, headline, next_step


class EmailSettings(NotifierSettings):
    host: str = Field(description="SMTP server.")
    port: int | None = Field(None, gt=0, lt=65536, description="Default: 465 with tls, 587 with starttls, else 25.")
    security: Literal["starttls", "tls", "none"] = Field("starttls", description="How the connection is encrypted.")
    ca_file: Path | None = Field(None, description="CA bundle to verify the server with; default: the system's.")
    username: str | None = Field(None, description="Log in as this user.")
    password: SecretStr | None = Field(None, description="Its password (prefer password_file or password_env).")
    from_addr: str = Field(alias="from", description="Sender address.")
    to: list[str] = Field(min_length=1, description="Recipients.")
    subject_prefix: str = Field("[trainguard]", description="Prepended to every subject.")
    group_window: Duration = Field(30.0, ge=0, description="Events within this window go out as one email.")

    @model_validator(mode="after")
    def _login_pair(self) -> EmailSettings:
        if (self.username is None) != (self.password is None):
            raise ValueError("give both username and password, or neither")
        return self


def email_message(events: Sequence[Event], s: EmailSettings) -> EmailMessage:
    events = clean_all(events)  # a value's own line breaks never start a line of the body, nor a header
    msg = EmailMessage()
    # The prefix is the config's: one line too, or the email library would refuse the message.
    msg["Subject"] = one_line(f"{s.subject_prefix} {headline(events)}".strip(), 900)
    msg["From"] = s.from_addr
    msg["To"] = ", ".join(s.to)
    msg["Date"] = formatdate(localtime=True)
    msg["Message-ID"] = make_msgid("trainguard", domain=events[0].node or None)
    text, rows = [], []
    for e in events:
        done = actions_done(e)
        step = next_step(e)
        text.append(event_line(e) + (f"\n  actions: {', '.join(done)}" if done else "") + (f"\n  next: {step}" if step else ""))
        rows.append(f"<li><b>{html.escape(e.kind.value.upper())} {html.escape(e.status.name)}</b> "
                    f"{html.escape(e.check)}/{html.escape(e.subject)}: {html.escape(e.summary)}"
                    + (f"<br><i>actions: {html.escape(', '.join(done))}</i>" if done else "") + "</li>")
    footer = f"trainguard on {events[0].node}; `trainguard status` there shows every incident."
    msg.set_content(printable("\n\n".join(text) + f"\n\n-- \n{footer}\n"))
    msg.add_alternative(printable(f"<html><body><ul>{''.join(rows)}</ul><p style='color:#777'>{html.escape(footer)}"
                                  "</p></body></html>"), subtype="html")
    return msg


class EmailNotifier(GroupNotifier):
    Settings = EmailSettings
    settings: EmailSettings

    def _connect(self) -> smtplib.SMTP:
        s = self.settings
        context = ssl.create_default_context(cafile=str(s.ca_file) if s.ca_file else None)
        if s.security == "tls":
            return smtplib.SMTP_SSL(s.host, s.port or 465, timeout=s.timeout, context=context)
        client = smtplib.SMTP(s.host, s.port or (587 if s.security == "starttls" else 25), timeout=s.timeout)
        if s.security == "starttls":
            client.starttls(context=context)
        return client

    def deliver(self, events: Sequence[Event]) -> str:
        s = self.settings
        try:
            msg = email_message(events, s)
        except (ValueError, TypeError) as exc:  # a message that can't be built never will be: don't block the channel
            raise NotifierError(f"cannot build the email: {type(exc).__name__}: {exc}", permanent=True) from None
        where = f"smtp {s.host}"
        try:
            with self._connect() as client:
                if s.username is not None and s.password is not None:
                    client.login(s.username, s.password.get_secret_value())
                refused = client.send_message(msg)
        except smtplib.SMTPAuthenticationError as exc:  # kept for retry: the password may be fixed meanwhile
            raise NotifierError(f"{where}: authentication failed for user {s.username}: {exc.smtp_code} "
                                f"{exc.smtp_error.decode(errors='replace')}") from None
        except smtplib.SMTPRecipientsRefused as exc:
            raise NotifierError(f"{where}: every recipient refused: {', '.join(exc.recipients)}", permanent=True) \
                from None
        except (smtplib.SMTPException, ssl.SSLError, OSError) as exc:
            raise NotifierError(f"{where}: {type(exc).__name__}: {exc}") from None
        # smtplib raises unless the server answered the message's DATA with 250
        taken = len(s.to) - len(refused)
        return f"{where}: 250 accepted for {taken} recipient(s)" + (f", refused {', '.join(refused)}" if refused else "")
