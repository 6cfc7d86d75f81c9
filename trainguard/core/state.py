"""Small persistent state (cursors, positions, counters) as string key/values, and each check's own corner of it."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from typing import Any, Protocol

from trainguard.core.logs import kv

log = logging.getLogger("trainguard.state")


class KeyValue(Protocol):
    def get(self, key: str) -> str | None: ...
    def put(self, key: str, value: str) -> None: ...


class KeyValueStore(KeyValue, Protocol):
    """A store whose keys can be removed: a key written for one reader once (a hand-over) leaves nothing behind."""

    def delete(self, key: str) -> None: ...


def scoped_key(scope: str, key: str) -> str:
    """Where `ScopedState(store, scope)` keeps `key` (tests seed state through it)."""
    return f"{scope}/{key}"


class ScopedState:
    """One check instance's keys, prefixed with its name so two instances of one type never overwrite each other.

    Keys written by versions before the prefix existed (`hang.counters`, `kmsg.cursor`, ...) are read once from
    `legacy` while the scoped key is absent, so an upgrade keeps log positions and hang clocks.
    """

    def __init__(self, store: KeyValue | None, scope: str, legacy: KeyValue | None = None) -> None:
        self.store = store
        self.scope = scope
        self.legacy = legacy
        # What this scope last wrote under each key: a value saved again unchanged (most checks save every run; most
        # runs change nothing) costs no write. Only this scope writes its keys.
        self._written: dict[str, str] = {}
        self._generation = 0  # the store's, when _written was last true of it
        self._lock = threading.Lock()  # a listener's write and a run's never leave _written unlike the store

    def get(self, key: str) -> str | None:
        if self.store is None:
            return None
        value = self.store.get(scoped_key(self.scope, key))
        if value is None and self.legacy is not None:
            value = self.legacy.get(key)
        return value

    def put(self, key: str, value: str) -> None:
        if self.store is None:
            return
        # A store that started over without what it held (store.py: its copy into memory failed) moves its
        # generation: what this scope wrote before is written again.
        generation = getattr(self.store, "generation", 0)
        with self._lock:
            if generation != self._generation:
                self._written.clear()
                self._generation = generation
            if self._written.get(key) == value:
                return
            self._written.pop(key, None)  # unknown until the write returns (it may raise)
            self.store.put(scoped_key(self.scope, key), value)
            self._written[key] = value

    def load_json(self, key: str) -> dict[str, Any]:
        """A JSON object saved under `key`; {} when absent or unreadable."""
        try:
            data = json.loads(self.get(key) or "{}")
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {}

    def save_json(self, key: str, data: Mapping[str, Any]) -> bool:
        """Save what `load_json` reads back; whether it is saved. A failure is logged, never raised: state is only a
        head start (a caller that saves only what changed saves again after a failure)."""
        try:
            self.put(key, json.dumps(data))
        except Exception as exc:  # noqa: BLE001 - the store may be closing or broken; the run's results still count
            log.warning("saving state failed", extra=kv(scope=self.scope, key=key, error=exc))
            return False
        return True
