"""Mount table and a statvfs that can't hang the agent.

statvfs on a dead NFS or FUSE mount blocks uninterruptibly. Each call runs on a worker thread
with a timeout; a mount whose call is still blocked is "stuck" and gets no further call until
the blocked one returns, so blocked threads never pile up. The worker is kept between calls (a
thread started per call cost more than the call) and replaced when a call blocks in it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from trainguard.core.text import linear
from trainguard.core.worker import KEEP_S, Worker
from trainguard.node.procfs import ProcFS
from trainguard.node.sysfs import read_small

PSEUDO_FSTYPES = (
    "autofs", "binfmt_misc", "bpf", "cgroup", "cgroup2", "configfs", "debugfs", "devpts", "devtmpfs", "efivarfs",
    "fusectl", "hugetlbfs", "mqueue", "nsfs", "proc", "pstore", "rpc_pipefs", "securityfs", "selinuxfs",
    "squashfs", "sysfs", "tracefs", "iso9660", "ramfs", "fuse.gvfsd-fuse", "fuse.portal", "erofs",
)
PSEUDO_MOUNTPOINTS = r"^/(dev|proc|sys|run/credentials|run/user/\d+/doc|var/lib/docker/.+|snap/.+)($|/)"

_OCTAL = linear(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


@dataclass(frozen=True)
class Mount:
    mountpoint: str
    device: str
    fstype: str
    dev_id: str  # major:minor
    options: str = ""  # the mount's own (rw/ro per mount point)
    super_options: str = ""  # the file system's: `ro` here under a `rw` mount is a file system gone read-only

    @property
    def went_read_only(self) -> bool:
        """Mounted read-write, but its file system is read-only now: what the kernel does to ext4 (errors=remount-ro)
        and btrfs after an error (a mount made read-only on purpose is `ro` in both)."""
        return "ro" in self.super_options.split(",") and "rw" in self.options.split(",")

    @property
    def made_by(self) -> int | None:
        """The uid of the local account that mounted this FUSE file system (fusermount records `user_id=`), when not
        root: a mount a user made and serves, whose answers are theirs to withhold; None for any other mount."""
        if self.fstype != "fuse" and not self.fstype.startswith(("fuse.", "fuseblk")):
            return None
        for option in self.super_options.split(","):
            key, _, value = option.partition("=")
            if key == "user_id" and value.isdigit() and value.isascii():
                return int(value) or None
        return None


def read_mounts(proc: ProcFS | None = None) -> list[Mount]:
    return parse_mountinfo((proc or ProcFS()).mountinfo())


def parse_mountinfo(text: str) -> list[Mount]:
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 2:
            continue
        mounts.append(Mount(_unescape(fields[4]), _unescape(tail[1]), tail[0], fields[2], fields[5] if len(fields) > 5
                            else "", tail[2] if len(tail) > 2 else ""))
    return mounts


def device_mounts(dev: str, mounts: list[Mount], sysfs_block: str = "/sys/class/block") -> list[Mount]:
    """The mounts of the block device the kernel calls `dev` (`sda1`, `nvme0n1`, `dm-3`, `vda`) and of its partitions:
    by device number (`/sys/class/block/DEV/dev`), which finds a /dev/mapper or /dev/disk/by-* source too; by the
    source's name where sysfs has no such device (btrfs mounts carry an anonymous device number)."""
    if not dev or "/" in dev or not dev.strip("."):
        return []
    numbers: set[str] = set()
    names = {dev}
    root = os.path.join(sysfs_block, dev)
    for name in [dev, *_partitions(root, dev)]:
        names.add(name)
        number = read_small(os.path.join(sysfs_block, name, "dev"))
        if number:
            numbers.add(number)
    return [m for m in mounts if m.dev_id in numbers or os.path.basename(m.device) in names]


def _partitions(root: str, dev: str) -> list[str]:
    try:
        return [e.name for e in os.scandir(root) if e.name.startswith(dev) and e.name != dev]
    except OSError:
        return []


def real_mounts(mounts: list[Mount], exclude_fstypes: tuple[str, ...] | list[str] = PSEUDO_FSTYPES,
                exclude_mountpoints: str = PSEUDO_MOUNTPOINTS) -> list[Mount]:
    pattern = linear(exclude_mountpoints) if exclude_mountpoints else None
    seen: dict[str, Mount] = {}
    for m in mounts:
        if m.fstype in exclude_fstypes or (pattern and pattern.search(m.mountpoint)):
            continue
        seen[m.mountpoint] = m  # the last mount on a mount point is the visible one
    return list(seen.values())


def mount_of(path: str, mounts: list[Mount]) -> Mount | None:
    """The mount a path lives on (longest mount point prefix; symlinks not resolved to avoid touching it)."""
    best: Mount | None = None
    path = os.path.normpath(path)
    for m in mounts:
        mp = m.mountpoint
        if path == mp or path.startswith(mp.rstrip("/") + "/"):
            if best is None or len(mp) >= len(best.mountpoint):
                best = m
    return best


@dataclass(frozen=True)
class Stuck:
    since: float


class StatfsProbe:
    """statvfs with a timeout, for one caller at a time (a check's runs never overlap): a call queued behind a
    blocked one on the kept thread would be taken for blocked itself."""

    def __init__(self, statvfs: Callable[[str], os.statvfs_result] = os.statvfs,
                 clock: Callable[[], float] = time.time, keep: float = KEEP_S) -> None:
        self._statvfs = statvfs
        self._clock = clock
        self._keep = keep
        self._lock = threading.Lock()
        self._stuck: dict[str, tuple[threading.Event, float]] = {}
        self._worker: Worker | None = None  # free for the next call: none is blocked in it

    def close(self) -> None:
        """End the free worker's thread (a blocked one ends when its call returns)."""
        with self._lock:
            if self._worker is not None:
                self._worker.close()
                self._worker = None

    def stuck_paths(self) -> list[str]:
        with self._lock:
            return [p for p, (done, _) in self._stuck.items() if not done.is_set()]

    def stat(self, path: str, timeout: float) -> os.statvfs_result | OSError | Stuck:
        with self._lock:
            if path in self._stuck:
                done, since = self._stuck[path]
                if not done.is_set():
                    return Stuck(since)
                del self._stuck[path]
            worker = self._worker = self._worker or Worker("statvfs", self._keep)
        done = threading.Event()
        box: list[os.statvfs_result | OSError] = []

        def call() -> None:
            try:
                box.append(self._statvfs(path))
            except OSError as exc:
                box.append(exc)
            finally:
                done.set()

        worker.submit(call)
        if done.wait(timeout):
            return box[0]
        since = self._clock()
        with self._lock:
            if done.is_set():  # it returned as the wait gave up: an answer, not a hung mount
                return box[0]
            self._stuck[path] = (done, since)
            if self._worker is worker:  # held by the blocked call: the next path gets a thread of its own
                self._worker = None
                worker.close()  # its thread ends once the call returns
        return Stuck(since)
