"""The explicit tables of check, action, notifier, job source and quota provider types. A new one is one module plus
one line here.

Entries are import paths so a type's heavy dependencies load only when it is configured.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

CHECKS: Mapping[str, str] = {
    "disk": "trainguard.checks.disk:DiskCheck",
    "memory": "trainguard.checks.memory:MemoryCheck",
    "gpu": "trainguard.checks.gpu:GpuCheck",
    "gpu_memory": "trainguard.checks.gpu_memory:GpuMemoryCheck",
    "xid": "trainguard.checks.xid:XidCheck",
    "kernel": "trainguard.checks.kernel:KernelCheck",
    "nvlink": "trainguard.checks.nvlink:NvlinkCheck",
    "pcie": "trainguard.checks.pcie:PcieCheck",
    "gpu_config": "trainguard.checks.gpu_config:GpuConfigCheck",
    "fabric": "trainguard.checks.fabric:FabricCheck",
    "infiniband": "trainguard.checks.infiniband:InfinibandCheck",
    "job_liveness": "trainguard.checks.job_liveness:JobLivenessCheck",
    "job_switch": "trainguard.checks.job_switch:SwitchCheck",
    "job_timelimit": "trainguard.checks.job_timelimit:TimeLimitCheck",
    "node_drain": "trainguard.checks.node_drain:NodeDrainCheck",
    "job_memory": "trainguard.checks.job_memory:JobMemoryCheck",
    "hang": "trainguard.checks.hang:HangCheck",
    "quota": "trainguard.checks.quota:QuotaCheck",
    "training_log": "trainguard.checks.training_log:TrainingLogCheck",
    "command": "trainguard.checks.command:CommandCheck",
    "job_pace": "trainguard.checks.job_pace:JobPaceCheck",
}

ACTIONS: Mapping[str, str] = {
    "signal": "trainguard.actions.signal:SignalAction",
    "switch": "trainguard.actions.switch:SwitchAction",
    "drain": "trainguard.actions.slurmctl:DrainAction",
    "resume": "trainguard.actions.slurmctl:ResumeAction",
    "requeue": "trainguard.actions.slurmctl:RequeueAction",
    "restart": "trainguard.actions.restart:RestartAction",
    "array": "trainguard.actions.slurmctl:ArrayPendingAction",
    "exec": "trainguard.actions.exec:ExecAction",
    "diag": "trainguard.actions.diag:DiagAction",
}

# Named actions every config has; `[actions.NAME]` adds more or redefines these.
BUILTIN_ACTIONS: Mapping[str, Mapping[str, str]] = {
    "signal": {"type": "signal"},
    "save": {"type": "switch", "switch": "save"},
    "stop": {"type": "switch", "switch": "stop"},
    "drain": {"type": "drain"},
    "resume": {"type": "resume"},
    "requeue": {"type": "requeue"},
    "restart": {"type": "restart"},
    "hold-array": {"type": "array", "mode": "hold"},
    "diag": {"type": "diag"},
}

# Where jobs come from (`[jobs] sources`): each a class built with (JobsSettings, node name, SlurmClient,
# ProcessSnapshots) whose `jobs()` lists them.
JOB_SOURCES: Mapping[str, str] = {
    "slurm": "trainguard.jobs.slurmsource:SlurmSource",
    "process": "trainguard.jobs.process:ProcessSource",
}

# Where the quota check gets its figures (`provider = "..."`).
QUOTA_PROVIDERS: Mapping[str, str] = {
    "quota": "trainguard.quota.providers:QuotaToolProvider",
    "lustre": "trainguard.quota.providers:LustreProvider",
    "gpfs": "trainguard.quota.providers:GpfsProvider",
    "beegfs": "trainguard.quota.providers:BeegfsProvider",
    "command": "trainguard.quota.providers:CommandProvider",
    "budget": "trainguard.quota.providers:BudgetProvider",
}

NOTIFIERS: Mapping[str, str] = {
    "console": "trainguard.notifiers.console:ConsoleNotifier",
    "slack": "trainguard.notifiers.slack:SlackNotifier",
    "email": "trainguard.notifiers.email:EmailNotifier",
    "alertmanager": "trainguard.notifiers.alertmanager:AlertmanagerNotifier",
    "webhook": "trainguard.notifiers.webhook:WebhookNotifier",
}


def load(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class Registry:
    checks: Mapping[str, str | type] = field(default_factory=lambda: dict(CHECKS))
    notifiers: Mapping[str, str | type] = field(default_factory=lambda: dict(NOTIFIERS))
    actions: Mapping[str, str | type] = field(default_factory=lambda: dict(ACTIONS))

    def check_class(self, kind: str) -> Any:
        return self._resolve(self.checks, kind, "check")

    def notifier_class(self, kind: str) -> Any:
        return self._resolve(self.notifiers, kind, "notifier")

    def action_class(self, kind: str) -> Any:
        return self._resolve(self.actions, kind, "action")

    @staticmethod
    def _resolve(table: Mapping[str, str | type], kind: str, what: str) -> Any:
        if kind not in table:
            raise KeyError(f"unknown {what} type {kind!r} (known: {', '.join(sorted(table))})")
        entry = table[kind]
        return load(entry) if isinstance(entry, str) else entry


DEFAULT_REGISTRY = Registry()
