"""A FUSE filesystem whose statfs never returns, nor a read of its one file `data` (the reader waits in D state, as
on a dead NFS/Lustre server): a stand-in for a dead NFS/Lustre mount.

Usage: python hangfs.py MOUNTPOINT CALL_LOG [SOURCE]. Every statfs call is appended to CALL_LOG before it blocks.
SOURCE is what the mount table shows as the mounted device (an NFS-like `server:/export`).
"""

from __future__ import annotations

import errno
import stat
import sys
import threading

from fuse import FUSE, FuseOSError, Operations


class HangFS(Operations):
    def __init__(self, call_log: str) -> None:
        self.call_log = call_log
        self.forever = threading.Event()

    def getattr(self, path: str, fh: object = None) -> dict[str, int]:
        if path == "/":
            return {"st_mode": stat.S_IFDIR | 0o755, "st_nlink": 2}
        if path == "/data":
            return {"st_mode": stat.S_IFREG | 0o644, "st_nlink": 1, "st_size": 1 << 20}
        raise FuseOSError(errno.ENOENT)

    def readdir(self, path: str, fh: object) -> list[str]:
        return [".", "..", "data"]

    def open(self, path: str, flags: int) -> int:
        return 0

    def read(self, path: str, size: int, offset: int, fh: object) -> bytes:
        self.forever.wait()
        return b""

    def statfs(self, path: str) -> dict[str, int]:
        with open(self.call_log, "a") as f:
            f.write("statfs\n")
        self.forever.wait()
        return {}


if __name__ == "__main__":
    FUSE(HangFS(sys.argv[2]), sys.argv[1], foreground=True, nothreads=False,
         **({"fsname": sys.argv[3]} if len(sys.argv) > 3 else {}))
