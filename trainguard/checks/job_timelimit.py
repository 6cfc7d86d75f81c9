"""TimeLimitCheck: a SLURM job close to its time limit is asked to save and exit before SLURM kills it."""

from __future__ import annotations

import time
from collections.abc import Sequence

from pydantic import Field

from trainguard.checks.base import CheckSettings, JobCheck
from trainguard.core.model import Metric, Result, Status
from trainguard.core.settings import Duration
from trainguard.core.units import format_duration

TIME_LEFT = Metric("trainguard_job_time_left_seconds", "Seconds until the job's time limit.", ("job_id",))


class TimeLimitSettings(CheckSettings):
    margin: Duration = Field(600.0, gt=0, description="Ask the job to save and exit this long before its EndTime.")
    interval: Duration = Field(10.0, gt=0, description="Time between runs.")


class TimeLimitCheck(JobCheck):
    """The `--signal=USR1@600` SLURM gives, also for jobs whose authors forgot it: bind the `signal` action."""

    Settings = TimeLimitSettings
    settings: TimeLimitSettings
    metrics = (TIME_LEFT,)

    def run(self) -> Sequence[Result]:
        view = self.view()
        out = self.source_errors(view, ["slurm"])
        now = self.context.clock()
        for job in view.on_node():
            if job.source != "slurm" or not job.end_time:
                continue
            left = job.end_time - now
            end = time.strftime("%H:%M:%S", time.localtime(job.end_time))
            details = {"job_key": job.key, "job_id": job.job_id, "end_time": job.end_time, "seconds_left": round(left)}
            sample = TIME_LEFT(left, {"job_id": job.job_id or ""})
            if left <= self.settings.margin:
                out.append(self.result(job.key, Status.WARNING, f"{job.label()} reaches its time limit at {end} "
                                       f"(in {format_duration(left)}): save and exit now", details, [sample]))
            else:
                out.append(self.result(job.key, Status.OK, f"{job.label()}: {format_duration(left)} left", details,
                                       [sample]))
        return out
