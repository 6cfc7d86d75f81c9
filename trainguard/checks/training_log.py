"""TrainingLogCheck: read each job's log as it is written and turn known failures into diagnosed incidents.

Only appended bytes are read (positions kept in the store); findings are remembered per job, so an
OOM reported once stays the job's status until the job is gone, and its message already carries the
diagnosis and the lever to pull.

A requeued SLURM job keeps its id; its restart count (`Restarts=`) is its life. Findings are kept per life: when
the count changes, what the earlier life left (findings, NaN streaks, collectives) is dropped, and its logs are read
on from where the reader stood: the end of what the earlier life wrote when it was read to the end (appended logs,
`--open-mode=append`), the start of a StdOut the new life truncated or recreated. A heartbeat older than the new
life's start is the earlier life's and is not read.

A node meeting a SLURM job first (it just started here, or was requeued onto this node) looks at where each of its
logs ends as soon as it knows the log's path (the SLURM source's news wakes the check: the prolog's record, which
names StdOut/StdErr before the job's first process; else the controller's record, a second or so after it), and a
log not written since the job's start is read from there: what it holds is another job's or an earlier life's
(appended: `--open-mode=append`, or a fixed `--output`). A later life's StdOut or StdErr looked at within EARLY_S of
its start is read from there even if the life wrote to it before the look: an appended one holds the earlier lives'
lines before them, which were dealt with then, and nothing in the file tells them apart. The cost is what the life
wrote before the look (a job that crashes then still has its final exception read at its end: `_exit`). A log that
was not there at the look, or was truncated or rewritten since, is read from its start; one looked at later than
that, from its start too (earlier lives' lines included).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, ClassVar, NamedTuple

from trainguard.checks.base import CheckContext, CheckSettings, JobCheck
from trainguard.checks.xid import KernelLogSettings, adopt_marks
from trainguard.core.budget import NO_DEADLINE, Deadline, OverBudgetError
from trainguard.core.logs import kv
from trainguard.core.model import Metric, Result, Status, worst
from trainguard.core.settings import Duration, Field, Size
from trainguard.core.text import linear, one_line
from trainguard.core.units import format_bytes, parse_size
from trainguard.jobs.kernelnotes import JobProcess, NotesReader, OomKill
from trainguard.jobs.model import Job
from trainguard.jobs.tree import (
    FLIGHT_RECORDER_DUMPS,
    flight_traces,
    heartbeat_path,
    job_fields,
    job_pids,
    job_processes,
    read_heartbeat,
)
from trainguard.logscan.collectives import ADVICE, Story, gather, observe, observe_all, tell
from trainguard.logscan.context import STEP_WINDOW, finite_loss, last_step, oom_gpu, relaunched, step_marks
from trainguard.logscan.diagnose import diagnose_cuda, diagnose_nccl
from trainguard.logscan.launcher import BLOCK, root_cause
from trainguard.logscan.lines import plain, stamp, timestamp, unwrap
from trainguard.logscan.nccl import MID_RUN, NETWORK, diagnose_nccl_error
from trainguard.logscan.nccl import PATTERN as NCCL_ERROR
from trainguard.logscan.oom import IMPOSSIBLE, GpuContext, classify, explain, parse_oom
from trainguard.logscan.reader import LogTail, Look, Position, look
from trainguard.logscan.signatures import BUILTIN, Hit, Scanner, SignatureSettings, custom, final_exception, last_exception
from trainguard.node.access import Identity, stat_as
from trainguard.node.flight import Stall, analyze
from trainguard.node.kernel_events import catalog

log = logging.getLogger("trainguard.checks.training_log")

POSITIONS_KEY = "logscan.positions"
# The controller's StartTime (whole seconds) against a file's mtime (the file server's clock): a log last written
# this much before a job's start is another job's, or its earlier lives'. A requeue takes longer than this between
# lives.
CLOCK_SKEW = 2.0
# A later life's StdOut and StdErr looked at this soon after its start are read from where they ended then (see
# above): without the prolog hook the look comes a second or so after the life's first process.
EARLY_S = 5.0
FINDINGS_KEY = "logscan.findings"
COLLECTIVES_KEY = "logscan.collectives"
LIVES_KEY = "logscan.lives"  # job key -> the life (SLURM restart count) its findings belong to
FINDINGS = Metric("trainguard_log_findings", "Known failures found in the job's logs.", ("job_id", "name"))
MAX_PER_SIGNATURE = 8  # per job and signature: a flood of one kind (25 ranks' timeouts) never crowds out another
# A worker's kill is not the rank's: the rank then fails by PyTorch's exception (or catches it), not by the kernel
WORKER_KILLED = ("A worker of the rank, not the rank: PyTorch then raises `DataLoader worker (pid N) is killed by signal: "
                 "Killed.` (or `... exited unexpectedly`) in the rank. Fewer DataLoader workers (num_workers) or less memory "
                 "per worker. ")
NEW_RANKS = 256  # a job's new processes whose rank is read per run, at most (one small /proc read each)


class TrainingLogSettings(KernelLogSettings):
    interval: Duration = Field(15.0, gt=0)
    kernel_log: bool = Field(True, description="Tell the kernel OOM killer's kills of a job's processes in its story "
                             "(which rank, which memory, when), read through the node's one kernel log reader.")
    logs: list[str] = Field(default_factory=list, description="More log paths or globs per job (templates as hang).")
    signatures: dict[str, SignatureSettings] = Field(default_factory=dict, description="Site signatures, by name.")
    nan_limit: int = Field(3, ge=1, description="This many NaN/Inf losses in a row (no finite loss between): "
                                                "CRITICAL (fewer: WARNING).")
    overflow_burst: int = Field(20, ge=1, description="This many fp16 OVERFLOW skips: WARNING.")
    warmup_steps: int = Field(10, ge=0, description="An OOM at or before this step is a static sizing error.")
    max_line: Size = Field(parse_size("1MiB"), description="Longer lines are cut here.")
    read_limit: Size = Field(parse_size("256MiB"), description="At most this much of one log per run (catch up later).")
    job_read_limit: Size = Field(parse_size("512MiB"), description="At most this much of all of one job's logs per run: "
                                 "the rest is read on next run, and the job's result says its logs are behind.")
    flight_recorder: bool = Field(True, description="Cross-check collective timeouts with the ranks' PyTorch flight "
                                                    "recorders (worker sockets, else the dumps below).")
    flight_recorder_dumps: str = Field(FLIGHT_RECORDER_DUMPS, description="Where the NCCL watchdog writes the "
                                       "flight-recorder dumps (TORCH_FR_DUMP_TEMP_FILE); templates as logs.")


# Which finding leads: the hardware first, then a cause (what failed on some rank), then the job's end as the launcher
# or a traceback tells it, then the echoes (the other ranks' timeouts, a peer that went away); within one tier the
# earliest by the lines' own timestamps (else the order read). A job that ended non-zero counts as a cause read last:
# its final exception leads when nothing more specific came before. A cause that came after an echo in time is its
# knock-on (an OOM after a NCCL timeout): it moves behind the echoes, and so does an impossible allocation.
HARDWARE, CAUSE, END, GENERIC, ECHO, KNOCK_ON = 0, 1, 2, 3, 4, 5
_TIER = {"oom_kill": CAUSE, "cuda_oom": CAUSE, "cuda_error": CAUSE, "nccl_error": CAUSE, "nan_loss": CAUSE,
         "loss_scale_min": CAUSE, "fp16_overflow": CAUSE, "launcher": END, "exit": CAUSE, "traceback": END, "nccl_timeout": ECHO,
         "nccl_progress": ECHO, "collective_failure": ECHO}
_CAUGHT = linear(r"(?i)\bwarn(?:ing)?\b")  # `| WARNING: ran out of memory`, `| WARNING | fairseq.trainer | OOM:`
_NAN_NORM = linear(r"(?i)grad[_ ]norm['\"]?\W{0,40}(?:nan|[-+]?inf)\b")
_NAN_LOSS = linear(r"(?i)\bloss['\"]?\W{0,40}(?:nan|[-+]?inf)\b")
_ZERO_LOSS = linear(r"""\bloss['"]?\s{0,40}[:=]\s{0,40}['"]?0(?:\.0{1,8})?(?:[,\s}|]|$)""")
_COLLECTIVE = ("nccl_timeout", "nccl_progress", "collective_failure")
# PyTorch prints an NCCL error's class on the line after the error (`ncclRemoteError: A call failed ...`): part of
# the finding above it, not one of its own
_NCCL_CLASS_LINE = linear(r"^nccl[A-Z]\w{1,30}: ")
# PyTorch's own NCCL error classes, which a network plugin's `Last error:` line below them tells more precisely
_GENERIC_NCCL = ("remote", "internal", "system")
# What the NCCL watchdog acts on: its abort (SIGABRT) of the process is their effect, whatever the lines' order
_WATCHED = ("nccl_timeout", "nccl_progress", "nccl_error", "collective_failure", "cuda_error")


def _unparsed_timeout(text: str) -> bool:
    """A watchdog line whose timeout is cut short (wrapped): `... terminated with exception: [Rank 0`, `... terminat`,
    `Watchdog caught ... NumelOut=5`; a complete one (or one about something else: a CUDA error) is not."""
    if "Watchdog caught" in text:
        obs = observe(text)
        return obs is None or obs.kind != "timeout"
    at = text.find("atchdog thread terminat")
    if at < 0:
        return False
    rest = text[at:]
    cut = rest.find("exception: ")
    what = rest[cut + len("exception: "):] if cut >= 0 else ""
    return not what.strip() or what.startswith("[Rank")


def _tier(f: dict[str, Any]) -> int:
    return HARDWARE if f.get("hardware") else int(f.get("tier", _TIER.get(f["signature"], END)))


def _when(f: dict[str, Any]) -> tuple[float, int]:
    """The time order of findings: the lines' own timestamps where they have them, else the order read."""
    ts = f.get("ts")
    return (ts if ts is not None else float("inf"), int(f.get("n", 0)))


def _knock_ons(findings: list[dict[str, Any]]) -> set[int]:
    """The causes that came after an echo (a collective timeout, a peer gone) by the lines' timestamps, or later on
    the same rank's log: knock-on effects of that failure (an OOM after a NCCL timeout), not its cause. A worker
    that torchrun saw die of SIGABRT, in a job whose logs show what the NCCL watchdog acts on (a timeout, an NCCL or
    CUDA error), was aborted by that watchdog: its effect, wherever its line stands."""
    echoes = [f for f in findings if _tier(f) == ECHO]
    watched = any(f["signature"] in _WATCHED for f in findings)
    late = {i for i, f in enumerate(findings) if watched and _aborted(f)}
    for i, f in enumerate(findings):
        if _tier(f) != CAUSE or f["signature"] == "nan_loss":
            continue
        for e in echoes:
            timed = e.get("ts") is not None and f.get("ts") is not None and e["ts"] < f["ts"]
            same_log = (e.get("path") == f.get("path") and f.get("rank") is not None and e.get("rank") == f["rank"]
                        and int(e.get("pos", 0)) < int(f.get("pos", 0)))
            if timed or same_log:
                late.add(i)
                break
    return late


class _Seen(NamedTuple):
    """One hit as `_record` read it: the line (a wrapped one joined), its message, and the signature's count."""

    job: Job
    hit: Hit
    data: bytes
    line: str
    text: str
    count: int


def _meaning(f: dict[str, Any]) -> Any:
    """What a finding says, to tell a repeat: its title; a CUDA error's name (the watchdog's line about an error
    whose assertion was told with the error: the same error)."""
    return ("cuda", (f.get("fields") or {}).get("error")) if f["signature"] == "cuda_error" else f.get("title")


def _aborted(f: dict[str, Any]) -> bool:
    return f["signature"] == "launcher" and (f.get("fields") or {}).get("signal") == "SIGABRT"


def _written(path: str, identity: Identity) -> float:
    """When the file was last written; +inf when that is unknown (it is read, as before)."""
    try:
        return stat_as(identity, path).st_mtime
    except OSError:
        return float("inf")


def _oom_kill(kill: OomKill, who: str | None, before_start: bool) -> dict[str, Any]:
    """The finding of a kernel OOM kill of one of the job's processes: CRITICAL, unless logged before the agent's
    first start on this boot (the first-start policy of every kernel event: reported, WARNING, not acted on)."""
    lever = (WORKER_KILLED if kill.worker else "") + catalog()["oom_kill_memcg" if kill.memcg_limit else "oom_kill"].lever
    title = kill.describe(who) + (" (logged before trainguard started: reported, not acted on)" if before_start else "")
    return {"signature": "oom_kill", "rank": None, "path": None, "at": kill.when, "line": kill.line[:500],
            "status": (Status.WARNING if before_start else Status.CRITICAL).name, "title": title,
            "ts": stamp(kill.when), "n": 0, "advice": lever, "fields": kill.fields()}


def _gpu_dict(gpu: GpuContext | None) -> dict[str, Any] | None:
    if gpu is None:
        return None
    return {"index": gpu.index, "faults": list(gpu.faults), "mig": gpu.mig,
            "other_processes": [{"pid": o.pid, "bytes": o.bytes, "command": o.command, "user": o.user, "job": o.job}
                                for o in gpu.others]}


class TrainingLogCheck(JobCheck):
    scope = "job"
    Settings = TrainingLogSettings
    metrics = (FINDINGS,)
    settings: TrainingLogSettings

    def __init__(self, name: str, settings: CheckSettings, context: CheckContext) -> None:
        super().__init__(name, settings, context)
        self.scanner = Scanner(BUILTIN + custom(self.settings.signatures))
        self.nvml = context.nvml
        # Read positions per (job, log): two jobs whose log templates name one file (a `{workdir}` or `{name}` the
        # users chose) each read all of it; one job's reads never consume the lines the other has not seen.
        self._positions: dict[tuple[str, str], Position] = {}
        self._earlier: dict[str, Position] = {}  # state saved before positions were per job: path -> position
        for key, value in self.load_state(POSITIONS_KEY).items():
            if isinstance(value, dict):
                self._positions.update(((key, p), Position.from_list(v)) for p, v in value.items()
                                       if isinstance(v, list))
            elif isinstance(value, list):
                self._earlier[key] = Position.from_list(value)
        self._findings: dict[str, list[dict[str, Any]]] = self.load_state(FINDINGS_KEY)
        self._collectives: dict[str, dict[str, Any]] = self.load_state(COLLECTIVES_KEY)  # job -> gathered record
        self._stalls: dict[str, tuple[int, Stall | None]] = {}  # job -> (record size read at, flight recorder)
        self._counts: dict[str, dict[str, int]] = {}
        self._pending_assert: dict[str, str] = {}
        self._steps: dict[tuple[str, str], int] = {}  # (job, log path) -> step of its last step line read
        # (job, log path) -> how far the log was searched for the step of a line that comes in floods, and that step
        self._near: dict[tuple[str, str], tuple[int, int | None]] = {}
        self._nan_streaks: dict[str, dict[str, int]] = {}  # job -> "path|rank" (or "heartbeat") -> NaNs in a row
        self._beat_steps: dict[str, int] = {}  # job -> heartbeat step last looked at
        self._lives: dict[str, int] = {k: v for k, v in self.load_state(LIVES_KEY).items() if isinstance(v, int)}
        # (job, log) -> where the log ended when the job was first heard of here (None: no such file), and when;
        # kept until the log's first read found it
        self._first: dict[tuple[str, str], tuple[Look | None, float]] = {}
        self._unlisten: Callable[[], None] | None = None
        self._behind: set[str] = set()  # jobs whose logs were left behind by their read budget, said once
        self._dropped: dict[str, float] = {}  # job -> when its findings were last dropped: older kills are told
        self.notes = context.kernel_notes
        self.kernel = (NotesReader(self.notes, context.kernel_log, name, self.settings.kmsg_path,
                                   self.settings.journalctl) if self.settings.kernel_log else None)

    def start(self, wake: Callable[[], None]) -> None:
        """Run at once when a job starts here, to look at its logs before it writes (`_look`), and when the kernel
        kills a process for memory (`_kernel_kills`)."""
        if self.context.jobs is not None:
            self._unlisten = self.context.jobs.listen(wake)
        if self.kernel is not None:
            self.kernel.start(wake)

    def stop(self) -> None:
        if self._unlisten is not None:
            self._unlisten()
        if self.kernel is not None:
            self.kernel.stop()

    def run(self) -> Sequence[Result]:
        if self.kernel is not None:
            self.kernel.read_once(lambda: adopt_marks(self.context, self.context.xid_history))
        view = self.view()
        results = self.source_errors(view)
        paths: set[tuple[str, str]] = set()  # (job, log) read or kept this run
        unlisted: set[str] = set()  # jobs whose logs were not all listed this run: their positions are all kept
        jobs = [job for job in view.jobs if job.on_this_node]
        for job, deadline in self.budgets(jobs):
            try:
                result = self._check_job(job, bool(view.stale.get(job.source)), deadline, paths)
            except OverBudgetError as exc:  # its own time is up: the rest of its logs are read next run
                result = self.over_budget(job, exc, "reading its logs", self._result(job))
                unlisted.add(job.key)
            except Exception as exc:  # noqa: BLE001 - one job's hostile log never blinds this check for the others
                error = one_line(f"{type(exc).__name__}: {exc}", 200)
                log.warning("reading a job's logs failed; skipped past the bytes read", extra=kv(job=job.key,
                                                                                                 error=error))
                result = self.result(job.key, Status.UNKNOWN, f"{job.label()}: could not read its logs: {error}",
                                     {"job_key": job.key, "error": error})
                unlisted.add(job.key)
            if result is not None:
                results.append(result)
        if not view.errors:  # a source that failed this time says nothing about which jobs are gone
            paths.update(key for key in [*self._positions, *self._first] if key[0] in unlisted)
            self._forget({job.key for job in jobs}, paths)
        self._save()
        return results

    def _check_job(self, job: Job, stale: bool, deadline: Deadline, paths: set[tuple[str, str]]) -> Result | None:
        """Read on in the job's logs within its budgets (files, bytes, time); its result, None while it is not read."""
        files = self.log_files(job, self.settings.logs, deadline)
        paths.update((job.key, path) for path in files.paths)
        if job.state == "REQUEUED":  # its life here ended; what its log says now is its next life's, elsewhere
            return None
        self._look(job, files.paths)
        if not self._life(job, stale):
            return None
        self._remember_ranks(job)
        behind = self._read_all(job, files.paths, deadline)
        self._heartbeat_loss(job)
        self._kernel_kills(job)
        self._exit(job, files.paths)
        return self._result(job, files.notes, behind)

    def _read_all(self, job: Job, logs: Sequence[str], deadline: Deadline) -> int:
        """Read on in each of the job's logs, `job_read_limit` bytes in all at most (`read_limit` of one); how many
        bytes that left unread (read on next run)."""
        left, behind = int(self.settings.job_read_limit), 0
        restarted = []
        for path in logs:
            deadline.check()
            if left <= 0:  # its positions stay: read on from there next run
                behind += self._unread(job, path)
                continue
            again, tail = self._read(job, path, min(left, int(self.settings.read_limit)), deadline)
            left -= tail.spent
            behind += tail.behind
            if again:
                restarted.append(path)
        if restarted:
            self._after_restart(job.key, restarted, len(logs) > len(restarted))
        self._say_behind(job, behind)
        return behind

    def _unread(self, job: Job, path: str) -> int:
        """How far the log's end is past the job's position in it (a log never read: all of it)."""
        position = self._positions.get((job.key, path))
        try:
            size = stat_as(self.identity(job), path).st_size
        except OSError:
            return 0
        return max(0, size - (position.offset if position is not None else 0))

    def _say_behind(self, job: Job, behind: int) -> None:
        """One log line when the job's logs fall behind its byte budget, one when they have caught up."""
        was = job.key in self._behind
        if behind and not was:
            self._behind.add(job.key)
            log.warning("a job's logs are behind: more was written than its read budget", extra=kv(
                job=job.key, unread_bytes=behind, job_read_limit=int(self.settings.job_read_limit)))
        elif not behind and was:
            self._behind.discard(job.key)
            log.info("a job's logs are read up again", extra=kv(job=job.key))

    def _forget(self, live: set[str], paths: set[tuple[str, str]]) -> None:
        """Bounded state: only what the jobs still here and the logs read (or kept) this run need."""
        for key in set(self._findings) - live:  # the job is gone: its story is told
            del self._findings[key]
        for table in (self._nan_streaks, self._beat_steps, self._counts, self._collectives, self._stalls,
                      self._lives, self._dropped):
            for key in set(table) - live:
                del table[key]
        self.notes.forget(live)
        self._behind &= live
        self.context.paces.forget(live)
        for log_key in set(self._positions) - paths:  # a log no longer read (gone, or past the newest) is forgotten
            del self._positions[log_key]
            self._steps.pop(log_key, None)
            self._near.pop(log_key, None)
        for log_key in set(self._first) - paths:
            del self._first[log_key]
        for path in set(self._earlier) - {path for _, path in paths}:  # kept while a job here names the log
            del self._earlier[path]

    def _save(self) -> None:
        # per job: {job key: {path: position}}; beside them, a position saved by a version before that (a path, never
        # a job key, and a list), kept until no job here names its log
        saved: dict[str, Any] = {path: pos.to_list() for path, pos in self._earlier.items()}
        for (key, path), pos in self._positions.items():
            saved.setdefault(key, {})[path] = pos.to_list()
        self.save_state(POSITIONS_KEY, saved)
        self.save_state(FINDINGS_KEY, self._findings)
        self.save_state(COLLECTIVES_KEY, self._collectives)
        self.save_state(LIVES_KEY, self._lives)

    def _life(self, job: Job, stale: bool) -> bool:
        """Whether the job's logs are read now. A new life (the restart count changed: requeued) drops what the
        earlier one left; a job back on this node whose record has not come yet (its life unknown) waits for it
        (a second, usually), unless the controller is not answering: then it is read as the life last known."""
        if job.restarts is None:
            # A job new to this node is read at once, unless its record is on its way (a second, usually): it may be
            # a requeued job's later life, whose appended log holds the earlier lives' lines (read() reads those
            # from the end only once the life is known)
            return (job.key not in self._lives and not job.extra.get("record_pending")) or stale
        before = self._lives.get(job.key)
        self._lives[job.key] = job.restarts
        if before is not None and before != job.restarts:
            dropped = len(self._findings.get(job.key, []))
            for table in (self._findings, self._nan_streaks, self._counts, self._collectives, self._stalls,
                          self._beat_steps, self._pending_assert):
                table.pop(job.key, None)
            log.info("job requeued: findings of its earlier life dropped",
                     extra=kv(job=job.key, life=job.restarts, earlier=before, findings=dropped))
        return True

    def clear(self, subject: str, at: float) -> None:
        """The job's findings so far are dealt with: only what its logs say from now on counts."""
        self._drop(subject)
        self.save_state(FINDINGS_KEY, self._findings)
        self.save_state(COLLECTIVES_KEY, self._collectives)

    def _drop(self, key: str) -> int:
        """Forget what the job's logs said so far; how many findings that was. The NaN streaks are emptied in place:
        a scan under way holds them."""
        dropped = len(self._findings.get(key, []))
        for table in (self._findings, self._counts, self._collectives, self._stalls, self._pending_assert):
            table.pop(key, None)
        self._nan_streaks.get(key, {}).clear()
        self._dropped[key] = self.context.clock()
        return dropped

    def _look(self, job: Job, logs: Sequence[str]) -> None:
        """Note where a SLURM job's logs end when this node first hears of the job (its life known or on its way),
        before it has written much: what lies before is another job's or an earlier life's (`_read`)."""
        if job.restarts is None and not job.extra.get("record_pending"):
            return  # not a SLURM job whose start this node knows: read whole, as before
        now = self.context.clock()
        for path in logs:
            key = (job.key, path)
            if key not in self._positions and key not in self._first and path not in self._earlier:
                try:
                    self._first[key] = (look(self.identity(job), path), now)
                except OSError as exc:  # its read says so (UNKNOWN for this job); without a look it is read whole
                    log.debug("log not looked at", extra=kv(job=job.key, log=path, error=exc))

    def _read(self, job: Job, path: str, limit: int, deadline: Deadline = NO_DEADLINE) -> tuple[bool, LogTail]:
        """Read on in one of the job's logs, `limit` bytes at most: whether the relaunch loop said there that it
        started the job again, and the tail (what it read, what it left)."""
        key = (job.key, path)
        position = self._positions.get(key)
        if position is None and (earlier := self._earlier.get(path)) is not None:
            position = replace(earlier)  # a copy: each job moves on from it alone
        older = begin = None
        cut = False
        seen, looked = self._first.get(key, (None, 0.0))
        if position is None and job.restarts is not None and job.start_time:
            # The first read of a log of a SLURM job new to this node: lines written before the job started are
            # another job's, or an earlier life's (`--open-mode=append`), dealt with then. A log not written since
            # the start when looked at is read from there (one looked at later, from its end); a later life's StdOut
            # or StdErr looked at soon after its start, from there too (the module's docstring). Else from its start.
            older = job.start_time - CLOCK_SKEW
            if seen is not None and seen.mtime < older:
                begin = seen
            elif seen is not None and job.restarts and path in job.log_paths and looked - job.start_time <= EARLY_S:
                begin, cut = seen, True  # the life may have written there before the look: its line's rest is not read
        tail = LogTail(path, self.identity(job), position, int(self.settings.max_line), older, begin, cut)
        streaks = self._nan_streaks.setdefault(job.key, {})
        try:
            return self._scan(job, path, tail, streaks, limit, deadline), tail
        finally:  # the reader moved past each chunk before handing it over: what failed is not read again
            if tail.position is not None:
                self._positions[key] = tail.position
                self._first.pop(key, None)

    def _after_restart(self, key: str, restarted: list[str], several: bool) -> None:
        """The loop's line was read in `restarted` this round. Lines of the job's other logs read this round have no
        order against it; they are taken as the earlier start's (the cancelled ranks' errors come right then), at the
        cost of a new start's error in another file within the same round."""
        mine = tuple(f"{path}|" for path in restarted)
        if key in self._findings:
            self._findings[key] = [f for f in self._findings[key] if f.get("path") in restarted]
        streaks = self._nan_streaks.get(key, {})
        for other in [k for k in streaks if not k.startswith(mine)]:
            del streaks[other]
        if several:  # the collectives seen in them this round too (not kept per file): later lines rebuild them
            self._collectives.pop(key, None)
            self._stalls.pop(key, None)

    def _scan(self, job: Job, path: str, tail: LogTail, streaks: dict[str, int], limit: int,
              deadline: Deadline) -> bool:
        restarted_here = False
        for chunk in tail.read(limit):
            deadline.check()  # between chunks: the reader has moved past the chunks before, which are not read again
            base = (tail.position.offset if tail.position is not None else len(chunk)) - len(chunk)
            since = 0  # end of the last NaN line in this chunk: a finite loss after it ends the streak
            consumed = -1  # end of the last line a wrapped message was joined up to: its continuations are read
            restarted = relaunched(chunk)
            if restarted >= 0:
                # Restarted in place by its relaunch loop: what the log said before is the earlier start's. The node
                # whose agent ran the restart forgets it anyway; every other node of the job reads this line too.
                dropped = self._drop(job.key)
                restarted_here = True
                since = consumed = restarted - 1  # the lines before it are not read for this start
                log.info("job restarted in place: findings of its earlier start dropped",
                         extra=kv(job=job.key, log=path, findings=dropped))
            for hit in self.scanner.scan(chunk):
                if hit.offset <= consumed:
                    continue
                if hit.signature.name == "nan_loss":
                    self._end_streaks(streaks, path, chunk, since, hit.offset)
                    key = f"{path}|{plain(hit.line).rank}"
                    streaks[key] = streaks.get(key, 0) + 1
                    since = hit.offset + 1
                consumed = max(consumed, self._record(job, path, hit, chunk, base))
            self._end_streaks(streaks, path, chunk, since, len(chunk))
            self._mark_steps(job, path, chunk)
        return restarted_here

    def _mark_steps(self, job: Job, path: str, chunk: bytes) -> None:
        """The last step line of the chunk (an OOM's step), and each rank's, with when it was printed (else read), to
        the job_pace check (`CheckContext.paces`)."""
        marks = step_marks(chunk)
        if not marks:
            return
        now = self.context.clock()
        for rank, (step, printed) in marks.items():
            self.context.paces.record(job.key, f"{path}|{rank or ''}", step, printed if printed is not None else now)
        if (last := last_step(chunk)) is not None:
            self._steps[(job.key, path)] = last

    @staticmethod
    def _end_streaks(streaks: dict[str, int], path: str, data: bytes, start: int, end: int) -> None:
        mine = [k for k in streaks if k.startswith(path + "|")]
        if mine and finite_loss(data, data.find(b"\n", start) + 1 if start else 0, end):
            for key in mine:
                del streaks[key]

    def _heartbeat_loss(self, job: Job) -> None:
        """A NaN/Inf loss in the trainer's heartbeat counts as a NaN line; each new step is one more in a row."""
        beat = heartbeat_path(job)
        if beat and job.restarts and job.start_time and _written(beat, self.identity(job)) < job.start_time:
            return  # left by an earlier life of the requeued job (its NaN is not this life's)
        step, metrics = read_heartbeat(beat, self.identity(job)) if beat else (None, {})
        loss = metrics.get("loss")
        if step is None or loss is None or self._beat_steps.get(job.key) == step:
            return
        self._beat_steps[job.key] = step
        streaks = self._nan_streaks.setdefault(job.key, {})
        if isinstance(loss, str) and loss.lower().lstrip("+-") in ("nan", "inf", "infinity"):
            streaks["heartbeat"] = streaks.get("heartbeat", 0) + 1
            nan = next(s for s in self.scanner.signatures if s.name == "nan_loss")
            self._record(job, str(beat), Hit(nan, f"heartbeat step {step}: loss={loss}", 0), b"")
        else:
            streaks.pop("heartbeat", None)

    def _exit(self, job: Job, logs: Sequence[str]) -> None:
        """A job that ended with a non-zero exit: one finding with the code and the final exception in its logs."""
        code = job.exit_code or ""
        kept = self._findings.setdefault(job.key, [])
        if job.active or not code or set(code.replace(":", "")) == {"0"} or any(f["signature"] == "exit" for f in kept):
            return
        crash = next((f for f in reversed(kept) if f["signature"] == "traceback"), None)
        exc = crash["exception"] if crash and crash.get("exception") else None
        for path in logs if exc is None else ():
            exc = last_exception(path, self.identity(job)) or exc
        title = f"the job ended {job.state} with exit code {code}" + (f": {exc}" if exc else "")
        kept.append({"signature": "exit", "rank": None, "path": None, "at": self.context.clock(), "line": exc or "",
                     "status": Status.CRITICAL.name, "title": title, "exit_code": code, "n": 1 << 30,
                     "advice": "read the end of the job's log; the final exception says what failed" if exc else
                     "no exception in the log: look for the OOM killer (dmesg), a signal, or the scheduler's reason"})

    def _remember_ranks(self, job: Job) -> None:
        """Tell the node's kernel notes the job's processes, their ranks and parents while they live: a kill, read
        after the process is gone, is then told as that rank's (or as its worker's)."""
        if self.kernel is None:
            return
        known, table = self.notes.known_pids(job.key), self.context.processes.get()
        new = [pid for pid in job_pids(job, table) if pid not in known][:NEW_RANKS]
        if new:
            self.notes.remember(job.key, job.name, {pid: JobProcess.read(table.procs[pid], self.context.proc) for pid in new})

    def _kernel_kills(self, job: Job) -> None:
        """The kernel OOM killer's kills of the job's processes (since its start, and since its findings were last
        dropped), as findings: which rank, which memory (the host's or its cgroup's limit), when."""
        if self.kernel is None:
            return
        since = max((job.start_time or 0.0) - CLOCK_SKEW, self._dropped.get(job.key, 0.0))
        kept = self._findings.setdefault(job.key, [])
        first = self.context.xid_history.first_start
        for kill in self.notes.kills(job.key, job.job_id, since=since):
            old = next((f for f in kept if f["signature"] == "oom_kill" and f["fields"]["pid"] == kill.pid), None)
            finding = _oom_kill(kill, self._launcher_rank(kept, kill), first is not None and first.before(kill.seq,
                                                                                                         kill.usec))
            if old is not None:
                old.update({k: v for k, v in finding.items() if k != "n"})
            elif sum(f["signature"] == "oom_kill" for f in kept) < MAX_PER_SIGNATURE:
                kept.append(finding)

    @staticmethod
    def _launcher_rank(kept: list[dict[str, Any]], kill: OomKill) -> str | None:
        """The rank torchrun named for the killed pid (`failed (exitcode: -9) local_rank: 3 (pid: 812917)`)."""
        if kill.rank is not None:
            return None
        fields = next((f.get("fields") or {} for f in kept if f["signature"] == "launcher"
                       and (f.get("fields") or {}).get("pid") == kill.pid), {})
        rank, local = fields.get("rank"), fields.get("local_rank")
        return f"rank {rank}" if rank is not None else f"local rank {local}" if local is not None else None

    def _record(self, job: Job, path: str, hit: Hit, data: bytes, base: int = 0) -> int:
        """Record one hit as a finding of the job; returns the end of the bytes it read (past its line when the
        message was wrapped over the next lines), -1 for its own line."""
        name = hit.signature.name
        counts = self._counts.setdefault(job.key, {})
        counts[name] = counts.get(name, 0) + 1
        line, consumed = hit.line, -1
        if name == "nccl_timeout" and _unparsed_timeout(line):  # wrapped by a terminal or a paste: join it back
            end = data.find(b"\n", hit.offset)
            joined = unwrap(data, len(data) if end < 0 else end, lambda t: not _unparsed_timeout(t))
            if joined is not None:
                line, consumed = joined
        p = plain(line)
        now = self.context.clock()
        finding: dict[str, Any] = {"signature": name, "rank": p.rank, "path": path, "at": now, "line": p.text[:500],
                                   "status": hit.signature.status.name, "ts": timestamp(line), "pos": base + hit.offset}
        if name in _COLLECTIVE:
            for obs in observe_all(line):
                gather(self._collectives.setdefault(job.key, {}), obs)
        if name in ("nccl_timeout", "nccl_error", "nan_loss"):
            end = data.find(b"\n", hit.offset)
            finding["step"] = (self._flood_step(job, path, data, len(data) if end < 0 else end, base) if data
                               else last_step(line.encode()))  # the heartbeat's NaN says its step
        tell = self._TELL.get(name)
        if tell is not None and not tell(self, _Seen(job, hit, data, line, p.text, counts[name]), finding):
            return consumed
        if tell is None:
            finding.update(title=f"{name}: {p.text[:200]}", advice=hit.signature.advice)
        xids = self._xids_near(now)
        if xids and name in ("cuda_error", "nccl_timeout", "cuda_oom", "collective_failure", "nccl_error"):
            finding["xids"] = xids
        finding["n"] = sum(counts.values())  # the order read, for findings without a timestamp
        self._keep(self._findings.setdefault(job.key, []), finding)
        return consumed

    # What each signature's line says, into its finding; False: no finding of its own (yet)
    def _device_assert(self, s: _Seen, finding: dict[str, Any]) -> bool:
        if not self._assert_after(s.job.key, s.text, finding["rank"]):  # printed before or after the error
            self._pending_assert[s.job.key] = s.text
        return False

    def _fp16_overflow(self, s: _Seen, finding: dict[str, Any]) -> bool:
        finding.update(status=Status.WARNING.name, title=f"{s.count} fp16 overflow steps skipped",
                       advice="a long run of loss-scale overflows means divergence: lower the learning rate or use bf16")
        return s.count == self.settings.overflow_burst

    def _cuda_oom(self, s: _Seen, finding: dict[str, Any]) -> bool:
        finding.update(self._oom(s.job, finding["path"], s.hit, s.data, s.text))
        if finding["fields"].get("diagnosis") == IMPOSSIBLE:
            finding["tier"] = KNOCK_ON
        if _CAUGHT.search(s.text, 0, max(0, s.text.find("out of memory"))):  # the trainer caught it and went on
            finding.update(status=Status.WARNING.name,
                           title=finding["title"] + "; caught and logged as a warning (training went on)")
        return True

    def _nccl_progress(self, s: _Seen, finding: dict[str, Any]) -> bool:
        """The story tells it across ranks; alone, it says which work failed."""
        obs = observe(s.line)
        if obs is not None:
            finding.update(title=f"NCCL work #{obs.seq} failed or timed out on rank {obs.rank} (last completed "
                                 f"#{obs.completed})", advice=ADVICE, fields={"seq": obs.seq, "rank": obs.rank},
                           tier=ECHO)
        return obs is not None

    def _nccl_timeout(self, s: _Seen, finding: dict[str, Any]) -> bool:
        d = diagnose_nccl(s.text)
        finding.update(title=d.title, advice=d.advice, fields=d.fields)
        return True

    def _nccl_error(self, s: _Seen, finding: dict[str, Any]) -> bool:
        wrapper = self._wrapper(s.job.key, finding["path"], finding["pos"])
        if wrapper is not None and _NCCL_CLASS_LINE.search(s.text):  # the class line of the error above
            return False
        e = diagnose_nccl_error(s.text)
        # a peer gone (a socket it closed, a flushed IB completion) is an echo, but one that names the peer: over a
        # bare echo or a traceback cut before its exception, under what failed on some rank
        tier = (GENERIC if e.kind in NETWORK else ECHO) if e.effect else CAUSE
        finding.update(title=e.title, advice=e.advice, fields={"class": e.kind, **e.fields}, tier=tier)
        if (wrapper is not None and e.kind in NETWORK and wrapper["fields"]["class"] in _GENERIC_NCCL
                and wrapper.get("rank") in (finding["rank"], None)):
            # PyTorch's generic error, then NCCL's `Last error:`, the network plugin's own: one error, told by it
            wrapper.update({k: finding[k] for k in ("title", "advice", "fields", "tier")})
            return False
        step = finding["step"]
        if e.kind == "system" and not e.fields.get("mid_run") and step and step > self.settings.warmup_steps:
            finding.update(title=f"{e.title}, mid-run", advice=MID_RUN)  # the run had been working: not setup
        return True

    def _launcher(self, s: _Seen, finding: dict[str, Any]) -> bool:
        cause = root_cause(s.data[s.hit.offset:s.hit.offset + BLOCK].decode("utf-8", errors="replace"))
        if cause is not None:
            # a signal says more than the rank's own traceback does; an exit code says less (read its exception)
            finding.update(title=cause.title, advice=cause.advice, fields=cause.fields,
                           rank=str(cause.rank) if cause.rank is not None else finding["rank"],
                           tier=END if cause.fields["signal"] is not None else GENERIC)
        return cause is not None

    def _collective_failure(self, s: _Seen, finding: dict[str, Any]) -> bool:
        obs = observe(s.line)
        finding.update(title=f"collective failure: {s.text[:200]}", advice=ADVICE,
                       fields={"rank": obs.rank if obs else None})
        return True

    def _cuda_error(self, s: _Seen, finding: dict[str, Any]) -> bool:
        d = diagnose_cuda(s.text, self._pending_assert.pop(s.job.key, None))
        finding.update(title=d.title, advice=d.advice, fields=d.fields, hardware=d.hardware)
        return True

    def _nan_loss(self, s: _Seen, finding: dict[str, Any]) -> bool:
        row = max(self._nan_streaks.get(s.job.key, {}).values(), default=1)
        collapsed = "; the loss collapsed to 0" if _ZERO_LOSS.search(s.text) else ""
        what = "NaN/Inf grad norm" if _NAN_NORM.search(s.text) and not _NAN_LOSS.search(s.text) else "NaN/Inf loss"
        at = f" at step {finding['step']}" if finding["step"] is not None else ""
        finding.update(status=(Status.CRITICAL if row >= self.settings.nan_limit else Status.WARNING).name,
                       in_a_row=row, title=f"{what}, {row} in a row ({s.count} in all){at}: divergence{collapsed}",
                       advice=s.hit.signature.advice)
        return True

    def _traceback(self, s: _Seen, finding: dict[str, Any]) -> bool:
        exc = final_exception(s.data, s.hit.offset)
        # an NCCL error raised to Python is told by its own finding (that line is one), with what NCCL said after it
        tier = (ECHO if NCCL_ERROR.search(exc) else END) if exc else GENERIC
        finding.update(title=f"the job crashed: {exc or 'Python traceback'}", exception=exc,
                       advice="read the traceback in the log; the final exception says what failed", tier=tier)
        return exc is None or "ChildFailedError" not in exc  # the launcher's own: its root cause is the failure

    _TELL: ClassVar[dict[str, Callable[[TrainingLogCheck, _Seen, dict[str, Any]], bool]]] = {
        "device_assert": _device_assert, "fp16_overflow": _fp16_overflow, "cuda_oom": _cuda_oom,
        "nccl_progress": _nccl_progress, "nccl_timeout": _nccl_timeout, "nccl_error": _nccl_error,
        "launcher": _launcher, "collective_failure": _collective_failure, "cuda_error": _cuda_error,
        "nan_loss": _nan_loss, "traceback": _traceback}

    @staticmethod
    def _keep(kept: list[dict[str, Any]], finding: dict[str, Any]) -> None:
        """Add a finding: one running entry for NaN losses, a count for a repeat of the same line's meaning on the
        same rank, and at most MAX_PER_SIGNATURE of one signature (the first ones: the earliest explain)."""
        name = finding["signature"]
        if name == "nan_loss":
            kept[:] = [f for f in kept if f["signature"] != "nan_loss"]
        same = next((f for f in kept if f["signature"] == name and _meaning(f) == _meaning(finding)
                     and f.get("rank") in (finding.get("rank"), None)), None)
        if same is not None:
            # the same error told again with its rank (a CUDA error, then the `[Rank 1]` watchdog line about it)
            same["rank"] = same.get("rank") or finding.get("rank")
            same["count"] = same.get("count", 1) + 1
        elif sum(f["signature"] == name for f in kept) < MAX_PER_SIGNATURE:
            kept.append(finding)

    def _assert_after(self, key: str, text: str, rank: str | None) -> bool:
        """A device-side assertion printed after its CUDA error (and the watchdog's lines about it): told in those
        errors' findings; whether there were any."""
        crashes = [f for f in self._findings.get(key, []) if f["signature"] == "cuda_error"
                   and (f.get("fields") or {}).get("error") == "device-side assert" and "condition" not in f["fields"]]
        for crash in crashes:
            d = diagnose_cuda(crash["line"], text)
            crash.update(title=d.title, advice=d.advice, fields=d.fields, rank=crash.get("rank") or rank)
        return bool(crashes)

    def _wrapper(self, key: str, path: str, pos: int, window: int = 2048) -> dict[str, Any] | None:
        """The NCCL error finding of the job read just before `pos` in the same log (the error this line goes on
        telling), or None."""
        return next((f for f in reversed(self._findings.get(key, [])) if f["signature"] == "nccl_error"
                     and f.get("path") == path and 0 < pos - int(f.get("pos", -1)) <= window), None)

    def _oom(self, job: Job, path: str, hit: Hit, data: bytes, text: str) -> dict[str, Any]:
        """The OOM's diagnosis, with what NVML knows of that GPU now and the step it came at."""
        report = parse_oom(text)
        pids = {p.pid for p in job_processes(job)}
        gpu = oom_gpu(self.nvml, report.gpu, pids, self.context.user_names, self.context.proc, self._job_of_pid)
        # the job's own processes, whatever they hold, are its ranks, not co-tenants
        mine = replace(gpu or GpuContext(), own_pids=frozenset(pids), user=job.user)
        rule, facts = classify(report, mine)
        d = explain(report, rule, facts)
        step = self._step_at(job, path, data, hit.offset)
        when = ("step unknown" if step is None else f"at step {step}: static sizing (first steps)"
                if step <= self.settings.warmup_steps else f"mid-run at step {step}: a growing working set "
                "or progressive fragmentation")
        title = d.title
        if gpu is not None and gpu.index is not None and gpu.index != report.gpu:
            title += f" (GPU {gpu.index} on this node)"
        return {"title": f"{title}; {when}", "advice": d.advice, "fields": d.fields, "step": step,
                "gpu": _gpu_dict(gpu), "hardware": d.hardware}

    def _job_of_pid(self, pid: int) -> str | None:
        """The label of the job a pid on this node belongs to (co-tenants of an OOMed GPU), None for none."""
        view = self.context.jobs.cached() if self.context.jobs is not None else None
        for other in view.on_node() if view is not None else ():
            if any(p.pid == pid for p in job_processes(other)):
                return other.label()
        return None

    def _flood_step(self, job: Job, path: str, data: bytes, end: int, base: int) -> int | None:
        """The step of a line that comes in floods (NaN losses, every rank's timeout): the last step line before
        `end` (data[end] is at `base + end` in the log), else the log's last step read. Each byte is searched once
        however many such lines follow: the search goes on from where the one before stopped."""
        done, step = self._near.get((job.key, path), (-1, None))
        if done - base < end - STEP_WINDOW:  # what was found before is too far back
            step = None
        if (found := last_step(data, end, done - base)) is not None:
            step = found
        self._near[(job.key, path)] = (base + end, step)
        return step if step is not None else self._steps.get((job.key, path))

    def _step_at(self, job: Job, path: str, data: bytes, end: int) -> int | None:
        """The step a finding came at: the last step line before `end`, else the log's last step read, else the
        heartbeat's step."""
        step = last_step(data, end) if data else None
        if step is None:
            step = self._steps.get((job.key, path))
        if step is None and (beat := heartbeat_path(job)):
            step = read_heartbeat(beat, self.identity(job))[0]
        return step

    def _story(self, job: Job) -> Story | None:
        """The job's collective failure told once, cross-checked with the ranks' flight recorders: read when the
        record grew (a new timeout), not every run."""
        record = self._collectives.get(job.key)
        if not record:
            return None
        size = sum(len(v) for v in record.values() if isinstance(v, dict))
        read_at, stall = self._stalls.get(job.key, (-1, None))
        if self.settings.flight_recorder and size != read_at:
            stall = analyze(flight_traces(job, job_processes(job), self.settings.flight_recorder_dumps,
                                          self.context.node, 5.0, self.context.proc))
            self._stalls[job.key] = (size, stall)
        return tell(record, stall)

    def _xids_near(self, when: float, window: float = 120.0) -> list[str]:
        """XIDs the kernel log reported on this node within `window` (as the xid check recorded them)."""
        return [f"XID {e.xid} on {e.bus_id}" for e in self.context.xid_history.entries() if abs(e.last - when) <= window]

    def _result(self, job: Job, notes: Sequence[str] = (), behind: int = 0) -> Result:
        """The job's result: its lead finding told (`_tell`), and what its budgets left unread (`notes`: its globs'
        files not read; `behind`: bytes of its logs not read yet)."""
        findings = self._findings.get(job.key, [])
        labels = {"job_id": job.job_id or job.name, "name": job.name}
        status, text, details = (self._tell(job, findings) if findings else
                                 (Status.OK, f"{job.label()}: no known failure in its logs", {"job_key": job.key}))
        if behind:
            text += (f"; its logs are behind: {format_bytes(behind)} not read yet (at most "
                     f"{format_bytes(self.settings.job_read_limit)} a run; read on next run)")
            details["behind_bytes"] = behind
        if notes:
            details["logs"] = list(notes)
        return self.result(job.key, status, text, details, [FINDINGS(len(findings), labels)])

    def _tell(self, job: Job, findings: list[dict[str, Any]]) -> tuple[Status, str, dict[str, Any]]:
        """The job's status, summary and details from its findings: the lead one (cause before echo) tells it."""
        status = worst(Status[f["status"]] for f in findings)
        late = _knock_ons(findings)
        tiers = [KNOCK_ON if i in late else _tier(f) for i, f in enumerate(findings)]
        lead_at = min(range(len(findings)), key=lambda i: (-Status[findings[i]["status"]].severity, tiers[i],
                                                             _when(findings[i])))
        lead = findings[lead_at]
        if lead_at in late:
            lead = {**lead, "title": lead["title"] + " (after a collective failure: its knock-on)"}
        rank = f" (rank {lead['rank']})" if lead.get("rank") is not None else ""
        text = f"{job.label()}{rank}: {lead['title']}"
        if lead.get("step") is not None and "step" not in lead["title"]:
            text += f" at step {lead['step']}"
        story = self._story(job)
        if story is not None and tiers[lead_at] in (ECHO, KNOCK_ON) and lead["signature"] != "nccl_error":
            step = next((f["step"] for f in findings if f["signature"] in _COLLECTIVE and f.get("step") is not None),
                        None)
            text = f"{job.label()}: {story.title}" + (f"; at step {step}" if step is not None else "")
            lead = {**lead, "advice": story.advice}
        elif story is not None:  # the lead is the cause; the collective that timed out after it is its echo
            text += f"; then {story.echo}"
        aborts = [f for i, f in enumerate(findings) if i in late and i != lead_at and _aborted(f)]
        if aborts:  # the effect, after its cause
            text += f"; then the watchdog's abort: {aborts[0]['title']}"
        if lead.get("xids"):
            text += f"; on this node meanwhile: {', '.join(lead['xids'][:3])}"
        if lead.get("advice"):
            text += f" — {lead['advice']}"
        details = {"job_key": job.key, "findings": sorted(findings, key=_when), "next_step": lead.get("advice") or None,
                   "collectives": story.fields if story else None,
                   **{k: v for k, v in job_fields(job).items() if k in ("job_id", "name")}}
        return status, text, details
