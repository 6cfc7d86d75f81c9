"""SlackNotifier: an incoming webhook; one Block Kit message per group of events, coloured by severity."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trainguard.core.events import Event, EventKind, job_of
from trainguard.core.model import Status, worst
from trainguard.core.settings import Duration, Field, SecretStr
from trainguard.notifiers.base import GroupNotifier, NotifierSettings
from trainguard.notifiers.http import answer, post_json
from trainguard.notifiers.text import actions_done, clean_all, event_line, headline, next_step

COLORS = {Status.CRITICAL: "#d32f2f", Status.WARNING: "#f9a825", Status.UNKNOWN: "#757575", Status.OK: "#2e7d32"}
MAX_BLOCK_EVENTS = 20  # Slack allows 50 blocks; the rest is counted, not listed


class SlackSettings(NotifierSettings):
    webhook_url: SecretStr = Field(description="Incoming webhook URL (a secret: prefer webhook_url_file or _env).")
    group_window: Duration = Field(30.0, ge=0, description="Events within this window go out as one message.")
    mention: str = Field("", description="Prepended on CRITICAL, e.g. '<!here>' or '<@U024BE7LH>'.")


def escape(text: str) -> str:
    """Slack's control characters: a job's log line saying `<!channel>` must not page the whole channel."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def slack_message(events: Sequence[Event], mention: str = "") -> dict[str, Any]:
    events = clean_all(events)  # then Slack's own markup escaped: `escape`
    active = [e for e in events if e.kind is not EventKind.RESOLVED]
    status = worst(e.status for e in active) if active else Status.OK
    title = headline(events)  # plain_text in the header: shown as is; escaped where Slack parses markup
    blocks: list[dict[str, Any]] = [
        {"type": "header", "text": {"type": "plain_text", "text": title[:150]}},
    ]
    for event in events[:MAX_BLOCK_EVENTS]:
        lines = [f"*{escape(event_line(event))}*"[:2900]]
        job = job_of(event.details)
        if job:
            lines.append(f"Job: `{escape(job)}`")
        done = actions_done(event)
        if done:
            lines.append("Actions: " + escape(", ".join(done)))
        step = next_step(event)
        if step:
            lines.append(f"Next: {escape(step)}")
        blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": "\n".join(lines)}})
    if len(events) > MAX_BLOCK_EVENTS:
        blocks.append({"type": "context", "elements": [
            {"type": "mrkdwn", "text": f"and {len(events) - MAX_BLOCK_EVENTS} more events: `trainguard status`"}]})
    blocks.append({"type": "context", "elements": [
        {"type": "mrkdwn", "text": f"trainguard on *{escape(events[0].node)}* · {len(events)} event(s)"}]})
    text = f"{mention} {escape(title)}" if mention and status is Status.CRITICAL else escape(title)
    return {"text": text, "attachments": [{"color": COLORS[status], "blocks": blocks}]}


class SlackNotifier(GroupNotifier):
    Settings = SlackSettings
    settings: SlackSettings

    def deliver(self, events: Sequence[Event]) -> str:
        url = self.settings.webhook_url.get_secret_value()
        return answer(post_json(url, slack_message(events, self.settings.mention), self.settings.timeout, "slack"), url)
