"""JobLivenessCheck: a job of each watched name is running or pending; when none is, how the last one ended
(from the controller, else from accounting).

Run it on one node (a login or head node), not on every compute node: it is about the cluster, not this node.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from trainguard.checks.base import CheckSettings, JobCheck
from trainguard.core.model import Metric, Result, Status
from trainguard.core.settings import Duration
from trainguard.core.units import format_duration
from trainguard.jobs.model import Job
from trainguard.jobs.slurm import SlurmError

ALIVE = Metric("trainguard_job_alive", "1 if a job of this name is running or pending.", ("name",))


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
    metrics = (ALIVE,)
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
                                   [ALIVE(0 if status is Status.CRITICAL else 1, {"name": name})]))
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
