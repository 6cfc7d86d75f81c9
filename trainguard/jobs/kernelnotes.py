"""KernelNotes: what the node's kernel log says that a job's own story needs: the OOM killer's kills (the pid, the
memory it ran out of: the host's or a memory cgroup's limit, the anon memory the victim held), the network file
systems that stopped answering (an NFS server not responding, a Lustre target lost or evicting this client), and the
tasks the kernel found blocked (hung task, by pid).

It reads through the node's one kernel log reader (KernelLog: one follower and cursor per device, shared with the
xid and kernel checks) with the kernel event catalog's own classes: a record holding none of their needles costs one
Aho-Corasick pass. The job checks (training_log) tell it which job and rank each of their pids is, and its parent,
while the pid lives: a kill, read after the process is gone, is then attributed to its job and rank the moment it is
read, and a rank's own worker (a DataLoader worker) is told as that, not as the rank. Bounded:
the newest MAX_KILLS kills, MAX_FS file systems, MAX_HUNG blocked tasks, MAX_PIDS pids per job.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from trainguard.core.listeners import Listeners
from trainguard.core.text import linear
from trainguard.core.units import format_bytes
from trainguard.jobs.slurmnode import job_of_cgroup
from trainguard.node.kernel_events import KernelClass, KernelEvent, KernelEventParser, catalog, number
from trainguard.node.kmsg import KernelLog, KernelRecord, KmsgFollower
from trainguard.node.mounts import Mount, mount_of
from trainguard.node.procfs import ProcFS
from trainguard.node.proctable import ProcInfo
from trainguard.node.stacks import rank_vars

K = TypeVar("K")
V = TypeVar("V")
OOM_CLASSES = ("oom_kill_constraint", "oom_kill_memcg", "oom_kill")
FS_CLASSES = ("nfs_not_responding", "nfs_timed_out", "lustre_evicted", "lustre_connection_lost")
CLEAR_CLASSES = ("nfs_ok", "lustre_restored")
NOTED = ("hung_task", *OOM_CLASSES, *FS_CLASSES, *CLEAR_CLASSES)
MAX_KILLS = 256
MAX_FS = 256
MAX_HUNG = 256
MAX_PIDS = 4096  # of one job remembered with its rank
DATA_WORKER = "pt_data_worker"  # the command name recent PyTorch gives its DataLoader workers (else `python`)
MAX_FDS = 1024  # of one process looked at for the mount it waits on
# A file system said again not to answer wakes the checks again, at most this often (from the last such wake): the
# word may be news to a job that stalled after it was first said (`fs_stale_after` counts it from the job's last
# progress), and the kernel says it for each request that reaches its major timeout, every few seconds while many stall
REWAKE_S = 60.0
MERGE_USEC = 2_000_000  # the lines of one kill (its constraint line, its `Killed process` line) come together
# Kernel functions that name the file system a task sleeps in (its /proc/PID/stack or wchan)
_FS_FRAME = linear(r"\b(nfs4?|rpc|fuse|ll|ptlrpc|osc|mdc|ldlm|lov|cl|ceph|cifs|smb2|gpfs|mmfs)_")
_FRAME_KIND = {"nfs": "nfs", "nfs4": "nfs", "rpc": "nfs", "fuse": "fuse", "ceph": "ceph", "cifs": "cifs", "smb2": "cifs",
               "gpfs": "gpfs", "mmfs": "gpfs"}  # the rest: Lustre's
NETWORK_FS = ("nfs", "nfs4", "lustre", "fuse", "ceph", "cifs", "smb3", "gpfs", "beegfs", "glusterfs", "9p")


def clock_time(when: float) -> str:
    """A wall time as the node's clock shows it (the time of day a log line of the job would carry)."""
    return time.strftime("%H:%M:%S", time.localtime(when))


@dataclass(frozen=True)
class OomKill:
    """One process the kernel's OOM killer killed."""

    pid: int
    comm: str
    when: float  # wall time of the kernel's record
    usec: int
    seq: int = -1  # the record's sequence number (-1 from the journal)
    memcg_limit: bool | None = None  # True: a memory cgroup's limit; False: the host's memory; None: not said
    memcg: str = ""
    anon_kb: int | None = None
    job_id: str | None = None  # SLURM's, from the memory cgroup path
    task: str | None = None  # SLURM's task, from the memory cgroup path
    job_key: str | None = None  # the job whose processes held the pid (as its checks last told)
    job_name: str | None = None
    rank: str | None = None
    forked: bool = False  # a process the rank started (its parent carried the same rank), not the rank
    line: str = ""

    @property
    def worker(self) -> bool:
        """A worker of a rank (PyTorch names its DataLoader workers; an older one's are `python` forks), not a rank."""
        return self.forked or self.comm == DATA_WORKER

    def memory(self) -> str:
        """`host memory, 54.0 GiB anon`: what ran out, and what the victim held."""
        kind = {True: "memory cgroup limit", False: "host memory", None: "memory"}[self.memcg_limit]
        return kind + (f", {format_bytes(self.anon_kb * 1024)} anon" if self.anon_kb else "")

    def who(self) -> str:
        """`rank 3`, else the SLURM task, else the pid and command; a worker as its rank's (`a DataLoader worker of rank
        3 (pid 4242, pt_data_worker)`): the rank lives on, and a message must not say it died."""
        owner = f"rank {self.rank}" if self.rank is not None else f"task {self.task}" if self.task is not None else ""
        if self.worker:
            kind = "a DataLoader worker" if self.comm == DATA_WORKER else "a subprocess"
            return f"{kind} of {owner or 'the job'} (pid {self.pid}, {self.comm})"
        return owner if self.rank is not None else f"{owner} (pid {self.pid})" if owner else f"pid {self.pid} ({self.comm})"

    def describe(self, who: str | None = None) -> str:
        return f"{who or self.who()} killed by the kernel OOM killer ({self.memory()}) at {clock_time(self.when)}"

    def fields(self) -> dict[str, Any]:
        """What a finding or a result's details carry of the kill."""
        return {"pid": self.pid, "rank": self.rank, "worker": self.worker, "task": self.task, "command": self.comm,
                "memory": self.memory(), "memcg": self.memcg, "anon_kb": self.anon_kb, "at": self.when}


@dataclass(frozen=True)
class JobProcess:
    """One process of a job as its checks saw it while it lived."""

    rank: str | None
    ppid: int = 0
    comm: str = ""
    ranks: tuple[str, ...] = ()  # its rank variables (stacks.rank_vars)

    @classmethod
    def read(cls, info: ProcInfo, proc: ProcFS) -> JobProcess:
        ranks = rank_vars(proc, info.pid)
        return cls(next((r for r in ranks if r), None), info.ppid, info.comm, ranks)

    def worker_of(self, parent: JobProcess | None) -> bool:
        """Whether this is a worker its parent (another process of the job, a rank) started, not a rank: a fork or a
        multiprocessing spawn carries its parent's rank variables and, unless PyTorch renamed it, its command name.
        A rank differs from its parent in one or the other (torchrun sets RANK for its children; `bash run.sh` runs
        `python`)."""
        return (parent is not None and self.rank is not None and parent.ranks == self.ranks
                and self.comm in (parent.comm, DATA_WORKER))


@dataclass(frozen=True)
class FsTrouble:
    """A network file system the kernel says is not answering: an NFS server, a Lustre target."""

    kind: str  # nfs, lustre
    name: str  # the server (nfs), the target or service (lustre)
    title: str
    line: str
    since: float
    last: float
    cleared: float = 0.0

    @property
    def active(self) -> bool:
        return self.cleared < self.last

    def said_since(self, since: float) -> bool:
        """Still said (not cleared), and last said at `since` or later."""
        return self.active and self.last >= since

    def names(self, mount: Mount) -> bool:
        """Whether this is the file system of `mount` (NFS: its server; Lustre: its file system's targets)."""
        source, _, export = mount.device.partition(":")
        if self.kind == "nfs":
            return bool(export) and source.rpartition("@")[2] == self.name
        fsname = export.strip("/").split("/")[0] if export else ""
        return mount.fstype == "lustre" and bool(fsname) and (self.name == fsname or self.name.startswith(fsname + "-"))

    def describe(self) -> str:
        return f"{self.title} ({self.kind} {self.name}) since {clock_time(self.since)}"


@dataclass(frozen=True)
class HungTask:
    pid: int
    comm: str
    seconds: int
    when: float


@dataclass(frozen=True)
class FsWait:
    """A process waiting on a file system: the mount, and how that is known."""

    pid: int
    mount: Mount
    how: str  # "its kernel stack (fuse_...)", "its open file /mnt/x"


def _classes() -> dict[str, KernelClass]:
    # Each line its own event (no blocks): a kill's constraint line and its `Killed process` line are merged by pid
    return {name: replace(catalog()[name], block="", family="") for name in NOTED if name in catalog()}


class KernelNotes:
    """The node's notes from the kernel log for the job checks; thread-safe (the follower writes, checks read)."""

    def __init__(self, proc: ProcFS | None = None, clock: Callable[[], float] = time.time) -> None:
        self.proc = proc or ProcFS()
        self.clock = clock
        self._lock = threading.Lock()
        self._parser = KernelEventParser(classes=_classes())
        self._parsing = threading.Lock()  # the parser is one reader's: two devices' followers take turns
        self._followers: dict[tuple[str, str], KmsgFollower] = {}
        self._boot_time: float | None = None
        self._kills: dict[int, OomKill] = {}
        self._fs: dict[tuple[str, str], FsTrouble] = {}
        self._fs_woke = -math.inf  # when a file system said not to answer last woke the checks (REWAKE_S)
        self._hung: dict[int, HungTask] = {}
        self._pids: dict[str, tuple[str, dict[int, JobProcess]]] = {}  # job key -> (name, pid -> process)
        self._listeners = Listeners()
        self._fs_listeners = Listeners()  # told only of a file system that stops answering

    # the reader ----------------------------------------------------------------------------
    def attach(self, kernel_log: KernelLog, path: str = "/dev/kmsg", journalctl: str = "journalctl") -> KmsgFollower:
        """The follower of `path` (the node's one reader of it), these notes fed by it once however many checks ask.
        No cursor of its own: the xid and kernel checks keep theirs."""
        with self._lock:
            follower = self._followers.get((path, journalctl))
            if follower is None:
                follower = kernel_log.subscribe("kernel-notes", self.feed, path=path, journalctl=journalctl,
                                                priority=20, kind="notes")
                self._followers[(path, journalctl)] = follower
            return follower

    def listen(self, callback: Callable[[], None], kills: bool = True) -> Callable[[], None]:
        """`callback` (it must return at once) is called on each OOM kill (unless not `kills`: a job's user may kill
        their own processes in a loop) and each file system that stops answering; returns what stops that."""
        return (self._listeners if kills else self._fs_listeners).add(callback)

    def feed(self, record: KernelRecord) -> None:
        """One kernel record (from the follower's thread)."""
        with self._parsing:
            events = self._parser.feed(record.message, record.usec, record.seq)
        news = fs = False
        for event in events:
            noted = self._note(event, self._when(record.usec))
            news |= noted
            fs |= noted and event.klass in FS_CLASSES
        if news:
            self._listeners.tell("kernel notes")
        if fs:
            self._fs_listeners.tell("kernel notes: a file system stopped answering")

    def _when(self, usec: int) -> float:
        """Wall time of a kernel timestamp (when it was logged, not when read)."""
        if self._boot_time is None:
            self._boot_time = self.proc.boot_time()
        now = self.clock()
        return min(self._boot_time + usec / 1e6, now) if usec >= 0 and self._boot_time > 0 else now

    def _note(self, event: KernelEvent, when: float) -> bool:
        n = event.names
        with self._lock:
            if event.klass in OOM_CLASSES:
                return self._kill(event, when)
            if event.klass == "hung_task" and (pid := number(n.get("pid"))) is not None:
                _bounded(self._hung, pid, HungTask(pid, n.get("comm", "?"), number(n.get("seconds")) or 0, when), MAX_HUNG)
                return False
            kind = event.cls.kind
            name = n.get("server") or n.get("target") or n.get("service") or n.get("by") or ""
            if event.klass in CLEAR_CLASSES:
                for key in [k for k in self._fs if k[1] == name or (kind == "lustre" and k[0] == kind
                                                                    and n.get("service") == k[1])]:
                    self._fs[key] = replace(self._fs[key], cleared=when)
                return False
            if not name:
                return False
            old = self._fs.get((kind, name))
            # said again: counted from the last wake for any file system, not from its last word (the kernel may say
            # it every few seconds while it lasts, for each of many servers or targets), and a record of earlier (a
            # second reader's replay) is no news
            wake = old is None or not old.active or when - self._fs_woke >= REWAKE_S
            if wake:
                self._fs_woke = when
            since = old.since if old is not None and old.active else when
            _bounded(self._fs, (kind, name), FsTrouble(kind, name, event.cls.title, event.line, since, when), MAX_FS)
            return wake

    def _kill(self, event: KernelEvent, when: float) -> bool:
        """One line of a kill (its constraint line, its `Killed process` line), from the names the parser read."""
        n = event.names
        pid = number(n.get("pid"))
        if pid is None:
            return False
        old = self._kills.get(pid)
        if old is not None and abs(event.usec - old.usec) > MERGE_USEC:
            old = None  # an earlier kill of a pid since reused
        kill = old or OomKill(pid, n.get("comm", "?"), when, event.usec, event.seq, line=event.line)
        if event.klass == "oom_kill_constraint":
            memcg = n.get("memcg", "")
            job, task = job_of_cgroup(memcg)  # SLURM's own tree only: a user's `job_N` names no job
            kill = replace(kill, memcg=memcg, memcg_limit=n.get("constraint") == "CONSTRAINT_MEMCG",
                           job_id=job or kill.job_id, task=task or kill.task)
        else:
            memcg_limit = kill.memcg_limit if kill.memcg_limit is not None else event.klass == "oom_kill_memcg"
            kill = replace(kill, anon_kb=number(n.get("anon_kb")) or kill.anon_kb, memcg_limit=memcg_limit,
                           line=event.line)
        kill = self._held(kill)
        _bounded(self._kills, pid, kill, MAX_KILLS)
        return old is None or kill != old

    def _held(self, kill: OomKill) -> OomKill:
        """The kill as the job's whose processes held its pid: its rank's, or the worker's of its rank."""
        for key, (name, procs) in self._pids.items():
            if (held := procs.get(kill.pid)) is not None:
                forked = held.worker_of(procs.get(held.ppid))
                return replace(kill, job_key=key, job_name=name, rank=held.rank, forked=forked)
        return kill

    # what the job checks tell and ask ---------------------------------------------------
    def remember(self, job_key: str, job_name: str, procs: dict[int, JobProcess]) -> None:
        """The job's processes now, with their ranks and parents (a rank's pid is then known when the kernel kills it,
        and a worker's as its rank's)."""
        with self._lock:
            _, known = self._pids.get(job_key, (job_name, {}))
            self._pids[job_key] = (job_name, dict(list({**known, **procs}.items())[-MAX_PIDS:]))

    def known_pids(self, job_key: str) -> dict[int, JobProcess]:
        with self._lock:
            return dict(self._pids.get(job_key, ("", {}))[1])

    def forget(self, live: Iterable[str]) -> None:
        """Only the jobs still here keep their pids."""
        keep = set(live)
        with self._lock:
            for key in set(self._pids) - keep:
                del self._pids[key]

    def kills(self, job_key: str | None = None, job_id: str | None = None, name: str | None = None,
              since: float = 0.0) -> list[OomKill]:
        """The kills of a job (by its key, its SLURM id from the memory cgroup, or its name), oldest first."""
        with self._lock:
            kills = list(self._kills.values())
        return sorted((k for k in kills if k.when >= since and (
            (job_key is not None and k.job_key == job_key) or (job_id is not None and k.job_id == job_id)
            or (name is not None and k.job_name == name))), key=lambda k: k.when)

    def trouble(self, mount: Mount, since: float = 0.0) -> FsTrouble | None:
        """What the kernel says of the file system of `mount`, while it says so (not cleared), last said at `since` or
        later (a `not responding, timed out` need not be followed by `OK`: the kernel rate-limits both)."""
        with self._lock:
            troubles = list(self._fs.values())
        return next((t for t in troubles if t.said_since(since) and t.names(mount)), None)

    def troubled(self, since: float = 0.0) -> bool:
        """Whether the kernel says any file system does not answer now, last said at `since` or later."""
        with self._lock:
            return any(t.said_since(since) for t in self._fs.values())

    def hung(self, pid: int) -> HungTask | None:
        with self._lock:
            return self._hung.get(pid)


class NotesReader:
    """One check's use of the notes: the node's reader attached when the check is made, started (and the check woken
    by each kill and each file system that stops answering) while it runs; read once for a one-shot run."""

    def __init__(self, notes: KernelNotes, kernel_log: KernelLog, name: str, path: str, journalctl: str) -> None:
        self.notes, self.kernel_log, self.name = notes, kernel_log, name
        self.follower = notes.attach(kernel_log, path, journalctl)
        self._untap: Callable[[], None] | None = None

    def start(self, wake: Callable[[], None], kills: bool = True) -> None:
        """`wake` on each kill (unless not `kills`) and each file system that stops answering."""
        self._untap = self.notes.listen(wake, kills)
        self.kernel_log.start(self.name, self.follower)

    def stop(self) -> None:
        if self._untap is not None:
            self._untap()
            self.kernel_log.stop(self.name, self.follower)

    def read_once(self, before: Callable[[], None]) -> None:
        """One-shot (`trainguard check`, never started): what the kernel log holds now, read once for every consumer
        (`before` as KernelLog.read_once)."""
        if self._untap is None:
            self.kernel_log.read_once(self.follower, before)


def _bounded(table: dict[K, V], key: K, value: V, limit: int) -> None:
    """Set `key` as the newest entry; the oldest go past `limit`."""
    table.pop(key, None)
    table[key] = value
    while len(table) > limit:
        del table[next(iter(table))]


def fs_wait(pid: int, mounts: list[Mount], proc: ProcFS) -> FsWait | None:
    """The file system a (blocked) process waits on: a network or FUSE mount that its kernel stack or wait channel
    names the code of, among those its open files and working directory lie on; else the first such mount they lie
    on. Read from /proc without touching the mounts (a path is matched to its mount as a string)."""
    stack = proc.read_text(pid, "stack") or ""
    frames = [m.group(1) for m in _FS_FRAME.finditer(stack + "\n" + (proc.wchan(pid) or ""))]
    kinds = {_FRAME_KIND.get(f, "lustre") for f in frames}
    opened = [(f"its open file {t}", t) for t in sorted(proc.open_paths(pid, limit=MAX_FDS))]
    try:
        opened.append(("its working directory", os.readlink(proc.path(pid, "cwd"))))
    except OSError:
        pass
    found: list[tuple[Mount, str]] = []
    for how, target in opened:
        mount = mount_of(target.removesuffix(" (deleted)"), mounts) if target.startswith("/") else None
        if mount is not None and mount.fstype.split(".")[0] in NETWORK_FS:
            found.append((mount, how.removesuffix(" (deleted)")))
    for mount, how in found:
        if _kind(mount) in kinds:
            frame = next(f for f in frames if _FRAME_KIND.get(f, "lustre") == _kind(mount))
            return FsWait(pid, mount, f"its kernel stack ({frame}_...) and {how}")
    return FsWait(pid, found[0][0], found[0][1]) if found else None


def _kind(mount: Mount) -> str:
    base = mount.fstype.split(".")[0]
    return "nfs" if base.startswith("nfs") else "cifs" if base in ("cifs", "smb3") else base
