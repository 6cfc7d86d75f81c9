"""TimeLimitCheck: a SLURM job close to its time limit is asked to save and exit before SLURM kills it."""

from __future__ import annotations

import time
from collections.abc import Sequence

from trainguard.checks.base import CheckSettings, JobCheck
from trainguard.core.model import Metric, Result, Status
from trainguard.core.settings import Duration, Field
from trainguard.core.units import format_duration

TIME_LEFT = Metric("trainguard_job_time_left_seconds", "Seconds until the job's time limit.", ("job_id",))
LOOKAHEAD_S = 120.0  # this long before a job enters its margin, its EndTime is asked again (a TimeLimit update)


class TimeLimitSettings(CheckSettings):
    margin: Duration = Field(600.0, gt=0, description="Ask the job to save and exit this long before its EndTime.")
    interval: Duration = Field(10.0, gt=0, description="Time between runs.")
    recheck: Duration = Field(300.0, ge=0, description="A running job's EndTime is asked of slurmctld again this "
                              "often (one small RPC per job; near the margin, once a minute): a TimeLimit cut by "
                              "`scontrol update` is seen within this. 0: only near the EndTime known.")


class TimeLimitCheck(JobCheck):
    """The `--signal=USR1@600` SLURM gives, also for jobs whose authors forgot it: bind the `signal` action."""

    scope = "job"
    Settings = TimeLimitSettings
    settings: TimeLimitSettings
    metrics = (TIME_LEFT,)

    def run(self) -> Sequence[Result]:
        view = self.view()
        out = self.source_errors(view, ["slurm"])
        now = self.context.clock()
        stale = view.stale.get("slurm")
        for job in view.on_node():
            if job.source != "slurm" or job.state != "RUNNING":
                continue  # a COMPLETING or ended job's EndTime is its end, not a limit it is heading for
            left = job.end_time - now if job.end_time else None
            near = left is not None and left <= self.settings.margin + LOOKAHEAD_S
            jobs = self.context.jobs
            if jobs is not None and (near or self.settings.recheck) and job.spoken_for_by(jobs.node):
                # Near the margin, as often as the source allows: a TimeLimit extended since is seen in time. Before,
                # every `recheck`: the EndTime known may be days away, or none (no limit), while an update cut the
                # limit to minutes. Only the node that speaks for the job asks: a 1,000-node job costs slurmctld one
                # RPC, not 1,000.
                jobs.refresh(job, 0.0 if near else self.settings.recheck)
            if job.end_time is None or left is None:
                if stale and job.extra.get("incomplete"):  # only the controller knows its EndTime, and it is silent
                    out.append(self.result(job.key, Status.UNKNOWN, f"{job.label()}: time limit unknown: {stale}",
                                           {"job_key": job.key, "job_id": job.job_id}))
                continue
            end = time.strftime("%H:%M:%S", time.localtime(job.end_time))
            details = {"job_key": job.key, "job_id": job.job_id, "end_time": job.end_time, "seconds_left": round(left)}
            sample = TIME_LEFT(left, {"job_id": job.job_id or ""})
            as_of = f" (EndTime as last known: {stale})" if stale else ""
            if left <= self.settings.margin:
                out.append(self.result(job.key, Status.WARNING, f"{job.label()} reaches its time limit at {end} "
                                       f"(in {format_duration(left)}): save and exit now{as_of}", details, [sample]))
            else:
                out.append(self.result(job.key, Status.OK, f"{job.label()}: {format_duration(left)} left{as_of}",
                                       details, [sample]))
        return out
