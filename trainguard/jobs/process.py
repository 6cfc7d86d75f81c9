"""Plain-process jobs declared in config by a command-line regex or a pidfile.

A listing uses the node's shared process snapshot (parents, start times) and reads the command line of a process
only when it is new: the first listing reads them all, later ones only those of processes started since (and, for a
few seconds after its start, a process's again: a fork's child takes its own command line only when it execs).

While the node's pids and the pidfiles' contents stay the same, no process is young enough to exec, and no check
read a newer snapshot, the last listing is the answer (for `REUSE_MAX_S` at most): the stop switch asks for the jobs
every 2 s, and reading every process's stat file for it was a fifth of an idle agent's CPU. A pid that exited and was
taken by a new process between two listings (a node that forks through its whole pid range in seconds) is seen at
the next full listing; a stale ProcessRef signals nothing (its start time no longer matches)."""

from __future__ import annotations

import os
import pwd
import time
from collections.abc import Sequence
from dataclasses import dataclass
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
REUSE_MAX_S = 30.0  # a listing is reused this long at most while nothing above says it changed


@dataclass(frozen=True)
class _Listing:
    jobs: tuple[Job, ...]
    pids: frozenset[int]  # of the table it was made from
    ids: tuple[tuple[int | None, ...], tuple[int | None, ...]]  # each job's user's uid, what each pidfile held
    taken: float  # the table's time (the snapshots' monotonic clock)
    young_until: float  # wall clock (start times are): reusable only from then on, no process may still exec


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
        self._patterns = {name: linear(spec.cmdline) for name, spec in self.declared.items() if spec.cmdline is not None}
        self._matches: dict[str, tuple[str, ...]] = {}  # command line -> the jobs whose regex finds it, for live ones
        self._last: _Listing | None = None

    def _pidfile_pid(self, spec: ProcessJobSettings, uid: int | None) -> int | None:
        return _read_pid(spec.pidfile, self.identities.of(uid)) if spec.pidfile is not None and uid is not None \
            else None

    def _find(self, spec: ProcessJobSettings, uid: int | None, table: ProcessTable, matching: list[int],
              pidfile_pid: int | None) -> list[int]:
        me = os.getpid()
        if uid is None:  # the configured user does not exist (yet): nothing of theirs runs
            return []
        if spec.pidfile is not None:
            pid = pidfile_pid
            if pid is None or pid in (0, 1, me) or not psutil.pid_exists(pid):
                return []
            pids = [pid]
        else:
            pids = [pid for pid in matching if pid not in (1, me)]
        # Only the configured user's processes: a pid another user wrote into a pidfile is not theirs to signal.
        pids = [pid for pid in pids if self.processes.proc.real_uid(pid) == uid]
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

    def _matching(self, cmdlines: dict[int, str]) -> dict[str, list[int]]:
        """Job name -> the pids whose command line its regex finds. A command line is searched when first seen: the
        node's processes hardly change between listings, and the searches were most of a listing's cost."""
        memo: dict[str, tuple[str, ...]] = {}
        found: dict[str, list[int]] = {name: [] for name in self._patterns}
        for pid, cmd in cmdlines.items():
            names = memo.get(cmd)
            if names is None:
                names = self._matches.get(cmd)
                if names is None:
                    names = tuple(name for name, pattern in self._patterns.items() if pattern.search(cmd))
                memo[cmd] = names
            for name in names:
                found[name].append(pid)
        self._matches = memo  # only live command lines: bounded as the cache of command lines is
        return found

    def jobs(self) -> Sequence[Job]:
        if not self.declared:  # `sources = ["process"]` with no [jobs.processes]: no /proc walk for nothing
            return []
        # each user looked up once a listing (NSS may be a round trip to LDAP; ten jobs of one user were ten)
        users = {user: _uid_of(user) for user in {spec.user for spec in self.declared.values()}}
        uids = {name: users[spec.user] for name, spec in self.declared.items()}
        pidfiles = tuple(self._pidfile_pid(spec, uids[name]) for name, spec in self.declared.items())
        last, now = self._last, time.time()
        ids = (tuple(uids.values()), pidfiles)
        if (last is not None and last.young_until <= now and self.processes.clock() - last.taken < REUSE_MAX_S
                and last.ids == ids):
            shared = self.processes.peek()
            if (shared is None or shared.taken <= last.taken) and frozenset(self.processes.proc.pids()) == last.pids:
                return last.jobs
        jobs = []
        table = self.processes.get()
        matching = self._matching(self._command_lines(table, self.processes.proc)) if self._patterns else {}
        for (name, spec), pidfile_pid in zip(self.declared.items(), pidfiles, strict=True):
            uid = uids[name]
            roots = self._find(spec, uid, table, matching.get(name, []), pidfile_pid)
            refs = tuple(r for r in (_ref(pid, table) for pid in roots) if r)
            user = spec.user
            start = min((r.create_time for r in refs), default=None)
            jobs.append(Job(key=f"process:{name}", source="process", name=name, state="RUNNING" if refs else "ABSENT",
                            job_id=spec.job_id or None, user=user, uid=uid, start_time=start, on_this_node=True, processes=refs,
                            log_paths=tuple(spec.logs), switch_dir=spec.switch_dir))
        youngest = max((info.create_time for info in table.procs.values()), default=0.0)
        self._last = _Listing(tuple(jobs), frozenset(table.procs), ids, table.taken, youngest + EXEC_WINDOW_S)
        return jobs


def _ref(pid: int, table: ProcessTable) -> ProcessRef | None:
    info = table.procs.get(pid)
    return ProcessRef(pid, info.create_time) if info is not None else ProcessRef.of(pid)


def _uid_of(user: str) -> int | None:
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        return None
