"""SQLite (WAL) state: incidents, the notification outbox and small key/value cursors.

State is worth keeping, but never worth an alert or the agent not running: a full or failing disk sends the store
to memory until the disk takes writes again, and only a file SQLite finds corrupt is moved aside for a fresh one.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
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
# The node ledger (trainguard.pipeline.ledger): faults, drains, resumes, boots and repairs by hardware identity, kept
# across reboots for `ledger.retention`.
LEDGER_SCHEMA = """
CREATE TABLE IF NOT EXISTS ledger (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    boot_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    component TEXT NOT NULL,
    uuid TEXT NOT NULL DEFAULT '',
    bus_id TEXT NOT NULL DEFAULT '',
    model TEXT NOT NULL DEFAULT '',
    event TEXT NOT NULL,
    class TEXT NOT NULL DEFAULT '',
    summary TEXT NOT NULL DEFAULT '',
    data TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS ledger_component ON ledger (component, at);
CREATE INDEX IF NOT EXISTS ledger_at ON ledger (at);
"""
# The schema's version (PRAGMA user_version). Version 1 is the unversioned schema of the releases before the ledger
# (user_version 0); each step up is MIGRATIONS[from], run in order at open. A database of a newer version is refused:
# an older agent would write rows the newer one misreads, or drop what it does not know.
SCHEMA_VERSION = 2
MIGRATIONS: dict[int, str] = {1: LEDGER_SCHEMA}


class SchemaTooNewError(Exception):
    """The state database was written by a newer trainguard: this one refuses it rather than downgrade it."""

    def __init__(self, path: object, found: int) -> None:
        self.found = found
        super().__init__(f"state database {path} is schema version {found}, newer than this trainguard's "
                         f"{SCHEMA_VERSION}: a downgrade is refused; run the newer release, or move the file aside "
                         "to start with no state")


def schema_version(conn: sqlite3.Connection) -> int:
    row = conn.execute("PRAGMA user_version").fetchone()
    return int(row[0]) if row else 0


def ensure_schema(conn: sqlite3.Connection, where: object = "(memory)") -> None:
    """Create what is missing and migrate forward to SCHEMA_VERSION, in one transaction; SchemaTooNewError for a
    database of a later release."""
    found = schema_version(conn)
    if found > SCHEMA_VERSION:
        raise SchemaTooNewError(where, found)
    if found == SCHEMA_VERSION:
        conn.executescript(SCHEMA + LEDGER_SCHEMA)  # IF NOT EXISTS: a no-op unless a table was dropped by hand
        return
    script = SCHEMA + "".join(MIGRATIONS[v] for v in range(max(found, 1), SCHEMA_VERSION))
    conn.executescript(f"BEGIN IMMEDIATE;\n{script}\nPRAGMA user_version = {SCHEMA_VERSION};\nCOMMIT;")
    if found:
        log.warning("state database migrated", extra=kv(path=where, from_version=found, to_version=SCHEMA_VERSION))


@dataclass(frozen=True)
class OutboxRow:
    id: int
    channel: str
    event: dict[str, Any]
    created: float
    attempts: int
    next_attempt: float
    last_error: str | None


@dataclass(frozen=True)
class LedgerRow:
    """One entry of the node ledger (trainguard.pipeline.ledger says what each field holds)."""

    at: float
    boot_id: str
    kind: str  # the component's kind: gpu, hca, nvswitch, node
    component: str  # its hardware identity: a GPU's serial (else its UUID), an HCA's node GUID, the node's name
    event: str  # fault, escalate, resolve, drain, resume, reboot, clear, lemon
    cls: str = ""  # a fault's class: the check's type (xid, gpu, nvlink, pcie, infiniband, ...)
    summary: str = ""
    uuid: str = ""
    bus_id: str = ""
    model: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    id: int = 0


def ledger_query(conn: sqlite3.Connection, since: float = 0.0, component: str | None = None, kind: str | None = None,
                 events: Iterable[str] = ()) -> list[LedgerRow]:
    """Ledger entries since `since`, oldest first: of one component (its id, or a GPU's UUID), one kind, some events."""
    sql = ("SELECT id, at, boot_id, kind, component, uuid, bus_id, model, event, class, summary, data FROM ledger "
           "WHERE at >= ?")
    args: list[Any] = [since]
    if component is not None:
        sql += " AND (component = ? OR uuid = ?)"
        args += [component, component]
    if kind is not None:
        sql += " AND kind = ?"
        args.append(kind)
    wanted = list(events)
    if wanted:
        sql += f" AND event IN ({','.join('?' * len(wanted))})"
        args += wanted
    out = []
    for r in conn.execute(sql + " ORDER BY at, id", args).fetchall():
        try:
            data = json.loads(r[11])
        except ValueError:
            data = {}
        out.append(LedgerRow(id=r[0], at=r[1], boot_id=r[2], kind=r[3], component=r[4], uuid=r[5], bus_id=r[6],
                             model=r[7], event=r[8], cls=r[9], summary=r[10], data=data if isinstance(data, dict) else {}))
    return out


def ledger_insert(conn: sqlite3.Connection, rows: Iterable[LedgerRow]) -> None:
    conn.executemany(
        "INSERT INTO ledger (at, boot_id, kind, component, uuid, bus_id, model, event, class, summary, data) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        [(r.at, r.boot_id, r.kind, r.component, r.uuid, r.bus_id, r.model, r.event, r.cls, r.summary,
          json.dumps(r.data)) for r in rows])


def ledger_append(state_dir: Path, rows: Iterable[LedgerRow], timeout: float) -> None:
    """Append entries to the ledger of a state database the agent keeps, from another process (`trainguard diag`,
    the prolog gate): nothing is created or migrated, and a database busy past `timeout` is given up on.
    FileNotFoundError without one; SchemaTooNewError, or ValueError for an older one the agent has not migrated;
    sqlite3.Error when it can't be written."""
    path = state_dir / Store.FILENAME
    if not path.exists():
        raise FileNotFoundError(f"no state database at {path}")
    conn = sqlite3.connect(f"file:{path}?mode=rw", uri=True, timeout=timeout, isolation_level=None)
    try:
        found = schema_version(conn)
        if found > SCHEMA_VERSION:
            raise SchemaTooNewError(path, found)
        if found < SCHEMA_VERSION:
            raise ValueError(f"{path} is at schema {found}: the agent migrates it at its next start")
        conn.execute("BEGIN IMMEDIATE")
        ledger_insert(conn, rows)
        conn.execute("COMMIT")
    finally:
        conn.close()


def open_read_only(state_dir: Path) -> sqlite3.Connection:
    """The state database as it is, for reading only (`trainguard history`): nothing is created or migrated.
    FileNotFoundError without one; SchemaTooNewError for a newer release's."""
    path = state_dir / Store.FILENAME
    if not path.exists():
        raise FileNotFoundError(f"no state database at {path}")
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
    found = schema_version(conn)
    if found > SCHEMA_VERSION:
        conn.close()
        raise SchemaTooNewError(path, found)
    return conn


RECOVER_HEADROOM = 256 << 10


class Store:
    """Persistent state that never costs an alert.

    On disk normally. When the state dir can't be written (full, read-only, I/O errors) the store carries on in
    memory with everything the disk held, so incidents still change and notifications still go out; `degraded`
    says why, and `recover()` (called periodically) writes the memory back once the disk takes it again. Only a
    file SQLite finds really corrupt is moved aside. Files are 0600 whatever the umask.
    """

    FILENAME = "state.db"

    def __init__(self, state_dir: Path | None) -> None:
        """`state_dir=None` keeps everything in memory on purpose (one-shot commands, tests)."""
        self._lock = threading.RLock()
        self.path = state_dir / self.FILENAME if state_dir is not None else None
        self.persistent = False
        self.degraded: str | None = None  # why the state is only in memory although it should be on disk
        self.generation = 0  # moved when the store starts over without what it held (ScopedState writes it again)
        self._conn = self._open()

    # opening ---------------------------------------------------------------------------------------------------
    def _open(self) -> sqlite3.Connection:
        if self.path is None:
            return self._connect(":memory:")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
            self._private_file()
        except OSError as exc:
            return self._in_memory(f"state dir unusable: {exc.strerror or exc}")
        for attempt in (1, 2):
            try:
                conn = self._connect(str(self.path))
                self.persistent = True
                return conn
            except sqlite3.DatabaseError as exc:
                if not is_corruption(exc):  # full, read-only, I/O: the file is fine, the disk is not
                    return self._in_memory(f"state file not writable: {exc}")
                if attempt == 2:
                    log.error("fresh state file unusable; state will not survive a restart",
                              extra=kv(path=self.path, error=exc))
                    break
                self._move_aside(exc)
        return self._connect(":memory:")

    def _private_file(self) -> None:
        """state.db exists and is 0600 before SQLite opens it: its -wal and -shm files take the same mode."""
        assert self.path is not None
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)
        finally:
            os.close(fd)
        for suffix in ("-wal", "-shm"):
            try:
                os.chmod(str(self.path) + suffix, 0o600)
            except FileNotFoundError:
                pass

    def _in_memory(self, reason: str) -> sqlite3.Connection:
        """Carry on in memory with what the disk still shows (read-only), and say so."""
        mem = self._connect(":memory:")
        if self.path is not None and self.path.exists():
            # Read-only needs the -shm file; on a disk that can't take even that, read the main file alone.
            for mode in ("mode=ro", "immutable=1"):
                try:
                    disk = sqlite3.connect(f"file:{self.path}?{mode}", uri=True, timeout=5.0)
                    try:
                        disk.backup(mem)
                    finally:
                        disk.close()
                    ensure_schema(mem, self.path)
                    break
                except sqlite3.Error as exc:
                    error = exc
            else:
                log.error("state file not readable either; starting empty in memory", extra=kv(path=self.path,
                                                                                               error=error))
        self._set_degraded(reason)
        return mem

    def _set_degraded(self, reason: str) -> None:
        self.persistent = False
        if self.degraded is None:
            log.error("state dir not writable; incidents and notifications carry on in memory and are written when "
                      "it is writable again", extra=kv(path=self.path, error=reason))
        self.degraded = reason

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
        log.error("state file corrupt; moved aside, starting fresh", extra=kv(path=self.path, moved_to=target,
                                                                               error=exc))

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
            ensure_schema(conn, target)
        except (sqlite3.DatabaseError, SchemaTooNewError):
            conn.close()
            raise
        return conn

    def recover(self) -> bool:
        """While degraded, try to put the memory state back on disk; True once the store is persistent again."""
        with self._lock:
            if self.degraded is None or self.path is None:
                return self.persistent
            if not self._has_headroom():
                return False
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
                self._private_file()
                disk = sqlite3.connect(str(self.path), check_same_thread=False, timeout=5.0, isolation_level=None)
            except (OSError, sqlite3.Error):
                return False
            try:
                self._conn.backup(disk)  # the whole memory database, in one go
                disk.close()
                conn = self._connect(str(self.path))
            except sqlite3.Error as exc:
                disk.close()
                log.debug("state dir still not writable", extra=kv(path=self.path, error=exc))
                return False
            self._conn.close()
            self._conn = conn
            self.persistent, self.degraded = True, None
            log.warning("state dir writable again; state written", extra=kv(path=self.path))
            return True

    def _has_headroom(self) -> bool:
        """Room for the state twice over (and at least RECOVER_HEADROOM): writing it back into the last free pages
        would only fail again at the next write, and the agent's state incident would flap."""
        assert self.path is not None
        try:
            st = os.statvfs(self.path.parent)
        except OSError:
            return False
        size = 0
        for suffix in ("", "-wal"):
            try:
                size += os.stat(str(self.path) + suffix).st_size
            except OSError:
                continue
        return st.f_bavail * st.f_frsize >= max(RECOVER_HEADROOM, 2 * size)

    def _write(self, fn: Callable[[sqlite3.Connection], None]) -> None:
        """Run a write; when the disk refuses it, switch to memory and run it there: never lose the change."""
        with self._lock:
            try:
                fn(self._conn)
                return
            except sqlite3.Error as exc:
                if not self.persistent or is_corruption(exc) or not is_storage_error(exc):
                    raise
                reason = f"{exc}"
            mem = self._connect(":memory:")
            try:
                self._conn.backup(mem)
            except sqlite3.Error as exc:
                log.error("copying the state into memory failed; continuing with what is in memory",
                          extra=kv(error=exc))
                self.generation += 1
            self._conn.close()
            self._conn = mem
            self._set_degraded(reason)
            fn(self._conn)

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

    def _in_transaction(self, body: Callable[[sqlite3.Connection], None]) -> Callable[[sqlite3.Connection], None]:
        def run(conn: sqlite3.Connection) -> None:
            conn.execute("BEGIN IMMEDIATE")
            try:
                body(conn)
            except BaseException:
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error:
                    pass  # a failed COMMIT may have ended the transaction already
                raise
            try:
                conn.execute("COMMIT")
            except sqlite3.Error:
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
                raise
        return run

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
        rows = [(i["check"], i["subject"], json.dumps(i)) for i in upserts]
        gone = list(deletes)
        queued = [(channel, json.dumps(event), now, now) for channel, event in outbox]

        def body(conn: sqlite3.Connection) -> None:
            conn.executemany("INSERT OR REPLACE INTO incidents (check_name, subject, data) VALUES (?, ?, ?)", rows)
            conn.executemany("DELETE FROM incidents WHERE check_name = ? AND subject = ?", gone)
            conn.executemany("INSERT INTO outbox (channel, event, created, next_attempt) VALUES (?, ?, ?, ?)", queued)

        self._write(self._in_transaction(body))

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
        self._write(lambda conn: conn.executemany("DELETE FROM outbox WHERE id = ?", [(i,) for i in row_ids]))

    def outbox_retry(self, row_ids: int | list[int], next_attempt: float, error: str) -> None:
        ids = [row_ids] if isinstance(row_ids, int) else row_ids
        self._write(lambda conn: conn.executemany(
            "UPDATE outbox SET attempts = attempts + 1, next_attempt = ?, last_error = ? WHERE id = ?",
            [(next_attempt, error, i) for i in ids]))

    def outbox_drop(self, check: str, key: str, value: str) -> int:
        """Removes the queued messages of `check` whose event's details[key] is `value` (a self-test's, once it is
        over); how many there were."""
        dropped: list[int] = []

        def body(conn: sqlite3.Connection) -> None:
            cursor = conn.execute("DELETE FROM outbox WHERE json_extract(event, '$.check') = ? AND "
                                  "json_extract(event, '$.details.' || ?) = ?", (check, key, value))
            dropped.append(cursor.rowcount)

        self._write(body)
        return dropped[-1] if dropped else 0  # the last try: a write the disk refused runs again in memory

    def outbox_stats(self) -> dict[str, tuple[int, float | None]]:
        """Per channel: (queued messages, creation time of the oldest)."""
        with self._lock:
            rows = self._conn.execute("SELECT channel, COUNT(*), MIN(created) FROM outbox GROUP BY channel").fetchall()
        return {channel: (count, oldest) for channel, count, oldest in rows}

    # ledger -----------------------------------------------------------------
    def ledger_add(self, rows: Iterable[LedgerRow]) -> None:
        """Append entries to the node ledger, in one transaction."""
        listed = list(rows)
        self._write(self._in_transaction(lambda conn: ledger_insert(conn, listed)))

    def ledger_rows(self, since: float = 0.0, component: str | None = None, kind: str | None = None,
                    events: Iterable[str] = ()) -> list[LedgerRow]:
        with self._lock:
            return ledger_query(self._conn, since, component, kind, events)

    def ledger_prune(self, before: float) -> None:
        self._write(lambda conn: conn.execute("DELETE FROM ledger WHERE at < ?", (before,)))

    # key/value -------------------------------------------------------------
    def get(self, key: str) -> str | None:
        with self._lock:
            row = self._conn.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def put(self, key: str, value: str) -> None:
        self._write(lambda conn: conn.execute("INSERT OR REPLACE INTO kv (key, value) VALUES (?, ?)", (key, value)))

    def delete(self, key: str) -> None:
        self._write(lambda conn: conn.execute("DELETE FROM kv WHERE key = ?", (key,)))

    def close(self) -> None:
        with self._lock:
            try:
                if self.persistent:
                    self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error as exc:
                log.warning("checkpoint on close failed", extra=kv(error=exc))
            self._conn.close()


# SQLite's primary result codes (sqlite3.h): what a failed statement says about the file and the disk.
_CORRUPT = {11, 26}  # SQLITE_CORRUPT, SQLITE_NOTADB
_STORAGE = {3, 8, 10, 13, 14}  # SQLITE_PERM, SQLITE_READONLY, SQLITE_IOERR, SQLITE_FULL, SQLITE_CANTOPEN


def is_corruption(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) in _CORRUPT
    return "integrity check failed" in str(exc) or "not a database" in str(exc) or "malformed" in str(exc)


def is_storage_error(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) in _STORAGE
    return isinstance(exc, sqlite3.OperationalError)
