"""NodeDrainCheck: SLURM is taking this node away (drained for a reboot or a repair) while a job still runs on it: the
job is asked to save and leave before the node goes, not killed with it.

A host's maintenance is a drain, then a reboot some minutes later: the job's ranks there die with the node, the
other ranks wait in a collective until NCCL gives up, and everything since the last checkpoint is lost. The drain
is the notice. slurmctld alone knows it (nothing on the node changes), so this check asks it about this node only
(`sinfo --nodes=NODE`: one small RPC, the node's row alone), and only while a SLURM job runs here: a node without
one costs slurmctld nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Literal

from trainguard.checks.base import (
    ActionBinding,
    CheckContext,
    CheckIdle,
    CheckSettings,
    JobCheck,
    PartialView,
    same_as_actions,
)
from trainguard.core.events import Event
from trainguard.core.logs import kv
from trainguard.core.model import Result, Status
from trainguard.core.settings import Duration, Field, field_validator
from trainguard.core.text import linear, one_line
from trainguard.jobs.slurm import NodeRecord, SlurmError, SlurmMissingError

log = logging.getLogger("trainguard.checks.node_drain")

# A node in one of these goes away whatever its reason says: a reboot issued, a power-down under way.
GOING_FLAGS = frozenset({"REBOOT_ISSUED", "POWERING_DOWN", "POWER_DOWN"})
# Drained with this one, it reboots once its jobs are gone (`scontrol reboot ASAP`); without a drain (`scontrol
# reboot`), once idle: new jobs may still start there, so it is said, and nothing is asked of the job.
REBOOT_FLAG = "REBOOT_REQUESTED"
# The node is in an active maintenance reservation (`scontrol create reservation flags=maint,ignore_jobs`): sinfo says
# MAINTENANCE (SLURM 22.05, tests/data/slurm/sinfo-node-maint.txt); MAINT is the flag's name in SLURM's code.
MAINT_FLAGS = frozenset({"MAINT", "MAINTENANCE"})


class NodeDrainSettings(CheckSettings):
    interval: Duration = Field(60.0, gt=0, description="Time between runs: one `sinfo --nodes=NODE` each while a "
                               "SLURM job runs here (none otherwise). A maintenance gives minutes of notice.")
    timeout: Duration = Field(20.0, gt=0, description="Room for the SLURM command to time out first "
                              "(`jobs.slurm_timeout`, 10s): a silent controller is this check's `unknown_after` case, "
                              "not a run cut short.")
    unknown_after: Duration = Field(
        300.0, ge=0, description="How long slurmctld may stay silent before this check says UNKNOWN for the node: a "
                                 "restart of slurmctld takes seconds, and every node with a job would say it at once. "
                                 "Meanwhile each job's incident stays as it was.")
    alert_on_unknown: bool = Field(False, description="Whether a run that could not ask slurmctld (UNKNOWN) opens "
                                   "an incident: off, as a controller down is one fault of the cluster, not one alert "
                                   "from every node that runs a job; still said after `unknown_after` (`trainguard status`).")
    leave_reasons: list[str] = Field(
        default_factory=lambda: ["reboot", "maint", "power", "upgrad", "firmware", "replac", "rma", "decommission"],
        description="A drain whose reason has a word beginning with one of these (any case) takes the node away: "
                    "CRITICAL, the jobs here asked to save and leave. Any other drain by someone else is a WARNING "
                    "(the jobs may run to their end). A drain trainguard set is its own incident's, never this "
                    "check's.")
    checker_reasons: list[str] = Field(
        default_factory=lambda: ["NHC"],
        description="A drain whose reason begins with one of these (any case) is a health checker's, whose message may "
                    "quote a user's process or file name (NHC's `Rogue process ...`): a WARNING whatever its words, so "
                    "that no user can name a process `reboot` and have every job on the node stopped.")

    maintenance: Literal["ok", "warning", "critical"] = Field(
        "warning", description="A job on a node whose maintenance reservation has begun (`scontrol create reservation "
        "flags=maint,ignore_jobs`: the state flag MAINTENANCE): the site's window is open and its work may take the node "
        "with the job, or may not. `warning`: said, the job runs on; `critical`: the jobs asked to save and leave, as "
        "for a drain for a reboot (where the site's maintenance reservations always mean a reboot); `ok`: not said.")
    batch_host_actions: ActionBinding | None = Field(
        None, description="Instead of `actions`, for a job whose batch host this node is (details `batch_host`): its "
                          "batch script, and the relaunch loop in it, run here and go down with the node, so a restart "
                          "without this node cannot keep the job; bind `signal, requeue` where `actions` restart the "
                          "job without the node. None (`\"actions\"` in TOML, which has no null): `actions` for every job.")

    @field_validator("batch_host_actions", mode="before")
    @classmethod
    def _same_as_actions(cls, value: object) -> object:
        return same_as_actions(value)

    @field_validator("leave_reasons")
    @classmethod
    def _words(cls, value: list[str]) -> list[str]:
        words = [w.strip().lower() for w in value]
        if any(not w or not w.replace("_", "").replace("-", "").isalnum() or len(w) > 32 for w in words):
            raise ValueError("each a word of letters and digits (up to 32), matched at a word's start")
        return words

    @field_validator("checker_reasons")
    @classmethod
    def _prefixes(cls, value: list[str]) -> list[str]:
        # the reason is compared with its leading blanks stripped: a prefix with them, or none, would never match
        prefixes = [p.strip() for p in value]
        if any(not p or len(p) > 64 for p in prefixes):
            raise ValueError("each a reason's first characters (1 to 64, not blank)")
        return prefixes


class NodeDrainCheck(JobCheck):
    """One result per SLURM job running here, each saying what slurmctld holds of this node: CRITICAL when the node
    is going away (bind `signal`: save and exit, and `requeue` where the site wants the job back at once), WARNING
    when someone else drained it for another reason, OK otherwise."""

    layer = "node"
    scope = "node"  # this node's state, said by this node's agent: the job's other nodes are not drained
    Settings = NodeDrainSettings
    settings: NodeDrainSettings

    def __init__(self, name: str, settings: CheckSettings, context: CheckContext) -> None:
        super().__init__(name, settings, context)
        words = "|".join(self.settings.leave_reasons)
        self._leave = linear(rf"(?i)(?:^|[^a-z0-9])(?:{words})") if words else None
        self._silent_since: float | None = None  # when slurmctld stopped answering this check

    def run(self) -> Sequence[Result]:
        catalog = self.context.jobs
        if catalog is None or "slurm" not in catalog.sources:
            raise CheckIdle("no SLURM job source here ([jobs] sources)")
        view = catalog.view()
        jobs = [j for j in view.on_node() if j.source == "slurm" and j.job_id]
        if not jobs:
            errors = self.source_errors(view, ["slurm"])  # no job to save: slurmctld is not asked
            # A failed job source lists no job: that is no job gone, so their incidents stay as they are
            return PartialView(errors, "the SLURM job source failed") if errors else errors
        try:
            record = catalog.slurm.node(catalog.node)
        except SlurmMissingError as exc:
            raise CheckIdle(f"no SLURM commands here: {exc}") from None
        except SlurmError as exc:
            return self.silent(catalog.node, exc)
        self._silent_since = None
        status, why = self.evaluate(record)
        details = {"node": catalog.node, "node_state": record.state, "reason": record.reason,
                   "reason_by": record.reason_by, "reason_at": record.reason_at, "leaving": status is Status.CRITICAL}
        return [self.result(job.key, status, f"{job.label()} on {catalog.node}: {why}",
                            {**details, "job_key": job.key, "job_id": job.job_id,
                             "batch_host": job.batch_host == catalog.node}) for job in jobs]

    def silent(self, node: str, exc: SlurmError) -> PartialView:
        """A partial run: a job's incident stays as it was while slurmctld is silent (resolved, it would fire again at
        the controller's return and run its actions a second time: a second SIGUSR1, a second requeue). UNKNOWN for
        the node once the silence outlasts `unknown_after`."""
        now = self.context.clock()
        if self._silent_since is None:
            self._silent_since = now
            log.warning("slurmctld silent: node state unknown", extra=kv(check=self.name, node=node, error=str(exc)))
        silent = now - self._silent_since
        if silent < self.settings.unknown_after:
            return PartialView([], f"slurmctld silent for {silent:.0f}s: {exc}")
        unknown = self.result(f"node:{node}", Status.UNKNOWN,
                              f"{node}: its state unknown (slurmctld silent for {silent:.0f}s): {exc}", {"node": node})
        return PartialView([unknown], f"slurmctld silent: {exc}")

    def actions_for(self, event: Event) -> ActionBinding:
        """`batch_host_actions` for a job whose batch script runs on this node; else `actions`."""
        if event.details.get("batch_host") is True and self.settings.batch_host_actions is not None:
            return self.settings.batch_host_actions
        return self.settings.actions

    def evaluate(self, record: NodeRecord) -> tuple[Status, str]:
        """The status of a job on a node in this state, and what to say of it."""
        said = self.said(record)
        flags = record.flags
        if flags & GOING_FLAGS:
            return Status.CRITICAL, f"the node is going down ({record.state}){said}: save and leave now"
        if record.drained and REBOOT_FLAG in flags:  # `scontrol reboot ASAP`, whoever drained it first
            return Status.CRITICAL, f"the node reboots once its jobs are gone ({record.state}){said}: save and leave now"
        if record.drained and record.trainguards:
            return Status.OK, f"drained by trainguard ({record.state}): its own incident acts"
        if record.drained and self.leaving(record.reason) and not self.checkers(record.reason):
            return Status.CRITICAL, f"the node is drained to be taken away ({record.state}){said}: save and leave now"
        window = self.settings.maintenance if flags & MAINT_FLAGS else "ok"
        if window == "critical":
            return Status.CRITICAL, f"the node's maintenance window has begun ({record.state}){said}: save and leave now"
        if record.drained:
            return Status.WARNING, (f"the node is drained ({record.state}){said}: no job starts here; this one may "
                                    "run to its end")
        if window == "warning":
            return Status.WARNING, (f"the node's maintenance window has begun ({record.state}){said}: the site's work "
                                    "may take the node")
        if REBOOT_FLAG in flags:
            return Status.WARNING, f"the node reboots once idle ({record.state}){said}"
        return Status.OK, f"the node is in service ({record.state or 'state unknown'})"

    def checkers(self, reason: str) -> bool:
        start = reason.lstrip().lower()
        return any(start.startswith(prefix.lower()) for prefix in self.settings.checker_reasons)

    def leaving(self, reason: str) -> bool:
        return bool(reason) and self._leave is not None and self._leave.search(reason) is not None

    @staticmethod
    def said(record: NodeRecord) -> str:
        if not record.reason:
            return ""
        by = f" by {record.reason_by}" if record.reason_by else ""
        at = time.strftime(" at %H:%M", time.localtime(record.reason_at)) if record.reason_at else ""
        return f": {one_line(record.reason)[:160]!r}{by}{at}"
