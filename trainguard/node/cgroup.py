"""The memory limit a process runs under: cgroup v2 `memory.max` or v1 `memory.limit_in_bytes`, whichever the node has.

SLURM's task/cgroup puts each job (and step) in a cgroup with a limit; the OOM killer acts when the
cgroup's usage reaches the tightest limit on its path, so the whole path up to the root is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainguard.node.procfs import ProcFS

_V1_UNLIMITED = 1 << 60  # v1 reports "no limit" as a page-rounded LONG_MAX


@dataclass(frozen=True)
class CgroupMemory:
    path: Path  # the cgroup holding the tightest limit
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


def _tightest(root: Path, rel: str, limit_file: str, unlimited: int) -> tuple[Path, int] | None:
    best: tuple[Path, int] | None = None
    current = root / rel.lstrip("/")
    while True:
        value = _read_int(current / limit_file)
        if value is not None and value < unlimited and (best is None or value < best[1]):
            best = (current, value)
        if current == root or root not in current.parents:
            return best
        current = current.parent


def memory_limit(pid: int, proc: ProcFS | None = None) -> CgroupMemory | None:
    """The tightest cgroup memory limit over `pid`, with that cgroup's working set; None when unlimited."""
    proc = proc or ProcFS()
    own, mountinfo = proc.cgroup(pid), proc.mountinfo()
    if own is None or not mountinfo:
        return None
    v2_mount, v1_mount = _mounts(mountinfo)
    v2_path, v1_path = _cgroup_paths(own)
    if v2_mount is not None and v2_path is not None:
        found = _tightest(v2_mount, v2_path, "memory.max", 1 << 62)  # "max" is not a digit: skipped
        if found is not None:
            where, limit = found
            usage = (_read_int(where / "memory.current") or 0) - _stat(where / "memory.stat", "inactive_file")
            return CgroupMemory(where, 2, limit, max(0, usage))
    if v1_mount is not None and v1_path is not None:
        found = _tightest(v1_mount, v1_path, "memory.limit_in_bytes", _V1_UNLIMITED)
        if found is not None:
            where, limit = found
            usage = (_read_int(where / "memory.usage_in_bytes") or 0) - _stat(where / "memory.stat",
                                                                               "total_inactive_file")
            return CgroupMemory(where, 1, limit, max(0, usage))
    return None
