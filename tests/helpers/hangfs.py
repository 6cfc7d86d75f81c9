"""A FUSE filesystem whose statfs never returns, nor a read of its one file `data` (the reader waits in D state, as
on a dead NFS/Lustre server): a stand-in for a dead NFS/Lustre mount.

Usage: python hangfs.py MOUNTPOINT CALL_LOG [SOURCE [CONTROL]]. Every statfs call is appended to CALL_LOG before it
blocks. SOURCE is what the mount table shows as the mounted device (an NFS-like `server:/export`). With CONTROL (a
path outside the mount), a live mount that hangs on demand: reads of `data` return its bytes and statfs answers, except
while CONTROL exists, when they block until it is removed (the server back: the blocked calls return).
"""

from __future__ import annotations

import errno
import os
import stat
import sys
import threading
import time

from fuse import FUSE, FuseOSError, Operations

DATA = bytes(range(256)) * 256  # 64 KiB: `data`'s bytes


class HangFS(Operations):
    def __init__(self, call_log: str, control: str | None = None) -> None:
        self.call_log = call_log
        self.control = control
        self.forever = threading.Event()

    def hang(self) -> None:
        """Block as a dead server's mount does: forever, or while CONTROL exists."""
        if self.control is None:
            self.forever.wait()
            return
        while os.path.exists(self.control):
            time.sleep(0.1)

    def getattr(self, path: str, fh: object = None) -> dict[str, int]:
        if path == "/":
            return {"st_mode": stat.S_IFDIR | 0o755, "st_nlink": 2}
        if path == "/data":
            return {"st_mode": stat.S_IFREG | 0o644, "st_nlink": 1, "st_size": len(DATA)}
        raise FuseOSError(errno.ENOENT)

    def readdir(self, path: str, fh: object) -> list[str]:
        return [".", "..", "data"]

    def open(self, path: str, flags: int) -> int:
        return 0

    def read(self, path: str, size: int, offset: int, fh: object) -> bytes:
        self.hang()
        return DATA[offset:offset + size]

    def statfs(self, path: str) -> dict[str, int]:
        with open(self.call_log, "a") as f:
            f.write("statfs\n")
        self.hang()
        return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": 1024, "f_bfree": 512, "f_bavail": 512}


if __name__ == "__main__":
    # allow_other: the mount is root's, its readers may be a job's user (the goodput benchmark's ranks)
    FUSE(HangFS(sys.argv[2], sys.argv[4] if len(sys.argv) > 4 else None), sys.argv[1], foreground=True,
         nothreads=False, allow_other=True, **({"fsname": sys.argv[3]} if len(sys.argv) > 3 else {}))
