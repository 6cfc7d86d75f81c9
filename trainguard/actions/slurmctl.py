"""Cluster actions through scontrol: drain and resume this node, requeue the job, hold or cancel pending array tasks."""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

from trainguard.actions.base import (
    Action,
    ActionContext,
    ActionError,
    ActionRefusedError,
    ActionSettings,
    ActionSkippedError,
    slurm_jobs,
)
from trainguard.actions.diag import LEVEL_HELP, DiagToolSettings, Level, reason_of, validate_before_resume
from trainguard.core.settings import Duration, Field, field_validator, model_validator
from trainguard.core.text import linear, one_line
from trainguard.jobs.model import Job
from trainguard.jobs.slurm import DRAIN_TAG, SlurmError, SlurmMissingError, parse_job_record

# A job in these states is back in the queue: requeued already (a job that ended, COMPLETED or FAILED, is requeued:
# a batch job that saved and exited comes back that way). Just after `scontrol requeue` it shows COMPLETING, as does
# a job ending by itself: only its Restarts= tells them apart then.
BACK_IN_QUEUE = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"})
T = TypeVar("T")


def drain_reason(summary: str) -> str:
    # scontrol passes the reason verbatim: one short printable line (a NUL would not even reach exec()).
    text = " ".join(one_line(summary).split()).replace('"', "'")
    return f"{DRAIN_TAG} {text}"[:200].rstrip()  # as the node table shows it: a drain compares it with that


def _slurm(call: str, fn: Callable[..., T], *args: object) -> T:
    try:
        return fn(*args)
    except SlurmMissingError as exc:  # a node without SLURM: nothing to drain or resume, and nothing failed
        raise ActionSkippedError(f"{call}: no SLURM on this node ({exc})") from None
    except SlurmError as exc:
        raise ActionError(f"{call}: {exc}") from None


_MAX_DRAINED = linear(r"^(\d{1,6})(%?)$")


class DrainSettings(ActionSettings):
    max_drained: str = Field("10%", description="Circuit breaker: the most nodes of this node's partitions that "
                                                "trainguard may hold drained at once, as a count (`4`) or a share "
                                                "(`10%`, at least one node). Beyond it the drain is refused and a "
                                                "CRITICAL incident says so: a bad driver rollout or a shared fault "
                                                "must not take a partition down node by node.")

    @field_validator("max_drained")
    @classmethod
    def _limit(cls, value: str) -> str:
        if not _MAX_DRAINED.match(value.strip()):
            raise ValueError(f"max_drained {value!r}: expected a count (e.g. 4) or a percentage (e.g. '10%')")
        return value.strip()

    def limit(self, nodes: int) -> int:
        m = _MAX_DRAINED.match(self.max_drained)
        assert m is not None  # validated
        n = int(m.group(1))
        return max(1, nodes * n // 100) if m.group(2) else n


@dataclass(frozen=True)
class PartitionView:
    nodes: int  # nodes of the partitions this node is in (this one included)
    drained: tuple[str, ...]  # other nodes of them that trainguard drained (or is draining)
    partitions: tuple[str, ...]
    own: str = ""  # this node's drain reason when trainguard drained it (or is draining it), else ""


def partition_view(sinfo: str, node: str) -> PartitionView:
    """From `sinfo -h -N -o %N|%P|%T|%E` (one line per node and partition): how many nodes share a partition with
    `node`, and which of them trainguard drained. Parsed without raising: a reason is free text."""
    rows = []
    for line in sinfo.splitlines():
        parts = line.split("|", 3)
        if len(parts) == 4:
            rows.append((parts[0].strip(), parts[1].strip().rstrip("*"), parts[2].strip().lower(), parts[3].strip()))
    mine = {p for n, p, _, _ in rows if n == node}
    nodes = {n for n, p, _, _ in rows if p in mine}
    drained = {n for n, p, state, reason in rows
               if p in mine and n != node and "drain" in state and reason.startswith(DRAIN_TAG)}
    own = next((reason for n, _, state, reason in rows
                if n == node and "drain" in state and reason.startswith(DRAIN_TAG)), "")
    return PartitionView(len(nodes | {node}), tuple(sorted(drained)), tuple(sorted(mine)), own)


class DrainAction(Action):
    """Drains the node, unless trainguard already holds `max_drained` nodes of its partitions drained."""

    needs_jobs = False
    resumes = True  # a node drained already is drained again, no more
    Settings = DrainSettings
    settings: DrainSettings

    def plan(self, ctx: ActionContext) -> str:
        return (f"drain node {ctx.node} reason={drain_reason(ctx.held_reason or ctx.event.summary)!r} unless "
                f"{self.settings.max_drained} "
                "of its partitions are already drained by trainguard")

    def run(self, ctx: ActionContext) -> str:
        # One fault is often several incidents whose lists run at once (two ports of one HCA): one drain at a time on
        # this agent, so that the second one's look sees the first one's drain. Waited for within this one's timeout:
        # a drain its list gave up on never runs later (after a resume, say)
        lock = ctx.claims.serial("drain")
        if not lock.acquire(timeout=self.settings.timeout):
            raise ActionError(f"drain {ctx.node}: another drain still under way after {self.settings.timeout:g}s")
        try:
            return self._drain(ctx)
        finally:
            lock.release()

    def _drain(self, ctx: ActionContext) -> str:
        reason = drain_reason(ctx.held_reason or ctx.event.summary)
        # One query of the node table per drain (a rare event), never per round.
        view = partition_view(_slurm("drain", ctx.slurm.run, "sinfo", "-h", "-N", "-o", "%N|%P|%T|%E"), ctx.node)
        if view.own and (not ctx.held_reason or view.own == reason):
            # The second drain of one fault (a GPU off the bus: `xid`, then `gpu`) is not a drain, and must not count
            # as one (the ledger's repeat-drain rule counts drains done); a lemon hold's reason replaces another one
            raise ActionSkippedError(f"{ctx.node} already drained by trainguard ({view.own[:120]}): left as it is")
        limit = self.settings.limit(view.nodes)
        if len(view.drained) >= limit:
            shown = ", ".join(view.drained[:5]) + (", ..." if len(view.drained) > 5 else "")
            raise ActionRefusedError(f"drain refused: {len(view.drained)} of {view.nodes} nodes of partition "
                                f"{','.join(view.partitions) or '?'} already drained by trainguard ({shown}; "
                                f"max_drained {self.settings.max_drained}): {ctx.node} stays in service. A fault "
                                "on this many nodes at once is rarely the nodes': check a recent driver, firmware "
                                "or config rollout, then drain by hand or raise max_drained")
        _slurm("drain", ctx.slurm.drain, ctx.node, reason)
        return f"drained {ctx.node}: {reason}"


class ResumeSettings(DiagToolSettings):
    timeout: Duration = Field(180.0, gt=0, description="An action still running after this is reported as failed; "
                                                       "longer than the validation level's budget.")
    validation: Literal["none", "quick", "standard", "long"] = Field(
        "quick", description=f"Diagnostics run before the node is resumed (docs/diagnostics.md): {LEVEL_HELP}. "
                             "Resumed only on a pass; a failure keeps the node drained, the failed test in the "
                             "drain reason. Tools this node lacks are skipped (a node without any resumes as with "
                             "`none`). While a job still holds the GPUs nothing runs and the node stays drained.")

    @model_validator(mode="after")
    def _level_fits(self) -> ResumeSettings:
        self.fits(None if self.validation == "none" else self.validation)
        return self


class ResumeAction(Action):
    """Lifts only drains trainguard set: an administrator's drain is never undone; and only once the configured
    diagnostics passed (`validation`)."""

    needs_jobs = False
    Settings = ResumeSettings
    settings: ResumeSettings

    def plan(self, ctx: ActionContext) -> str:
        return f"resume node {ctx.node} if its drain reason starts with {DRAIN_TAG!r}"

    def run(self, ctx: ActionContext) -> str:
        try:
            state, reason = ctx.slurm.node_state(ctx.node)
        except SlurmError as exc:
            raise ActionError(f"resume: {exc}") from None
        if "DRAIN" not in state:
            raise ActionSkippedError(f"{ctx.node} is not drained ({state})")
        if not reason.startswith(DRAIN_TAG):
            raise ActionSkippedError(f"{ctx.node} drained by someone else ({reason!r}): left alone")
        if ctx.others_critical:
            raise ActionSkippedError(f"{ctx.node} left drained: still critical: {', '.join(ctx.others_critical)}")
        for gate in ctx.resume_gates:
            ok, why = gate.check(ctx)
            if not ok:
                raise ActionSkippedError(f"{ctx.node} left drained: {gate.name}: {why}")
        if self.settings.validation != "none":
            self._validate(ctx, self.settings.validation)
        _slurm("resume", ctx.slurm.resume, ctx.node)
        return f"resumed {ctx.node} (was: {reason})"

    def _validate(self, ctx: ActionContext, level: Level) -> None:
        """A resume is a test, not a hope: the level's diagnostics pass, or the node stays drained, the failed
        test in its reason (still trainguard's drain: a later pass lifts it)."""
        report = validate_before_resume(self.settings, level, ctx)
        if report.refused:
            raise ActionSkippedError(f"{ctx.node} left drained: {report.summary()}")
        if not report.passed:
            reason = drain_reason(f"{level} diag failed: {reason_of(report)}")
            _slurm("drain", ctx.slurm.drain, ctx.node, reason)
            raise ActionError(f"{ctx.node} left drained ({reason}): {report.summary()}")


class WaitExitSettings(ActionSettings):
    """An action that gives the job's ranks `wait_exit` to save and exit, within its own `timeout`."""

    timeout: Duration = Field(330.0, gt=0, description="An action still running after this is reported as failed.")
    wait_exit: Duration = Field(300.0, ge=0)
    after_save: Duration = Field(
        30.0, ge=0, description="Once the ranks report their checkpoint written (the trainer helper's `saved()` on "
                                "rank 0 writes `saved.<job id>` in the switch dir while a request of the agent's is "
                                "there: a restart, or the save signal of `signal`), what still runs of the job this "
                                "long after is ended without waiting out `wait_exit`: the progress is safe, and a "
                                "rank hung in a collective or on a lost GPU never exits by itself.")

    @model_validator(mode="after")
    def _wait_fits(self) -> WaitExitSettings:
        if self.wait_exit >= self.timeout:
            raise ValueError(f"wait_exit ({self.wait_exit:g}s) must be shorter than timeout ({self.timeout:g}s)")
        return self


class RequeueSettings(WaitExitSettings):
    wait_exit: Duration = Field(300.0, ge=0, description="Wait up to this long for the job's processes on this node "
                                                         "to exit (saving after a signal) before requeueing it.")


class RequeueAction(Action):
    """Puts the job back in the queue, to run elsewhere once this node is drained.

    Bound after a save signal it first lets the job finish saving: `scontrol requeue` of a running job
    kills it, so it waits (up to `wait_exit`) for the job's processes here to exit, or `after_save` once rank 0
    reported its checkpoint written (trainguard.actions.savereport: a rank on a lost GPU never exits). Jobs submitted
    with `--no-requeue` are left alone.
    """

    Settings = RequeueSettings
    settings: RequeueSettings
    resumes = True  # it reads the job's record first: a job requeued already is not requeued again

    def plan(self, ctx: ActionContext) -> str:
        return "requeue " + (", ".join(j.label() for j in slurm_jobs(ctx)) or "no SLURM job")

    def run(self, ctx: ActionContext) -> str:
        jobs = slurm_jobs(ctx)
        if not jobs:
            raise ActionSkippedError("no SLURM job on this node: nothing to requeue")
        refused = [j for j in jobs if not j.requeue]
        waiting = [j for j in jobs if j.requeue]
        s = self.settings
        started = time.monotonic()
        deadline = started + s.wait_exit

        def over(job: Job) -> bool:  # its processes here exited, or its wait is over
            report = ctx.reports.get(job.job_id or "")
            until = deadline if report is None or report.at is None else min(deadline, report.at + s.after_save)
            return time.monotonic() >= until or not any(ref.matches() for ref in job.processes)

        done, errors = [], []
        while waiting:  # each job requeued once its own wait is over: one that never reports waits for no other
            for job in [j for j in waiting if over(j)]:
                waiting.remove(job)
                report = ctx.reports.get(job.job_id or "")
                try:
                    done.append(self._requeue(job, ctx) + (report.said(started, "the wait began") if report else ""))
                except ActionError as exc:
                    errors.append(f"{job.job_id}: {exc}")
            if waiting:
                time.sleep(0.2)
        parts = done + errors
        if refused:
            parts.append("not requeueable (--no-requeue): " + ", ".join(j.job_id or "" for j in refused))
        if errors and not done:  # nothing requeued: a failure, whatever was left alone besides
            raise ActionError("; ".join(parts))
        if not any(d.startswith("requeued ") for d in done):  # each left alone: requeued already, cancelled, refused
            raise ActionSkippedError("; ".join(parts))
        return "; ".join(parts)

    @staticmethod
    def _requeue(job: Job, ctx: ActionContext) -> str:
        """`scontrol requeue`, unless the job left the life this event was about: another incident about the same
        fault (a lost GPU is `xid` and `gpu`), or another node's agent, requeued it first, and its next life may
        already be running elsewhere; or it was cancelled meanwhile (one REQUEST_JOB_INFO_SINGLE per requeue; not
        answering: requeued anyway)."""
        assert job.job_id
        try:
            now = parse_job_record(ctx.slurm.show_job(job.job_id) or "", job.uid)
        except SlurmError:
            now = None
        if now is not None and (now.state in BACK_IN_QUEUE or (
                job.restarts is not None and now.restarts is not None and now.restarts > job.restarts)):
            return f"{job.job_id} not requeued: requeued already ({now.state}, Restarts={now.restarts})"
        if now is not None and now.state == "CANCELLED":  # its user or an operator ended it meanwhile: their call
            return f"{job.job_id} not requeued: cancelled meanwhile"
        _slurm("requeue", ctx.slurm.requeue, job.job_id)
        return f"requeued {job.job_id}"


class ArraySettings(ActionSettings):
    mode: Literal["hold", "admin-hold", "cancel"] = Field(
        "hold", description="Hold the pending tasks of the array (a user hold: the job's owner may `scontrol release` "
                            "them), hold them as an administrator (only an operator may release them), or cancel them.")


class ArrayPendingAction(Action):
    """Stops a job array from burning through its remaining tasks."""

    Settings = ArraySettings
    settings: ArraySettings

    def plan(self, ctx: ActionContext) -> str:
        arrays = sorted({j.array_job_id for j in slurm_jobs(ctx) if j.array_job_id})
        return f"{self.settings.mode} pending tasks of array " + (", ".join(arrays) or "(none)")

    def run(self, ctx: ActionContext) -> str:
        arrays = sorted({j.array_job_id for j in slurm_jobs(ctx) if j.array_job_id})
        if not arrays:
            raise ActionSkippedError("not an array job: nothing pending to stop")
        if self.settings.mode == "cancel":
            for array in arrays:
                _slurm("cancel", ctx.slurm.cancel_pending, array)
            return f"cancelled pending tasks of array {', '.join(arrays)}"
        user_hold = self.settings.mode == "hold"
        held = {array: _slurm("hold", ctx.slurm.hold_pending, array, user_hold) for array in arrays}
        done = "held " + ", ".join(f"{array}_[{tasks}]" if tasks else f"{array} (none pending)"
                                   for array, tasks in held.items())
        release = " ".join(f"{array}_[{tasks}]" for array, tasks in held.items() if tasks)
        if not release:
            raise ActionSkippedError(f"no task of array {', '.join(arrays)} was pending: nothing held")
        # A held task waits until someone releases it: say how. A stop switch left in place would end each released
        # task before its first step (the trainer helper checks it then), so it goes first.
        switch = ctx.event.details.get("path") if ctx.event.details.get("switch") == "stop" else None
        first = f"rm {shlex.quote(one_line(str(switch)))}, then " if switch else ""  # a path of the user's: quoted
        return f"{done}; to go on: {first}scontrol release {release}"
