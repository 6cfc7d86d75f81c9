"""Cluster actions through scontrol: drain and resume this node, requeue the job, hold or cancel pending array tasks."""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from typing import Literal, TypeVar

from pydantic import Field, model_validator

from trainguard.actions.base import Action, ActionContext, ActionError, ActionSettings, slurm_jobs
from trainguard.core.settings import Duration
from trainguard.core.text import one_line
from trainguard.jobs.slurm import SlurmError

DRAIN_TAG = "trainguard:"
T = TypeVar("T")


def drain_reason(summary: str) -> str:
    # scontrol passes the reason verbatim: one short printable line (a NUL would not even reach exec()).
    text = " ".join(one_line(summary).split()).replace('"', "'")
    return f"{DRAIN_TAG} {text}"[:200]


def _slurm(call: str, fn: Callable[..., T], *args: object) -> T:
    try:
        return fn(*args)
    except SlurmError as exc:
        raise ActionError(f"{call}: {exc}") from None


class DrainAction(Action):
    needs_jobs = False

    def plan(self, ctx: ActionContext) -> str:
        return f"drain node {ctx.node} reason={drain_reason(ctx.event.summary)!r}"

    def run(self, ctx: ActionContext) -> str:
        reason = drain_reason(ctx.event.summary)
        _slurm("drain", ctx.slurm.drain, ctx.node, reason)
        return f"drained {ctx.node}: {reason}"


class ResumeAction(Action):
    """Lifts only drains trainguard set: an administrator's drain is never undone."""

    needs_jobs = False

    def plan(self, ctx: ActionContext) -> str:
        return f"resume node {ctx.node} if its drain reason starts with {DRAIN_TAG!r}"

    def run(self, ctx: ActionContext) -> str:
        try:
            state, reason = ctx.slurm.node_state(ctx.node)
        except SlurmError as exc:
            raise ActionError(f"resume: {exc}") from None
        if "DRAIN" not in state:
            return f"{ctx.node} is not drained ({state})"
        if not reason.startswith(DRAIN_TAG):
            return f"{ctx.node} drained by someone else ({reason!r}): left alone"
        if ctx.others_critical:
            return f"{ctx.node} left drained: still critical: {', '.join(ctx.others_critical)}"
        _slurm("resume", ctx.slurm.resume, ctx.node)
        return f"resumed {ctx.node} (was: {reason})"


class RequeueSettings(ActionSettings):
    timeout: Duration = Field(330.0, gt=0, description="An action still running after this is reported as failed.")
    wait_exit: Duration = Field(300.0, ge=0, description="Wait up to this long for the job's processes on this node "
                                                         "to exit (saving after a signal) before requeueing it.")

    @model_validator(mode="after")
    def _wait_fits(self) -> RequeueSettings:
        if self.wait_exit >= self.timeout:
            raise ValueError(f"wait_exit ({self.wait_exit:g}s) must be shorter than timeout ({self.timeout:g}s)")
        return self


class RequeueAction(Action):
    """Puts the job back in the queue, to run elsewhere once this node is drained.

    Bound after a save signal it first lets the job finish saving: `scontrol requeue` of a running job
    kills it, so it waits (up to `wait_exit`) for the job's processes here to exit. Jobs submitted with
    `--no-requeue` are left alone.
    """

    Settings = RequeueSettings
    settings: RequeueSettings

    def plan(self, ctx: ActionContext) -> str:
        return "requeue " + (", ".join(j.label() for j in slurm_jobs(ctx)) or "no SLURM job")

    def run(self, ctx: ActionContext) -> str:
        jobs = slurm_jobs(ctx)
        if not jobs:
            return "no SLURM job on this node: nothing to requeue"
        refused = [j for j in jobs if not j.requeue]
        jobs = [j for j in jobs if j.requeue]
        deadline = time.monotonic() + self.settings.wait_exit
        while any(ref.matches() for j in jobs for ref in j.processes) and time.monotonic() < deadline:
            time.sleep(0.2)
        for job in jobs:
            assert job.job_id
            _slurm("requeue", ctx.slurm.requeue, job.job_id)
        parts = []
        if jobs:
            parts.append("requeued " + ", ".join(j.job_id or "" for j in jobs))
        if refused:
            parts.append("not requeueable (--no-requeue): " + ", ".join(j.job_id or "" for j in refused))
        return "; ".join(parts)


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
            return "not an array job: nothing pending to stop"
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
            return done
        # A held task waits until someone releases it: say how. A stop switch left in place would end each released
        # task before its first step (the trainer helper checks it then), so it goes first.
        switch = ctx.event.details.get("path") if ctx.event.details.get("switch") == "stop" else None
        first = f"rm {shlex.quote(one_line(str(switch)))}, then " if switch else ""  # a path of the user's: quoted
        return f"{done}; to go on: {first}scontrol release {release}"
