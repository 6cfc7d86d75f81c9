"""A FUSE filesystem whose files are slow to stat: a stand-in for an overloaded NFS/Lustre mount.

Usage: python slowfs.py MOUNTPOINT COUNT DELAY. The root holds COUNT empty files `rank<i>.log`, world-readable; each
stat of one takes DELAY seconds.
"""

from __future__ import annotations

import errno
import stat
import sys
import time

from fuse import FUSE, FuseOSError, Operations


class SlowFS(Operations):
    def __init__(self, count: int, delay: float) -> None:
        self.names = {f"rank{i}.log" for i in range(count)}
        self.delay = delay

    def getattr(self, path: str, fh: object = None) -> dict[str, int | float]:
        if path == "/":
            return {"st_mode": stat.S_IFDIR | 0o755, "st_nlink": 2}
        if path.lstrip("/") not in self.names:
            raise FuseOSError(errno.ENOENT)
        time.sleep(self.delay)
        return {"st_mode": stat.S_IFREG | 0o644, "st_nlink": 1, "st_size": 0, "st_mtime": time.time()}

    def readdir(self, path: str, fh: object) -> list[str]:
        return [".", "..", *sorted(self.names)]


if __name__ == "__main__":
    FUSE(SlowFS(int(sys.argv[2]), float(sys.argv[3])), sys.argv[1], foreground=True, nothreads=False, attr_timeout=0,
         entry_timeout=0)
