"""DiskCheck: free bytes and free inodes per path or per real mount, with a time-to-full forecast."""

from __future__ import annotations

import os
from collections.abc import Sequence

from trainguard.checks.base import Check, CheckContext, CheckSettings
from trainguard.checks.capacity import CapacitySettings, CapacityTracker, Usage, summarize, time_to_full
from trainguard.core.model import Metric, Result, Status, worst
from trainguard.core.settings import Duration, Field, Regex, field_validator, model_validator
from trainguard.core.units import format_duration
from trainguard.core.worker import KEEP_S
from trainguard.node.mounts import (
    PSEUDO_FSTYPES,
    PSEUDO_MOUNTPOINTS,
    Mount,
    StatfsProbe,
    Stuck,
    mount_of,
    read_mounts,
    real_mounts,
)

_FS = ("path", "device", "fstype")
SIZE = Metric("trainguard_filesystem_size_bytes", "Filesystem size in bytes.", _FS)
AVAIL = Metric("trainguard_filesystem_avail_bytes", "Bytes available to unprivileged users.", _FS)
FILES = Metric("trainguard_filesystem_files", "Inodes in the filesystem.", _FS)
FILES_FREE = Metric("trainguard_filesystem_files_free", "Inodes available to unprivileged users.", _FS)
DEVICE_ERROR = Metric("trainguard_filesystem_device_error", "1 if the filesystem could not be read (statvfs failed or hung).",
                      _FS)
TIME_TO_FULL = Metric("trainguard_filesystem_time_to_full_seconds",
                      "Forecast time until full at the current robust growth trend (+Inf: never).", (*_FS, "resource"))
METRICS = (SIZE, AVAIL, FILES, FILES_FREE, DEVICE_ERROR, TIME_TO_FULL)


class DiskSettings(CapacitySettings):
    paths: list[str] = Field(default_factory=list, description="Paths to watch; empty: every real mount.")
    exclude_fstypes: list[str] = Field(default_factory=lambda: list(PSEUDO_FSTYPES),
                                       description="Filesystem types skipped when watching every mount.")
    exclude_mountpoints: Regex = Field(PSEUDO_MOUNTPOINTS, description="Regex of mount points skipped likewise.")
    mount_timeout: Duration = Field(5.0, gt=0, description="statvfs slower than this marks the mount not responding.")

    @field_validator("paths")
    @classmethod
    def _absolute(cls, paths: list[str]) -> list[str]:
        for p in paths:
            if not p.startswith("/"):
                raise ValueError(f"path {p!r} is not absolute")
        return paths

    @model_validator(mode="after")
    def _mount_timeout_fits(self) -> DiskSettings:
        if self.mount_timeout >= self.timeout:
            raise ValueError(f"mount_timeout ({self.mount_timeout:g}s) must be shorter than timeout ({self.timeout:g}s)")
        return self


def gather(path: str, st: os.statvfs_result, mount: Mount | None) -> Usage:
    return Usage(path, mount.device if mount else "", mount.fstype if mount else "",
                 st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize, st.f_files, st.f_favail)


class DiskCheck(Check):
    Settings = DiskSettings
    metrics = METRICS
    settings: DiskSettings

    def __init__(self, name: str, settings: CheckSettings, context: CheckContext) -> None:
        super().__init__(name, settings, context)
        # the probe's thread waits for the next run rather than being started again for it
        self.probe = StatfsProbe(clock=context.clock, keep=self.settings.interval + KEEP_S)
        self.tracker = CapacityTracker(self.settings)

    def stop(self) -> None:
        self.probe.close()

    def _targets(self) -> list[tuple[str, Mount | None]]:
        mounts = read_mounts(self.context.proc)
        if self.settings.paths:
            return [(p, mount_of(p, mounts)) for p in self.settings.paths]
        visible = real_mounts(mounts, self.settings.exclude_fstypes, self.settings.exclude_mountpoints)
        return [(m.mountpoint, m) for m in visible]

    def run(self) -> Sequence[Result]:
        return [self._one(path, mount) for path, mount in self._targets()]

    def _one(self, path: str, mount: Mount | None) -> Result:
        labels = {"path": path, "device": mount.device if mount else "", "fstype": mount.fstype if mount else ""}
        error = DEVICE_ERROR(1, labels)
        outcome = self.probe.stat(path, self.settings.mount_timeout)
        now = self.context.clock()
        if isinstance(outcome, Stuck):
            return self.result(path, Status.UNKNOWN,
                               f"{path}: mount not responding (statvfs blocked for {format_duration(now - outcome.since)})",
                               {"stuck_since": outcome.since, **labels}, [error])
        if isinstance(outcome, OSError):
            return self.result(path, Status.UNKNOWN, f"{path}: cannot stat: {outcome.strerror or outcome}",
                               {"errno": outcome.errno, **labels}, [error])
        usage = gather(path, outcome, mount)
        verdict, bytes_fc, inodes_fc = self.tracker.assess(path, usage, now)
        samples = [SIZE(usage.size, labels), AVAIL(usage.avail, labels), FILES(usage.files, labels),
                   FILES_FREE(usage.files_free, labels), DEVICE_ERROR(0, labels)]
        details = {**labels, "size_bytes": usage.size, "avail_bytes": usage.avail, "files": usage.files,
                   "files_free": usage.files_free}
        samples += time_to_full(TIME_TO_FULL, labels, bytes_fc, inodes_fc, details)
        status, summary = verdict.status, summarize(usage, verdict)
        if mount is not None and mount.went_read_only:  # the kernel check grades the fault and names its line
            details["read_only"] = True
            status = worst([status, Status.WARNING])
            summary = (f"{path}: file system read-only under a read-write mount ({mount.device}: the kernel remounts "
                       "one so after an error; the kernel check's result names its line); "
                       + summary.removeprefix(f"{path}: "))
        return self.result(path, status, summary, details, samples)
