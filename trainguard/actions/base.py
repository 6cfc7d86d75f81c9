"""The action interface: named, configured responses to incident events, acting on jobs or the node."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from pydantic import Field

from trainguard.core.events import Event
from trainguard.core.settings import Duration, SettingsModel
from trainguard.jobs.model import Job
from trainguard.jobs.slurm import SlurmClient

if TYPE_CHECKING:
    from trainguard.actions.savereport import SaveReport


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


@dataclass(frozen=True)
class ActionContext:
    event: Event
    jobs: tuple[Job, ...]  # the jobs this incident concerns
    node: str  # this node's SLURM name
    slurm: SlurmClient
    clock: Callable[[], float]
    others_critical: tuple[str, ...] = ()  # other CRITICAL incidents firing on this node ("check/subject")
    slurmd: str = ""  # this node's slurmd by name where a host runs several (`jobs.slurm_node`); empty: the one
    # Job id -> the ranks' report asked for after a save signal by an action of this event's list, for the actions
    # after it that wait for the ranks (`requeue`); the responder closes them once the list is done.
    saves: dict[str, SaveReport] = field(default_factory=dict)

    def done(self) -> None:
        """The event's actions are over: the reports asked for served them."""
        for report in self.saves.values():
            report.close()


class Action(ABC):
    Settings: ClassVar[type[ActionSettings]] = ActionSettings
    needs_jobs: ClassVar[bool] = True
    # Done, it leaves the job starting afresh (restarted in place): the check forgets what it learned about the
    # incident's subject, so that the new start's own logs and samples decide whether the incident is over.
    fresh_start: ClassVar[bool] = False
    # It needs what only the controller's record of a SLURM job says (its switch dir, its nodes): a job listed before
    # that record came is waited for (trainguard.pipeline.responder.event_jobs).
    needs_record: ClassVar[bool] = False

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
    """`act` on every job: one job's failure never keeps another from its turn. Fails only when every job failed."""
    done, errors = [], []
    for job in jobs:
        try:
            done.append(act(job))
        except ActionError as exc:
            errors.append(f"{job.label()}: {exc}")
    if errors and not done:
        raise ActionError("; ".join(errors))
    return "; ".join(done + errors)
