"""The memory limit a process runs under: cgroup v2 `memory.max` or v1 `memory.limit_in_bytes`, whichever the node has.

SLURM's task/cgroup puts each job (and step) in a cgroup with a limit; the OOM killer acts when any cgroup on a
process's path reaches its limit, so the whole path up to the root is read, and the limit nearest to an OOM kill is
the one with the least headroom (limit less working set): a job cgroup and its step cgroups often carry the same
limit, and the job's usage is its steps' together.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainguard.node.procfs import ProcFS

_V1_UNLIMITED = 1 << 60  # v1 reports "no limit" as a page-rounded LONG_MAX


@dataclass(frozen=True)
class CgroupMemory:
    path: Path  # the limited cgroup on the path with the least headroom
    version: int
    limit: int
    usage: int  # working set: usage minus inactive file cache, which the kernel reclaims before any OOM kill

    @property
    def headroom(self) -> int:
        return max(0, self.limit - self.usage)

    def describe(self) -> str:
        knob = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
        return f"cgroup v{self.version} {knob} of {self.path}"


def _mounts(mountinfo: str) -> tuple[Path | None, Path | None]:
    """(cgroup v2 mount, cgroup v1 memory controller mount) from /proc/self/mountinfo text."""
    v2 = v1 = None
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        if tail[0] == "cgroup2" and v2 is None:
            v2 = Path(fields[4])
        elif tail[0] == "cgroup" and "memory" in tail[2].split(",") and v1 is None:
            v1 = Path(fields[4])
    return v2, v1


def _cgroup_paths(text: str) -> tuple[str | None, str | None]:
    """(v2 path, v1 memory path) from /proc/PID/cgroup text."""
    v2 = v1 = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "memory" in parts[1].split(","):
            v1 = parts[2]
    return v2, v1


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


# per cgroup version: the limit file, the usage file, the reclaimable part of the usage in memory.stat, "no limit"
_KNOBS = {2: ("memory.max", "memory.current", "inactive_file", 1 << 62),  # "max" is not a digit: skipped
          1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file", _V1_UNLIMITED)}


def _nearest(root: Path, rel: str, version: int) -> CgroupMemory | None:
    limit_file, usage_file, inactive, unlimited = _KNOBS[version]
    best: CgroupMemory | None = None
    current = root / rel.lstrip("/")
    while True:
        limit = _read_int(current / limit_file)
        if limit is not None and limit < unlimited:
            usage = (_read_int(current / usage_file) or 0) - _stat(current / "memory.stat", inactive)
            found = CgroupMemory(current, version, limit, max(0, usage))
            if best is None or found.headroom < best.headroom:
                best = found
        if current == root or root not in current.parents:
            return best
        current = current.parent


def memory_limit(pid: int, proc: ProcFS | None = None) -> CgroupMemory | None:
    """The cgroup memory limit over `pid` nearest to an OOM kill, with that cgroup's working set; None when unlimited
    (or the process is gone)."""
    proc = proc or ProcFS()
    own, mountinfo = proc.cgroup(pid), proc.mountinfo()
    if own is None or not mountinfo:
        return None
    return memory_limit_of(own, mountinfo)


def memory_key(cgroup_text: str) -> tuple[str | None, str | None]:
    """What decides a process's memory limits in its /proc/PID/cgroup text: its v2 path and its v1 memory path (a v1
    line per controller names its cpuset, devices, ... cgroups too, which differ per task under SLURM)."""
    return _cgroup_paths(cgroup_text)


def memory_limit_of(cgroup_text: str, mountinfo: str) -> CgroupMemory | None:
    """`memory_limit` of a process with this /proc/PID/cgroup text, the node's mounts as /proc/self/mountinfo says."""
    v2_mount, v1_mount = _mounts(mountinfo)
    v2_path, v1_path = _cgroup_paths(cgroup_text)
    if v2_mount is not None and v2_path is not None:
        found = _nearest(v2_mount, v2_path, 2)
        if found is not None:
            return found
    if v1_mount is not None and v1_path is not None:
        return _nearest(v1_mount, v1_path, 1)
    return None
