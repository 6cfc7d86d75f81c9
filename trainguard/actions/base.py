"""The action interface: named, configured responses to incident events, acting on jobs or the node."""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

from trainguard.core.events import Event
from trainguard.core.settings import Duration, Field, SettingsModel
from trainguard.jobs.model import Job
from trainguard.jobs.slurm import SlurmClient

if TYPE_CHECKING:
    from trainguard.actions.diag import DiagReport


class ActionSettings(SettingsModel):
    type: str | None = Field(None, description="Action type; defaults to the table name.")
    timeout: Duration = Field(30.0, gt=0, description="An action still running after this is reported as failed.")
    dry_run: bool = Field(False, description="Log what would be done instead of doing it.")
    repeat: bool = Field(False, description="Run again on escalations and reminders, not only once per incident.")


class ActionError(Exception):
    """The action could not do what it was asked; the message says what and why."""


class ActionRefusedError(ActionError):
    """The action chose not to act: a safety limit (the drain circuit breaker). The agent keeps a CRITICAL incident
    open while it stands, since the fault it answered is still there and nobody acted on it."""


class ActionSkippedError(ActionError):
    """Nothing to act on (no job on this node, not an array job, every process already gone, a node not drained):
    the action is skipped with this reason. An alert never says a skipped action was done, nor that it failed."""


class ActionAnsweredError(ActionSkippedError):
    """Skipped: another list's action did it for this incident too (one fault seen by two checks, or twice by one:
    two ports of one HCA), never said done twice. That action left the job starting afresh: the check forgets what it
    learned about the subject, as after its own `fresh_start` action."""


class Report(Protocol):
    """What an action that waits for the ranks reads of their report (trainguard.actions.savereport.SaveReport)."""

    at: float | None  # monotonic time the report was first seen

    def said(self, since: float, what: str) -> str: ...

    def close(self) -> None: ...


class ActionList:
    """One event's list of actions, run in order on one context: done once its last action returned."""

    def __init__(self) -> None:
        self.done = False  # under Reports' lock


class Reports:
    """The ranks' reports asked for on this agent, one per job, shared by every event's action list about it: one
    fault is often two incidents (a GPU off the bus: `xid` from the kernel log, `gpu` on its next poll), and one list
    must never withdraw what another waits for. The last list done with a report closes it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reports: dict[str, tuple[Report, set[ActionList]]] = {}

    def join(self, job_id: str, user: ActionList, make: Callable[[], Report]) -> Report | None:
        """The job's report under way, else a new one from `make()`; None once `user` is done (nothing would wait
        for it, and nothing would close it)."""
        with self._lock:
            if user.done:
                return None
            report, users = self._reports.get(job_id) or (None, set())
            if report is None:
                report = make()
            self._reports[job_id] = (report, users | {user})
            return report

    def get(self, job_id: str) -> Report | None:
        with self._lock:
            held = self._reports.get(job_id)
        return held[0] if held else None

    def held_by(self, user: ActionList) -> dict[str, Report]:
        """The reports `user`'s list asked for or joined, by job id."""
        with self._lock:
            return {job_id: report for job_id, (report, users) in self._reports.items() if user in users}

    def leave(self, job_id: str, user: ActionList) -> None:
        """`user`'s list is done with this job's report (a `restart` that made it): closed unless another holds it."""
        with self._lock:
            report, users = self._reports.get(job_id) or (None, set())
            if report is None or user not in users:
                return
            if users == {user}:
                del self._reports[job_id]
            else:
                self._reports[job_id] = (report, users - {user})
                report = None
        if report is not None:
            report.close()

    def release(self, user: ActionList) -> None:
        """`user`'s list is done: each report no other list holds is closed."""
        closing = []
        with self._lock:
            user.done = True
            for job_id, (report, users) in list(self._reports.items()):
                if user in users:
                    if users == {user}:
                        del self._reports[job_id]
                        closing.append(report)
                    else:
                        self._reports[job_id] = (report, users - {user})
        for report in closing:
            report.close()


@dataclass(eq=False)
class Claim:
    """An action on a job under way in one of this agent's lists, for the lists that come to the same job meanwhile:
    one fault is often several incidents, whose lists run at once, each in its own thread."""

    what: str  # what it does, in words for the others' reasons ("in place", "without n1")
    by: str  # the incident it answers, "check/subject"
    leave: str = ""  # the node it leaves ("" for none)
    ended: threading.Event = field(default_factory=threading.Event)
    error: ActionError | None = None  # why it failed or was skipped, once ended
    at: float = 0.0  # monotonic time it ended
    # when it ended on the agent's clock (ActionContext.clock, the incidents' `since`): a fault that began later is
    # not the one it answered (0.0 while under way)
    ended_at: float = 0.0


class Claims:
    """This agent's claims (the responder's, shared by its lists): per job, the actions under way and the last one
    done of each kind (what it leaves: one in place may end after one without the node that ran beside it); per name,
    one lock for an action whose look and act must not interleave with another list's (`drain`)."""

    KEEP_S = 3600.0  # a claim done is kept this long: longer than any `within` asked

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, list[Claim]] = {}  # key -> the claims under way, the last taken last
        self._last: dict[str, dict[str, Claim]] = {}  # key -> what it left ("" for none) -> the last one done
        self._serial: dict[str, threading.Lock] = {}

    def take(self, key: str, claim: Claim, within: float, answers: Callable[[Claim], bool]) -> Claim | None:
        """Hold `key` for `claim`, unless a claim under way on it (the last taken first), or one done less than
        `within` s ago (the newest first), `answers` it: that one is returned, and `claim` is not held. Taken beside
        one under way that does not answer it, `claim` is the first later lists ask; that one still answers them once
        `claim` ended (a restart without the node that failed leaves the one in place under way)."""
        with self._lock:
            for other in [*reversed(self._held.get(key, [])), *self._recent(key, within)]:
                if answers(other):
                    return other
            self._held.setdefault(key, []).append(claim)
            return None

    def last(self, key: str, within: float) -> Claim | None:
        """The last claim on `key` done (not failed) less than `within` s ago."""
        with self._lock:
            return next(iter(self._recent(key, within)), None)

    def _recent(self, key: str, within: float) -> list[Claim]:
        now = time.monotonic()
        return sorted((c for c in self._last.get(key, {}).values() if now - c.at < within), key=lambda c: -c.at)

    def end(self, key: str, claim: Claim, error: ActionError | None) -> None:
        claim.error, claim.at = error, time.monotonic()
        with self._lock:
            held = [c for c in self._held.get(key, []) if c is not claim]
            if held:
                self._held[key] = held
            else:
                self._held.pop(key, None)
            if error is None:
                self._last.setdefault(key, {})[claim.leave] = claim
            for old in [k for k, done in self._last.items()  # jobs long gone
                        if all(claim.at - c.at > self.KEEP_S for c in done.values())]:
                del self._last[old]
        claim.ended.set()

    def serial(self, name: str) -> threading.Lock:
        with self._lock:
            return self._serial.setdefault(name, threading.Lock())


class ResumeGate(Protocol):
    """What must hold before the `resume` action lifts a drain, asked in order after the node's other CRITICAL
    incidents. `check` returns (True, "") to let the resume go on, or (False, why) to keep the node drained: the
    resume is then skipped with `why` on the incident. Gates: the lemon hold (trainguard.pipeline.lemon.HoldGate);
    a repair's validation (run the configured diagnostics, pass or keep drained) plugs in here too. A gate may take
    as long as the resume action's `timeout` allows, and must not raise for a failing test (say so in `why`)."""

    name: str

    def check(self, ctx: ActionContext) -> tuple[bool, str]: ...


@dataclass(frozen=True)
class ActionContext:
    event: Event
    jobs: tuple[Job, ...]  # the jobs this incident concerns
    node: str  # this node's SLURM name
    slurm: SlurmClient
    clock: Callable[[], float]
    others_critical: tuple[str, ...] = ()  # other CRITICAL incidents firing on this node ("check/subject")
    slurmd: str = ""  # this node's slurmd by name where a host runs several (`jobs.slurm_node`); empty: the one
    # The ranks' reports asked for with a save signal (`signal`), for the actions after it that wait for the ranks
    # (`requeue`): the agent's, shared by its lists; this list's hold on them ends with done().
    reports: Reports = field(default_factory=Reports)
    actions: ActionList = field(default_factory=ActionList)
    claims: Claims = field(default_factory=Claims)  # the agent's, shared by its lists
    # What the `resume` action asks, in order, before it lifts a drain (ResumeGate): the lemon hold, then the
    # validation the site configured. Empty: none.
    resume_gates: tuple[ResumeGate, ...] = ()
    # A lemon rule holds the node (trainguard.pipeline.ledger): a drain gives this reason, whatever incident asked
    # for it, so that the node's SLURM reason says why it stays out (two drains at once would race otherwise).
    held_reason: str = ""
    # Where a diagnostics run's report goes, with what ran it (`action`, `resume`): the node ledger. None: nowhere.
    on_diag: Callable[[DiagReport, str], None] | None = None

    def done(self) -> None:
        """The event's actions are over: the reports this list asked for or joined served them."""
        self.reports.release(self.actions)


class Action(ABC):
    Settings: ClassVar[type[ActionSettings]] = ActionSettings
    needs_jobs: ClassVar[bool] = True
    # Done, it leaves the job starting afresh (restarted in place): the check forgets what it learned about the
    # incident's subject, so that the new start's own logs and samples decide whether the incident is over.
    fresh_start: ClassVar[bool] = False
    # It needs what only the controller's record of a SLURM job says (its switch dir, its nodes): a job listed before
    # that record came is waited for (trainguard.pipeline.responder.event_jobs).
    needs_record: ClassVar[bool] = False
    # Safe to run again when a stop or a crash of the agent cut it short while under way: its list is taken up from
    # it at the next start (trainguard.pipeline.responder). Not a signal (delivered, or the ranks would get it twice),
    # nor a restart (the relaunch loop may have started the job again already).
    resumes: ClassVar[bool] = False

    def __init__(self, name: str, settings: ActionSettings) -> None:
        self.name = name
        self.settings = settings

    @abstractmethod
    def plan(self, ctx: ActionContext) -> str:
        """What `run` would do, in words (the audit line, and all a dry run does)."""

    @abstractmethod
    def run(self, ctx: ActionContext) -> str:
        """Do it; return what was done, or raise ActionError."""


def slurm_jobs(ctx: ActionContext) -> list[Job]:
    return [j for j in ctx.jobs if j.source == "slurm" and j.job_id]


def each_job(jobs: Iterable[Job], act: Callable[[Job], str]) -> str:
    """`act` on every job, one after another: one job's failure never keeps another from its turn. Fails only when
    every job failed or was skipped and one failed; skipped when every job was skipped (nothing to act on), answered
    when every job was. An exception other than ActionError (a bug) ends it at once: the runner fails the action."""
    return _combined((job, _outcome(job, act)) for job in jobs)  # lazy: each job's turn as its outcome is asked


# One lane per job user: a user's jobs take their turns one after another in their own lane, the users' lanes at
# once. A node's users are few (its jobs are); past LANES, users share lanes in turn rather than a thread each.
LANES = 64


def each_job_at_once(jobs: Iterable[Job], act: Callable[[Job], str], lanes: int = LANES) -> str:
    """each_job, with each job user's jobs in a lane (a thread) of their own: an action that waits for a job's ranks
    (`restart`: up to `wait_exit` for ranks that may ignore the signal) makes only that user's later jobs wait, never
    another user's (however many jobs one user lists first). The outcomes are combined as each_job's, in the order
    the jobs were given. An exception other than ActionError (a bug) in one job's `act` is raised once every lane is
    over (the first in that order), and the runner fails the action, as with each_job. The lanes are joined without
    a deadline of their own: each job's turn is bounded by its own wait, and the responder stops waiting for the
    action at its `timeout` while this thread goes on (a thread cannot be stopped), as a turn of each_job did. Daemon
    threads, as the action's own: a stop of the agent never waits for them; a lane whose thread cannot start (the
    unit's TasksMax) runs here, after the others began."""
    given = list(jobs)
    by_user: dict[int | None, list[int]] = {}
    for index, job in enumerate(given):
        by_user.setdefault(job.uid, []).append(index)
    if len(by_user) < 2:  # one user: their jobs in turn, as each_job
        return each_job(given, act)
    shared: list[list[int]] = [[] for _ in range(min(max(1, lanes), len(by_user)))]
    for n, indices in enumerate(by_user.values()):
        shared[n % len(shared)].extend(indices)
    outcomes: list[str | ActionError] = [ActionError("ended without an outcome")] * len(given)
    bugs: dict[int, BaseException] = {}  # each lane writes its own jobs' entries

    def lane(indices: list[int]) -> None:
        for index in indices:
            try:
                outcomes[index] = _outcome(given[index], act)
            except BaseException as exc:  # noqa: BLE001 - raised again in the action's thread, below
                bugs[index] = exc

    started, inline = [], []
    for n, indices in enumerate(shared):
        thread = threading.Thread(target=lane, args=(indices,), name=f"job-lane-{n}", daemon=True)
        try:
            thread.start()
            started.append(thread)
        except RuntimeError:  # no thread to be had: this lane in the action's own thread
            inline.append(indices)
    for indices in inline:
        lane(indices)
    for thread in started:
        thread.join()
    if bugs:
        raise bugs[min(bugs)]
    return _combined(zip(given, outcomes, strict=True))


def _outcome(job: Job, act: Callable[[Job], str]) -> str | ActionError:
    """What `act` did for `job`, or the ActionError that says why it did not."""
    try:
        return act(job)
    except ActionError as exc:
        return exc


def _combined(outcomes: Iterable[tuple[Job, str | ActionError]]) -> str:
    """The jobs' outcomes in one (each_job's rules), or the error every job's outcome adds up to."""
    done, skipped, errors, answered = [], [], [], True
    for job, outcome in outcomes:
        if isinstance(outcome, ActionSkippedError):
            skipped.append(f"{job.label()}: {outcome}")
            answered = answered and isinstance(outcome, ActionAnsweredError)
        elif isinstance(outcome, ActionError):
            errors.append(f"{job.label()}: {outcome}")
        else:
            done.append(outcome)
    if errors and not done:
        raise ActionError("; ".join(errors + skipped))
    if not done:  # answered when each job was: another list's action did it
        raise (ActionAnsweredError if skipped and answered else ActionSkippedError)("; ".join(skipped) or "no job")
    return "; ".join(done + errors + skipped)
