"""KmsgFollower: a long-lived, event-driven reader of the kernel log.

/dev/kmsg yields one record per read (`prio,seq,usec,flags;message` plus ` KEY=value` lines). The
sequence number and the boot id are persisted, so a restarted agent resumes right after the last
record it saw (nothing announced twice, nothing missed while it was down) and a rebooted node is
read from the start of its new buffer. A reader that fell behind gets EPIPE: the records lost are
counted from the sequence gap and reading goes on. Where /dev/kmsg can't be read (no CAP_SYSLOG, a
container) `journalctl -k -f -o json` is followed instead, with its cursor persisted.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import select
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from trainguard.core.logs import kv
from trainguard.core.state import KeyValue
from trainguard.core.text import linear
from trainguard.node.procfs import ProcFS

log = logging.getLogger("trainguard.node.kmsg")

CURSOR_KEY = "kmsg.cursor"
_ESCAPE = linear(rb"\\x([0-9a-fA-F]{2})")

# What tools put before the kernel's text, one layer at a time (they nest: syslog's `host kernel: [  12.3] `):
# <4> (console level), a raw /dev/kmsg record's `4,123,456,-;`, dmesg's `[  123.456789]` and its caller id `[ T291]`,
# dmesg -H's `[  +0.000123]`, dmesg -T's `[Sun Nov 29 06:46:19 2026]` (any locale: a bracket holding a time of day),
# dmesg --time-format iso and rsyslog's RFC 3339 stamps, dmesg -x's `kern  :warn  : `, syslog and journalctl -k's
# `Nov 29 06:46:19 host kernel: `, a bare `host kernel: `, and pdsh's `host: ` before a dmesg stamp.
_PREFIX_LAYER = linear(
    r"^\s*(?:<\d{1,3}>"
    r"|\d{1,3},\d{1,20},\d{1,20}(?:,[^;\s]{0,16})?;"
    r"|\[\s*\+?\d{1,12}(?:\.\d{1,9})?\](?:\[\s*[CT]\d{1,9}\])?"
    r"|\[[^\]\n]{0,48}\d\d:\d\d[^\]\n]{0,24}\]"
    r"|\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d{1,9})?(?:Z|[+-]\d\d:?\d\d)?(?:\s+\S{1,64}\s+kernel:)?"
    r"|kern\s{0,4}:\s{0,4}[a-z]{1,8}\s{0,4}:"
    r"|\S{1,12}\.?\s{1,3}\d{1,2}\s{1,3}\d\d:\d\d:\d\d(?:\s+\S{1,64})?\s+kernel:"
    r"|(?:\S{1,64}\s+)?kernel:"
    r"|[\w.-]{1,64}:\s{1,8}\[\s*\d{1,12}\.\d{1,9}\])")
_PREFIX_LAYERS = 6


def strip_prefix(line: str) -> str:
    """The kernel's own text of a line as a tool printed it (dmesg in any of its time formats, syslog, journalctl -k,
    a raw /dev/kmsg record): the prefixes, however nested, removed. In linear time; a line without one is returned
    as it is."""
    for _ in range(_PREFIX_LAYERS):
        m = _PREFIX_LAYER.match(line)
        if m is None or m.end() == 0:
            break
        line = line[m.end():]
    return line.lstrip()


@dataclass(frozen=True)
class KernelRecord:
    seq: int  # -1 from the journal
    priority: int
    facility: int
    usec: int
    message: str
    fields: dict[str, str] = field(default_factory=dict)


def parse_kmsg(raw: bytes) -> KernelRecord | None:
    header, sep, body = raw.partition(b";")
    if not sep:
        return None
    parts = header.split(b",")
    try:
        prio, seq, usec = int(parts[0]), int(parts[1]), int(parts[2])
    except (IndexError, ValueError):
        return None
    lines = body.rstrip(b"\n").split(b"\n")
    # The kernel escapes unprintable bytes as \xNN; undo that, then tolerate any invalid UTF-8.
    message = _ESCAPE.sub(lambda m: bytes([int(m.group(1), 16)]), lines[0]).decode("utf-8", "replace")
    fields = {}
    for extra in lines[1:]:
        key, _, value = extra.strip().decode("utf-8", "replace").partition("=")
        if key:
            fields[key] = value
    return KernelRecord(seq, prio & 7, prio >> 3, usec, message, fields)


def parse_journal(line: str) -> tuple[KernelRecord, str] | None:
    """One `journalctl -o json` line; None for anything that is not a kernel record of the expected shape."""
    try:
        entry: Any = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(entry, dict):
        return None
    message = entry.get("MESSAGE")
    if isinstance(message, list):  # journald gives non-UTF-8 messages as byte arrays
        try:
            message = bytes(message).decode("utf-8", "replace")
        except (TypeError, ValueError):
            return None
    cursor = entry.get("__CURSOR")
    if not isinstance(message, str) or not isinstance(cursor, str):
        return None
    return KernelRecord(-1, _small_int(entry.get("PRIORITY"), 6) & 7, 0,
                        _small_int(entry.get("_SOURCE_MONOTONIC_TIMESTAMP"), 0), message), cursor


def _small_int(value: object, default: int) -> int:
    """A journal field as an int (they are strings of digits); `default` for anything else."""
    text = str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
    return int(text) if text.isdigit() and len(text) <= 20 else default


def newest_seq(path: str = "/dev/kmsg") -> int:
    """The sequence number of the newest record in the kernel log now (-1 when it is empty). Raises OSError when the
    device can't be read."""
    last = -1  # reads the whole buffer: SEEK_END would skip the newest record too, and it is what we need
    for record in _records(path):
        last = record.seq
    return last


def _records(path: str) -> Iterator[KernelRecord]:
    """Every record the kernel log holds now, oldest first, without waiting for more. The device gives one record a
    read and EAGAIN at the end; a plain file (a saved copy of the log) is read as lines, one record each."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            with os.fdopen(os.dup(fd), "rb") as lines:
                for line in lines:
                    record = parse_kmsg(line.rstrip(b"\n"))
                    if record is not None:
                        yield record
            return
        while True:
            try:
                raw = os.read(fd, 16384)
            except BlockingIOError:
                return
            except BrokenPipeError:
                continue  # overrun: the next read returns the oldest record still there
            if not raw:  # a FIFO without a writer: nothing more to come now
                return
            record = parse_kmsg(raw)
            if record is not None:
                yield record
    finally:
        os.close(fd)


def cursor_at_end(path: str = "/dev/kmsg", proc: ProcFS | None = None) -> str:
    """A saved position just past the newest record: a follower resuming from it sees only what comes next."""
    return json.dumps({"source": "kmsg", "boot_id": (proc or ProcFS()).boot_id(), "seq": newest_seq(path)})


@dataclass(frozen=True)
class LogPoint:
    """A moment in this boot's kernel log (the agent's first start, an operator's clear): a record is before it when
    its sequence number is at most `seq` (the newest record then), or, from the journal, which has no sequence
    numbers, when its kernel timestamp is at most `usec` (CLOCK_MONOTONIC then, the clock printk stamps records
    with, to within the clocks' drift)."""

    seq: int
    usec: int

    def before(self, seq: int, usec: int) -> bool:
        if seq >= 0 and self.seq >= 0:
            return seq <= self.seq
        return 0 <= usec <= self.usec

    @classmethod
    def now(cls, path: str = "/dev/kmsg") -> LogPoint:
        try:
            seq = newest_seq(path)
        except OSError:
            seq = -1  # no device (journal fallback): the time alone places records
        return cls(seq, time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000)


class KmsgFollower:
    def __init__(self, on_record: Callable[[KernelRecord], None], cursor: KeyValue | None = None,
                 path: str = "/dev/kmsg", journalctl: str = "journalctl", save_every_s: float = 1.0,
                 proc: ProcFS | None = None) -> None:
        self.on_record = on_record
        self.boot_id = (proc or ProcFS()).boot_id()
        self.cursor = cursor
        self.path = path
        self.journalctl = journalctl
        self.save_every_s = save_every_s
        self.source = "none"
        self.error: str | None = None
        self.records = 0
        self.lost = 0
        self.last_seq = -1
        self.lost_log_every_s = 10.0
        self._lost_unlogged = 0  # a sustained overrun logs one line per interval, not one per gap
        self._lost_logged_at = -float("inf")
        self.running = False
        # Set once the records the buffer held at start have all been delivered (the replay is over), or when the
        # follower ends: until then, what was delivered is only part of the log.
        self.caught_up = threading.Event()
        self._stop = threading.Event()
        self._wake_lock = threading.Lock()
        self._wake: tuple[int, int] | None = None  # a pipe stop() writes to: the follower sleeps until a record or that
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._journal_cursor: str | None = None
        self._saved_at = 0.0
        self._taps: tuple[Callable[[KernelRecord], None], ...] = ()  # also told each record (`trainguard selftest`)

    # lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kmsg", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        with self._wake_lock:
            if self._wake is not None:
                os.write(self._wake[1], b"x")
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGTERM)  # its own session: children holding the pipe go too
            except ProcessLookupError:
                pass
        if self._thread is not None:
            self._thread.join(timeout)
        self._save(force=True)

    def _run(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            if stat.S_ISREG(os.fstat(fd).st_mode):  # always readable, never waits: nothing to follow
                os.close(fd)
                raise OSError(errno.EINVAL, "a plain file, not the kernel log device")
        except OSError as exc:
            log.warning("cannot read the kernel log device; following the journal instead",
                        extra=kv(path=self.path, error=exc.strerror or exc))
            self._follow_journal()
            return
        self.source, self.running = "kmsg", True
        log.info("following kernel log", extra=kv(source="kmsg", path=self.path))
        try:
            self._follow_kmsg(fd)
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("kernel log follower stopped")
        finally:
            self.running = False
            self.caught_up.set()
            os.close(fd)

    def read_once(self) -> int:
        """Read what the buffer holds now, without following or persisting (one-shot `trainguard check`)."""
        self.source = "kmsg"
        for record in _records(self.path):
            self.records += 1
            self.last_seq = record.seq
            self._deliver(record)
        return self.records

    # /dev/kmsg -------------------------------------------------------------------------------
    def _resume_after(self) -> int:
        if self.cursor is None:
            return -1
        try:
            saved = json.loads(self.cursor.get(CURSOR_KEY) or "{}")
        except ValueError:
            return -1
        if saved.get("source") == "kmsg" and saved.get("boot_id") == self.boot_id:
            return int(saved.get("seq", -1))
        return -1  # another boot: its buffer is new, read it from the start

    def _follow_kmsg(self, fd: int) -> None:
        skip_through = self._resume_after()
        self.last_seq = skip_through
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        with self._wake_lock:
            self._wake = os.pipe()
            poller.register(self._wake[0], select.POLLIN)
        try:
            self._poll_kmsg(fd, poller, skip_through)
        finally:
            with self._wake_lock:
                for end in self._wake:
                    os.close(end)
                self._wake = None

    def _poll_kmsg(self, fd: int, poller: select.poll, skip_through: int) -> None:
        while not self._stop.is_set():
            # Asleep until a record or stop(); a timeout only while lost records wait to be logged.
            if not poller.poll(500 if self._lost_unlogged else None):
                self._log_lost()
                continue
            while not self._stop.is_set():
                try:
                    raw = os.read(fd, 16384)
                except BlockingIOError:
                    if not self.caught_up.is_set():
                        self.caught_up.set()
                        log.info("kernel log replayed", extra=kv(records=self.records, last_seq=self.last_seq))
                    break
                except BrokenPipeError:
                    continue  # overrun: the next read returns the oldest record still there; the gap counts it
                if not raw:  # a FIFO whose writer went (the device never reads empty): wait for one, not spin
                    self._stop.wait(0.5)
                    break
                record = parse_kmsg(raw)
                if record is None or record.seq <= skip_through:
                    continue
                if self.last_seq >= 0 and record.seq > self.last_seq + 1:
                    gap = record.seq - self.last_seq - 1
                    self.lost += gap
                    self._lost_unlogged += gap
                    self._log_lost(after_seq=self.last_seq)
                self.last_seq = record.seq
                self.records += 1
                self._deliver(record)
            self._save()

    def _log_lost(self, after_seq: int | None = None) -> None:
        now = time.monotonic()
        if self._lost_unlogged and now - self._lost_logged_at >= self.lost_log_every_s:
            log.warning("kernel log records lost (reader overrun)",
                        extra=kv(lost=self._lost_unlogged, lost_total=self.lost, after_seq=after_seq))
            self._lost_unlogged, self._lost_logged_at = 0, now

    # journal ---------------------------------------------------------------------------------
    def _follow_journal(self) -> None:
        saved = {}
        if self.cursor is not None:
            try:
                saved = json.loads(self.cursor.get(CURSOR_KEY) or "{}")
            except ValueError:
                saved = {}
        cmd = [self.journalctl, "-k", "-f", "-o", "json", "--no-pager"]
        if saved.get("source") == "journal" and saved.get("cursor"):
            cmd.append(f"--after-cursor={saved['cursor']}")
        else:
            cmd += ["-b", "--lines=all"]
        try:
            self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          errors="replace", stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            self.error = f"kernel log unavailable: {self.path} not readable and {self.journalctl}: {exc.strerror or exc}"
            log.error("no kernel log source", extra=kv(error=self.error))
            self.caught_up.set()
            return
        self.source, self.running = "journal", True
        # journalctl -f marks no boundary between the backlog and what follows: a check reading through the journal
        # fallback cannot wait for its replay (it sees the backlog arrive as if live).
        self.caught_up.set()
        log.info("following kernel log", extra=kv(source="journal", command=" ".join(cmd)))
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if self._stop.is_set():
                break
            parsed = parse_journal(line)
            if parsed is None:
                continue
            record, self._journal_cursor = parsed
            self.records += 1
            self._deliver(record)
            self._save()
        self.running = False
        if not self._stop.is_set():
            err = self._proc.stderr.read().strip() if self._proc.stderr else ""
            self.error = f"journalctl exited {self._proc.wait()}: {err[-200:]}"
            log.error("journal follower ended", extra=kv(error=self.error))

    # shared ------------------------------------------------------------------------------------
    def tap(self, fn: Callable[[KernelRecord], None]) -> Callable[[], None]:
        """`fn` is told each record from now on, after the owner's handler; returns what ends that."""
        self._taps = (*self._taps, fn)

        def untap() -> None:
            self._taps = tuple(t for t in self._taps if t is not fn)

        return untap

    def _deliver(self, record: KernelRecord) -> None:
        for handler in (self.on_record, *self._taps):
            try:
                handler(record)
            except Exception:
                log.exception("kernel record handler failed", extra=kv(seq=record.seq))

    def _save(self, force: bool = False) -> None:
        if self.cursor is None or (not force and time.monotonic() - self._saved_at < self.save_every_s):
            return
        if self.source == "kmsg" and self.last_seq >= 0:
            value = {"source": "kmsg", "boot_id": self.boot_id, "seq": self.last_seq}
        elif self.source == "journal" and self._journal_cursor:
            value = {"source": "journal", "cursor": self._journal_cursor}
        else:
            return
        try:
            self.cursor.put(CURSOR_KEY, json.dumps(value))
            self._saved_at = time.monotonic()
        except Exception as exc:  # noqa: BLE001 - a store hiccup must not stop the follower
            log.warning("saving the kernel log cursor failed", extra=kv(error=exc))


@dataclass
class _Reader:
    follower: KmsgFollower
    subscribers: list[tuple[int, str, Callable[[KernelRecord], None]]] = field(default_factory=list)
    kinds: set[str] = field(default_factory=set)
    cursor_priority: int = 1 << 30
    started: set[str] = field(default_factory=set)
    read: bool = False


class KernelLog:
    """The node's one reader of the kernel log: every consumer (the xid check, the kernel check) subscribes, and one
    follower per device reads each record once, with one cursor and one journal fallback, and hands it to the
    subscribers in priority order (the XID path first, so nothing else runs before it acts)."""

    def __init__(self, proc: ProcFS | None = None) -> None:
        self.proc = proc
        self._lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._readers: dict[tuple[str, str], _Reader] = {}

    def subscribe(self, name: str, on_record: Callable[[KernelRecord], None], *, path: str = "/dev/kmsg",
                  journalctl: str = "journalctl", cursor: KeyValue | None = None, priority: int = 10,
                  kind: str = "") -> KmsgFollower:
        """The follower of `path` (shared with every subscriber of it); `on_record` gets each record it reads. The
        cursor of the highest-priority subscriber is the one kept."""
        with self._lock:
            reader = self._readers.get((path, journalctl))
            if reader is None:
                reader = _Reader(KmsgFollower(lambda r: None, cursor, path, journalctl, proc=self.proc))
                reader.follower.on_record = functools.partial(self._deliver, reader)
                self._readers[(path, journalctl)] = reader
            if cursor is not None and priority < reader.cursor_priority:
                reader.follower.cursor, reader.cursor_priority = cursor, priority
            reader.subscribers = sorted([*reader.subscribers, (priority, name, on_record)], key=lambda s: s[0])
            reader.kinds.add(kind)
            return reader.follower

    def subscribed(self, follower: KmsgFollower, kind: str) -> bool:
        """Whether a consumer of this kind (a check type) reads what `follower` reads."""
        with self._lock:
            return kind in self._reader(follower).kinds

    @staticmethod
    def _deliver(reader: _Reader, record: KernelRecord) -> None:
        for _, name, on_record in reader.subscribers:
            try:
                on_record(record)
            except Exception:  # one consumer's bug must not keep a record from the others
                log.exception("kernel record handler failed", extra=kv(subscriber=name, seq=record.seq))

    def _reader(self, follower: KmsgFollower) -> _Reader:
        return next(r for r in self._readers.values() if r.follower is follower)

    def start(self, name: str, follower: KmsgFollower) -> None:
        """Start following (once, whoever asks first)."""
        with self._lock:
            reader = self._reader(follower)
            first = not reader.started
            reader.started.add(name)
        if first:
            follower.start()

    def stop(self, name: str, follower: KmsgFollower) -> None:
        """Stop following when the last subscriber that started it stops."""
        with self._lock:
            reader = self._reader(follower)
            reader.started.discard(name)
            last = not reader.started
        if last:
            follower.stop()

    def read_once(self, follower: KmsgFollower, before: Callable[[], None] | None = None) -> int:
        """One-shot (`trainguard check`): read what the buffer holds now, once for every subscriber; `before` runs
        first, by whichever subscriber gets here first (the others wait for the read to end)."""
        with self._read_lock:
            reader = self._reader(follower)
            if not reader.read:
                if before is not None:
                    before()
                follower.read_once()
                reader.read = True
            return follower.records
