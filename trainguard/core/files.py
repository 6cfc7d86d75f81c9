"""Small files the agent publishes for other processes, and small files it reads from places it does not own:
written whole or not at all, read without following links or blocking on a FIFO."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path


def replace_file(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write `path` as a whole: a reader sees the old file or the new one, never a part (a temporary file beside it,
    renamed over it). The temporary file is created new (O_EXCL) and never through a link."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def read_small(path: Path, limit: int) -> bytes:
    """At most `limit` bytes of a regular file; a link, a FIFO or a device is refused with OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path}: not a regular file")
        return os.read(fd, limit)
    finally:
        os.close(fd)
