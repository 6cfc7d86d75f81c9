"""Plain-process jobs declared in config by a command-line regex or a pidfile."""

from __future__ import annotations

import os
import pwd
from collections.abc import Sequence
from pathlib import Path

import psutil

from trainguard.core.text import linear
from trainguard.jobs.model import Job, ProcessRef
from trainguard.jobs.settings import JobsSettings, ProcessJobSettings
from trainguard.jobs.slurm import SlurmClient
from trainguard.node.access import Identities, Identity, read_as


def _read_pid(pidfile: Path, identity: Identity) -> int | None:
    """The pid in a pidfile the job's user may read (a regular file: a FIFO never blocks the agent)."""
    try:
        text = read_as(identity, str(pidfile), 64).decode("ascii", errors="replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and len(text) <= 10 else None


class ProcessSource:
    """The jobs declared in `[jobs.processes]`, found by command-line regex or pidfile."""

    def __init__(self, settings: JobsSettings, node: str, slurm: SlurmClient) -> None:
        self.declared = settings.processes
        self.identities = Identities()

    def _find(self, spec: ProcessJobSettings, uid: int | None,
              table: list[tuple[psutil.Process, str]]) -> list[psutil.Process]:
        me = os.getpid()
        if uid is None:  # the configured user does not exist (yet): nothing of theirs runs
            return []
        if spec.pidfile is not None:
            pid = _read_pid(spec.pidfile, self.identities.of(uid))
            if pid is None or pid in (0, 1, me) or not psutil.pid_exists(pid):
                return []
            procs = [psutil.Process(pid)]
        else:
            assert spec.cmdline is not None
            pattern = linear(spec.cmdline)
            procs = [p for p, cmd in table if p.pid not in (1, me) and pattern.search(cmd)]
        # Only the configured user's processes: a pid another user wrote into a pidfile is not theirs to signal.
        procs = [p for p in procs if _uid(p) == uid]
        pids = {p.pid for p in procs}
        # A launcher and its workers may all match: the job's main processes are the topmost ones.
        return [p for p in procs if _ppid(p) not in pids]

    def jobs(self) -> Sequence[Job]:
        jobs = []
        # One pass over /proc for all declared jobs: reading every command line is most of a refresh's cost.
        table: list[tuple[psutil.Process, str]] = []
        if any(spec.pidfile is None for spec in self.declared.values()):
            table = [(p, cmd) for p in psutil.process_iter(["cmdline"]) if (cmd := " ".join(p.info.get("cmdline") or []))]
        for name, spec in self.declared.items():
            uid = _uid_of(spec.user)
            roots = self._find(spec, uid, table)
            refs = tuple(r for r in (ProcessRef.of(p.pid) for p in roots) if r)
            user = spec.user
            start = min((r.create_time for r in refs), default=None)
            jobs.append(Job(key=f"process:{name}", source="process", name=name, state="RUNNING" if refs else "ABSENT",
                            job_id=spec.job_id or None, user=user, uid=uid, start_time=start, on_this_node=True, processes=refs,
                            log_paths=tuple(spec.logs), switch_dir=spec.switch_dir))
        return jobs


def _uid_of(user: str) -> int | None:
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        return None


def _uid(p: psutil.Process) -> int | None:
    try:
        return p.uids().real
    except psutil.Error:
        return None


def _ppid(p: psutil.Process) -> int | None:
    try:
        return p.ppid()
    except psutil.Error:
        return None
