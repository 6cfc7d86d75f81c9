"""Create a switch file (`save`, `stop`) in a job's switch dir, as the job's user, without following links.

The agent runs as root and the directory belongs to a user, who may plant a symlink or a hard
link there. Everything happens relative to a directory fd opened with O_NOFOLLOW whose owner is
checked; the file is written under a temporary name and renamed into place (rename never follows
a link), and an existing entry that isn't a regular, singly linked file of the user is refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from typing import Literal

from pydantic import Field

from trainguard.actions.base import Action, ActionContext, ActionError, ActionSettings
from trainguard.jobs.model import Job

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class SwitchSettings(ActionSettings):
    switch: Literal["save", "stop"] = Field("save", description="Which switch file to create.")


def _open_dir(path: str, uid: int, create: bool) -> int:
    parent, name = os.path.split(path.rstrip("/"))
    try:
        return _checked_dir(os.open(path, _DIR_FLAGS), path, uid)
    except FileNotFoundError:
        if not create:
            raise ActionError(f"switch dir {path} does not exist") from None
    except OSError as exc:
        # O_DIRECTORY|O_NOFOLLOW on a symlink fails with ENOTDIR or ELOOP: say which case it was.
        if os.path.islink(path):
            raise ActionError(f"switch dir {path} is a symlink: refused") from None
        if isinstance(exc, NotADirectoryError):
            raise ActionError(f"switch dir {path} is not a directory") from None
        raise ActionError(f"cannot open switch dir {path}: {exc.strerror}") from None
    pfd = _open_dir(parent, uid, create=False)
    try:
        os.mkdir(name, 0o755, dir_fd=pfd)
        # Just made by the agent, so owned by its user: root, or trainguard under the unit (then chowned below).
        fd = _checked_dir(os.open(name, _DIR_FLAGS, dir_fd=pfd), path, os.geteuid())
        try:
            os.fchown(fd, uid, -1)
        except OSError:  # not handed to the user: not left behind either
            os.close(fd)
            with contextlib.suppress(OSError):
                os.rmdir(name, dir_fd=pfd)
            raise
        return fd
    except OSError as exc:
        raise ActionError(f"cannot create switch dir {path}: {exc.strerror}") from None
    finally:
        os.close(pfd)


def _checked_dir(fd: int, path: str, uid: int) -> int:
    st = os.fstat(fd)
    if st.st_uid not in (uid, 0) or (st.st_uid == 0 and uid != 0 and st.st_mode & stat.S_IWOTH):
        os.close(fd)
        raise ActionError(f"switch dir {path} belongs to uid {st.st_uid}, not the job's user (uid {uid}): refused")
    return fd


def create_switch(directory: str, name: str, uid: int, gid: int, payload: dict[str, object]) -> str:
    dfd = _open_dir(directory, uid, create=True)
    try:
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None and not (stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid in (uid, 0)):
            kind = "symlink" if stat.S_ISLNK(st.st_mode) else "hard link" if st.st_nlink > 1 else "foreign file"
            raise ActionError(f"{directory}/{name} exists as a {kind} (uid {st.st_uid}): refused")
        tmp = f".{name}.{os.getpid()}.{time.monotonic_ns()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd)
        try:
            try:
                os.fchown(fd, uid, gid)
                os.write(fd, (json.dumps(payload) + "\n").encode())
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:  # a failed attempt (fchown EPERM, a full disk) leaves nothing in the user's dir
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
        return f"{directory}/{name}"
    finally:
        os.close(dfd)


def _owner(job: Job) -> tuple[int, int]:
    if job.uid is None:
        raise ActionError(f"{job.label()}: unknown owner")
    import pwd

    try:
        return job.uid, pwd.getpwuid(job.uid).pw_gid
    except KeyError:
        return job.uid, job.uid


class SwitchAction(Action):
    Settings = SwitchSettings
    settings: SwitchSettings

    def plan(self, ctx: ActionContext) -> str:
        return f"create switch {self.settings.switch!r} for " + (", ".join(j.label() for j in ctx.jobs) or "no job")

    def run(self, ctx: ActionContext) -> str:
        if not ctx.jobs:
            raise ActionError("no job to switch")
        made = []
        for job in ctx.jobs:
            if not job.switch_dir:
                raise ActionError(f"{job.label()} has no switch dir")
            uid, gid = _owner(job)
            made.append(create_switch(job.switch_dir, self.settings.switch, uid, gid, {
                "requested_by": "trainguard", "at": ctx.clock(), "incident": ctx.event.incident_id,
                "reason": ctx.event.summary}))
        return "created " + ", ".join(made)
