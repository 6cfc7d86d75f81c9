"""JobLivenessCheck: a job of each watched name is running or pending; when none is, how the last one ended
(from the controller, else from accounting).

It is about the cluster, not this node: it asks the controller with one filtered query per run (`squeue --name`,
text, never the whole queue as JSON), and accounting (`sacct --name`) only for a name that is down. Run it on one
node (a login or head node), not on every compute node: each agent that configures it adds one query per interval.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from trainguard.checks.base import CheckContext, CheckSettings, JobCheck
from trainguard.checks.xid import KernelLogSettings, adopt_marks
from trainguard.core.model import Metric, Result, Status
from trainguard.core.settings import Duration, Field, field_validator
from trainguard.core.units import format_duration
from trainguard.jobs.kernelnotes import NotesReader
from trainguard.jobs.model import Job
from trainguard.jobs.slurm import SlurmError

ALIVE = Metric("trainguard_job_alive", "1 if a job of this name is running or pending.", ("name",))


class LivenessSettings(KernelLogSettings):
    names: list[str] = Field(min_length=1, description="Job names that must always be running or pending.")
    interval: Duration = Field(60.0, gt=0, description="Time between runs (each asks the controller once).")
    accounting: bool = Field(True, description="When the controller knows no job of a name any more, ask "
                                               "accounting (sacct) for the last one.")
    lookback: Duration = Field(7 * 86400.0, gt=0, description="How far back accounting is searched.")
    kernel_log: bool = Field(True, description="A job that went down after the kernel OOM killer killed one of its "
                             "processes on this node says so (which rank, which memory, when), read through the node's "
                             "one kernel log reader.")

    @field_validator("names")
    @classmethod
    def _one_name_each(cls, names: list[str]) -> list[str]:
        for name in names:  # squeue and sacct split --name on commas; a line break would let a name forge a line
            if not name or "," in name or any(ch in name for ch in "\r\n\0"):
                raise ValueError(f"job name {name[:60]!r}: a watched name is one non-empty name without commas or "
                                 "line breaks (squeue --name splits on commas)")
        return names


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

    def __init__(self, name: str, settings: CheckSettings, context: CheckContext) -> None:
        super().__init__(name, settings, context)
        self.kernel = (NotesReader(context.kernel_notes, context.kernel_log, name, self.settings.kmsg_path,
                                   self.settings.journalctl) if self.settings.kernel_log else None)

    def start(self, wake: Callable[[], None]) -> None:
        if self.kernel is not None:
            self.kernel.start(lambda: None)  # a kill does not bring a job down: its next run tells both

    def stop(self) -> None:
        if self.kernel is not None:
            self.kernel.stop()

    def run(self) -> Sequence[Result]:
        if self.kernel is not None:
            self.kernel.read_once(lambda: adopt_marks(self.context, self.context.xid_history))
        jobs, errors = self._listed()
        if errors:
            return errors
        now = self.context.clock()
        verdicts = {name: evaluate_liveness(name, jobs, now) for name in self.settings.names}
        down = [name for name, (status, _, _) in verdicts.items() if status is Status.CRITICAL]
        history, history_error = self._history(down)
        out = []
        for name in self.settings.names:
            status, summary, details = verdicts[name]
            if name in down:
                status, summary, details = self._down(name, jobs, now, history, history_error)
            out.append(self.result(name, status, summary, details,
                                   [ALIVE(0 if status is Status.CRITICAL else 1, {"name": name})]))
        return out

    def _listed(self) -> tuple[list[Job], list[Result]]:
        """The jobs of the watched names the sources know now, or the results saying why they can't say."""
        catalog = self.context.jobs
        if catalog is None:
            raise RuntimeError("no job source configured ([jobs] sources)")
        jobs: list[Job] = []
        if "process" in catalog.sources:  # declared process jobs are this node's: the catalog has them
            view = catalog.view()
            errors = self.source_errors(view, ["process"])
            if errors:
                return [], list(errors)
            jobs += [j for j in view.jobs if j.source == "process"]
        if "slurm" in catalog.sources:
            try:
                jobs += catalog.slurm.named(self.settings.names)
            except SlurmError as exc:
                return [], [self.result("source:slurm", Status.UNKNOWN, f"job source slurm: {exc}",
                                        {"source": "slurm"})]
        return jobs, []

    def _down(self, name: str, jobs: list[Job], now: float, history: list[Job] | None,
              history_error: str | None) -> tuple[Status, str, dict[str, Any]]:
        """A name with no job running or pending: how its last one ended, from accounting too, and the kernel's OOM
        kill of it on this node."""
        status, summary, details = evaluate_liveness(name, jobs, now, history)
        if history_error:
            details = {**details, "accounting_error": history_error}
        summary, details = self._oom_killed(name, summary, details, now)
        return status, summary, details

    def _oom_killed(self, name: str, summary: str, details: dict[str, Any], now: float) -> tuple[str, dict[str, Any]]:
        """A job down after the kernel killed one of its processes on this node (its SLURM id in the kill's memory
        cgroup, or a pid its checks knew as its): the kill in its story."""
        if self.kernel is None:
            return summary, details
        job_id = details.get("last_job_id")
        kills = self.context.kernel_notes.kills(job_id=job_id if isinstance(job_id, str) else None, name=name,
                                                since=now - self.settings.lookback)
        if not kills:
            return summary, details
        return f"{summary}; {kills[-1].describe()}", {**details, "oom_kills": [k.fields() for k in kills[-8:]]}

    def _history(self, names: list[str]) -> tuple[list[Job] | None, str | None]:
        """What accounting knows of these names; (None, why) when it can't say (not configured, slurmdbd down)."""
        jobs = self.context.jobs
        if not names or not self.settings.accounting or jobs is None or "slurm" not in jobs.sources:
            return None, None
        try:
            return jobs.slurm.history(names, self.settings.lookback), None
        except SlurmError as exc:
            return None, str(exc)
