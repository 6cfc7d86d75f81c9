"""Delivers queued events from the SQLite outbox, one worker thread per channel.

A message leaves the outbox only once its channel accepted it, so a restart or an outage loses
nothing; a slow or failing channel only ever delays itself.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

from trainguard.core.events import Event, EventKind
from trainguard.core.logs import kv
from trainguard.notifiers.base import Notifier, NotifierError
from trainguard.pipeline.store import Store

log = logging.getLogger("trainguard.dispatch")

MAX_AGE_S = 24 * 3600.0
BACKOFF_BASE_S = 2.0
MAX_CRASHES = 3  # a notifier raising something other than NotifierError on one message this often: drop it

# Told of each delivery attempt: (channel, the events, the peer's answer or None, the error or None).
Watcher = Callable[[str, list[Event], str | None, str | None], None]


class ChannelStats:
    def __init__(self) -> None:
        self.sent = 0
        self.failed = 0
        self.dropped = 0
        self.not_routed: dict[str, int] = {}  # by the routing rule that kept the event from the channel


class Dispatcher:
    def __init__(self, store: Store, notifiers: Mapping[str, Notifier], clock: Callable[[], float] = time.time,
                 max_age_s: float = MAX_AGE_S, annotator: Callable[[Event], dict[str, Any]] | None = None) -> None:
        self._store = store
        self._annotator = annotator
        self._notifiers = dict(notifiers)
        self._clock = clock
        self._max_age_s = max_age_s
        self._wake = {name: threading.Event() for name in self._notifiers}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.stats = {name: ChannelStats() for name in self._notifiers}
        self._watchers: tuple[Watcher, ...] = ()  # `trainguard selftest` follows its messages (replaced, never changed)

    def route(self, event: Event) -> Iterable[str]:
        """The channels that take `event`; the others count it (and say so) under the rule that kept it out, so a
        routing example copied too literally is seen, not silent."""
        taken = []
        for name, notifier in self._notifiers.items():
            rule = notifier.refusal(event)
            if rule is None:
                taken.append(name)
                continue
            counts = self.stats[name].not_routed
            counts[rule] = counts.get(rule, 0) + 1
            if rule not in ("min_severity", "send_resolved"):  # the expected filters stay out of the log
                log.info("not routed to channel", extra=kv(channel=name, rule=rule, incident=event.incident_id,
                                                            check=event.check, subject=event.subject,
                                                            status=event.status.label, event=event.kind.value))
        return taken

    def watch(self, watcher: Watcher) -> None:
        self._watchers = (*self._watchers, watcher)

    def unwatch(self, watcher: Watcher) -> None:
        self._watchers = tuple(w for w in self._watchers if w is not watcher)

    def _tell(self, channel: str, events: list[Event], answer: str | None, error: str | None) -> None:
        for watcher in self._watchers:
            try:
                watcher(channel, events, answer, error)
            except Exception as exc:  # noqa: BLE001 - an observer never stops a delivery
                log.warning("delivery watcher failed", extra=kv(channel=channel, error=exc))

    def start(self) -> None:
        for name in self._notifiers:
            thread = threading.Thread(target=self._worker, args=(name,), name=f"notify-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def wake(self) -> None:
        for event in self._wake.values():
            event.set()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self.wake()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def deliver_pending(self, channel: str) -> float | None:
        """Send what is due on `channel`, in order. Returns seconds until the next retry, None when empty."""
        notifier = self._notifiers[channel]
        stats = self.stats[channel]
        window = notifier.settings.group_window
        while not self._stop.is_set():
            row = self._store.next_outbox(channel)
            if row is None:
                return None
            now = self._clock()
            if now - row.created > min(self._max_age_s, notifier.settings.max_age):
                log.error("dropping undeliverable notification", extra=kv(
                    channel=channel, age_s=round(now - row.created), attempts=row.attempts, error=row.last_error))
                stats.dropped += 1
                self._store.outbox_done(row.id)
                continue
            if row.next_attempt > now:
                return row.next_attempt - now
            if window > 0 and row.attempts == 0 and now < row.created + window:
                return row.created + window - now  # let the rest of the burst arrive: one message for all
            rows = _one_colour(self._store.outbox_group(channel, row.created + window, notifier.settings.max_group)) \
                if window > 0 else [row]
            ids = [r.id for r in rows]
            events = [self._annotate(Event.from_dict(r.event)) for r in rows]
            try:
                answer = notifier.deliver(events)
            except NotifierError as exc:
                stats.failed += 1
                self._tell(channel, events, None, str(exc))
                if exc.permanent:
                    log.error("notification rejected, not retrying", extra=kv(
                        channel=channel, incident=events[0].incident_id, events=len(events), error=str(exc)))
                    self._store.outbox_done(*ids)
                    continue
                delay = exc.retry_after if exc.retry_after is not None else min(
                    notifier.settings.retry_max, BACKOFF_BASE_S * 2 ** row.attempts) * random.uniform(0.8, 1.2)
                log.warning("notification failed, will retry", extra=kv(
                    channel=channel, incident=events[0].incident_id, events=len(events), attempt=row.attempts + 1,
                    retry_in_s=round(delay, 1), error=str(exc)))
                self._store.outbox_retry(ids, now + delay, str(exc))
                return delay
            except Exception as exc:
                stats.failed += 1
                error = f"{type(exc).__name__}: {exc}"
                self._tell(channel, events, None, error)
                if row.attempts + 1 >= MAX_CRASHES:  # a message the channel chokes on must not block the ones after it
                    log.error("notifier crashed on this message again; dropping it", extra=kv(
                        channel=channel, incident=events[0].incident_id, attempts=row.attempts + 1, error=error))
                    stats.dropped += len(ids)
                    self._store.outbox_done(*ids)
                    continue
                log.exception("notifier crashed; will retry", extra=kv(channel=channel))
                delay = BACKOFF_BASE_S * 2 ** row.attempts
                self._store.outbox_retry(ids, now + delay, error)
                return delay
            stats.sent += len(events)
            self._store.outbox_done(*ids)
            self._tell(channel, events, answer, None)
        return None

    def _annotate(self, event: Event) -> Event:
        """Add what the agent has done about the incident by now (actions run after the event was queued)."""
        if self._annotator is None:
            return event
        try:
            extra = self._annotator(event)
        except Exception as exc:  # noqa: BLE001 - an annotation is a nicety; the message goes out without it
            log.warning("annotating a notification failed", extra=kv(incident=event.incident_id, error=exc))
            return event
        return replace(event, details={**event.details, **extra}) if extra else event

    def _worker(self, channel: str) -> None:
        wake = self._wake[channel]
        while not self._stop.is_set():
            wake.clear()
            try:
                delay = self.deliver_pending(channel)
            except Exception:
                log.exception("outbox worker error", extra=kv(channel=channel))
                delay = 5.0
            wake.wait(delay)


def _one_colour(rows: list[Any]) -> list[Any]:
    """The first rows of a group that all resolve, or all do not: a resolution gets its own (green) message instead
    of riding in a new firing's (yellow or red) one, and a firing is never hidden in a green one. The rest stay
    first in the queue, for the next delivery; the order of events is kept."""
    resolved = [r.event.get("kind") == EventKind.RESOLVED.value for r in rows]
    cut = next((i for i, r in enumerate(resolved) if r != resolved[0]), len(rows))
    return rows[:cut]
