"""A FUSE filesystem whose statfs never returns: a stand-in for a dead NFS/Lustre mount.

Usage: python hangfs.py MOUNTPOINT CALL_LOG. Every statfs call is appended to CALL_LOG before it blocks.
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
        raise FuseOSError(errno.ENOENT)

    def readdir(self, path: str, fh: object) -> list[str]:
        return [".", ".."]

    def statfs(self, path: str) -> dict[str, int]:
        with open(self.call_log, "a") as f:
            f.write("statfs\n")
        self.forever.wait()
        return {}


if __name__ == "__main__":
    FUSE(HangFS(sys.argv[2]), sys.argv[1], foreground=True, nothreads=False)
