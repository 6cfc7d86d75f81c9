"""Create a switch file (`save`, `stop`) in a job's switch dir, as the job's user, with no more authority than theirs.

The agent runs as root (or holds CAP_DAC_OVERRIDE and CAP_CHOWN for this) and the path comes from the job: a user
may plant symlinks, hard links, a trailing slash or a `..` walk towards root's files. So the switch dir's parent is
reached with the job user's authority (node.access.resolve: component by component on dirfds, symlinks followed by
hand, every directory searchable by the user), the switch dir itself is opened O_NOFOLLOW and must belong to the
job's user (a root-owned or foreign directory is refused), and a missing one is only created inside a directory of
theirs. The file is written under a temporary name in that directory fd and renamed into place (rename never follows
a link); an existing entry that isn't a regular, singly linked file of the user is refused; the temporary file is
removed on every error.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import stat
import time
from collections.abc import Iterable
from typing import Literal

from trainguard.actions.base import Action, ActionContext, ActionError, ActionSettings, ActionSkippedError
from trainguard.core.settings import Field
from trainguard.jobs.model import Job
from trainguard.node.access import AccessDeniedError, Identity, resolve

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
HANDOVER_S = 0.5  # a switch dir the agent just made is its own until handed to the job's user: microseconds


class SwitchDirMissingError(ActionError):
    """The job's switch dir does not exist (and was not to be created)."""


class SwitchSettings(ActionSettings):
    switch: Literal["save", "stop"] = Field("save", description="Which switch file to create.")


def _open_switch_dir(directory: str, identity: Identity, create: bool) -> int:
    path = directory.rstrip("/")  # "dir/" would make the kernel follow a final symlink despite O_NOFOLLOW
    parent, name = os.path.split(path)
    if not path.startswith("/") or name in ("", ".", ".."):
        raise ActionError(f"switch dir {directory!r} is not an absolute path to a directory: refused")
    try:
        pfd, _ = resolve(identity, parent, follow_final=True)
    except AccessDeniedError:
        raise ActionError(f"switch dir {path}: {parent} is not reachable by the job's user: refused") from None
    except OSError as exc:
        raise ActionError(f"switch dir {path}: cannot reach {parent}: {exc.strerror or exc}") from None
    try:
        try:
            fd = _opened(pfd, name, path)
        except SwitchDirMissingError:
            if not create:
                raise
            fd = _create_dir(pfd, name, path, identity)
        owner = _owner(fd, identity)
        if owner != identity.uid:
            os.close(fd)
            raise ActionError(f"switch dir {path} belongs to uid {owner}, not the job's user (uid {identity.uid}): "
                              "refused")
        return fd
    finally:
        os.close(pfd)


def _opened(pfd: int, name: str, path: str) -> int:
    """The switch dir `name` in `pfd`, opened without following a link."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=pfd)
    except FileNotFoundError:
        raise SwitchDirMissingError(f"switch dir {path} does not exist") from None
    except OSError as exc:
        # O_DIRECTORY|O_NOFOLLOW on a symlink fails with ENOTDIR or ELOOP: say which case it was.
        try:
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except OSError:
            raise ActionError(f"cannot open switch dir {path}: {exc.strerror}") from None
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise ActionError(f"switch dir {path} is {kind}: refused") from None


def _owner(fd: int, identity: Identity) -> int:
    """The switch dir's owner. One the agent itself owns was made a moment ago by another of its threads (another
    action's, for a job submitted from the same directory) and is handed to the user next: waited for, HANDOVER_S at
    most."""
    owner, until = os.fstat(fd).st_uid, time.monotonic() + HANDOVER_S
    while owner == os.geteuid() != identity.uid and time.monotonic() < until:
        time.sleep(0.01)
        owner = os.fstat(fd).st_uid
    return owner


def _create_dir(pfd: int, name: str, path: str, identity: Identity) -> int:
    """The missing switch dir, made inside a directory of the job's user (where they could have made it)."""
    owner = os.fstat(pfd).st_uid
    if owner != identity.uid:
        raise ActionError(f"cannot create switch dir {path}: its parent belongs to uid {owner}, not the job's user "
                          f"(uid {identity.uid})")
    try:
        os.mkdir(name, 0o755, dir_fd=pfd)
    except FileExistsError:  # made meanwhile (by its user, or by another of the agent's actions): checked as found
        return _opened(pfd, name, path)
    except OSError as exc:
        raise ActionError(f"cannot create switch dir {path}: {exc.strerror}") from None
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=pfd)
    except OSError as exc:
        raise ActionError(f"cannot create switch dir {path}: {exc.strerror}") from None
    try:  # just made by the agent, so its own (root's, or trainguard's under the unit) until handed over
        os.fchown(fd, identity.uid, -1)
    except OSError as exc:  # not handed to the user: not left behind either
        os.close(fd)
        with contextlib.suppress(OSError):
            os.rmdir(name, dir_fd=pfd)
        raise ActionError(f"cannot hand switch dir {path} to uid {identity.uid}: {exc.strerror}") from None
    return fd


def create_switch(directory: str, name: str, identity: Identity, gid: int, payload: dict[str, object],
                  create: bool = True) -> str:
    return create_switch_file(directory, name, identity, gid, payload, create)[0]


def create_switch_file(directory: str, name: str, identity: Identity, gid: int, payload: dict[str, object],
                       create: bool = True) -> tuple[str, int, int | None]:
    """create_switch, and the inode of the file it wrote with its change time once in place (None when another
    writer's file was already renamed over it): what is at `name` later is the agent's only with that inode and
    change time (another writer may rename a file of its own into place at any time, and a file system may give a
    freed inode number to the next file)."""
    dfd = _open_switch_dir(directory, identity, create=create)
    where = f"{directory.rstrip('/')}/{name}"
    tmp = f".{name}.{os.getpid()}.{time.monotonic_ns()}"
    made = False
    try:
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        except OSError as exc:  # a stale NFS handle, an I/O error: a clear failure, never a raw one
            raise ActionError(f"cannot look at {where}: {exc.strerror or exc}") from None
        if st is not None and not (stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid in (identity.uid, 0)):
            kind = "symlink" if stat.S_ISLNK(st.st_mode) else "hard link" if st.st_nlink > 1 else "foreign file"
            raise ActionError(f"{where} exists as a {kind} (uid {st.st_uid}): refused")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd)
            made = True
            try:
                os.fchown(fd, identity.uid, gid)
                os.write(fd, (json.dumps(payload) + "\n").encode())
                ino = os.fstat(fd).st_ino
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            made = False
        except OSError as exc:
            raise ActionError(f"cannot create {where}: {exc.strerror or exc}") from None
        try:  # the rename changed its ctime: the pair is known only now
            placed = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except OSError:
            placed = None
        return where, ino, placed.st_ctime_ns if placed is not None and placed.st_ino == ino else None
    finally:
        if made:  # nothing of ours is left in the user's directory
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
        os.close(dfd)


def remove_switch(directory: str, name: str, identity: Identity, ino: int | None = None,
                  ctime_ns: int | None = None) -> bool:
    """Withdraw a switch file the agent made (an action that failed after writing it): unlinked through the switch
    dir opened as in create_switch, only while it is a regular file (unlink never follows a link) and, given `ino`
    (and `ctime_ns`), still that file (not one written in its place since, which may have its inode number once the
    file system reused it). False when it is gone or cannot be removed."""
    try:
        dfd = _open_switch_dir(directory, identity, create=False)
    except ActionError:
        return False
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode) or (ino is not None and st.st_ino != ino) or (
                ctime_ns is not None and st.st_ctime_ns != ctime_ns):
            return False
        os.unlink(name, dir_fd=dfd)
        return True
    except OSError:
        return False
    finally:
        os.close(dfd)


def switch_stats(directory: str, names: Iterable[str], identity: Identity) -> dict[str, os.stat_result]:
    """The lstat of each of `names` that is a switch file in a job's switch dir (opened as in create_switch; none
    when it is missing): regular files of the job's user or root, as the agent writes them. One lstat per name asked,
    so the cost follows what is asked, never how many files the user keeps there."""
    try:
        dfd = _open_switch_dir(directory, identity, create=False)
    except SwitchDirMissingError:
        return {}
    present = {}
    try:
        for name in names:
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise ActionError(f"cannot look for {name} in switch dir {directory}: {exc.strerror or exc}") from None
            if stat.S_ISREG(st.st_mode) and st.st_uid in (identity.uid, 0):
                present[name] = st
    finally:
        os.close(dfd)
    return present


def job_owner(job: Job) -> tuple[Identity, int]:
    if job.uid is None:
        raise ActionError(f"{job.label()}: unknown owner")
    return uid_owner(job.uid)


def uid_owner(uid: int) -> tuple[Identity, int]:
    """The user's identity (its groups, from NSS) and primary group."""
    try:
        gid = pwd.getpwuid(uid).pw_gid
    except KeyError:
        gid = uid
    return Identity.of_uid(uid), gid


class SwitchAction(Action):
    needs_record = True  # the switch dir comes from the job's workdir
    Settings = SwitchSettings
    settings: SwitchSettings

    def plan(self, ctx: ActionContext) -> str:
        return f"create switch {self.settings.switch!r} for " + (", ".join(j.label() for j in ctx.jobs) or "no job")

    def run(self, ctx: ActionContext) -> str:
        if not ctx.jobs:
            raise ActionSkippedError("no job on this node to switch")
        made = []
        for job in ctx.jobs:
            if not job.switch_dir:
                raise ActionError(f"{job.label()} has no switch dir")
            identity, gid = job_owner(job)
            made.append(create_switch(job.switch_dir, self.settings.switch, identity, gid, {
                "requested_by": "trainguard", "at": ctx.clock(), "incident": ctx.event.incident_id,
                "reason": ctx.event.summary}))
        return "created " + ", ".join(made)
