"""The check interface: a small class with a name, validated settings and `run()` returning results."""

from __future__ import annotations

import json
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field, PositiveInt

from trainguard.core.logs import kv
from trainguard.core.model import Result, Sample, Status
from trainguard.core.settings import Duration, SettingsModel
from trainguard.jobs.catalog import JobCatalog

log = logging.getLogger("trainguard.checks")


class ActionBinding(SettingsModel):
    """Which named actions run when an incident of this check fires at (or escalates to) a status."""

    warning: list[str] = Field(default_factory=list)
    critical: list[str] = Field(default_factory=list)
    resolved: list[str] = Field(default_factory=list, description="Run when the incident resolves, e.g. resume.")

    def for_status(self, status: Status) -> list[str]:
        return {Status.WARNING: self.warning, Status.CRITICAL: self.critical}.get(status, [])


class CheckSettings(SettingsModel):
    """Settings every check has: its schedule, its time budget and its incident policy."""

    type: str | None = Field(None, description="Check type; defaults to the table name.")
    enabled: bool = True
    interval: Duration = Field(30.0, gt=0, description="Time between runs.")
    timeout: Duration = Field(10.0, gt=0, description="A run still going after this is reported UNKNOWN.")
    jitter: Duration = Field(1.0, ge=0, description="Random delay added to each run, to spread load.")
    fire_after: Duration = Field(0.0, ge=0, description="How long a problem must last before its incident fires.")
    fire_after_runs: PositiveInt = Field(1, description="How many consecutive bad runs before its incident fires.")
    repeat_interval: Duration = Field(4 * 3600.0, gt=0, description="Reminder interval while an incident fires.")
    alert_on_unknown: bool = Field(True, description="Whether UNKNOWN (check broken, mount hung) opens incidents.")
    actions: ActionBinding = Field(default_factory=ActionBinding,
                                   description="Named actions run when an incident fires or escalates.")


@dataclass(frozen=True)
class CheckContext:
    """What the agent hands every check: where it runs and the seams tests drive."""

    node: str
    state_dir: Path
    clock: Callable[[], float] = time.time
    extras: Mapping[str, Any] = field(default_factory=dict)
    jobs: JobCatalog | None = None
    store: Any = None  # key/value persistence (get/put) for cursors and offsets


class Check(ABC):
    """Subclasses set `Settings` and implement `run()`. They hold no alert state; the agent owns incidents."""

    Settings: ClassVar[type[CheckSettings]] = CheckSettings

    def __init__(self, name: str, settings: CheckSettings, context: CheckContext) -> None:
        self.name = name
        self.settings = settings
        self.context = context

    @abstractmethod
    def run(self) -> Sequence[Result]:
        """Gather, evaluate and summarize. May raise or block: the runner turns that into data."""

    def start(self, wake: Callable[[], None]) -> None:  # noqa: B027 - optional hook
        """Event-driven checks start their watchers here and call `wake()` to be run at once."""

    def stop(self) -> None:  # noqa: B027 - optional hook
        """Stop what `start` started."""

    def load_state(self, key: str) -> dict[str, Any]:
        """A JSON object this check saved in the store (counters, positions); {} when absent or unreadable."""
        store = self.context.store
        try:
            data = json.loads((store.get(key) if store is not None else None) or "{}")
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {}

    def save_state(self, key: str, data: Mapping[str, Any]) -> None:
        """Save what `load_state` reads back; a failure is logged, never raised: state is only a head start."""
        store = self.context.store
        if store is None:
            return
        try:
            store.put(key, json.dumps(data))
        except Exception as exc:  # noqa: BLE001 - the store may be closing or broken; the run's results still count
            log.warning("saving check state failed", extra=kv(check=self.name, key=key, error=exc))

    def result(
        self,
        subject: str,
        status: Status,
        summary: str,
        details: Mapping[str, Any] | None = None,
        samples: Sequence[Sample] = (),
    ) -> Result:
        return Result(self.name, subject, status, summary, details or {}, tuple(samples))
