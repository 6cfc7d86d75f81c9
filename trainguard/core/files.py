"""Small files the agent publishes for other processes, and small files it reads from places it does not own:
written whole or not at all, read without following links or blocking on a FIFO."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Collection
from pathlib import Path


def replace_file(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write `path` as a whole, with `mode` whatever the umask (default 0600: the agent's state is its own): a reader
    sees the old file or the new one, never a part (a temporary file of a name no one else has, beside it, renamed
    over it). Two writers at once each leave a whole file; the last rename wins, so a caller whose content must not
    go backwards holds its own lock."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            os.fchmod(out.fileno(), mode)  # mkstemp makes it 0600; the service's umask must not decide who reads it
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def read_small(path: Path, limit: int, owners: Collection[int] | None = None) -> bytes:
    """At most `limit` bytes of a regular file; a link, a FIFO or a device is refused with OSError, and so is, with
    `owners`, a file another user owns or one its group or others may write (what it says is then anyone's word)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path}: not a regular file")
        if owners is not None and (st.st_uid not in owners or st.st_mode & 0o022):
            raise OSError(f"{path}: owned by uid {st.st_uid}, mode {stat.filemode(st.st_mode)}: not trusted")
        return os.read(fd, limit)
    finally:
        os.close(fd)
