"""QuotaCheck: user, group, project and fileset quotas, and directory budgets, in bytes and inodes.

A training job rarely fills its filesystem; it hits its quota first, often the inode quota, and the
next checkpoint write fails. The thresholds and the time-to-full forecast are the disk check's own
(CapacityTracker); this module only turns quota records into capacities and adds the grace rules.
"""

from __future__ import annotations

import grp
import pwd
from collections.abc import Sequence
from typing import Any, Literal

from trainguard.checks.base import Check, CheckContext, CheckSettings
from trainguard.checks.capacity import CapacitySettings, CapacityTracker, Usage, Verdict, summarize, time_to_full
from trainguard.core.model import Metric, Result, Status, worst
from trainguard.core.settings import Duration, Field, Size, model_validator
from trainguard.core.text import linear
from trainguard.core.units import format_duration
from trainguard.quota.parsers import QuotaUsage
from trainguard.quota.providers import Provider, QuotaError
from trainguard.registry import QUOTA_PROVIDERS, load

Kind = Literal["user", "group", "project", "fileset", "dir"]

_Q = ("filesystem", "kind", "owner", "scope")  # scope: `pool:NAME`, `fileset:NAME` or "" (the whole filesystem)
USED_BYTES = Metric("trainguard_quota_used_bytes", "Bytes counted against the quota.", _Q)
LIMIT_BYTES = Metric("trainguard_quota_limit_bytes", "The quota's byte limit in use (hard or soft).", _Q)
USED_INODES = Metric("trainguard_quota_used_inodes", "Inodes counted against the quota.", _Q)
LIMIT_INODES = Metric("trainguard_quota_limit_inodes", "The quota's inode limit in use.", _Q)
TIME_TO_FULL = Metric("trainguard_quota_time_to_full_seconds", "Forecast time until the quota is full (+Inf: never).",
                      (*_Q, "resource"))
METRICS = (USED_BYTES, LIMIT_BYTES, USED_INODES, LIMIT_INODES, TIME_TO_FULL)


class QuotaSettings(CapacitySettings):
    interval: Duration = Field(300.0, gt=0, description="Quota figures lag by minutes anyway.")
    timeout: Duration = Field(60.0, gt=0)
    provider: Literal["quota", "lustre", "gpfs", "beegfs", "command", "budget"] = Field(
        description="Where the figures come from.")
    mounts: list[str] = Field(default_factory=list, description="Filesystems to ask about (lustre: mount points, "
                                                                "gpfs: devices, budget: directories).")
    kinds: list[Kind] = Field(default_factory=lambda: ["user", "group"], description="Owner kinds to check.")
    owners: list[str] = Field(default_factory=list, description="Users and groups; empty: those of the jobs here.")
    projects: list[str] = Field(default_factory=list, description="Project ids (kind project).")
    filesets: list[str] = Field(default_factory=list, description="GPFS filesets (kind fileset).")
    limit: Literal["hard", "soft"] = Field("hard", description="Which limit the thresholds apply to.")
    effective_fraction: float = Field(1.0, gt=0, le=1, description="Share of the nominal limit usable in practice "
                                                                     "(some filesystems give ~0.8).")
    breakdown: bool = Field(False, description="lustre: per-MDT/OST usage in the details (lfs quota -v).")
    pools: list[str] = Field(default_factory=list, description="lustre: OST pools whose quotas are checked too, each "
                                                               "a subject of its own (lfs quota --pool).")
    command_timeout: Duration = Field(20.0, gt=0, description="Timeout of each provider command.")
    command: list[str] = Field(default_factory=list, description="command: argv with {owner} {kind} {mount}.")
    format: Literal["regex", "json"] = Field("regex", description="command: how `fields` read its output.")
    fields: dict[str, str] = Field(default_factory=dict, description="command: bytes_used, bytes_soft, bytes_hard, "
                                                                     "inodes_used, ... -> regex (group 1) or JSON pointer.")
    size_unit: Size = Field(1, description="command: bytes per unit of the byte fields.")
    bytes_budget: Size | None = Field(None, description="budget: bytes allowed under each directory.")
    inodes_budget: int | None = Field(None, gt=0, description="budget: files and directories allowed.")
    walk_budget: Duration = Field(2.0, gt=0, description="budget: time spent walking per run.")

    @model_validator(mode="after")
    def _provider_needs(self) -> QuotaSettings:
        if self.provider == "budget":
            if not self.mounts or (self.bytes_budget is None and self.inodes_budget is None):
                raise ValueError("provider budget needs mounts (directories) and bytes_budget or inodes_budget")
        if self.provider == "command" and (not self.command or ("bytes_used" not in self.fields and
                                           "inodes_used" not in self.fields)):
            raise ValueError("provider command needs command and fields (bytes_used and/or inodes_used)")
        if self.provider in ("lustre", "gpfs") and not self.mounts:
            raise ValueError(f"provider {self.provider} needs mounts")
        if self.provider == "command" and self.format == "regex":
            for name, pattern in self.fields.items():
                try:
                    linear(pattern)
                except ValueError as exc:
                    raise ValueError(f"fields.{name}: {exc}") from None
        return self


def capacity(q: QuotaUsage, s: QuotaSettings) -> Usage:
    """A quota as a disk-like capacity: the limit is the size, what is left under it is free."""
    b_limit = (q.bytes_hard if s.limit == "hard" else q.bytes_soft or q.bytes_hard) or 0
    i_limit = (q.inodes_hard if s.limit == "hard" else q.inodes_soft or q.inodes_hard) or 0
    b_limit, i_limit = int(b_limit * s.effective_fraction), int(i_limit * s.effective_fraction)
    label = f"budget of {q.filesystem}" if q.kind == "dir" else f"{q.kind} {q.owner} on {q.filesystem}"
    if q.scope:
        label += f" ({q.scope.replace(':', ' ', 1)})"
    return Usage(label, q.filesystem, "", b_limit,
                 max(0, b_limit - (q.bytes_used or 0)), i_limit, max(0, i_limit - (q.inodes_used or 0)))


def grace(q: QuotaUsage) -> tuple[Status, list[str]]:
    """Over a soft limit: WARNING while grace remains; CRITICAL once it ran out (writes now fail). A figure the tool
    marked inaccurate, or a target that did not answer, is a WARNING that says so; the figures there are still
    graded, since a quota that is half-known is still the quota that fails the next write."""
    statuses, reasons = [Status.OK], []
    if q.problems or q.inaccurate:
        statuses.append(Status.WARNING)
        reasons.extend(q.problems)
        if q.inaccurate:
            reasons.append(f"inaccurate figures: {', '.join(q.inaccurate)}")
    for what, left in (("space", q.bytes_grace), ("inodes", q.inodes_grace)):
        if left is None:
            continue
        if left <= 0:
            statuses.append(Status.CRITICAL)
            reasons.append(f"{what} over the soft limit and its grace period has expired: writes fail")
        else:
            statuses.append(Status.WARNING)
            reasons.append(f"{what} over the soft limit, {format_duration(left)} of grace left")
    return worst(statuses), reasons


def job_owners(context: CheckContext) -> dict[str, list[str]]:
    """Users and primary groups of the jobs running on this node."""
    users: dict[str, None] = {}
    groups: dict[str, None] = {}
    if context.jobs is None:
        return {"user": [], "group": []}
    for job in context.jobs.view().on_node():
        if not job.user:
            continue
        users[job.user] = None
        try:
            groups[grp.getgrgid(pwd.getpwnam(job.user).pw_gid).gr_name] = None
        except KeyError:
            continue
    return {"user": list(users), "group": list(groups)}


class QuotaCheck(Check):
    Settings = QuotaSettings
    metrics = METRICS
    settings: QuotaSettings

    def __init__(self, name: str, settings: CheckSettings, context: CheckContext) -> None:
        super().__init__(name, settings, context)
        self.provider: Provider = load(QUOTA_PROVIDERS[self.settings.provider])(self.settings)
        self.tracker = CapacityTracker(self.settings)

    def targets(self) -> list[tuple[str, str]]:
        s = self.settings
        if s.provider == "budget":
            return [("dir", path) for path in s.mounts]
        found = job_owners(self.context) if not s.owners else {"user": s.owners, "group": s.owners}
        out = []
        for kind in s.kinds:
            names = {"project": s.projects, "fileset": s.filesets}.get(kind, found.get(kind, []))
            out.extend((kind, owner) for owner in names)
        return out

    def run(self) -> Sequence[Result]:
        results = []
        for kind, owner in self.targets():
            try:
                records = self.provider.query(kind, owner)
            except QuotaError as exc:
                results.append(self.result(f"{kind}:{owner}", Status.UNKNOWN, f"{kind} {owner}: {exc}",
                                           {"kind": kind, "owner": owner, "provider": self.settings.provider}))
                continue
            results.extend(self._one(q) for q in records)
        if not results:
            return [self.result("owners", Status.OK, "no quota owners to check (no jobs on this node)")]
        return results

    def _one(self, q: QuotaUsage) -> Result:
        usage = capacity(q, self.settings)
        key = f"{q.kind}:{q.owner}@{q.filesystem}" + (f"[{q.scope}]" if q.scope else "")
        now = self.context.clock()
        verdict, bytes_fc, inodes_fc = self.tracker.assess(key, usage, now)
        grace_status, grace_reasons = grace(q)
        verdict = Verdict(worst([verdict.status, grace_status]), (*grace_reasons, *verdict.reasons))
        summary = summarize(usage, verdict)
        if q.measured_at is None and q.kind == "dir":
            summary += " (first walk still running: a lower bound)"
        elif q.measured_at is not None:
            summary += f" (measured {format_duration(max(0.0, now - q.measured_at))} ago)"
        labels = {"filesystem": q.filesystem, "kind": q.kind, "owner": q.owner, "scope": q.scope}
        samples = []
        for metric, value in ((USED_BYTES, q.bytes_used), (LIMIT_BYTES, usage.size or None),
                              (USED_INODES, q.inodes_used), (LIMIT_INODES, usage.files or None)):
            if value is not None:
                samples.append(metric(value, labels))
        details: dict[str, Any] = {**labels, **{k: list(v) if isinstance(v, tuple) else v
                                                for k, v in q.__dict__.items() if k != "extra"}, **q.extra}
        samples += time_to_full(TIME_TO_FULL, labels, bytes_fc, inodes_fc, details)
        return self.result(key, verdict.status, summary, details, samples)
