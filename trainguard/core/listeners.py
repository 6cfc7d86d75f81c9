"""Listeners: callbacks told of news from another thread (a source's watcher, the kernel log's follower)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from trainguard.core.logs import kv

log = logging.getLogger("trainguard.core.listeners")


class Listeners:
    """Callbacks, each of which must return at once; added and removed under a lock, told without it (the tuple is
    replaced whole). One that raises is logged and never keeps the news from the others."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: tuple[Callable[[], None], ...] = ()

    def __bool__(self) -> bool:
        return bool(self._callbacks)

    def add(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Tell `callback` of news from now on; returns what stops that."""
        with self._lock:
            self._callbacks = (*self._callbacks, callback)

        def stop() -> None:
            with self._lock:
                self._callbacks = tuple(c for c in self._callbacks if c is not callback)

        return stop

    def tell(self, what: str) -> None:
        for callback in self._callbacks:
            try:
                callback()
            except Exception as exc:  # noqa: BLE001 - a listener's failure never stops the thread that tells
                log.warning("listener failed", extra=kv(news=what, error=exc))
