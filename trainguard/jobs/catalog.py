"""JobCatalog: one cached view of the jobs from every configured source, shared by all checks and actions.

Sources are queried at most once per `refresh` period however many checks ask; a source that
fails (slurmctld down, squeue timing out) is reported in `errors`, never raised at the caller.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from trainguard.jobs.model import Job
from trainguard.jobs.settings import JobsSettings
from trainguard.jobs.slurm import SlurmClient, SlurmError
from trainguard.node.access import Identities
from trainguard.registry import JOB_SOURCES, load


class JobSource(Protocol):
    """A job source: one module in trainguard/jobs and one line in the registry's JOB_SOURCES. Built with the
    `[jobs]` settings, this node's name and the shared SLURM client; `jobs()` raises SlurmError or OSError on failure."""

    def jobs(self) -> Sequence[Job]: ...



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
        names = list(settings.sources) + (["process"] if settings.processes and "process" not in settings.sources else [])
        self._sources: dict[str, JobSource] = {
            name: load(JOB_SOURCES[name])(settings, self.node, self.slurm) for name in names}
        self.identities = Identities()  # whose authority a job's files are read with
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
