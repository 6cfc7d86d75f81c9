"""LogTail: only the bytes appended to a log since the last read, as lines, whatever happens to the file.

Position is kept per file identity (device, inode, and its first bytes: a deleted log's inode
number is soon reused) and saved, so a restart reads on from where it stopped. A rotated or
recreated file is read from its start; a truncated one (smaller than the saved offset) too.
A line longer than `max_line` is cut there and the rest of it skipped: never loaded whole.
Bytes that aren't UTF-8 are replaced, never fatal.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

from trainguard.node.access import Identity, open_as

MAX_LINE = 1 << 20  # 1 MiB
CHUNK = 4 << 20
HEAD = 64


@dataclass
class Position:
    dev: int
    ino: int
    offset: int
    skipping: bool = False  # inside an over-long line: drop bytes until its newline
    head: str = ""  # hex of the file's first bytes (up to HEAD) when last read

    def to_list(self) -> list[int | str]:
        return [self.dev, self.ino, self.offset, int(self.skipping), self.head]

    @classmethod
    def from_list(cls, data: list[int | str]) -> Position:
        return cls(int(data[0]), int(data[1]), int(data[2]), bool(data[3]) if len(data) > 3 else False,
                   str(data[4]) if len(data) > 4 else "")


@dataclass(frozen=True)
class Look:
    """Where a file ended when looked at (`look`), to begin reading there later if it is still that file: the same
    inode, at least as long, with the same first bytes and the same bytes before `size` (a file truncated in place
    and written again, as SLURM's default open mode does, has other bytes there; the same bytes are the same lines)."""

    dev: int
    ino: int
    size: int
    mtime: float  # when it was last written, as the look found it
    head: str  # hex of its first bytes (up to HEAD)
    before: str  # hex of the bytes before `size` (up to HEAD)

    def ends_line(self) -> bool:
        return not self.before or self.before.endswith("0a")


def look(identity: Identity, path: str) -> Look | None:
    """Where the regular file at `path` ends now; None when there is no such file the job's user may read. Raises
    OSError only for a failing read."""
    try:
        fd = open_as(identity, path)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        return Look(st.st_dev, st.st_ino, st.st_size, st.st_mtime, os.pread(fd, HEAD, 0).hex(),
                    _before(fd, st.st_size))
    finally:
        os.close(fd)


def _before(fd: int, size: int) -> str:
    """Hex of the bytes before offset `size` (up to HEAD) of the file open as `fd`."""
    start = max(0, size - HEAD)
    return os.pread(fd, size - start, start).hex()


def _still(fd: int, st: os.stat_result, head: str, seen: Look) -> bool:
    """Whether the file open as `fd` is still the one `seen` looked at, grown or not."""
    if (seen.dev, seen.ino) != (st.st_dev, st.st_ino) or seen.size > st.st_size or not head.startswith(seen.head):
        return False
    return _before(fd, seen.size) == seen.before


class LogTail:
    def __init__(self, path: str, identity: Identity, position: Position | None = None, max_line: int = MAX_LINE,
                 older: float | None = None, begin: Look | None = None, cut: bool = False) -> None:
        """`identity`: the job's user, whose authority the log is read with (a path the user names is only read
        if they could read it themselves). With no position: where `begin` looked, if it is still that file, is
        where reading starts (`cut`: a line unfinished there is the reader's own, whose rest is not read, as after
        a line cut at max_line; else what follows is a line of its own); else a file last written before `older`
        (epoch seconds) is read from its end; else from its start."""
        self.path = path
        self.identity = identity
        self.position = position
        self.max_line = max_line
        self.older = older
        self.begin = begin
        self.cut = cut
        self.spent = 0  # bytes read by the last `read`
        self.behind = 0  # bytes its `limit` left unread (read on next time)

    def read(self, limit: int = 64 << 20) -> Iterator[bytes]:
        """Appended complete lines (newline-terminated), in chunks, up to `limit` bytes per call (the rest next time:
        `behind` says how much)."""
        self.spent = self.behind = 0
        try:  # a regular file the job's user may read; a device or FIFO is never opened for reading
            fd = open_as(self.identity, self.path)
        except OSError:
            return
        try:
            st = os.fstat(fd)
            pos = self.position
            head = os.pread(fd, HEAD, 0).hex()
            if pos is None and self.begin is not None and _still(fd, st, head, self.begin):
                pos = Position(st.st_dev, st.st_ino, self.begin.size, skipping=self.cut and not self.begin.ends_line())
            elif pos is None and self.older is not None and st.st_mtime < self.older:
                pos = Position(st.st_dev, st.st_ino, st.st_size)
            elif pos is None or (pos.dev, pos.ino) != (st.st_dev, st.st_ino) or not head.startswith(pos.head):
                pos = Position(st.st_dev, st.st_ino, 0)
            elif st.st_size < pos.offset:  # truncated (copytruncate, or rewritten)
                pos = Position(st.st_dev, st.st_ino, 0)
            pos.head = head
            self.position = pos
            while self.spent < limit and pos.offset < st.st_size:
                os.lseek(fd, pos.offset, os.SEEK_SET)
                data = os.read(fd, min(CHUNK, limit - self.spent, st.st_size - pos.offset))
                if not data:
                    break
                self.spent += len(data)
                chunk = self._lines(data, pos)
                self.behind = st.st_size - pos.offset if self.spent >= limit else 0
                if chunk is not None:
                    yield chunk
                elif len(data) < CHUNK:
                    break  # only a partial line is left: wait for its newline
        finally:
            os.close(fd)

    def _lines(self, data: bytes, pos: Position) -> bytes | None:
        start = pos.offset
        if pos.skipping:
            nl = data.find(b"\n")
            if nl < 0:
                pos.offset += len(data)
                return None
            pos.skipping = False
            data, start = data[nl + 1:], start + nl + 1
        last = data.rfind(b"\n")
        if last < 0:
            if len(data) >= self.max_line:  # an over-long line: keep its head, skip the rest
                pos.offset = start + len(data)
                pos.skipping = True
                return data[:self.max_line] + b"\n"
            pos.offset = start
            return None
        body = data[:last + 1]
        pos.offset = start + last + 1
        if self._may_hold_long_line(body):
            parts = body.split(b"\n")
            if max(map(len, parts)) > self.max_line:
                body = b"\n".join(p[:self.max_line] for p in parts)
        return body

    def _may_hold_long_line(self, body: bytes) -> bool:
        """A line longer than max_line contains a whole aligned window of max_line/2 bytes without a newline:
        a few `find` calls rule that out without splitting the chunk into lines."""
        window = max(1, self.max_line // 2)
        return any(body.find(b"\n", i, i + window) < 0 for i in range(0, len(body) - window + 1, window))
