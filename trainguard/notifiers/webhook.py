"""WebhookNotifier: the events as JSON, optionally signed (HMAC-SHA256), for PagerDuty/Opsgenie-style receivers."""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Sequence

from trainguard.core.events import Event
from trainguard.core.settings import Duration, Field, SecretStr
from trainguard.notifiers.base import GroupNotifier, NotifierSettings
from trainguard.notifiers.http import answer, post_json
from trainguard.notifiers.text import clean_all, headline

SIGNATURE_HEADER = "X-Trainguard-Signature"


class WebhookSettings(NotifierSettings):
    url: SecretStr = Field(description="Where to POST (a secret when it embeds a token: url_file / url_env).")
    secret: SecretStr | None = Field(None, description="Signs the body: X-Trainguard-Signature: sha256=<hex HMAC>.")
    group_window: Duration = Field(30.0, ge=0, description="Events within this window go out as one POST.")


def webhook_body(events: Sequence[Event]) -> bytes:
    events = clean_all(events)  # a receiver may show any field as text (PagerDuty, Opsgenie, a chat bridge)
    return json.dumps({"version": 1, "node": events[0].node, "title": headline(events),
                       "events": [e.to_dict() for e in events]}, sort_keys=True).encode()


def signature(body: bytes, secret: str) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


class WebhookNotifier(GroupNotifier):
    Settings = WebhookSettings
    settings: WebhookSettings

    def deliver(self, events: Sequence[Event]) -> str:
        body = webhook_body(events)
        headers = {SIGNATURE_HEADER: signature(body, self.settings.secret.get_secret_value())} \
            if self.settings.secret else {}
        url = self.settings.url.get_secret_value()
        return answer(post_json(url, None, self.settings.timeout, "webhook", data=body, headers=headers), url)
