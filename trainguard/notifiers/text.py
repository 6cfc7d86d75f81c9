"""The words of a notification, shared by every channel: each event cleaned once at the channel's door (`clean`),
a headline that tells the story, and one line per event."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from trainguard.core.events import Event, EventKind
from trainguard.core.model import worst
from trainguard.core.text import one_line
from trainguard.core.units import format_duration

# Bounds on what a channel carries of an event: a label (check, subject, node, a key), any other text (a summary, a
# value in details), and how deep details nest (ours nest two or three levels; deeper is flattened to text).
MAX_LABEL = 256
MAX_TEXT = 2000
MAX_DEPTH = 6
MAX_INT = 2**63


def _clean_value(value: Any, depth: int = 0) -> Any:
    if value is None or isinstance(value, (bool, float)):
        return value
    if isinstance(value, int):  # thousands of digits can't even be written out (Python's int-to-str limit)
        return value if -MAX_INT <= value <= MAX_INT else "(a number too large to show)"
    if depth < MAX_DEPTH and isinstance(value, dict):
        return {one_line(str(k), MAX_LABEL): _clean_value(v, depth + 1) for k, v in value.items()}
    if depth < MAX_DEPTH and isinstance(value, (list, tuple)):
        return [_clean_value(v, depth + 1) for v in value]
    return one_line(str(value), MAX_TEXT)


def clean(event: Event) -> Event:
    """`event` as every channel may show it: each string in it (summary, subject, details: file names, log lines,
    job names a job's user wrote) through `one_line` and bounded. Checks compose summaries from what they read;
    this is where, once, before any channel formats them, nothing of a value can start a line of its own, colour a
    terminal, reorder text with bidi controls or hide text."""
    return dataclasses.replace(event, check=one_line(event.check, MAX_LABEL), subject=one_line(event.subject, MAX_LABEL),
                               node=one_line(event.node, MAX_LABEL), incident_id=one_line(event.incident_id, MAX_LABEL),
                               summary=one_line(event.summary, MAX_TEXT), details=_clean_value(event.details))


def clean_all(events: Sequence[Event]) -> list[Event]:
    return [clean(e) for e in events]


# What a successful action did, in the words of a headline.
_DONE = {"signal": "job signalled", "save": "save requested", "stop": "stop requested", "drain": "node drained",
         "requeue": "job requeued", "restart": "job restarted in place", "hold-array": "array held",
         "resume": "node resumed"}


def actions_done(event: Event) -> list[str]:
    """What the actions on the event's incident did, in words: those done, and those that failed or timed out. A
    skipped action (nothing to act on), a refused one and a dry run did nothing, and are not said."""
    done = []
    for record in event.details.get("actions_taken") or ():
        if record.get("outcome") == "ok":
            name = str(record.get("action"))
            done.append(_DONE.get(name, f"{name} done"))
        elif record.get("outcome") in ("failed", "timeout"):
            done.append(f"{record.get('action')} {record.get('outcome')}")
    return list(dict.fromkeys(done))


def next_step(event: Event) -> str:
    """The check's advice for the operator ("reset the GPU"); none once the incident resolved: the fault is gone (a
    cleared XID said "Next: reset the GPU" in its green message)."""
    step = event.details.get("next_step")
    return str(step) if step and event.kind is not EventKind.RESOLVED else ""


def headline(events: Sequence[Event]) -> str:
    """`CRITICAL gpu-node-17: GPU 3 fell off the bus (XID 79) — job signalled, node drained (+2 more)`."""
    alerts = [e for e in events if not e.kind.operator] or list(events)
    lead = max(alerts, key=lambda e: (e.kind is not EventKind.RESOLVED, e.status.severity, -e.at))
    if all(e.kind.operator for e in events):
        status = lead.kind.value.upper()  # ACKNOWLEDGED, SILENCED, UNSILENCED
    elif all(e.kind is EventKind.RESOLVED for e in alerts):
        status = "RESOLVED"
    else:
        status = worst(e.status for e in alerts if e.kind is not EventKind.RESOLVED).name
    summary = lead.summary if len(lead.summary) <= 120 else lead.summary[:117] + "..."
    done = actions_done(lead)
    text = f"{status} {lead.node}: {summary}" + (f" — {', '.join(done)}" if done else "")
    return text + (f" (+{len(events) - 1} more)" if len(events) > 1 else "")


def event_line(event: Event) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(event.since))
    kind = event.kind.value.upper()
    if event.kind.operator:
        return f"{kind} {event.check}/{event.subject}: {event.summary}"
    if event.kind is EventKind.RESOLVED:
        return f"{kind} {event.check}/{event.subject} after {format_duration(event.at - event.since)}: {event.summary}"
    return f"{kind} {event.status.name} {event.check}/{event.subject} since {when}: {event.summary}"
