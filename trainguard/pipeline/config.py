"""What a validated config is: the agent's own settings and the named checks, notifiers, actions and job sources.
Reading it from TOML is the daemon shell's job (trainguard.agent.configfile)."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from trainguard.actions.base import ActionSettings
from trainguard.checks.base import CheckSettings
from trainguard.core.settings import Field, SettingsModel, field_validator
from trainguard.core.text import linear
from trainguard.core.units import format_duration
from trainguard.jobs.settings import JobsSettings
from trainguard.jobs.slurmnode import cluster_name
from trainguard.notifiers.base import NotifierSettings
from trainguard.pipeline.ledger import LedgerSettings


def default_state_dir() -> Path:
    # systemd's StateDirectory= sets STATE_DIRECTORY; a non-root user can't write /var/lib.
    if os.environ.get("STATE_DIRECTORY"):
        return Path(os.environ["STATE_DIRECTORY"].split(":")[0])
    if os.geteuid() == 0:
        return Path("/var/lib/trainguard")
    return Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "trainguard"


_LISTEN = linear(r"^(?P<host>\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]*):(?P<port>\d{1,5})$")


DEFAULT_CONFIG_PATH = Path("/etc/trainguard/trainguard.toml")
CONFIG_ENV = "TRAINGUARD_CONFIG"


def resolve_config_path(cli_path: str | None) -> tuple[Path, bool]:
    """The path to read and whether the user named it (a named file that is missing is an error)."""
    if cli_path:
        return Path(cli_path), True
    if os.environ.get(CONFIG_ENV):
        return Path(os.environ[CONFIG_ENV]), True
    return DEFAULT_CONFIG_PATH, False


class ConfigError(Exception):
    """One or more problems in a config file, each naming the file and key path."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__("\n".join(f"config error in {source}: {p}" for p in problems))


class AgentSettings(SettingsModel):
    node_name: str = Field(default_factory=lambda: socket.gethostname().split(".")[0],
                           description="Name of this node in alerts.", json_schema_extra={"default_doc": "short hostname"})
    cluster: str = Field(default_factory=cluster_name, max_length=128,
                         description="Name of this cluster in alerts: Alertmanager groups a job's alerts from all its "
                                     "nodes by cluster and job id (deploy/alertmanager).",
                         json_schema_extra={"default_doc": "`ClusterName` of slurm.conf as SLURM's commands "
                                                           "find it (`$SLURM_CONF`, /etc/slurm, the configless "
                                                           "cache), else empty"})
    state_dir: Path = Field(default_factory=default_state_dir, description="Where incidents and the outbox persist.",
                            json_schema_extra={"default_doc": "`$STATE_DIRECTORY` (systemd), `/var/lib/trainguard` as root, "
                                                              "else `~/.local/state/trainguard`"})
    listen: str = Field("127.0.0.1:9721", description="HTTP address for /metrics, /healthz and /status; empty: off.")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    control_socket: Path | None = Field(None, description="The local socket where root and the agent's group read "
                                                          "/status with details.",
                                        json_schema_extra={"default_doc": "`control.sock` in `$RUNTIME_DIRECTORY` "
                                                                          "(systemd: /run/trainguard), else in state_dir"})

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        if value == "":
            return value
        match = _LISTEN.match(value)
        if not match or int(match.group("port")) > 65535:
            raise ValueError(f"invalid listen address {value!r}: expected HOST:PORT, e.g. '127.0.0.1:9721'")
        return value

    def control_path(self) -> Path:
        if self.control_socket is not None:
            return self.control_socket
        runtime = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
        return (Path(runtime) if runtime else self.state_dir) / "control.sock"

    def listen_address(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]") or "0.0.0.0", int(port)


def _late_staleness(name: str, settings: CheckSettings) -> str:
    """A job counts as hung after `stale_after`, but the check first sees a job at a run (its deadline timer wakes it
    only for jobs it has seen): a job that hangs before that run is reported up to an `interval` after its
    `stale_after` (20 s fired at 42 s with a 30 s interval), which such a `stale_after` is surely not meant to allow."""
    limits = [getattr(settings, "stale_after", None), *(getattr(settings, "stale_after_by_name", None) or {}).values()]
    shortest = min((v for v in limits if isinstance(v, (int, float))), default=None)
    if shortest is None or shortest >= settings.interval:
        return ""
    return (f"checks.{name}: stale_after {format_duration(shortest)} is shorter than interval "
            f"{format_duration(settings.interval)}: a hang may be reported up to an interval late; set interval to "
            "stale_after / 2 or less")


@dataclass(frozen=True)
class Config:
    agent: AgentSettings
    checks: Mapping[str, CheckSettings] = field(default_factory=dict)
    notifiers: Mapping[str, NotifierSettings] = field(default_factory=dict)
    source: Path | None = None
    jobs: JobsSettings = field(default_factory=JobsSettings)
    actions: Mapping[str, ActionSettings] = field(default_factory=dict)
    ledger: LedgerSettings = field(default_factory=LedgerSettings)

    def warnings(self) -> list[str]:
        """What is valid but almost surely not meant: said by `validate`, logged at start and reported by the agent's
        own check, so that an agent that watches nothing does not look healthy."""
        if not any(s.enabled for s in self.checks.values()):
            disabled = ", ".join(sorted(self.checks))
            return ["no check is enabled: the agent watches nothing" + (f" ({disabled} disabled)" if disabled else "")
                    + "; add [checks.NAME] tables (docs/configuration.md)"]
        return [w for name, s in self.checks.items() if s.enabled and (w := _late_staleness(name, s))]

    def kind_of_check(self, name: str) -> str:
        return self.checks[name].type or name

    def kind_of_notifier(self, name: str) -> str:
        return self.notifiers[name].type or name

    def kind_of_action(self, name: str) -> str:
        return self.actions[name].type or name

    def to_dict(self) -> dict[str, Any]:
        """The effective config; secrets come out as '**********'."""
        return {
            "source": str(self.source) if self.source else "(built-in default)",
            "agent": self.agent.model_dump(mode="json", by_alias=True),
            "checks": {n: {"type": self.kind_of_check(n), **s.model_dump(mode="json", by_alias=True, exclude={"type"})}
                       for n, s in self.checks.items()},
            "notifiers": {n: {"type": self.kind_of_notifier(n), **s.model_dump(mode="json", by_alias=True, exclude={"type"})}
                          for n, s in self.notifiers.items()},
            "jobs": self.jobs.model_dump(mode="json", by_alias=True),
            "actions": {n: {"type": self.kind_of_action(n), **s.model_dump(mode="json", by_alias=True, exclude={"type"})}
                        for n, s in self.actions.items()},
            "ledger": self.ledger.model_dump(mode="json", by_alias=True),
        }
