"""Restart a SLURM job's ranks in place, inside the job's allocation: no requeue, no wait for the scheduler.

A requeue goes through slurmctld: the job is killed, waits out its credential (`AuthInfo=cred_expire`, 120 s by
default), waits for a scheduling pass and starts from its batch script again, on nodes that may be busy by then. For
a fault that leaves every node of the job usable (a NaN streak, a hung rank, a leak) the allocation can be kept: the
ranks save and exit, and the job's batch script launches them again. Its part is one line, the trainer helper's
relaunch loop around `srun` (docs/jobs-and-actions.md):

    python3 -m trainguard.trainer relaunch -- srun python train.py

The action, in order: writes the `restart` request in the job's switch dir (as the job's user, as `switch` does:
the loop relaunches only when it finds a new request there after `srun` returns), sends the save signal to the job's
srun steps (never the batch script: the loop must live), waits up to `wait_exit` for them to end, on this node
(free) and then elsewhere (one REQUEST_JOB_STEP_INFO a second for this job), and cancels the steps still running
then (a rank hung in a collective or a CUDA call never exits by itself). The request is written before the signal:
a rank that exits before the loop could see a request would end the job instead.
"""

from __future__ import annotations

import time

from pydantic import Field, field_validator, model_validator

from trainguard.actions.base import Action, ActionContext, ActionError, ActionSettings, slurm_jobs
from trainguard.actions.signal import signal_name
from trainguard.actions.switch import create_switch, job_owner
from trainguard.core.settings import Duration
from trainguard.jobs.model import Job, ProcessRef
from trainguard.jobs.slurm import SlurmError

POLL = 0.2  # the ranks on this node: /proc only
POLL_CONTROLLER = 1.0  # the ranks elsewhere: one RPC per look


class RestartSettings(ActionSettings):
    timeout: Duration = Field(330.0, gt=0, description="An action still running after this is reported as failed.")
    signal: str = Field("USR1", description="The signal that asks the ranks to save and exit (the trainer helper's "
                                            "default: USR1).")
    wait_exit: Duration = Field(300.0, ge=0, description="How long the ranks get to save and exit before their "
                                                         "steps are cancelled.")

    @field_validator("signal")
    @classmethod
    def _valid_signal(cls, value: str) -> str:
        return signal_name(value)

    @model_validator(mode="after")
    def _wait_fits(self) -> RestartSettings:
        if self.wait_exit >= self.timeout:
            raise ValueError(f"wait_exit ({self.wait_exit:g}s) must be shorter than timeout ({self.timeout:g}s)")
        return self


class RestartAction(Action):
    """Restarts the job's srun steps inside its allocation; the trainer helper's relaunch loop starts them again."""

    Settings = RestartSettings
    settings: RestartSettings
    fresh_start = True

    def plan(self, ctx: ActionContext) -> str:
        return (f"restart in place {', '.join(j.label() for j in slurm_jobs(ctx)) or 'no SLURM job'}: a `restart` "
                f"request in its switch dir, SIG{self.settings.signal} to its steps, the steps still running after "
                f"{self.settings.wait_exit:g}s cancelled")

    def run(self, ctx: ActionContext) -> str:
        others = [j.label() for j in ctx.jobs if not (j.source == "slurm" and j.job_id)]
        if others:
            raise ActionError(f"restart in place is for SLURM jobs (their allocation is kept); {', '.join(others)}: "
                              "bind `signal` and let the service manager start it again (Restart=on-failure)")
        jobs = slurm_jobs(ctx)
        if not jobs:
            raise ActionError("no job to restart")
        return "; ".join(self._one(job, ctx) for job in jobs)

    def _one(self, job: Job, ctx: ActionContext) -> str:
        assert job.job_id
        job_id, s = job.job_id, self.settings
        if not job.switch_dir:
            raise ActionError(f"{job.label()} has no switch dir: nowhere to ask its relaunch loop for a restart")
        try:
            here = ctx.slurm.local_steps(job_id, ctx.slurmd)
            steps = set(here) or set(ctx.slurm.steps(job_id))
        except SlurmError as exc:
            raise ActionError(f"restart {job_id}: {exc}") from None
        if not steps:
            raise ActionError(f"{job.label()} has no srun step running: nothing to restart in place (its ranks must be "
                              "srun steps under the trainer helper's relaunch loop)")
        identity, gid = job_owner(job)
        request = create_switch(job.switch_dir, "restart", identity, gid, {
            "requested_by": "trainguard", "at": ctx.clock(), "incident": ctx.event.incident_id,
            "check": ctx.event.check, "reason": ctx.event.summary})
        try:
            ctx.slurm.signal(job_id, s.signal, "steps")
        except SlurmError as exc:
            raise ActionError(f"restart {job_id}: {exc}") from None
        started = time.monotonic()
        deadline = started + s.wait_exit
        refs = [r for pids in here.values() for r in map(ProcessRef.of, pids) if r is not None]
        while any(r.matches() for r in refs) and time.monotonic() < deadline:
            time.sleep(POLL)
        try:
            left = self._running(ctx, job_id, steps)
            while left and time.monotonic() < deadline:
                time.sleep(POLL_CONTROLLER)
                left = self._running(ctx, job_id, steps)
            cancelled = [step for step in sorted(left) if ctx.slurm.cancel_step(job_id, step)]
        except SlurmError as exc:
            raise ActionError(f"restart {job_id}: {request} written, SIG{s.signal} sent, then: {exc}") from None
        took = time.monotonic() - started
        ended = ", ".join(f"{job_id}.{step}" for step in sorted(steps))
        how = (f"cancelled {', '.join(f'{job_id}.{c}' for c in cancelled)} still running after {took:.1f}s"
               if cancelled else f"ended in {took:.1f}s")
        return f"restart of {job_id} requested ({request}); SIG{s.signal} to step {ended}: {how}"

    @staticmethod
    def _running(ctx: ActionContext, job_id: str, steps: set[str]) -> set[str]:
        return steps & set(ctx.slurm.steps(job_id))
