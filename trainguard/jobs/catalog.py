"""JobCatalog: one cached view of the jobs from every configured source, shared by all checks and actions.

A view is listed again when a source says something changed (a job step started or ended on this node, a prolog
ran, a record came back from slurmctld: cheap probes, asked at every call) or once it is `refresh` old; an
action asks for a fresh one. A source that fails is reported in `errors`, and one that answers from its cache
because slurmctld does not answer in `stale`; neither is raised at the caller.

The catalog also holds the node's shared process snapshot (`processes`): the per-job checks of one round find
their jobs' process trees in one pass over /proc.
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
from trainguard.node.proctable import ProcessSnapshots, ProcessTable
from trainguard.registry import JOB_SOURCES, load


class JobSource(Protocol):
    """A job source: one module in trainguard/jobs and one line in the registry's JOB_SOURCES. Built with the
    `[jobs]` settings, this node's name, the shared SLURM client and the shared process snapshot; `jobs()` raises
    SlurmError or OSError on failure. Optional: `changed()` (a cheap probe: would a listing now differ?),
    `stale()` (why what it lists may be out of date), `refresh(job_id)`, `listen(callback)` (news of a job starting
    here, between listings), `close()`."""

    def jobs(self) -> Sequence[Job]: ...


@dataclass(frozen=True)
class JobView:
    jobs: tuple[Job, ...] = ()
    errors: dict[str, str] = field(default_factory=dict)
    taken: float = 0.0
    stale: dict[str, str] = field(default_factory=dict)  # source -> why it answered from its cache

    def on_node(self) -> list[Job]:
        return [j for j in self.jobs if j.on_this_node and j.running]

    def by_key(self, key: str) -> Job | None:
        return next((j for j in self.jobs if j.key == key), None)


class JobCatalog:
    def __init__(self, settings: JobsSettings, node: str, clock: Callable[[], float] = time.time,
                 processes: ProcessSnapshots | None = None) -> None:
        self.settings = settings
        self.node = settings.slurm_node or node
        self.clock = clock
        self.slurm = SlurmClient(settings.slurm_timeout, settings.slurm_bin_dir)
        self.snapshots = processes or ProcessSnapshots()
        self._names = list(settings.sources) + (["process"] if settings.processes and "process" not in settings.sources
                                                else [])
        self._built: dict[str, JobSource] | None = None
        self._build_lock = threading.Lock()
        self.identities = Identities()  # whose authority a job's files are read with
        self._lock = threading.Lock()
        self._view: JobView | None = None
        # Fresh listings begun, and the one `_view` came from (0: a listing that may reuse a process table a few
        # seconds old): a fresh view is any fresh listing begun after the caller asked.
        self._begun = 0
        self._view_from = 0

    @property
    def _sources(self) -> dict[str, JobSource]:
        """The sources, made at their first use: an agent whose checks and actions never ask for jobs starts none
        (no slurmd discovery, no log line about it)."""
        with self._build_lock:
            if self._built is None:
                self._built = {name: load(JOB_SOURCES[name])(self.settings, self.node, self.slurm, self.snapshots)
                               for name in self._names}
            return self._built

    @property
    def sources(self) -> list[str]:
        return list(self._names)

    def cached(self) -> JobView | None:
        """The last view, without querying anything (for /status)."""
        return self._view

    def processes(self) -> ProcessTable:
        """The shared snapshot of this node's processes (a few seconds old at most)."""
        return self.snapshots.get()

    def view(self, max_age: float | None = None, fresh: bool = False) -> JobView:
        """The jobs now: the last listing unless a source changed, it is older than `max_age` (default `refresh`),
        or `fresh` (an action about to act on them). Fresh callers waiting together share one listing begun after
        they asked: a kernel log replayed with 200 GPUs' faults starts 200 actions at once, and they cost two listings
        (and two sets of SLURM calls), not 200 one after another."""
        max_age = self.settings.refresh if max_age is None else max_age
        asked = self._begun
        with self._lock:  # concurrent callers share one listing
            if self._view is not None and fresh and self._view_from > asked:
                return self._view
            if (self._view is not None and not fresh and self.clock() - self._view.taken <= max_age
                    and not any(self._changed(s) for s in self._sources.values())):
                return self._view
            begun = 0
            if fresh:
                self._begun += 1
                begun = self._begun
            now = self.clock()  # after the count: a caller that takes this listing asked before it began
            if fresh:  # the processes of a job that started a moment ago too
                self.snapshots.get(max_age=0.0)
            jobs: list[Job] = []
            errors: dict[str, str] = {}
            stale: dict[str, str] = {}
            for name, source in self._sources.items():
                try:
                    jobs.extend(source.jobs())
                except SlurmError as exc:
                    errors[name] = str(exc)
                except OSError as exc:
                    errors[name] = f"{type(exc).__name__}: {exc}"
                reason = getattr(source, "stale", lambda: None)()
                if reason:
                    stale[name] = reason
            self._view, self._view_from = JobView(tuple(jobs), errors, now, stale), begun
            return self._view

    @staticmethod
    def _changed(source: JobSource) -> bool:
        probe = getattr(source, "changed", None)
        return bool(probe()) if probe is not None else False

    def refresh(self, job: Job, max_age: float = 0.0) -> None:
        """Ask the job's source to fetch what only the controller knows again, unless what it has is younger than
        `max_age` (rate-limited by the source too)."""
        source = self._sources.get(job.source)
        ask = getattr(source, "refresh", None)
        if ask is not None and job.job_id:
            ask(job.job_id, max_age)

    def listen(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Have `callback` called (from a source's thread; it must return at once) when a source has news of a job
        starting on this node, between listings. Returns what stops it."""
        stops = [listen(callback) for source in self._sources.values()
                 if (listen := getattr(source, "listen", None)) is not None]

        def stop() -> None:
            for one in stops:
                one()
        return stop

    def settle(self, timeout: float, listed: bool = False) -> None:
        """List the jobs (unless the caller just took a fresh listing: `listed`), then wait (`timeout` at most) for
        what their sources fetch in the background."""
        if not listed:
            self.view(fresh=True)
        for source in self._sources.values():
            wait = getattr(source, "settle", None)
            if wait is not None:
                wait(timeout)

    def close(self) -> None:
        for source in (self._built or {}).values():  # never made: nothing to stop
            stop = getattr(source, "close", None)
            if stop is not None:
                stop()
