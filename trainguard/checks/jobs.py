"""Checks over the training jobs on this node: liveness, kill/save switches, the approaching time limit.

Each reports `job_key` in its details so the actions bound to it act on that job alone.
"""

from __future__ import annotations

import os
import pwd
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field

from trainguard.checks.base import Check, CheckSettings
from trainguard.core.model import Result, Sample, Status
from trainguard.core.settings import Duration
from trainguard.core.units import format_duration
from trainguard.jobs.catalog import JobView
from trainguard.jobs.model import Job
from trainguard.jobs.slurm import SlurmError


class JobCheck(Check):
    """Shared plumbing: the job view, and one UNKNOWN per failed source instead of a crash."""

    def view(self) -> JobView:
        if self.context.jobs is None:
            raise RuntimeError("no job source configured ([jobs] sources)")
        return self.context.jobs.view()

    def source_errors(self, view: JobView, sources: Sequence[str] | None = None) -> list[Result]:
        """One UNKNOWN per failed source (of `sources`; None: every source)."""
        return [self.result(f"source:{name}", Status.UNKNOWN, f"job source {name}: {error}", {"source": name})
                for name, error in view.errors.items() if sources is None or name in sources]

    @staticmethod
    def jobs_here(view: JobView, names: Sequence[str] = ()) -> list[Job]:
        """Jobs running on this node, only those named when `names` is given."""
        return [j for j in view.on_node() if not names or j.name in names]


# liveness ---------------------------------------------------------------------------------------
class LivenessSettings(CheckSettings):
    names: list[str] = Field(min_length=1, description="Job names that must always be running or pending.")
    accounting: bool = Field(True, description="When the controller knows no job of a name any more, ask "
                                               "accounting (sacct) for the last one.")
    lookback: Duration = Field(7 * 86400.0, gt=0, description="How far back accounting is searched.")


def _pick_last(jobs: list[Job]) -> Job | None:
    return max(jobs, key=lambda j: (j.end_time or 0, int(j.job_id or 0) if (j.job_id or "").isdigit() else 0),
               default=None)


def evaluate_liveness(name: str, jobs: list[Job], now: float,
                      history: Sequence[Job] | None = None) -> tuple[Status, str, dict[str, object]]:
    """`jobs` are what the controller knows now; `history` what accounting recorded (finished jobs only)."""
    mine = [j for j in jobs if j.name == name]  # exact: never a truncated squeue column
    running = [j for j in mine if j.running]
    pending = [j for j in mine if j.state == "PENDING"]
    if running:
        return Status.OK, f"{name}: running as {', '.join(j.label() for j in running)}", {
            "state": "RUNNING", "job_ids": [j.job_id for j in running]}
    if pending:
        reasons = sorted({j.reason or "?" for j in pending})
        return Status.OK, f"{name}: pending ({', '.join(reasons)})", {
            "state": "PENDING", "reasons": reasons, "job_ids": [j.job_id for j in pending]}
    known = {j.key for j in mine}
    last = _pick_last(mine + [j for j in history or () if j.name == name and j.key not in known])
    if last is None:
        return Status.CRITICAL, f"{name}: no job running or pending, and none known to the controller" + (
            " or accounting" if history is not None else ""), {"state": None}
    down = f", down for {format_duration(now - last.end_time)}" if last.end_time else ""
    return Status.CRITICAL, (f"{name}: no job running or pending; last was {last.label()} {last.state}"
                             f" exit {last.exit_code or '?'}{down}"), {
        "state": last.state, "exit_code": last.exit_code, "last_job_id": last.job_id, "ended": last.end_time,
        "reason": last.reason, "known_from": last.extra.get("from", "controller")}


class JobLivenessCheck(JobCheck):
    Settings = LivenessSettings
    settings: LivenessSettings

    def run(self) -> Sequence[Result]:
        view = self.view()
        errors = self.source_errors(view, ["slurm", "process"])
        if errors:
            return errors
        now = self.context.clock()
        verdicts = {name: evaluate_liveness(name, list(view.jobs), now) for name in self.settings.names}
        down = [name for name, (status, _, _) in verdicts.items() if status is Status.CRITICAL]
        history, history_error = self._history(down)
        out = []
        for name in self.settings.names:
            status, summary, details = verdicts[name]
            if name in down and history is not None:
                status, summary, details = evaluate_liveness(name, list(view.jobs), now, history)
            if name in down and history_error:
                details = {**details, "accounting_error": history_error}
            out.append(self.result(name, status, summary, details,
                                   [Sample("trainguard_job_alive", 0 if status is Status.CRITICAL else 1,
                                           {"name": name}, "1 if a job of this name is running or pending.")]))
        return out

    def _history(self, names: list[str]) -> tuple[list[Job] | None, str | None]:
        """What accounting knows of these names; (None, why) when it can't say (not configured, slurmdbd down)."""
        jobs = self.context.jobs
        if not names or not self.settings.accounting or jobs is None or "slurm" not in jobs.sources:
            return None, None
        try:
            return jobs.slurm.history(names, self.settings.lookback), None
        except SlurmError as exc:
            return None, str(exc)


# switches ---------------------------------------------------------------------------------------
class SwitchCheckSettings(CheckSettings):
    switch: Literal["stop", "save"] = Field("stop", description="Which switch file this check watches.")
    interval: Duration = Field(2.0, gt=0, description="Time between runs.")
    jitter: Duration = Field(0.0, ge=0)


@dataclass(frozen=True)
class SwitchFile:
    path: Path
    uid: int
    mtime: float


def find_switch(job: Job, switch: str, stop_dir: Path) -> list[SwitchFile]:
    candidates = []
    if job.switch_dir:
        candidates.append(Path(job.switch_dir) / switch)
    if switch == "stop":
        candidates.append(stop_dir / job.name)  # the operator's per-job-name stop file
    found = []
    for path in candidates:
        try:
            st = os.lstat(path)
        except OSError:  # absent, or the switch dir is gone or unreadable: no request
            continue
        found.append(SwitchFile(path, st.st_uid, st.st_mtime))
    return found


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


class SwitchCheck(JobCheck):
    """A switch touched by the job's owner (or root) is a request: WARNING, so the bound actions relay it.

    One created by anyone else is ignored: UNKNOWN, naming that user.
    """

    Settings = SwitchCheckSettings
    settings: SwitchCheckSettings

    def candidates(self, view: JobView) -> list[Job]:
        """Running jobs; for `stop`, also finished tasks of an array that still has tasks pending,
        since the trainer may honour the switch and exit before this check next runs."""
        running = view.on_node()
        if self.settings.switch != "stop":
            return running
        pending = {j.array_job_id for j in view.jobs if j.state == "PENDING" and j.array_job_id}
        finished = [j for j in view.jobs if j.on_this_node and not j.running and j.array_job_id in pending]
        return running + finished

    def run(self) -> Sequence[Result]:
        view = self.view()
        stop_dir = self.context.jobs.settings.stop_dir if self.context.jobs else Path("/run/trainguard/stop")
        out = self.source_errors(view, ["slurm", "process"])
        seen: set[Path] = set()
        for job in self.candidates(view):
            for sw in find_switch(job, self.settings.switch, stop_dir):
                if sw.path in seen:  # array tasks share a switch dir: one request, one incident
                    break
                seen.add(sw.path)
                details = {"job_key": job.key, "job_id": job.job_id, "path": str(sw.path), "by": _user(sw.uid),
                           "switch": self.settings.switch}
                subject = f"{job.key}:{self.settings.switch}"
                if sw.uid not in (0, job.uid):
                    out.append(self.result(subject, Status.UNKNOWN,
                                           f"ignored {self.settings.switch} switch for {job.label()}: {sw.path} was "
                                           f"created by {_user(sw.uid)}, not by the job's owner {job.user} or root",
                                           details))
                else:
                    out.append(self.result(subject, Status.WARNING,
                                           f"{self.settings.switch} switch touched for {job.label()} by {_user(sw.uid)}",
                                           details))
                break
        return out


# time limit -------------------------------------------------------------------------------------
class TimeLimitSettings(CheckSettings):
    margin: Duration = Field(600.0, gt=0, description="Ask the job to save and exit this long before its EndTime.")
    interval: Duration = Field(10.0, gt=0, description="Time between runs.")


class TimeLimitCheck(JobCheck):
    """The `--signal=USR1@600` SLURM gives, also for jobs whose authors forgot it: bind the `signal` action."""

    Settings = TimeLimitSettings
    settings: TimeLimitSettings

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
            sample = Sample("trainguard_job_time_left_seconds", left, {"job_id": job.job_id or ""},
                            "Seconds until the job's time limit.")
            if left <= self.settings.margin:
                out.append(self.result(job.key, Status.WARNING, f"{job.label()} reaches its time limit at {end} "
                                       f"(in {format_duration(left)}): save and exit now", details, [sample]))
            else:
                out.append(self.result(job.key, Status.OK, f"{job.label()}: {format_duration(left)} left", details,
                                       [sample]))
        return out
