"""JobCatalog: one cached view of the jobs from every configured source, shared by all checks and actions.

Sources are queried at most once per `refresh` period however many checks ask; a source that
fails (slurmctld down, squeue timing out) is reported in `errors`, never raised at the caller.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import Field

from trainguard.core.settings import Duration, SettingsModel
from trainguard.jobs.model import Job
from trainguard.jobs.process import ProcessJobSettings, ProcessSource
from trainguard.jobs.slurm import SlurmClient, SlurmError, SlurmSource


def _default_sources() -> list[str]:
    return ["slurm"] if shutil.which("squeue") else []


class JobsSettings(SettingsModel):
    sources: list[Literal["slurm", "process"]] = Field(
        default_factory=_default_sources, description="Where jobs come from.",
        json_schema_extra={"default_doc": "`[\"slurm\"]` when squeue is installed, else `[]`"})
    slurm_timeout: Duration = Field(10.0, gt=0, description="Timeout of every SLURM command.")
    slurm_bin_dir: str = Field("", description="Directory of the SLURM commands; empty: PATH.")
    slurm_node: str = Field("", description="This node's SLURM name; empty: the agent's node_name.")
    switch_dir: str = Field("{workdir}/.trainguard",
                            description="Switch dir of a SLURM job; {workdir} {job_id} {array_job_id} {name} {user}.")
    stop_dir: Path = Field(Path("/run/trainguard/stop"), description="Root-owned dir: a file named after a job stops it.")
    refresh: Duration = Field(5.0, ge=0, description="How long one query of the sources is reused.")
    processes: dict[str, ProcessJobSettings] = Field(default_factory=dict, description="Plain-process jobs by name.")


@dataclass(frozen=True)
class JobView:
    jobs: tuple[Job, ...] = ()
    errors: dict[str, str] = field(default_factory=dict)
    taken: float = 0.0

    def on_node(self) -> list[Job]:
        return [j for j in self.jobs if j.on_this_node and j.running]

    def by_key(self, key: str) -> Job | None:
        return next((j for j in self.jobs if j.key == key), None)


class JobCatalog:
    def __init__(self, settings: JobsSettings, node: str, clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.node = settings.slurm_node or node
        self.clock = clock
        self.slurm = SlurmClient(settings.slurm_timeout, settings.slurm_bin_dir)
        self._sources: dict[str, SlurmSource | ProcessSource] = {}
        if "slurm" in settings.sources:
            self._sources["slurm"] = SlurmSource(self.slurm, self.node, settings.switch_dir)
        if "process" in settings.sources or settings.processes:
            self._sources["process"] = ProcessSource(settings.processes)
        self._lock = threading.Lock()
        self._view: JobView | None = None

    @property
    def sources(self) -> list[str]:
        return list(self._sources)

    def cached(self) -> JobView | None:
        """The last view, without querying anything (for /status)."""
        return self._view

    def view(self, max_age: float | None = None) -> JobView:
        max_age = self.settings.refresh if max_age is None else max_age
        with self._lock:  # concurrent callers share one query
            now = self.clock()
            if self._view is not None and now - self._view.taken <= max_age:
                return self._view
            jobs: list[Job] = []
            errors: dict[str, str] = {}
            for name, source in self._sources.items():
                try:
                    jobs.extend(source.jobs())
                except SlurmError as exc:
                    errors[name] = str(exc)
                except OSError as exc:
                    errors[name] = f"{type(exc).__name__}: {exc}"
            self._view = JobView(tuple(jobs), errors, now)
            return self._view
