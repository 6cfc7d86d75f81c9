"""Send a signal to the job: through scancel for SLURM jobs (every rank on every node), directly for process jobs."""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Literal

from trainguard.actions.base import Action, ActionContext, ActionError, ActionSettings, ActionSkippedError, each_job
from trainguard.actions.savereport import ask_save
from trainguard.core.logs import kv
from trainguard.core.settings import Duration, Field, field_validator
from trainguard.jobs.model import Job, ProcessRef

log = logging.getLogger("trainguard.actions.signal")


def signal_name(value: str) -> str:
    name = value.strip().upper().removeprefix("SIG")
    try:
        signal.Signals[f"SIG{name}"]
    except KeyError:
        raise ValueError(f"unknown signal {value!r}") from None
    return name


class SignalSettings(ActionSettings):
    signal: str = Field("USR1", description="Signal to send (SLURM convention: USR1 = save and exit).")
    slurm_mode: Literal["full", "batch"] = Field("full", description="scancel --full (every step) or --batch.")
    then: str | None = Field(None, description="Process jobs: a second signal if still alive after `grace`.")
    grace: Duration = Field(30.0, ge=0, description="Process jobs: wait before `then`.")

    @field_validator("signal", "then")
    @classmethod
    def _valid_signal(cls, value: str | None) -> str | None:
        return signal_name(value) if value else value


class ProcessGoneError(ActionError):
    """The job's process exited (its pid is free, or another process's now): nothing left to signal."""


def signal_process(ref: ProcessRef, signame: str, uid: int | None) -> str:
    """Signal one process of the job's user `uid`, refusing pid 1, the agent itself, any pid whose identity changed
    and any process of another user: the agent's CAP_KILL is never lent to a job against someone else."""
    if ref.pid in (0, 1) or ref.pid == os.getpid():
        raise ActionError(f"refusing to signal pid {ref.pid}")
    if not ref.matches():
        raise ProcessGoneError(f"pid {ref.pid} is no longer the job's process (exited or recycled): not signalled")
    owner = ref.uid()
    if uid is None or owner != uid:
        raise ActionError(f"pid {ref.pid} belongs to uid {owner}, not to the job's user (uid {uid}): not signalled")
    try:
        os.kill(ref.pid, signal.Signals[f"SIG{signame}"])
    except ProcessLookupError:
        raise ProcessGoneError(f"pid {ref.pid} exited before the signal") from None
    except PermissionError:
        raise ActionError(f"no permission to signal pid {ref.pid} (CAP_KILL missing?)") from None
    return f"SIG{signame} -> pid {ref.pid}"


class SignalAction(Action):
    Settings = SignalSettings
    settings: SignalSettings

    def plan(self, ctx: ActionContext) -> str:
        return f"send SIG{self.settings.signal} to " + (", ".join(j.label() for j in ctx.jobs) or "no job")

    def run(self, ctx: ActionContext) -> str:
        if not ctx.jobs:
            raise ActionSkippedError("no job on this node to signal")
        # first: a requeue after it waits for rank 0's report of the checkpoint written, not for a rank that never
        # exits (on a lost GPU), and rank 0 reports only when the request was there as it decided to stop
        unasked = ask_save(ctx.jobs, ctx) if self.settings.signal not in ("KILL", "STOP") else []  # uncatchable
        # one job after another: a turn waits for nothing a job's user controls (scancel asks the controller, within
        # its timeout; a process job's `then` waits on a timer of its own)
        return "; ".join([each_job(ctx.jobs, lambda job: self._one(job, ctx)), *unasked])

    def _one(self, job: Job, ctx: ActionContext) -> str:
        s = self.settings
        if job.source == "slurm" and job.job_id:
            from trainguard.jobs.slurm import SlurmError

            try:
                ctx.slurm.signal(job.job_id, s.signal, s.slurm_mode)
            except SlurmError as exc:
                raise ActionError(str(exc)) from None
            return f"scancel --signal={s.signal} --{s.slurm_mode} {job.job_id}"
        if not job.processes:
            raise ActionError("job has no running process")
        sent, gone = [], []
        for ref in job.processes:
            try:
                sent.append(signal_process(ref, s.signal, job.uid))
            except ProcessGoneError:  # it exited first: a trainer that honoured the stop switch before we relayed it
                gone.append(str(ref.pid))
        if not sent:
            raise ActionSkippedError(f"had already exited (pid {', '.join(gone)}): nothing to signal")
        if gone:
            sent.append(f"pid {', '.join(gone)} had already exited")
        if s.then:
            timer = threading.Timer(s.grace, self._escalate, args=(job,))
            timer.daemon = True
            timer.start()
        return ", ".join(sent)

    def _escalate(self, job: Job) -> None:
        assert self.settings.then is not None
        for ref in job.processes:
            if ref.matches():
                try:
                    result = signal_process(ref, self.settings.then, job.uid)
                    log.warning("escalated signal", extra=kv(action=self.name, job=job.key, result=result))
                except ActionError as exc:
                    log.warning("escalation failed", extra=kv(action=self.name, job=job.key, error=str(exc)))
