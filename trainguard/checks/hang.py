"""HangCheck: a job is hung when none of its progress signals advanced for `stale_after`.

Signals, per job: its log files (SLURM StdOut/StdErr or configured paths and globs, plus any file its
processes hold open for writing, which follows a log renamed by rotation), the trainer heartbeat
(its step must increase: a file rewritten with the same step is no progress), and for jobs with
neither, the write I/O counters of its process tree.

The check is not polled blindly: after each run it sets a timer for the earliest deadline (last
progress + stale_after), so a hang is reported within a second of it. The first run that finds a
job hung captures its stacks (py-spy) and, for a distributed job, each rank's flight recorder (PyTorch's
ring buffer of collectives, from the rank's worker socket or the dumps of the NCCL watchdog) before the
incident fires and any action touches the job; the incident names the rank that never entered the
collective the others wait in. Once per hang, also across restarts of the agent (the state remembers which hang
was dumped where).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import psutil

from trainguard.checks.base import ActionBinding, CheckContext, CheckSettings, JobCheck, same_as_actions
from trainguard.checks.xid import KernelLogSettings, adopt_marks
from trainguard.core.budget import NO_DEADLINE, Deadline, OverBudgetError
from trainguard.core.events import Event
from trainguard.core.logs import kv
from trainguard.core.model import Metric, Result, Status
from trainguard.core.settings import Duration, Field, field_validator
from trainguard.core.text import one_line
from trainguard.core.timer import WakeTimer
from trainguard.core.units import format_duration
from trainguard.jobs.kernelnotes import FsWait, KernelNotes, NotesReader, fs_wait
from trainguard.jobs.model import Job
from trainguard.jobs.tree import (
    FLIGHT_RECORDER_DUMPS,
    HEARTBEAT,
    flight_traces,
    heartbeat_path,
    job_processes,
    read_heartbeat,
)
from trainguard.node.access import Identity, stat_as
from trainguard.node.flight import Stall, analyze
from trainguard.node.kernel_events import catalog
from trainguard.node.mounts import Mount, StatfsProbe, Stuck, read_mounts
from trainguard.node.procfs import ProcFS
from trainguard.node.stacks import (
    Capture,
    DumpLimits,
    ProcessStack,
    StackDumper,
    find_py_spy,
    process_rank,
    ptrace_refusal,
    write_dumps,
)

log = logging.getLogger("trainguard.checks.hang")

STATE_KEY = "hang.counters"
SIGNALS_SHARE = 0.5  # of the timeout, what the jobs' progress signals share (`budgets`): the rest is the dumps' room
DUMPS_KEY = "hang.dumps"  # job key -> the hang its stacks were taken for: a restart does not dump a still-hung job again
_WRITE_MODES = ("w", "a", "r+", "w+", "a+")
# details["cause_kind"] of a hang whose blocked ranks wait on a file system the kernel says does not answer (its
# server not responding, its connection lost): it runs `fs_actions`
CAUSE_KIND = "cause_kind"
FILE_SYSTEM = "file_system"
# `fs_stale_after` takes the kernel's word when said since the job's last progress, less this: a kernel record's time
# is its boot-relative stamp plus the boot time (whole seconds), which drifts from the wall clock with uptime
KERNEL_CLOCK_SLACK = 60.0

_JOB = ("job_id", "name")
LAST_PROGRESS = Metric("trainguard_job_last_progress_timestamp_seconds",
                       "Unix time of the job's latest progress (log write, heartbeat step, I/O).", _JOB)
STALE_AFTER = Metric("trainguard_job_stale_after_seconds", "How long without progress before the job counts as hung.", _JOB)
HUNG = Metric("trainguard_job_hung", "1 while the job is hung.", _JOB)
METRICS = (LAST_PROGRESS, STALE_AFTER, HUNG)


class HangSettings(KernelLogSettings):
    interval: Duration = Field(60.0, gt=0, description="Re-evaluation period (deadlines wake the check on time).")
    timeout: Duration = Field(30.0, gt=0, description="Room for the stack dumps of a hung job.")
    stale_after: Duration = Field(1800.0, gt=0, description="Hung when no progress signal advanced for this long.")
    stale_after_by_name: dict[str, Duration] = Field(default_factory=dict, description="Per job name.")
    names: list[str] = Field(default_factory=list, description="Only jobs of these names; empty: every job here.")
    logs: list[str] = Field(default_factory=list, description="More log paths or globs per job: {workdir} {job_id} "
                                                              "{name} {user} {switch_dir}.")
    open_files: bool = Field(True, description="Count writes to any file the job's processes hold open for writing.")
    heartbeat: str = Field(HEARTBEAT, description="The trainer helper's heartbeat file; empty: none.")
    io_fallback: bool = Field(True, description="Jobs with no log or heartbeat: their write I/O counters are progress.")
    stacks: bool = Field(True, description="Capture the stacks of a hung job's Python processes with py-spy.")
    py_spy: str = Field("", description="py-spy executable; default: the one installed with trainguard, else PATH.")
    native: bool = Field(False, description="py-spy --native: include C/C++/CUDA frames (slower; it stops each "
                                            "process with ptrace, which the unit allows with its native-stacks drop-in).")
    dump_timeout: Duration = Field(10.0, gt=0, description="Timeout of the py-spy dumps of one job, all together.")
    dump_process_timeout: Duration = Field(5.0, gt=0, description="Timeout of one py-spy dump.")
    dump_parallel: int = Field(4, ge=1, le=64, description="py-spy dumps of one job running at a time.")
    dump_processes: int = Field(32, ge=1, le=4096, description="py-spy dumps per hang at most: one per rank (RANK, "
                                "SLURM_PROCID, ... in its environment), then the job's other Python processes, "
                                "parents first; the rest are counted and said once.")
    inspect_processes: int = Field(256, ge=1, le=65536, description="A job's processes looked at, at most, breadth "
                                   "first (its ranks before their workers): their open files and write I/O at each "
                                   "run; when it hangs, their state, kernel wait channel and environment (stacks, "
                                   "flight recorders). A hang's capture says how many were left out.")
    flight_recorder: bool = Field(True, description="Read each rank's PyTorch flight recorder (its worker socket, "
                                                    "TORCH_WORKER_SERVER_SOCKET) and name the rank that never entered "
                                                    "the collective the others wait in.")
    flight_recorder_dumps: str = Field(FLIGHT_RECORDER_DUMPS, description="Where the ranks' NCCL "
                                       "watchdog writes its flight-recorder dumps (TORCH_FR_DUMP_TEMP_FILE); "
                                       "templates as logs; empty: none.")
    flight_recorder_timeout: Duration = Field(5.0, gt=0, description="Timeout of reading the flight recorders "
                                                                     "of one job.")
    kernel_log: bool = Field(True, description="Name the file system a hung job's blocked ranks wait on (their "
                             "kernel stack, wait channel and open files) as the hang's cause, with what the kernel log "
                             "says of it (NFS server not responding, Lustre connection lost or evicted), read through "
                             "the node's one kernel log reader; without a kernel record, whether the mount answers.")
    mount_timeout: Duration = Field(1.0, gt=0, description="How long a blocked rank's mount may take to answer a "
                                    "statfs before it counts as not answering (once per hang; a call that blocks "
                                    "is not repeated while it does).")
    fs_stale_after: Duration | None = Field(
        None, gt=0, description="Sooner than `stale_after`: hung after this long without progress when the job's "
        "ranks wait in D state on a mount the kernel says does not answer (its NFS server not responding, its Lustre "
        "connection lost; as `fs_actions`; said since the job's last progress, less a minute: a record no `OK` "
        "followed is no word about a later stall), answered by `fs_actions`. The kernel says so only after the client's own "
        "retries (NFS over TCP at its defaults, timeo=600 retrans=2: about 3 minutes), so a job waits about that plus "
        "this; an outage that ends sooner (`nfs: server ... OK`) is never answered by it. An outage of a server every "
        "node mounts drains every node that runs a job on it (up to the drain's `max_drained`) this much sooner. "
        "None: `stale_after` alone.")
    fs_actions: ActionBinding | None = Field(
        default_factory=lambda: ActionBinding(critical=["signal", "drain", "requeue"]),
        description="Instead of `actions`, the actions of a hang whose blocked ranks wait on a file system the kernel "
                    "says does not answer (its NFS server not responding, its Lustre connection lost, on the mount "
                    "their open files lie on, not one a local account made with FUSE; details `cause_kind = "
                    "\"file_system\"`; a slow or failed statfs alone only says so in the alert). A restart in place "
                    "would hang again in this node's dead mount, so by default as for the node's other faults (xid, "
                    "kernel): ask the job to save, drain the node, requeue the job onto other nodes. A server down "
                    "for every node drains every node that runs a job on it, up to the drain's `max_drained`. `{}`: "
                    "alert only; `\"actions\"`: as `actions`.")

    @field_validator("fs_actions", mode="before")
    @classmethod
    def _same_as_actions(cls, value: object) -> object:
        return same_as_actions(value)


@dataclass(frozen=True)
class Signal:
    at: float  # when this signal last advanced
    what: str  # "log /path", "heartbeat step 1200", "write I/O"


def log_signal(paths: Sequence[str], identity: Identity, procs: list[psutil.Process], open_files: bool,
               skip_dir: str | None = None, procfs: ProcFS | None = None,
               deadline: Deadline = NO_DEADLINE) -> Signal | None:
    """The newest write among the job's log files (`paths`) and the files it holds open for writing (except in
    `skip_dir`, the switch dir, where the heartbeat's temporary file would pass for progress); `deadline` is checked
    between files and processes."""
    procfs = procfs or ProcFS()
    best: Signal | None = None
    for path in paths:
        deadline.check()
        try:
            mtime = stat_as(identity, path).st_mtime
        except OSError:
            continue
        if best is None or mtime > best.at:
            best = Signal(mtime, f"log {path}")
    if open_files:
        for proc in procs:
            deadline.check()
            try:
                files = proc.open_files()
            except psutil.Error:
                continue
            for f in files:
                if getattr(f, "mode", "r") not in _WRITE_MODES or (skip_dir and f.path.startswith(skip_dir + "/")):
                    continue
                mtime = procfs.fd_mtime(proc.pid, f.fd)  # a log renamed by rotation is still the file being written
                if mtime is None:
                    continue
                if best is None or mtime > best.at:
                    best = Signal(mtime, f"log {f.path}")
    return best


def io_written(procs: list[psutil.Process]) -> int | None:
    total, seen = 0, False
    for proc in procs:
        try:
            total += proc.io_counters().write_chars
            seen = True
        except (psutil.Error, AttributeError):
            continue
    return total if seen else None


@dataclass(frozen=True)
class Evidence:
    """What was captured of a hung job, once per hang: its stacks, where they were written, and its collectives."""

    since: float  # the hang's last progress: a new hang captures anew
    stacks: list[ProcessStack]
    path: Path | None = None
    stall: Stall | None = None
    note: str | None = None  # what the capture left out ("1496 more processes not dumped ...") or why it failed
    collectives: bool = True  # the flight recorders were read (not yet, for a capture restored from the state)
    cause: str | None = None  # the file system its blocked ranks wait on, and what the kernel says of it
    lever: str | None = None  # what to do about that file system
    cause_kind: str | None = None  # FILE_SYSTEM when that file system does not answer (`FsCause.down`)


def _stack_record(stack: ProcessStack) -> dict[str, Any]:
    """What the state keeps of a stack: all but the full dump text, which is in the dump file."""
    return {"pid": stack.pid, "rank": stack.rank, "state": stack.state, "where": stack.where, "wchan": stack.wchan}


def blocked_waits(procs: list[psutil.Process], proc: ProcFS, mounts: list[Mount],
                  deadline: Deadline = NO_DEADLINE) -> list[tuple[str, FsWait | None]]:
    """The job's processes blocked in the kernel (D state), each named (its rank, else its pid) with the file system
    it waits on, when its kernel stack, wait channel or open files say (None when they do not); within `deadline`."""
    found = []
    for p in procs:
        deadline.check()
        try:
            blocked = p.status() == psutil.STATUS_DISK_SLEEP
        except psutil.Error:
            continue
        if blocked:
            rank = process_rank(proc, p.pid)
            found.append((f"rank {rank}" if rank is not None else f"pid {p.pid}", fs_wait(p.pid, mounts, proc)))
    return found


class FsCause(NamedTuple):
    text: str  # the cause, in words
    lever: str  # what to do about it
    down: bool  # the kernel says the mount the ranks' files lie on does not answer (and no local account made it)


def fs_cause(waits: list[tuple[str, FsWait | None]], notes: KernelNotes, mounts: list[Mount],
             answers: Callable[[Mount], str | None], since: float = 0.0) -> FsCause | None:
    """The hang's cause when its blocked ranks wait on a file system, in words, and the lever: the mount most of them
    wait on, with what the kernel says of it (NFS server not responding, a Lustre target lost), else whether it
    answers now (`answers`: why not, None when it does). Ranks blocked on no mount their files name, while the kernel
    says a mounted file system is not answering: that one, as the likely cause. `since`: the kernel's word counts
    only when last said then or later."""
    if not waits:
        return None
    by_mount: dict[Mount, list[tuple[str, FsWait]]] = {}
    for who, wait in waits:
        if wait is not None:
            by_mount.setdefault(wait.mount, []).append((who, wait))
    if not by_mount:
        trouble = next(((m, t) for m in mounts if (t := notes.trouble(m, since)) is not None), None)
        if trouble is None:
            return None
        mount, t = trouble
        return FsCause(f"{_who([w for w, _ in waits], 'blocked')} in D state while the kernel says {t.describe()}, "
                       f"mounted at {one_line(mount.mountpoint, 200)}: likely what they wait on", _lever(t.kind), False)
    mount, blocked = max(by_mount.items(), key=lambda kv: len(kv[1]))
    what = one_line(f"{mount.fstype} {mount.device} at {mount.mountpoint}", 300)  # a user's FUSE names its source
    hung = [n for _, w in blocked if (n := notes.hung(w.pid)) is not None]
    also = f"; the kernel reported pid {hung[0].pid} blocked for more than {hung[0].seconds} s" if hung else ""
    who = _who([w for w, _ in blocked], "waits" if len(blocked) == 1 else "wait")
    # Down, for `fs_actions` (a drain), only on the kernel's word about the very mount the ranks' files lie on: a
    # local account can make a process sit in D state holding a file anywhere and load a shared file system until
    # a statfs is slow, but cannot write the kernel log. A FUSE mount a local account made is served by that account:
    # its silence is never the node's fault, and the agent does not statfs it (its server decides how long that takes).
    if mount.made_by is not None:
        return FsCause(f"{who} in D state on {what} (seen in {blocked[0][1].how}){also}; mounted by uid "
                       f"{mount.made_by}, not the node's", _lever(""), False)
    if (t := notes.trouble(mount, since)) is not None:
        return FsCause(f"{who} in D state on {what}: the kernel says {t.describe()}{also}", _lever(t.kind), True)
    why = answers(mount)
    state = f"it does not answer ({why})" if why else "it answers now (slow, or answering again)"
    return FsCause(f"{who} in D state on {what} (seen in {blocked[0][1].how}): {state}{also}", _lever(""), False)


def _cause_fields(cause: FsCause | None) -> dict[str, str | None]:
    """An Evidence's fields of the file system its ranks wait on (`cause_kind` FILE_SYSTEM when it is down)."""
    if cause is None:
        return {}
    return {"cause": cause.text, "lever": cause.lever, "cause_kind": FILE_SYSTEM if cause.down else None}


def _who(names: list[str], verb: str = "") -> str:
    listed = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"{listed} {verb}" if verb else listed


def _lever(kind: str) -> str:
    if kind in ("nfs", "lustre"):
        return catalog()["nfs_not_responding" if kind == "nfs" else "lustre_connection_lost"].lever
    return ("the ranks wait on that file system, not on each other: bring its server (or FUSE daemon) back, or "
            "requeue the job away from it; `trainguard kernel` reads what dmesg says of it")


def _load_evidence(saved: dict[str, Any]) -> dict[str, Evidence]:
    """The dumps an earlier run of the agent took, from its state; a record that does not parse is dropped (that
    job is dumped again, nothing worse). The collectives are not kept: they are read again, once, without harm."""
    dumps = {}
    for key, record in saved.items():
        try:
            stacks = [ProcessStack(int(s["pid"]), s["rank"], str(s["state"]), str(s["where"]), wchan=s["wchan"])
                      for s in record["stacks"]]
            dumps[key] = Evidence(float(record["since"]), stacks, Path(record["path"]) if record["path"] else None,
                                  note=record.get("note"), collectives=False, cause=record.get("cause"),
                                  lever=record.get("lever"), cause_kind=record.get("cause_kind"))
        except (KeyError, TypeError, ValueError):
            continue
    return dumps


def next_step(stall: Stall | None, stacks: list[ProcessStack]) -> str | None:
    """The runbook's first move for this hang: the rank that never entered the collective, and where it is stuck."""
    if stall is None or not stall.missing or stall.collective is None:
        return None
    where = {s.pid: s.where for s in stacks}
    culprits = "; ".join(t.label() + (f" is stuck in {where[t.pid]}" if t.pid in where else "") for t in stall.missing)
    return (f"{culprits}: it never entered {stall.collective.describe()} that the other ranks wait in, so it is the "
            "cause; read its stack and its log, and check its node's XIDs")


@dataclass(frozen=True)
class Progress:
    last: Signal
    signals: tuple[Signal, ...]


def evaluate(progress: Progress, stale_after: float, now: float) -> Status:
    return Status.CRITICAL if now - progress.last.at >= stale_after else Status.OK


def summarize(job: Job, progress: Progress, stale_after: float, now: float, evidence: Evidence) -> str:
    idle = format_duration(max(0.0, now - progress.last.at))
    if now - progress.last.at < stale_after:
        return f"{job.label()}: progressing ({progress.last.what}, {idle} ago)"
    # The file system the blocked ranks wait on leads, then the rank that never entered the collective: the cause,
    # and headlines are cut at 120 characters.
    stacks = evidence.stacks
    text = (f"{job.label()}: " + (f"cause: {evidence.cause}; " if evidence.cause else "")
            + (f"{evidence.stall.describe()}; " if evidence.stall else "")
            + f"no progress for {idle} (stale after {format_duration(stale_after)}); last: {progress.last.what}")
    if stacks:
        text += "; stuck in: " + "; ".join(s.describe() for s in stacks[:8])
        if len(stacks) > 8:
            text += f"; and {len(stacks) - 8} more"
    if evidence.note:
        text += f"; {evidence.note}"
    if evidence.path is not None:
        text += f"; stacks in {evidence.path}"
    return text


class HangCheck(JobCheck):
    # job: a rank that stalls stops every rank at the next collective, so the owner node's own signals (the job's
    # log, heartbeat, its ranks' I/O) show the hang within the same stale_after; the other nodes still dump their
    # ranks' stacks (logged with their path, on that node), but one alert and one requeue speak for the job
    scope = "job"
    Settings = HangSettings
    metrics = METRICS
    settings: HangSettings

    def __init__(self, name: str, settings: CheckSettings, context: CheckContext) -> None:
        super().__init__(name, settings, context)
        limits = DumpLimits(self.settings.inspect_processes, self.settings.dump_processes,
                            self.settings.dump_parallel, self.settings.dump_process_timeout)
        self.dumper = StackDumper(find_py_spy(self.settings.py_spy), self._native(), self.settings.dump_timeout,
                                  context.proc, limits)
        self._counters = self.load_state(STATE_KEY)  # job key -> kind -> [value, since]: steps and I/O, kept across restarts
        self._dumps = _load_evidence(self.load_state(DUMPS_KEY))
        self._timer: WakeTimer | None = None
        self._dirty = False
        self.kernel = (NotesReader(context.kernel_notes, context.kernel_log, name, self.settings.kmsg_path,
                                   self.settings.journalctl) if self.settings.kernel_log else None)
        self.probe = StatfsProbe(clock=context.clock)

    def actions_for(self, event: Event) -> ActionBinding:
        """`fs_actions` for a hang whose ranks wait on a file system that does not answer; else `actions`."""
        if event.details.get(CAUSE_KIND) == FILE_SYSTEM and self.settings.fs_actions is not None:
            return self.settings.fs_actions
        return self.settings.actions

    def _native(self) -> bool:
        """`native = true` where the sandbox allows ptrace; where it does not, said once here, at start, and the
        dumps keep to Python frames (py-spy --nonblocking needs no ptrace) instead of failing at every hang."""
        if not (self.settings.native and self.settings.stacks):
            return False
        refusal = ptrace_refusal()
        if refusal is not None:
            log.error("native stacks refused; hung jobs get Python frames only", extra=kv(
                check=self.name, reason=refusal, fix="trainguard install --dropin native-stacks (docs/install.md)"))
        return refusal is None

    def start(self, wake: Callable[[], None]) -> None:
        self._timer = WakeTimer(wake, self.context.clock, name=f"deadline-{self.name}")
        if self.kernel is not None:
            # read when a job hangs; with `fs_stale_after` a file system that stops answering may be one already (an
            # OOM kill never: it changes nothing decided here, and a job's user may kill their own processes in a loop)
            early = self.settings.fs_stale_after is not None
            self.kernel.start(wake if early else lambda: None, kills=False)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.stop()
        if self.kernel is not None:
            self.kernel.stop()
        self.probe.close()

    def _advanced(self, key: str, kind: str, value: float, when: float) -> float:
        """When `value` (a step, a byte count) last changed; `when` is the best known time of the current value."""
        entry = self._counters.setdefault(key, {}).get(kind)
        if entry is None or value != entry[0]:  # new, advanced, or reset by a restarted process
            self._counters[key][kind] = [value, when]
            self._dirty = True
        return self._counters[key][kind][1]

    def stale_after(self, job: Job) -> float:
        return self.settings.stale_after_by_name.get(job.name, self.settings.stale_after)

    def progress(self, job: Job, procs: list[psutil.Process], now: float,
                 deadline: Deadline = NO_DEADLINE) -> Progress:
        started = job.start_time or min((p.create_time() for p in procs), default=now)
        signals = [Signal(started, "job start")]
        identity = self.identity(job)
        logs = self.log_files(job, self.settings.logs, deadline).paths
        logged = log_signal(logs, identity, procs, self.settings.open_files, job.switch_dir, self.context.proc,
                            deadline)
        if logged is not None:
            signals.append(logged)
        beat = heartbeat_path(job, self.settings.heartbeat)
        step = read_heartbeat(beat, identity)[0] if beat else None
        if step is not None:
            try:  # the new step was written at the latest by the file's last write, not when we noticed it
                written = stat_as(identity, beat).st_mtime
            except OSError:
                written = now
            signals.append(Signal(self._advanced(job.key, "step", step, written), f"heartbeat step {step}"))
        if logged is None and step is None and self.settings.io_fallback:
            written_bytes = io_written(procs)
            if written_bytes is not None:
                signals.append(Signal(self._advanced(job.key, "io", written_bytes, now), "write I/O"))
        return Progress(max(signals, key=lambda s: s.at), tuple(signals))

    def run(self) -> Sequence[Result]:
        if self.kernel is not None:
            self.kernel.read_once(lambda: adopt_marks(self.context, self.context.xid_history))
        view = self.view()
        now = self.context.clock()
        results = self.source_errors(view)
        deadlines = []
        live = set()
        table = self.context.processes.get()
        running = [(job, procs) for job in self.jobs_here(view, self.settings.names)
                   if (procs := job_processes(job, table))]
        budgets = self.budgets([job for job, _ in running], SIGNALS_SHARE)
        for (job, procs), (_, deadline) in zip(running, budgets, strict=True):
            live.add(job.key)
            try:
                result, wake_at = self._check_job(job, procs, now, deadline)
            except OverBudgetError as exc:  # its own files or processes are slow: the other jobs are still watched
                results.append(self.over_budget(job, exc, "reading its progress signals"))
                continue
            except Exception as exc:  # noqa: BLE001 - one job's odd files or processes never stop the watch on the others
                error = one_line(f"{type(exc).__name__}: {exc}", 200)
                log.warning("checking a job for a hang failed", extra=kv(job=job.key, error=error))
                results.append(self.result(job.key, Status.UNKNOWN, f"{job.label()}: hang check failed: {error}",
                                           {"job_key": job.key, "error": error}))
                continue
            results.append(result)
            if wake_at is not None:
                deadlines.append(wake_at)
        self._forget(live)
        if self._timer is not None:
            self._timer.set(min(deadlines) + 0.05 if deadlines else None)
        return results

    def _check_job(self, job: Job, procs: list[psutil.Process], now: float,
                   budget: Deadline = NO_DEADLINE) -> tuple[Result, float | None]:
        """The job's result, and its deadline while it progresses. Only the first `inspect_processes` of the job's
        processes are looked at (their open files and I/O at every run): a job's user picks how many processes
        it has, not what they cost the agent; reading its progress signals keeps to the job's `budget` of time."""
        progress = self.progress(job, procs[:self.settings.inspect_processes], now, budget)
        limit = self.stale_after(job)
        status = evaluate(progress, limit, now)
        dead = None
        if status is Status.OK:
            early = self._early(limit, progress)  # asked once: the look for a dead mount and the deadline share it
            dead = self._dead_mount(job, procs, progress, early, now, budget)
            if dead is None and not self._hung_early(job, progress, limit, now):
                self._dirty |= self._dumps.pop(job.key, None) is not None
                return (self._result(job, progress, limit, now, status, Evidence(0.0, [])),
                        self._deadline(progress, limit, early, now))
            status, limit = Status.CRITICAL, self.settings.fs_stale_after or limit
        return self._result(job, progress, limit, now, status, self._evidence(job, procs, progress, now, dead)), None

    def _early(self, limit: float, progress: Progress) -> float | None:
        """`fs_stale_after` where it is sooner than the job's `stale_after` and the kernel says a file system does
        not answer now, and said so since the job's last progress (a record with no `OK` after it is no word about
        a later stall); else None."""
        early = self.settings.fs_stale_after
        if (early is None or early >= limit or self.kernel is None
                or not self.kernel.notes.troubled(progress.last.at - KERNEL_CLOCK_SLACK)):
            return None
        return early

    def _dead_mount(self, job: Job, procs: list[psutil.Process], progress: Progress, early: float | None,
                    now: float, budget: Deadline = NO_DEADLINE) -> FsCause | None:
        """The dead file system a job idle for `early` (`_early`) waits on (`FsCause.down`), else None. Looked for at
        each run while the kernel says one is dead (the job's processes' states, at most `inspect_processes`), within
        the job's `budget`: its user picks how many processes sit in D state holding how many files."""
        if early is None or now - progress.last.at < early:
            return None
        cause = self._fs_cause(job, procs, progress.last.at - KERNEL_CLOCK_SLACK, budget)
        return cause if cause is not None and cause.down else None

    def _hung_early(self, job: Job, progress: Progress, limit: float, now: float) -> bool:
        """Whether the job was found hung on a dead file system at `fs_stale_after` and has not progressed since: still
        hung, though the kernel now says the file system answers (`OK`) or its ranks left D state for a moment. Only
        progress ends a hang; its incident would otherwise resolve saying the job progresses, fire again at the
        next blip, and capture its stacks anew each time."""
        early, cached = self.settings.fs_stale_after, self._dumps.get(job.key)
        return (early is not None and early < limit and now - progress.last.at >= early and cached is not None
                and cached.since == progress.last.at and cached.cause_kind == FILE_SYSTEM)

    @staticmethod
    def _deadline(progress: Progress, limit: float, early: float | None, now: float) -> float:
        """When the progressing job is next looked at: at its `stale_after`, or at `early` (`_early`: `fs_stale_after`
        while the kernel says a file system is dead; past it, the check's interval looks again)."""
        at = progress.last.at + limit
        return min(at, progress.last.at + early) if early is not None and progress.last.at + early > now else at

    def _evidence(self, job: Job, procs: list[psutil.Process], progress: Progress, now: float,
                  dead: FsCause | None = None) -> Evidence:
        """Once per hang: dump the stacks, read the flight recorders, and keep them for the runs that follow. The
        hang is marked captured before the capture starts: a capture that fails is not run again at every run.
        `dead`: the dead file system already found (`fs_stale_after`), not looked for again."""
        cached = self._dumps.get(job.key)
        if cached is not None and cached.since == progress.last.at:
            if not cached.collectives:  # restored from the state of an earlier agent: its collectives read once
                self._dumps[job.key] = replace(cached, collectives=True)  # once, even if reading them raises
                self._dumps[job.key] = cached = replace(cached, stall=self._stall(job, procs), collectives=True)
            return cached
        # a capture that fails keeps the dead file system it was for (`fs_actions`, not `actions`, at the next run)
        self._dumps[job.key] = Evidence(progress.last.at, [], note="capturing the stacks failed: see the agent's log",
                                        **_cause_fields(dead))
        self._dirty = True
        capture = self.dumper.dump(procs) if self.settings.stacks else Capture([])
        path = None
        if capture.stacks:
            try:
                path = write_dumps(self.context.state_dir / "stacks", job.label(), capture.stacks, now, capture.note)
            except OSError as exc:
                log.error("writing stack dumps failed", extra=kv(job=job.key, error=exc))
        if self.settings.stacks:
            log.warning("hung job stacks", extra=kv(job=job.key, processes=len(capture.stacks), path=path,
                                                    where=capture.stacks[0].describe() if capture.stacks else None,
                                                    left_out=capture.note))
        stall = self._stall(job, procs)
        if stall is not None:
            log.warning("hung job collectives", extra=kv(job=job.key, stall=stall.describe()))
        cause = dead or self._fs_cause(job, procs)
        if cause is not None:
            log.warning("hung job waits on a file system", extra=kv(job=job.key, cause=cause.text, down=cause.down))
        evidence = Evidence(progress.last.at, capture.stacks, path, stall, capture.note, **_cause_fields(cause))
        self._dumps[job.key] = evidence
        return evidence

    def _fs_cause(self, job: Job, procs: list[psutil.Process], since: float = 0.0,
                  budget: Deadline = NO_DEADLINE) -> FsCause | None:
        """The file system the job's blocked processes wait on, what to do, and whether it is down: `fs_cause`."""
        if self.kernel is None:
            return None
        try:
            mounts = read_mounts(self.context.proc)
        except OSError:
            mounts = []
        waits = blocked_waits(procs[:self.settings.inspect_processes], self.context.proc, mounts, budget)
        return fs_cause(waits, self.kernel.notes, mounts, self._answers, since)

    def _answers(self, mount: Mount) -> str | None:
        """Why the mount does not answer a statfs (blocked past `mount_timeout`, an error); None when it answers."""
        outcome = self.probe.stat(mount.mountpoint, self.settings.mount_timeout)
        if isinstance(outcome, Stuck):
            blocked = format_duration(max(self.context.clock() - outcome.since, self.settings.mount_timeout))
            return f"a statfs still blocked after {blocked}"
        return f"statfs failed: {outcome.strerror or outcome}" if isinstance(outcome, OSError) else None

    def _stall(self, job: Job, procs: list[psutil.Process]) -> Stall | None:
        """What the ranks' flight recorders say: live from their worker sockets, else the NCCL watchdog's dumps."""
        if not self.settings.flight_recorder:
            return None
        traces = flight_traces(job, procs[:self.settings.inspect_processes], self.settings.flight_recorder_dumps,
                               self.context.node, self.settings.flight_recorder_timeout, self.context.proc)
        if malformed := sum(t.malformed for t in traces):
            log.warning("flight recorder entries skipped", extra=kv(
                job=job.key, entries=malformed, reason="a sequence or process group id that is not an int64 >= 0"))
        return analyze(traces)

    def _forget(self, live: set[str]) -> None:
        for key in set(self._counters) - live:
            del self._counters[key]
            self._dirty = True
        for key in set(self._dumps) - live:
            del self._dumps[key]
            self._dirty = True
        if self._dirty:  # losing this only restarts the hang clocks (and dumps a still-hung job once more)
            self._dirty = False
            self.save_state(STATE_KEY, self._counters)
            self.save_state(DUMPS_KEY, {key: {"since": e.since, "path": str(e.path) if e.path else None,
                                              "note": e.note, "stacks": [_stack_record(s) for s in e.stacks],
                                              "cause": e.cause, "lever": e.lever, "cause_kind": e.cause_kind}
                                        for key, e in self._dumps.items()})

    def _result(self, job: Job, progress: Progress, limit: float, now: float, status: Status,
                evidence: Evidence) -> Result:
        labels = {"job_id": job.job_id or job.name, "name": job.name}
        samples = [LAST_PROGRESS(progress.last.at, labels), STALE_AFTER(limit, labels),
                   HUNG(1 if status is not Status.OK else 0, labels)]
        details: dict[str, Any] = {
            "job_key": job.key, "job_id": job.job_id, "last_progress": progress.last.at,
            "last_signal": progress.last.what, "idle_seconds": now - progress.last.at, "stale_after": limit,
            "signals": [{"what": s.what, "at": s.at} for s in progress.signals],
            "stacks": [{"pid": s.pid, "rank": s.rank, "state": s.state, "where": s.where} for s in evidence.stacks],
            "stacks_path": str(evidence.path) if evidence.path else None,
            "collectives": evidence.stall.fields() if evidence.stall else None,
            "cause": evidence.cause, CAUSE_KIND: evidence.cause_kind,
            "next_step": evidence.lever or next_step(evidence.stall, evidence.stacks)}
        if evidence.cause_kind == FILE_SYSTEM:
            # this node's own ranks wait on this node's dead mount: what only this node sees, said (and drained) here
            # even when another node owns the job and speaks for its hang (trainguard/pipeline/engine.py `_spoken`)
            details["scope"] = "node"
        text = summarize(job, progress, limit, now, evidence)
        return self.result(job.key, status, text, details, samples)
