"""The check interface: a small class with a name, validated settings and `run()` returning results; `CheckIdle`, which a
check raises when what it watches is absent from this node; and the two family base classes, JobCheck (checks over the
jobs on this node) and NvmlCheck (checks over the GPUs)."""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from trainguard.core.budget import NO_DEADLINE, Deadline, OverBudgetError
from trainguard.core.events import Event
from trainguard.core.logs import kv
from trainguard.core.model import Metric, Result, Sample, Status
from trainguard.core.pace import PaceLedger
from trainguard.core.settings import Duration, Field, PositiveInt, SettingsModel, field_validator
from trainguard.core.state import ScopedState
from trainguard.gpu.faults import XidLedger
from trainguard.gpu.nvml import GpuState, Nvml, NvmlUnavailableError, Reading
from trainguard.jobs.catalog import JobCatalog, JobView
from trainguard.jobs.kernelnotes import KernelNotes
from trainguard.jobs.model import Job
from trainguard.jobs.settings import MAX_LOG_ENTRIES, MAX_LOG_FILES
from trainguard.jobs.tree import LogFiles, job_log_files
from trainguard.node.access import NOBODY, Identity
from trainguard.node.kmsg import KernelLog
from trainguard.node.procfs import ProcFS
from trainguard.node.proctable import ProcessSnapshots
from trainguard.node.users import UserNames

log = logging.getLogger("trainguard.checks")

T = TypeVar("T")
V = TypeVar("V")


class ActionBinding(SettingsModel):
    """Which named actions run when an incident of this check fires at (or escalates to) a status."""

    warning: list[str] = Field(default_factory=list)
    critical: list[str] = Field(default_factory=list)
    resolved: list[str] = Field(default_factory=list, description="Run when the incident resolves, e.g. resume.")

    def for_status(self, status: Status) -> list[str]:
        return {Status.WARNING: self.warning, Status.CRITICAL: self.critical}.get(status, [])


def same_as_actions(value: object) -> object:
    """An alternative binding (`fs_actions`, `batch_host_actions`) written `"actions"`: None, the check's own
    `actions` (TOML has no null, and a site file that set one must be able to set it back)."""
    return None if value == "actions" else value


class CheckIdle(Exception):  # noqa: N818 - an outcome, not an error
    """Raised by `run()` when the hardware the check watches is absent from this node (no NVML on a CPU-only node, no
    InfiniBand device): the run is `idle`, not a failure. The runner logs it once, the check opens no incident and
    raises no alert (it reports no result), and `trainguard_check_idle{check}` is 1. A check raises it only when the
    hardware was never expected here: hardware that vanished, or that the config names, is a fault to report."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class PartialView(list[Result]):
    """What `run()` returns when it saw only part of what it watches (the kernel log still being replayed at start, a
    ledger that had to drop entries): the results it holds count as usual, but a subject it does not report is not
    taken as gone (the run is not `complete`, so its incident stays as it was). `reason` says what is missing."""

    def __init__(self, results: Sequence[Result], reason: str) -> None:
        super().__init__(results)
        self.reason = reason


MIN_INTERVAL = 0.01  # seconds: the shortest interval a check may have (the schedule refuses less too)


class CheckSettings(SettingsModel):
    """Settings every check has: its schedule, its time budget and its incident policy."""

    type: str | None = Field(None, description="Check type; defaults to the table name.")
    enabled: bool = True
    interval: Duration = Field(30.0, gt=0, description="Time between runs.")
    timeout: Duration = Field(10.0, gt=0, description="A run still going after this is reported UNKNOWN.")
    jitter: Duration = Field(1.0, ge=0, description="Random delay added to each run, to spread load.")
    fire_after: Duration = Field(0.0, ge=0, description="How long a problem must last before its incident fires.")
    fire_after_runs: PositiveInt = Field(1, description="How many consecutive bad runs before its incident fires.")
    repeat_interval: Duration = Field(4 * 3600.0, gt=0, description="Reminder interval while an incident fires.")
    alert_on_unknown: bool = Field(True, description="Whether UNKNOWN (check broken, mount hung) opens incidents.")
    actions: ActionBinding = Field(default_factory=ActionBinding,
                                   description="Named actions run when an incident fires or escalates.")

    @field_validator("interval", check_fields=False)
    @classmethod
    def _not_a_spin(cls, value: float) -> float:
        # every check type's interval, also where a type declares its own default
        if value < MIN_INTERVAL:
            raise ValueError(f"at least {MIN_INTERVAL:g}s: a shorter interval would keep a core busy")
        return value


@dataclass(frozen=True)
class CheckContext:
    """What the engine hands each check: where it runs, and the node's sources and services, typed.

    `state` is this check instance's own store (keys scoped to its name). `xid_history` is the node's XID ledger
    this boot: the xid check records into it and other checks (training_log) read it. `processes` is the node's
    shared /proc snapshot: the checks of one round (job_memory, hang, gpu_memory, memory) share one pass.
    `kernel_log` is the node's one reader of the kernel log, shared by the xid and kernel checks; `kernel_notes`
    what it says that the job checks (training_log, job_liveness, hang) need, read through it. `paces`
    carries the step samples training_log reads in the jobs' logs to the job_pace check. `user_names` names the users
    of processes in summaries, each NSS lookup bounded, shared by the checks (one cache, one lookup per uid at a time).
    """

    node: str
    state_dir: Path
    clock: Callable[[], float] = time.time
    jobs: JobCatalog | None = None
    nvml: Nvml = field(default_factory=Nvml)
    proc: ProcFS = field(default_factory=ProcFS)
    state: ScopedState = field(default_factory=lambda: ScopedState(None, "check"))
    xid_history: XidLedger = field(default_factory=lambda: XidLedger(None))
    processes: ProcessSnapshots = field(default_factory=ProcessSnapshots)
    # The node's one kernel log reader: the xid and kernel checks subscribe to it (one follower, one cursor).
    kernel_log: KernelLog = field(default_factory=KernelLog)
    # What the kernel log says that the job checks need (OOM kills by pid, file systems not answering), fed by it
    kernel_notes: KernelNotes = field(default_factory=KernelNotes)
    paces: PaceLedger = field(default_factory=PaceLedger)
    user_names: UserNames = field(default_factory=UserNames)
    # `trainguard check --since`: kernel log records stamped before this (microseconds since boot) do not count.
    kernel_since_usec: int | None = None


class Check(ABC):
    """Subclasses set `Settings` and implement `run()`. They hold no alert state; the agent owns incidents."""

    Settings: ClassVar[type[CheckSettings]] = CheckSettings
    metrics: ClassVar[tuple[Metric, ...]] = ()  # every metric its results may carry (docs/metrics.md lists them)
    # What a fault it reports takes down, for grouping and inhibition across nodes (deploy/alertmanager): the node's
    # hardware (every job on it), one job, or the node's own resources.
    layer: ClassVar[Literal["hardware", "job", "node"]] = "node"
    # Who speaks for what it finds. "node": every node's agent alerts and acts on its own evidence (a GPU, a rank's
    # memory, this node's disks). "job": the finding is about a job as a whole (its log, its time limit, its stop
    # switch, its progress), which every node of a multi-node job sees alike: only the job's owner node (its BatchHost)
    # opens the incident and runs the bound actions; the others still run the check (metrics, stack dumps) silently.
    scope: ClassVar[Literal["job", "node"]] = "node"

    def __init__(self, name: str, settings: CheckSettings, context: CheckContext) -> None:
        self.name = name
        self.settings = settings
        self.context = context

    @abstractmethod
    def run(self) -> Sequence[Result]:
        """Gather, evaluate and summarize. May raise or block: the runner turns that into data."""

    def start(self, wake: Callable[[], None]) -> None:  # noqa: B027 - optional hook
        """Event-driven checks start their watchers here and call `wake()` to be run at once."""

    def stop(self) -> None:  # noqa: B027 - optional hook
        """Stop what `start` started."""

    def clear(self, subject: str, at: float) -> None:  # noqa: B027 - optional hook
        """An operator says the cause behind `subject` is fixed (`trainguard clear`): checks that keep a history
        (XIDs seen, log findings) forget what they recorded about it up to `at`, so it does not fire again."""

    def actions_for(self, event: Event) -> ActionBinding:
        """The actions bound to one of this check's events: its `actions`. A check whose results say what kind of
        fault they found (details the event carries) binds another lever to that kind: a hang whose ranks wait on a
        dead file system drains the node instead of restarting the job into the same mount."""
        return self.settings.actions

    def load_state(self, key: str) -> dict[str, Any]:
        """A JSON object this check saved (counters, positions); {} when absent or unreadable."""
        return self.context.state.load_json(key)

    def save_state(self, key: str, data: Mapping[str, Any]) -> bool:
        """Save what `load_state` reads back; whether it is saved. A failure is logged, never raised: state is only a
        head start."""
        return self.context.state.save_json(key, data)

    def result(
        self,
        subject: str,
        status: Status,
        summary: str,
        details: Mapping[str, Any] | None = None,
        samples: Sequence[Sample] = (),
    ) -> Result:
        return Result(self.name, subject, status, summary, details or {}, tuple(samples))


class JobCheck(Check):
    """Shared plumbing: the job view, one UNKNOWN per failed source instead of a crash, and each job's budget within a
    run: its share of the run's time (`budgets`), its log globs capped (`log_files`)."""

    layer = "job"
    # Of the check's timeout, the part its jobs share (`budgets`): the rest is the run's own (the view, saving state).
    RUN_SHARE = 0.8

    def __init__(self, name: str, settings: CheckSettings, context: CheckContext) -> None:
        super().__init__(name, settings, context)
        self._capped: dict[str, tuple[str, ...]] = {}  # job key -> its log globs the caps cut

    def budgets(self, jobs: Sequence[Job], share: float = RUN_SHARE) -> Iterator[tuple[Job, Deadline]]:
        """Each job with its deadline: an equal part of what is left of `share` of the check's timeout among the jobs
        not yet checked. A job done early leaves its time to those after it; a slow one costs its own part, and the
        others are still checked in the same run (`over_budget`)."""
        end = time.monotonic() + self.settings.timeout * share
        for i, job in enumerate(jobs):
            now = time.monotonic()
            part = max(0.0, end - now) / (len(jobs) - i)
            yield job, Deadline(now + part, part)
        keys = {job.key for job in jobs}
        for key in set(self._capped) - keys:
            del self._capped[key]

    def over_budget(self, job: Job, exc: OverBudgetError, what: str, known: Result | None = None) -> Result:
        """The result of a job whose `what` ("reading its logs") took longer than its budget: UNKNOWN, or what was
        `known` of it when that is worse (a finding already made stays), said either way."""
        said = f"{what} took longer than its budget of {exc.budget:.1f}s; the other jobs were checked"
        log.warning("a job went over its time budget", extra=kv(check=self.name, job=job.key, what=what,
                                                                 budget_s=round(exc.budget, 2)))
        if known is not None and known.status.severity > Status.UNKNOWN.severity:
            return self.result(known.subject, known.status, f"{known.summary}; {said}",
                               {**known.details, "over_budget": said}, known.samples)
        return self.result(job.key, Status.UNKNOWN, f"{job.label()}: {said}", {"job_key": job.key,
                                                                                "over_budget": said})

    def log_files(self, job: Job, patterns: Sequence[str] = (), deadline: Deadline = NO_DEADLINE) -> LogFiles:
        """The job's log files, its globs listed with its user's authority within the caps of `[jobs]`; what the caps
        left out is logged once per job and change."""
        jobs = self.context.jobs.settings if self.context.jobs is not None else None
        files = job_log_files(job, patterns, self.identity(job), jobs.max_log_files if jobs else MAX_LOG_FILES,
                              jobs.max_log_entries if jobs else MAX_LOG_ENTRIES, deadline)
        capped = tuple(files.capped)
        if self._capped.get(job.key, ()) != capped:
            self._capped[job.key] = capped
            if capped:
                log.warning("a job's log globs match more than is read", extra=kv(check=self.name, job=job.key,
                                                                                  logs="; ".join(files.notes)))
            else:
                log.info("a job's log globs are within their caps again", extra=kv(check=self.name, job=job.key))
        return files

    def view(self) -> JobView:
        if self.context.jobs is None:
            raise RuntimeError("no job source configured ([jobs] sources)")
        return self.context.jobs.view()

    def source_errors(self, view: JobView, sources: Sequence[str] | None = None) -> list[Result]:
        """One UNKNOWN per failed source (of `sources`; None: every source)."""
        return [self.result(f"source:{name}", Status.UNKNOWN, f"job source {name}: {error}", {"source": name})
                for name, error in view.errors.items() if sources is None or name in sources]

    def identity(self, job: Job) -> Identity:
        """The job's user: every file of the job is read with their authority, never the agent's."""
        return self.context.jobs.identities.of(job.uid) if self.context.jobs is not None else NOBODY

    @staticmethod
    def jobs_here(view: JobView, names: Sequence[str] = ()) -> list[Job]:
        """Jobs running on this node, only those named when `names` is given."""
        return [j for j in view.on_node() if not names or j.name in names]


class NvmlCheck(Check):
    """A check over NVML: idle on a node without it (no driver, no library): the runner says so once."""

    layer = "hardware"

    def __init__(self, name: str, settings: CheckSettings, context: CheckContext) -> None:
        super().__init__(name, settings, context)
        self.nvml = context.nvml

    def gpus(self) -> list[GpuState]:
        """The GPUs; CheckIdle with the reason when NVML can't be used on this node."""
        return self.nvml_read(self.nvml.gpus)

    @staticmethod
    def nvml_read(read: Callable[[], T]) -> T:
        """One of the gateway's reads; CheckIdle with the reason when NVML can't be used on this node."""
        try:
            return read()
        except NvmlUnavailableError as exc:
            raise CheckIdle(str(exc)) from None

    @staticmethod
    def gpu_labels(reading: Reading[Any]) -> dict[str, str]:
        return {"gpu": str(reading.gpu.index), "uuid": reading.gpu.uuid}

    @staticmethod
    def present(readings: list[Reading[V]]) -> list[Reading[V]]:
        """The readings of GPUs not lost. A lost GPU is the gpu check's CRITICAL: the checks over its links and
        settings would only add an UNKNOWN (and a notification) each to the same fault."""
        return [r for r in readings if not r.lost]

    def unanswered(self, reading: Reading[Any]) -> Result | None:
        """A GPU NVML answered with an error for this check: UNKNOWN naming it; None when it answered."""
        if reading.error is None:
            return None
        return self.result(reading.gpu.uuid or f"gpu{reading.gpu.index}", Status.UNKNOWN,
                           f"GPU {reading.gpu.index}: NVML error: {reading.error}",
                           {"index": reading.gpu.index, "uuid": reading.gpu.uuid})
