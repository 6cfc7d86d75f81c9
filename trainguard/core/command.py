"""Running a site's script (a Nagios plugin, an NHC check, a gate's helper) with a timeout, its output bounded, and
nothing of it left behind.

The script runs in its own session (so in its own process group): on its timeout, and when it exits leaving children
behind, the whole group is killed with SIGKILL and the leader reaped. The leader is kept a zombie (waitid WNOWAIT)
until the group is killed, so its pid, which is the group's id, cannot be reused by an unrelated process in between.
A child that starts its own session escapes the group: that is the one thing this does not catch.

Its output is read up to `limit` bytes a stream (stderr into stdout, in order, when asked); what follows is read and
discarded (counted) so the script does not block on a full pipe, up to `DRAIN_MAX`, past which the group is killed: a
script printing without end costs the agent a bounded amount of reading, not its whole timeout.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DRAIN_MAX = 64 << 20  # bytes of output read and discarded before the script is killed
_CHUNK = 65536
_POLL_S = 0.05  # while its pipes are open, how often the leader's exit is looked at (its children may hold them)


@dataclass(frozen=True)
class RunAs:
    """Who the script runs as; changing to it needs root (CAP_SETUID, CAP_SETGID)."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()


@dataclass(frozen=True)
class Finished:
    """How a script ended. `code` is its exit status, -N when a signal N ended it, None when it was killed here
    (`timed_out`, or `flooded`: it printed more than DRAIN_MAX). `stdout`/`stderr` are at most the limit each;
    `discarded` counts the bytes read past it. `stderr` is empty when it was merged into `stdout`."""

    code: int | None
    stdout: bytes
    stderr: bytes
    discarded: int
    elapsed: float
    timed_out: bool = False
    flooded: bool = False


def run_bounded(argv: Sequence[str], timeout: float, limit: int, *, run_as: RunAs | None = None,
                env: Mapping[str, str] | None = None, cwd: str = "/", merge_stderr: bool = False) -> Finished:
    """Run `argv` (no shell) with stdin from /dev/null. Raises OSError when it cannot start (not found, not
    executable, not permitted to change user); whatever happens after that is in the Finished. `merge_stderr`: one
    pipe for both streams (a tool whose readers want its messages where they came)."""
    start = time.monotonic()
    ids = {}
    if run_as is not None:
        ids = {"user": run_as.uid, "group": run_as.gid, "extra_groups": list(run_as.groups)}
    proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                            env=dict(env) if env is not None else None, cwd=cwd, start_new_session=True,
                            close_fds=True, **ids)
    deadline = start + timeout
    kept = {"stdout": bytearray(), "stderr": bytearray()}
    discarded = 0
    timed_out = flooded = False
    exited = False
    pipes = {name: pipe for name, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr)) if pipe is not None}
    with selectors.DefaultSelector() as sel:
        for name, pipe in pipes.items():
            sel.register(pipe, selectors.EVENT_READ, name)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            # Once the leader is gone, what is in the pipes is read, and a pipe still open without data is held by a
            # leftover of its group: the group is killed below.
            ready = sel.select(0 if exited else min(left, _POLL_S))
            if exited and not ready:
                break
            for key, _ in ready:
                chunk = os.read(key.fd, _CHUNK)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = kept[key.data]
                room = max(0, limit - len(buf))
                buf += chunk[:room]
                discarded += len(chunk) - min(room, len(chunk))
            if discarded > DRAIN_MAX:
                flooded = True
                break
            exited = leader_exited(proc.pid)
    status = end_group(proc, 0.0 if timed_out or flooded else deadline)
    timed_out = timed_out or (status is None and not flooded)
    code = None if timed_out or flooded else status
    for pipe in pipes.values():  # a leftover outside its group (its own session) may hold them open: not waited for
        pipe.close()
    return Finished(code, bytes(kept["stdout"]), bytes(kept["stderr"]), discarded, time.monotonic() - start,
                    timed_out, flooded)


def end_group(proc: subprocess.Popen[Any], deadline: float) -> int | None:
    """The end of a process started in its own session: wait (unreaped) until `deadline` (monotonic) for it to exit,
    then kill whatever is left of its group and reap it. Its exit status; None when it still ran at `deadline`."""
    exited = _wait_exit(proc.pid, deadline)
    # Whatever is left of its group goes, before the leader is reaped: its zombie keeps the group's id reserved.
    _kill_group(proc.pid)
    status = proc.wait()
    return status if exited else None


def leader_exited(pid: int) -> bool:
    """Whether the leader has exited, leaving it unreaped (so its pid and group id stay reserved)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None


def _wait_exit(pid: int, deadline: float) -> bool:
    """Wait (unreaped) for the leader to exit, until `deadline`; whether it did. Its output closes a moment before
    it exits, so this is usually at once."""
    pause = 0.001
    while not leader_exited(pid):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, _POLL_S)
    return True


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is empty (its leader reaped and no child left), or it is not ours to kill
