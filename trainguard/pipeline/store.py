"""SQLite (WAL) state: incidents, the notification outbox and small key/value cursors.

A corrupt or unreadable file is moved aside and a fresh one started: state is worth keeping,
but never worth the agent not running.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.core.logs import kv

log = logging.getLogger("trainguard.store")

SCHEMA = """
CREATE TABLE IF NOT EXISTS incidents (
    check_name TEXT NOT NULL,
    subject TEXT NOT NULL,
    data TEXT NOT NULL,
    PRIMARY KEY (check_name, subject)
);
CREATE TABLE IF NOT EXISTS outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    channel TEXT NOT NULL,
    event TEXT NOT NULL,
    created REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_attempt REAL NOT NULL,
    last_error TEXT
);
CREATE INDEX IF NOT EXISTS outbox_channel ON outbox (channel, id);
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


@dataclass(frozen=True)
class OutboxRow:
    id: int
    channel: str
    event: dict[str, Any]
    created: float
    attempts: int
    next_attempt: float
    last_error: str | None


class Store:
    FILENAME = "state.db"

    def __init__(self, state_dir: Path | None) -> None:
        """`state_dir=None` keeps everything in memory (one-shot commands, tests)."""
        self._lock = threading.RLock()
        self.path = state_dir / self.FILENAME if state_dir is not None else None
        self.persistent = False
        self._conn = self._open()

    def _open(self) -> sqlite3.Connection:
        if self.path is None:
            return self._connect(":memory:")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
        except OSError as exc:
            log.error("state dir unusable; state will not survive a restart",
                      extra=kv(path=self.path.parent, error=exc.strerror or exc))
            return self._connect(":memory:")
        for attempt in (1, 2):
            try:
                conn = self._connect(str(self.path))
                self.persistent = True
                return conn
            except sqlite3.DatabaseError as exc:
                if attempt == 2:
                    log.error("fresh state file unusable; state will not survive a restart",
                              extra=kv(path=self.path, error=exc))
                    break
                self._move_aside(exc)
        return self._connect(":memory:")

    def _move_aside(self, exc: Exception) -> None:
        assert self.path is not None
        stamp = time.strftime("%Y%m%dT%H%M%S")
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        for suffix in ("", "-wal", "-shm"):
            src = Path(str(self.path) + suffix)
            if src.exists():
                try:
                    src.rename(Path(str(target) + suffix))
                except OSError:
                    src.unlink(missing_ok=True)
        log.error("state file corrupt or unreadable; moved aside, starting fresh",
                  extra=kv(path=self.path, moved_to=target, error=exc))

    @staticmethod
    def _connect(target: str) -> sqlite3.Connection:
        conn = sqlite3.connect(target, check_same_thread=False, timeout=5.0, isolation_level=None)
        try:
            if target != ":memory:":
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")
                row = conn.execute("PRAGMA quick_check").fetchone()
                if row is None or row[0] != "ok":
                    raise sqlite3.DatabaseError(f"integrity check failed: {row[0] if row else 'no answer'}")
            conn.executescript(SCHEMA)
        except sqlite3.DatabaseError:
            conn.close()
            raise
        return conn

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    # incidents -------------------------------------------------------------
    def load_incidents(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._conn.execute("SELECT data FROM incidents").fetchall()
        out = []
        for (data,) in rows:
            try:
                out.append(json.loads(data))
            except ValueError:
                log.error("skipping unreadable incident row", extra=kv(data=data[:200]))
        return out

    def save(
        self,
        upserts: Iterable[dict[str, Any]] = (),
        deletes: Iterable[tuple[str, str]] = (),
        outbox: Iterable[tuple[str, dict[str, Any]]] = (),
        now: float | None = None,
    ) -> None:
        """Incident changes and the messages they cause, in one transaction: a crash keeps both or neither."""
        now = time.time() if now is None else now
        with self.transaction() as conn:
            conn.executemany(
                "INSERT OR REPLACE INTO incidents (check_name, subject, data) VALUES (?, ?, ?)",
                [(i["check"], i["subject"], json.dumps(i)) for i in upserts],
            )
            conn.executemany("DELETE FROM incidents WHERE check_name = ? AND subject = ?", list(deletes))
            conn.executemany(
                "INSERT INTO outbox (channel, event, created, next_attempt) VALUES (?, ?, ?, ?)",
                [(channel, json.dumps(event), now, now) for channel, event in outbox],
            )

    # outbox ----------------------------------------------------------------
    def next_outbox(self, channel: str) -> OutboxRow | None:
        with self._lock:
            row = self._conn.execute(
                "SELECT id, channel, event, created, attempts, next_attempt, last_error FROM outbox "
                "WHERE channel = ? ORDER BY id LIMIT 1", (channel,)).fetchone()
        if row is None:
            return None
        return OutboxRow(row[0], row[1], json.loads(row[2]), row[3], row[4], row[5], row[6])

    def outbox_group(self, channel: str, created_until: float, limit: int) -> list[OutboxRow]:
        """The oldest messages of a channel created up to `created_until`, in order: one grouped delivery."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT id, channel, event, created, attempts, next_attempt, last_error FROM outbox "
                "WHERE channel = ? AND created <= ? ORDER BY id LIMIT ?", (channel, created_until, limit)).fetchall()
        return [OutboxRow(r[0], r[1], json.loads(r[2]), r[3], r[4], r[5], r[6]) for r in rows]

    def outbox_done(self, *row_ids: int) -> None:
        with self._lock:
            self._conn.executemany("DELETE FROM outbox WHERE id = ?", [(i,) for i in row_ids])

    def outbox_retry(self, row_ids: int | list[int], next_attempt: float, error: str) -> None:
        ids = [row_ids] if isinstance(row_ids, int) else row_ids
        with self._lock:
            self._conn.executemany(
                "UPDATE outbox SET attempts = attempts + 1, next_attempt = ?, last_error = ? WHERE id = ?",
                [(next_attempt, error, i) for i in ids])

    def outbox_stats(self) -> dict[str, tuple[int, float | None]]:
        """Per channel: (queued messages, creation time of the oldest)."""
        with self._lock:
            rows = self._conn.execute("SELECT channel, COUNT(*), MIN(created) FROM outbox GROUP BY channel").fetchall()
        return {channel: (count, oldest) for channel, count, oldest in rows}

    # key/value -------------------------------------------------------------
    def get(self, key: str) -> str | None:
        with self._lock:
            row = self._conn.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def put(self, key: str, value: str) -> None:
        with self._lock:
            self._conn.execute("INSERT OR REPLACE INTO kv (key, value) VALUES (?, ?)", (key, value))

    def close(self) -> None:
        with self._lock:
            try:
                if self.persistent:
                    self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error as exc:
                log.warning("checkpoint on close failed", extra=kv(error=exc))
            self._conn.close()
