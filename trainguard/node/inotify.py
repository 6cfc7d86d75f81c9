"""DirWatcher: wake a check the moment a file of a given name appears in one of a set of directories (inotify).

The job switch check relays `stop` to `hold-array`; polled every 2 s, a trainer that saves and exits within that time
let the array's next task start before the hold. A watch only wakes the check: what the file is, who made it and
whether it counts is decided by the check's own lookups with the job user's authority, as before. So a watch on a
directory a user controls tells the agent nothing but "look now", and the poll stays, for what inotify does not see
(a file touched on another node of a network file system) and where watches can't be had (the per-user limit).

Bounded whatever a user does: one watch per directory, at most `max_watches`; events are read in fixed-size chunks
and only the names asked for wake the check, at most once per `min_gap` seconds however many arrive.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import select
import struct
import threading
import time
from collections.abc import Callable, Collection, Iterable

from trainguard.core.logs import kv

log = logging.getLogger("trainguard.inotify")

IN_ATTRIB = 0x00000004  # a `touch` of a file that exists: its times changed
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_TO = 0x00000080  # written elsewhere and renamed in (the agent's own switch files are)
IN_CREATE = 0x00000100
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000  # the watch is gone (its directory removed or unmounted)
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000  # a job's switch dir that is a symlink is not followed as root: the poll reads it as the user
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
MASK = IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE | IN_ONLYDIR | IN_DONT_FOLLOW
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then `len` bytes of NUL-padded name
READ_CHUNK = 64 << 10


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.inotify_init1.argtypes, libc.inotify_init1.restype = [ctypes.c_int], ctypes.c_int
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        libc.inotify_add_watch.restype = ctypes.c_int
        libc.inotify_rm_watch.argtypes, libc.inotify_rm_watch.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    except (OSError, AttributeError):  # not glibc, or a libc without inotify: the poll alone
        return None
    return libc


def names_in(buffer: bytes) -> Iterable[tuple[int, int, bytes]]:
    """(wd, mask, name) of each event in what one read() returned; a truncated tail is dropped, never raises."""
    offset = 0
    while offset + _EVENT.size <= len(buffer):
        wd, mask, _, length = _EVENT.unpack_from(buffer, offset)
        start = offset + _EVENT.size
        if start + length > len(buffer):
            return
        yield wd, mask, buffer[start:start + length].rstrip(b"\0")
        offset = start + length


class DirWatcher:
    """Calls `wake()` when a file named one of `names` is created, renamed in, written or touched in a watched
    directory (any name in the directories given as `any_name`). `watch(dirs, any_name)` sets the directories (added
    and removed to match); `close()` ends it. Without inotify (no libc support, the fd limit, a refusal) it watches
    nothing and says so once: the caller's poll goes on."""

    def __init__(self, names: Collection[str], wake: Callable[[], None], *, max_watches: int = 1024,
                 min_gap: float = 0.1, name: str = "inotify") -> None:
        self._names = frozenset(os.fsencode(n) for n in names)
        self._wake = wake
        self._max = max_watches
        self._min_gap = min_gap
        self._lock = threading.Lock()
        self._watches: dict[str, int] = {}  # directory -> watch descriptor
        self._any: set[int] = set()  # watch descriptors where any name wakes
        self._refused: set[str] = set()  # said once each
        self._libc = _libc()
        self._fd = -1
        self._stop_r, self._stop_w = os.pipe()
        self._thread: threading.Thread | None = None
        if self._libc is None:
            log.info("inotify unavailable: switch files are seen at the next poll", extra=kv(reason="no libc inotify"))
            return
        fd = self._libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            log.warning("inotify unavailable: switch files are seen at the next poll",
                        extra=kv(reason=os.strerror(ctypes.get_errno())))
            return
        self._fd = fd
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def watching(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._watches)

    def watch(self, directories: Iterable[str], any_name: Collection[str] = ()) -> None:
        if self._fd < 0 or self._libc is None:
            return
        wanted = list(dict.fromkeys([*any_name, *(d for d in directories if d)]))[:self._max]
        with self._lock:
            for gone in set(self._watches) - set(wanted):
                self._libc.inotify_rm_watch(self._fd, self._watches.pop(gone))  # EINVAL once IN_IGNORED: harmless
            for directory in wanted:
                if directory in self._watches:
                    continue
                wd = self._libc.inotify_add_watch(self._fd, os.fsencode(directory), MASK)
                if wd >= 0:
                    self._watches[directory] = wd
                    self._refused.discard(directory)
                    continue
                err = ctypes.get_errno()
                if err in (errno.ENOSPC, errno.EMFILE) and directory not in self._refused:
                    log.warning("inotify watch limit reached: this switch dir is polled only",
                                extra=kv(dir=directory, error=os.strerror(err),
                                         fix="raise fs.inotify.max_user_watches"))
                self._refused.add(directory)  # absent (not made yet), or not a directory: the poll finds it
            self._any = {self._watches[d] for d in any_name if d in self._watches}

    def close(self) -> None:
        """Once; a second call does nothing (its descriptors' numbers may belong to another file by then)."""
        if self._stop_w < 0:
            return
        thread, self._thread = self._thread, None
        os.write(self._stop_w, b"x")
        if thread is not None:
            thread.join(2.0)
        if thread is None or not thread.is_alive():
            for fd in (self._stop_r, self._stop_w, self._fd):
                if fd >= 0:
                    os.close(fd)
            self._fd = -1
        self._stop_w = -1  # a thread still alive keeps its pipe's read end and the inotify fd: closed with the process

    def _loop(self) -> None:
        last = 0.0
        poller = select.poll()  # not select(): an agent holding many connections has descriptors past FD_SETSIZE
        poller.register(self._fd, select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poller.poll()}
            if self._stop_r in ready:
                return
            woken = False
            while True:  # drain what is queued: a flood of events costs reads, never one wake each
                try:
                    buffer = os.read(self._fd, READ_CHUNK)
                except BlockingIOError:
                    break
                except OSError as exc:
                    log.warning("inotify read failed: switch files are seen at the next poll", extra=kv(error=exc))
                    return
                woken |= self._read(buffer)
            if woken:
                pause = last + self._min_gap - time.monotonic()
                if pause > 0:  # at most one wake per gap, whatever a user's loop of touches does
                    time.sleep(pause)
                last = time.monotonic()
                try:
                    self._wake()
                except Exception as exc:  # noqa: BLE001 - the watch goes on; the poll covers a lost wake
                    log.warning("waking the check failed", extra=kv(error=exc))

    def _read(self, buffer: bytes) -> bool:
        """Whether these events ask for a look; a watch the kernel dropped (its directory removed) is forgotten, so
        the next `watch()` adds the directory again once it exists."""
        woken = False
        with self._lock:
            for wd, mask, name in names_in(buffer):
                if mask & IN_IGNORED:
                    for directory in [d for d, w in self._watches.items() if w == wd]:
                        del self._watches[directory]
                    self._any.discard(wd)
                elif mask & IN_Q_OVERFLOW or name in self._names or (name and wd in self._any):
                    woken = True
        return woken
