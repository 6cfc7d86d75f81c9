"""Plain-process jobs declared in config by a command-line regex or a pidfile.

A listing uses the node's shared process snapshot (parents, start times) and reads the command line of a process
only when it is new: the first listing reads them all, later ones only those of processes started since (and, for a
few seconds after its start, a process's again: a fork's child takes its own command line only when it execs)."""

from __future__ import annotations

import os
import pwd
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from trainguard.core.text import linear
from trainguard.jobs.model import Job, ProcessRef
from trainguard.jobs.settings import JobsSettings, ProcessJobSettings
from trainguard.jobs.slurm import SlurmClient
from trainguard.node.access import Identities, Identity, read_as
from trainguard.node.procfs import ProcFS
from trainguard.node.proctable import ProcessSnapshots, ProcessTable

EXEC_WINDOW_S = 5.0  # a process this young may still exec: its command line is read again


def _read_pid(pidfile: Path, identity: Identity) -> int | None:
    """The pid in a pidfile the job's user may read (a regular file: a FIFO never blocks the agent)."""
    try:
        text = read_as(identity, str(pidfile), 64).decode("ascii", errors="replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and len(text) <= 10 else None


class ProcessSource:
    """The jobs declared in `[jobs.processes]`, found by command-line regex or pidfile."""

    def __init__(self, settings: JobsSettings, node: str, slurm: SlurmClient,
                 processes: ProcessSnapshots | None = None) -> None:
        self.declared = settings.processes
        self.identities = Identities()
        self.processes = processes or ProcessSnapshots()
        self._cmdlines: dict[tuple[int, float], str] = {}  # (pid, start time) -> command line, for live processes

    def _find(self, spec: ProcessJobSettings, uid: int | None, table: ProcessTable,
              cmdlines: dict[int, str]) -> list[int]:
        me = os.getpid()
        if uid is None:  # the configured user does not exist (yet): nothing of theirs runs
            return []
        if spec.pidfile is not None:
            pid = _read_pid(spec.pidfile, self.identities.of(uid))
            if pid is None or pid in (0, 1, me) or not psutil.pid_exists(pid):
                return []
            pids = [pid]
        else:
            assert spec.cmdline is not None
            pattern = linear(spec.cmdline)
            pids = [pid for pid, cmd in cmdlines.items() if pid not in (1, me) and pattern.search(cmd)]
        # Only the configured user's processes: a pid another user wrote into a pidfile is not theirs to signal.
        pids = [pid for pid in pids if _uid(pid) == uid]
        chosen = set(pids)
        # A launcher and its workers may all match: the job's main processes are the topmost ones.
        return [pid for pid in pids if (info := table.procs.get(pid)) is None or info.ppid not in chosen]

    def _command_lines(self, table: ProcessTable, proc: ProcFS) -> dict[int, str]:
        """pid -> command line of every process in the table, read only for processes not seen before."""
        now = time.time()
        cache: dict[tuple[int, float], str] = {}
        out = {}
        for pid, info in table.procs.items():
            key = (pid, info.create_time)
            cmd = self._cmdlines.get(key)
            if cmd is None or now - info.create_time < EXEC_WINDOW_S:
                raw = proc.read_text(pid, "cmdline")
                cmd = " ".join(a for a in (raw or "").split("\0") if a)
            cache[key] = cmd
            if cmd:
                out[pid] = cmd
        self._cmdlines = cache  # only live processes: bounded by the node's process count
        return out

    def jobs(self) -> Sequence[Job]:
        jobs = []
        table = self.processes.get()
        cmdlines = self._command_lines(table, self.processes.proc) if any(
            spec.pidfile is None for spec in self.declared.values()) else {}
        for name, spec in self.declared.items():
            uid = _uid_of(spec.user)
            roots = self._find(spec, uid, table, cmdlines)
            refs = tuple(r for r in (_ref(pid, table) for pid in roots) if r)
            user = spec.user
            start = min((r.create_time for r in refs), default=None)
            jobs.append(Job(key=f"process:{name}", source="process", name=name, state="RUNNING" if refs else "ABSENT",
                            job_id=spec.job_id or None, user=user, uid=uid, start_time=start, on_this_node=True, processes=refs,
                            log_paths=tuple(spec.logs), switch_dir=spec.switch_dir))
        return jobs


def _ref(pid: int, table: ProcessTable) -> ProcessRef | None:
    info = table.procs.get(pid)
    return ProcessRef(pid, info.create_time) if info is not None else ProcessRef.of(pid)


def _uid_of(user: str) -> int | None:
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        return None


def _uid(pid: int) -> int | None:
    try:
        return psutil.Process(pid).uids().real
    except psutil.Error:
        return None
