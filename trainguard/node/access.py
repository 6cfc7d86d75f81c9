"""Reading files on behalf of a job, with that job user's authority and never more.

The agent holds CAP_DAC_READ_SEARCH (or runs as root), so the kernel would let it open any file a job's user names:
its StdOut path, a heartbeat, a log glob. Such a path is therefore walked here from the root one component at a time
on directory file descriptors, following symlinks by hand (each target walked the same way), checking at every
directory that the user may search it and at the end that the user may read a regular file. The file is first
opened O_PATH (no open side effect, a FIFO or a device never blocks or wakes), checked with fstat, and only then
reopened for reading through /proc/self/fd, which names that same inode. Reads are capped.

Permission is decided from the mode bits with the kernel's rule (owner bits for the owner, else group bits for a
member, else other bits); POSIX ACLs are not evaluated, so an ACL granting more than the mode is not honoured here
(the safe direction) and one denying a named user what "other" allows would be (documented in docs/security.md).
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

MAX_SYMLINKS = 40  # the kernel's own limit (ELOOP)
R_OK, X_OK = 4, 1
_PATH = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


class AccessDeniedError(PermissionError):
    """The job's user could not do this themselves."""


@dataclass(frozen=True)
class Identity:
    """Whose authority a read happens under: a uid and all its groups."""

    uid: int
    gids: frozenset[int] = frozenset()

    @classmethod
    def of_uid(cls, uid: int) -> Identity:
        try:
            pw = pwd.getpwuid(uid)
            gids = os.getgrouplist(pw.pw_name, pw.pw_gid)
        except (KeyError, OSError):  # a uid without a passwd entry has no groups we can know of
            gids = []
        return cls(uid, frozenset(gids))

    def may(self, st: os.stat_result, want: int) -> bool:
        if self.uid == 0:
            return True
        if st.st_uid == self.uid:
            bits = st.st_mode >> 6
        elif st.st_gid in self.gids:
            bits = st.st_mode >> 3
        else:
            bits = st.st_mode
        return (bits & want) == want


NOBODY = Identity(65534)  # a job whose owner is unknown reads only what everyone may
# Paths from the operator's own config (not a job's): read with the agent's own rights, the kernel deciding.
AGENT = Identity(0)


class Identities:
    """Identity by uid, cached: group lists come from NSS (LDAP on many clusters), not to be asked every round."""

    def __init__(self, ttl_s: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._cache: dict[int, tuple[float, Identity]] = {}

    def of(self, uid: int | None) -> Identity:
        if uid is None:
            return NOBODY
        now = self._clock()
        with self._lock:
            hit = self._cache.get(uid)
            if hit is not None and now - hit[0] < self._ttl:
                return hit[1]
        identity = Identity.of_uid(uid)
        with self._lock:
            if len(self._cache) > 4096:  # bounded: the users of the jobs on one node are few
                self._cache.clear()
            self._cache[uid] = (now, identity)
        return identity


def resolve(identity: Identity, path: str, follow_final: bool) -> tuple[int, os.stat_result]:
    """An O_PATH descriptor of `path` as `identity` may reach it, and its stat. Raises OSError (AccessDeniedError when
    a directory on the way may not be searched by the user)."""
    if not os.path.isabs(path) or "\0" in path:
        raise OSError(errno.EINVAL, "not an absolute path", path)
    parts = [p for p in path.split("/") if p not in ("", ".")]
    parts.reverse()  # a stack: the next component is last
    current = os.open("/", _PATH | os.O_DIRECTORY)
    links = 0
    try:
        while parts:
            name = parts.pop()
            here = os.fstat(current)
            if not identity.may(here, X_OK):
                raise AccessDeniedError(errno.EACCES, "directory not searchable by the job's user", path)
            fd = os.open(name, _PATH, dir_fd=current)
            st = os.fstat(fd)
            if stat.S_ISLNK(st.st_mode) and (parts or follow_final):
                links += 1
                target = os.readlink("", dir_fd=fd)
                os.close(fd)
                if links > MAX_SYMLINKS:
                    raise OSError(errno.ELOOP, "too many levels of symbolic links", path)
                if target.startswith("/"):
                    os.close(current)
                    current = os.open("/", _PATH | os.O_DIRECTORY)
                parts.extend(reversed([p for p in target.split("/") if p not in ("", ".")]))
                continue
            if parts and not stat.S_ISDIR(st.st_mode):
                os.close(fd)
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", path)
            os.close(current)
            current = fd
        return current, os.fstat(current)
    except BaseException:
        os.close(current)
        raise


def stat_as(identity: Identity, path: str, follow_symlinks: bool = True) -> os.stat_result:
    """stat (or lstat) of `path` if the job's user could stat it: every directory on the way searchable."""
    fd, st = resolve(identity, path, follow_symlinks)
    os.close(fd)
    return st


def open_as(identity: Identity, path: str) -> int:
    """A read-only descriptor of `path`, which must be a regular file the job's user may read."""
    fd, st = resolve(identity, path, follow_final=True)
    try:
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        if not identity.may(st, R_OK):
            raise AccessDeniedError(errno.EACCES, "not readable by the job's user", path)
        # The O_PATH descriptor names the checked inode; reopening it through /proc cannot land anywhere else.
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    finally:
        os.close(fd)


def read_as(identity: Identity, path: str, limit: int, from_end: bool = False) -> bytes:
    """At most `limit` bytes of a regular file the job's user may read: its start, or its end with `from_end`."""
    fd = open_as(identity, path)
    try:
        size = os.fstat(fd).st_size
        offset = max(0, size - limit) if from_end else 0
        return os.pread(fd, limit, offset)
    finally:
        os.close(fd)
