"""SwitchCheck: the kill and save switch files a job's owner, root or a teammate (a member of `switch_group`) touches,
relayed to the bound actions."""

from __future__ import annotations

import grp
import os
import stat
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from trainguard.checks.base import CheckSettings, JobCheck
from trainguard.core.model import Result, Status
from trainguard.core.settings import Duration, Field
from trainguard.jobs.catalog import JobView
from trainguard.jobs.model import Job
from trainguard.jobs.settings import STOP_DIR
from trainguard.node.access import Identity, stat_as
from trainguard.node.inotify import DirWatcher


class SwitchCheckSettings(CheckSettings):
    switch: Literal["stop", "save"] = Field("stop", description="Which switch file this check watches.")
    switch_group: str | None = Field(None, description="A group whose members' switch files count too (teammates "
                                     "who may stop a run); the trainer helper needs the same group "
                                     "(`$TRAINGUARD_SWITCH_GROUP`).",
                                     json_schema_extra={"default_doc": "none: the job's owner and root only"})
    interval: Duration = Field(2.0, gt=0, description="Time between runs.")
    jitter: Duration = Field(0.0, ge=0)


@dataclass(frozen=True)
class SwitchFile:
    path: Path
    uid: int
    mtime: float


def find_switch(job: Job, switch: str, stop_dir: Path, identity: Callable[[Job], Identity],
                operator_stops: Collection[str] | None = None) -> list[SwitchFile]:
    """The switch files of `job` that exist as regular files: in its switch dir, looked up with the job user's
    authority (`identity(job)`: a dir they cannot search holds no request of theirs), and the operator's per-job-name
    stop file. `operator_stops`: the names in `stop_dir`, listed once for a run's jobs (None: look for each job).
    Paths as strings until one is found: the check runs every 2 s for every job, nearly always finding nothing, and
    building Paths was half of that. The switch dir is walked as the user every time, never first looked at with
    the agent's own rights: that would reach where the user cannot (another user's hung mount)."""
    candidates: list[tuple[str, Identity | None]] = []
    if job.switch_dir:
        candidates.append((os.path.join(job.switch_dir, switch), identity(job)))
    if switch == "stop" and job.name not in ("", ".", "..") and "/" not in job.name \
            and (operator_stops is None or job.name in operator_stops):  # a name is not a path
        candidates.append((os.path.join(stop_dir, job.name), None))  # root's own directory: the agent's authority
    found = []
    for path, reader in candidates:
        try:
            st = stat_as(reader, path, follow_symlinks=False) if reader is not None else os.lstat(path)
        except OSError:  # absent, or the switch dir is gone or not searchable: no request
            continue
        if stat.S_ISREG(st.st_mode):  # as the trainer helper counts them: a link or a FIFO is no switch
            found.append(SwitchFile(Path(path), st.st_uid, st.st_mtime))
    return found


def listed(directory: Path) -> frozenset[str]:
    """The names in `directory`; none where it is absent or unreadable (the operator's stop dir is usually empty or
    missing: one system call instead of one per job)."""
    try:
        return frozenset(os.listdir(directory))
    except OSError:
        return frozenset()


class SwitchCheck(JobCheck):
    """A switch touched by the job's owner, root or a member of `switch_group` is a request: WARNING, so the bound
    actions relay it.

    One created by anyone else is ignored: UNKNOWN, naming that user.
    """

    scope = "job"
    Settings = SwitchCheckSettings
    settings: SwitchCheckSettings
    _watcher: DirWatcher | None = None

    def start(self, wake: Callable[[], None]) -> None:
        """Run the moment a switch appears (inotify on the switch dirs this check already looks in, and the operator's
        stop dir): a trainer that saves and exits within the `interval` ended before the hold reached its array's next
        task. The watch only wakes the check; the lookups below decide, with the job user's authority."""
        self._watcher = DirWatcher([self.settings.switch], wake, name=f"inotify-{self.name}")

    def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.close()

    def candidates(self, view: JobView) -> list[Job]:
        """Running jobs; for `stop`, also finished tasks of an array that may still have tasks pending, since the
        trainer may honour the switch and exit before this check next runs. The source asks the controller once when
        a task ends; until it answered (`array_pending` unknown) the task counts: the next task may start any moment,
        and `hold-array` itself holds only what is pending."""
        running = view.on_node()
        if self.settings.switch != "stop":
            return running
        finished = [j for j in view.jobs if j.on_this_node and not j.running and j.array_job_id
                    and j.extra.get("array_pending") is not False]
        return running + finished

    def teammate(self, uid: int) -> bool:
        """A member of `switch_group`, by the owner's groups as NSS lists them (as the trainer helper decides); never
        by the file's group, which anyone who may write a setgid directory gets."""
        if not self.settings.switch_group or self.context.jobs is None:
            return False
        try:
            gid = grp.getgrnam(self.settings.switch_group).gr_gid
        except KeyError:  # unknown on this node (NSS down, a typo): nobody is a teammate
            return False
        return gid in self.context.jobs.identities.of(uid).gids

    def run(self) -> Sequence[Result]:
        view = self.view()
        stop_dir = self.context.jobs.settings.stop_dir if self.context.jobs else STOP_DIR
        out = self.source_errors(view, ["slurm", "process"])
        seen: set[Path] = set()
        candidates = self.candidates(view)
        if self._watcher is not None:
            self._watcher.watch([j.switch_dir for j in candidates if j.switch_dir],
                                [str(stop_dir)] if candidates and self.settings.switch == "stop" else ())
        stops = listed(stop_dir) if candidates and self.settings.switch == "stop" else frozenset()
        for job in candidates:
            for sw in find_switch(job, self.settings.switch, stop_dir, self.identity, stops):
                if sw.path in seen:  # array tasks share a switch dir: one request, one incident
                    break
                seen.add(sw.path)
                by = self.context.user_names.get(sw.uid) or f"uid {sw.uid}"  # for display: the uid decides
                details = {"job_key": job.key, "job_id": job.job_id, "path": str(sw.path), "by": by,
                           "switch": self.settings.switch}
                if sw.path.parent == stop_dir:
                    # the operator's stop dir is this node's own (/etc): the other nodes of the job do not see it
                    details["scope"] = "node"
                subject = f"{job.key}:{self.settings.switch}"
                if sw.uid not in (0, job.uid) and not self.teammate(sw.uid):
                    allowed = f"{job.user}, root or a member of {self.settings.switch_group}" \
                        if self.settings.switch_group else f"{job.user} or root"
                    out.append(self.result(subject, Status.UNKNOWN,
                                           f"ignored {self.settings.switch} switch for {job.label()}: {sw.path} was "
                                           f"created by {by}, not by the job's owner {allowed}",
                                           details))
                else:
                    out.append(self.result(subject, Status.WARNING,
                                           f"{self.settings.switch} switch touched for {job.label()} by {by}",
                                           details))
                break
        return out
