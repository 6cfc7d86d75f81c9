"""Which SLURM jobs run on this node, asked of the node itself and never of slurmctld.

Three places say it, each without a controller RPC:

- the SLURM cgroup tree (proctrack/cgroup or task/cgroup): a directory per job, its processes in `cgroup.procs`.
  cgroup v1: `<mount>/<controller>/slurm[_<node>]/uid_<uid>/job_<id>/step_<step>/`; cgroup v2:
  `<mount>/system.slice/[<node>_]slurmstepd.scope/job_<id>/step_<step>/user/task_<n>/` (the `<node>_` forms are
  SLURM built for several slurmd per host). Read with plain directory listings and small files.
- the slurmd spool dir (`SlurmdSpoolDir`): slurmstepd makes a socket `<node>_<job>.<step>` there for every step
  while it runs, which is what `scontrol listpids` itself looks for. Its mtime changes when a step starts or ends,
  so one stat tells whether anything changed.
- `scontrol listpids` (no job id): every step's pids, from the local slurmstepds.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from trainguard.core.text import linear
from trainguard.node.mounts import parse_mountinfo

CONF_PATHS = ("/etc/slurm/slurm.conf", "/run/slurm/conf/slurm.conf", "/etc/slurm-llnl/slurm.conf")
SPOOL_DEFAULTS = ("/var/spool/slurmd", "/var/spool/slurm/d", "/var/lib/slurm/slurmd", "/var/spool/slurm/slurmd")
CONF_MAX = 1 << 20
MAX_JOBS = 4096  # more job directories than any node runs at once: the rest are not read
MAX_PIDS = 65536

_SOCKET = linear(r"^(.+)_(\d{1,10})\.(\d{1,10})(?:\.\d{1,10})?$")
_JOB_DIR = linear(r"^job_(\d{1,10})$")
_UID_DIR = linear(r"^uid_(\d{1,10})$")
# A cgroup path (as the kernel names a task's memory cgroup) in SLURM's own tree only, v1 and v2 with the `<node>_`
# forms: a `job_N` a user made in a delegated tree of their own (user@.service/app.slice/job_4711) names no job
_CGROUP_JOB = linear(r"^/(?:system\.slice/(?:[^/]{1,64}_)?slurmstepd\.scope|slurm[^/]{0,64}/uid_\d{1,10})"
                     r"/job_(\d{1,20})(?:/step_[^/]{1,20}(?:/user)?/task_(\d{1,9}))?(?:/|$)")


def job_of_cgroup(path: str) -> tuple[str | None, str | None]:
    """(SLURM job id, task) of a cgroup path in SLURM's own tree (`/slurm/uid_1000/job_4242/step_0/task_3`,
    `/system.slice/slurmstepd.scope/job_77/step_0/user/task_1`); (None, None) elsewhere, the task None when the
    path stops above it."""
    m = _CGROUP_JOB.match(path)
    return (m.group(1), m.group(2)) if m else (None, None)


def jobs_of_proc_cgroup(text: str) -> frozenset[str]:
    """The SLURM job ids a process's /proc/PID/cgroup text places it in (`hierarchy:controllers:path` lines, one per
    v1 hierarchy, `0::path` for v2), each path read as `job_of_cgroup` reads it: `job_1` is never `job_12`."""
    return frozenset(job for line in text.splitlines()
                     if (job := job_of_cgroup(line.split(":", 2)[-1])[0]) is not None)


def conf_path(env: Mapping[str, str]) -> Path | None:
    """slurm.conf as SLURM's commands find it: $SLURM_CONF, the usual places, the configless cache."""
    candidates = [env["SLURM_CONF"]] if env.get("SLURM_CONF") else []
    for candidate in [*candidates, *CONF_PATHS]:
        if os.path.isfile(candidate):
            return Path(candidate)
    return None


def conf_text(env: Mapping[str, str]) -> str | None:
    """The text of slurm.conf (its first CONF_MAX bytes: a slurm.conf is kilobytes); None when none is found."""
    path = conf_path(env)
    if path is None:
        return None
    try:
        with path.open("rb") as f:
            return f.read(CONF_MAX).decode("utf-8", "replace")
    except OSError:
        return None


def cluster_name() -> str:
    """slurm.conf's ClusterName, read from the file (no RPC to slurmctld for a fact every node holds); "" when
    there is no slurm.conf or it names none."""
    text = conf_text(os.environ)
    return ((conf_value(text, "ClusterName") if text else None) or "")[:128]


def conf_value(text: str, key: str) -> str | None:
    """The value of `key` (case-insensitive, as slurmd reads it) in slurm.conf text; None when not set."""
    wanted = key.lower()
    for raw in text.splitlines():
        name, sep, value = raw.split("#", 1)[0].strip().partition("=")
        if sep and name.strip().lower() == wanted:
            return value.strip().strip('"') or None
    return None


def spool_dir(node: str, hostname: str, conf_text: str | None, configured: str = "") -> Path | None:
    """This node's slurmd spool dir: the configured one, slurm.conf's SlurmdSpoolDir (%n and %h filled in), or the
    first of SLURM's usual defaults that exists; None when none exists (no slurmd here)."""
    raw = configured or (conf_value(conf_text, "SlurmdSpoolDir") if conf_text else None)
    candidates = [raw.replace("%n", node).replace("%h", hostname)] if raw else list(SPOOL_DEFAULTS)
    return next((Path(c) for c in candidates if os.path.isdir(c)), None)


def spool_jobs(names: Iterable[str], node: str = "") -> set[str]:
    """Job ids with a step socket among a spool dir's entries (`<node>_<job>.<step>`); only `node`'s when given."""
    jobs = set()
    for name in names:
        match = _SOCKET.match(name)
        if match and (not node or match.group(1) == node):
            jobs.add(match.group(2))
    return jobs


def spool_listing(path: Path, node: str = "") -> set[str]:
    """The jobs with a step socket in the spool dir now."""
    try:
        with os.scandir(path) as entries:
            return spool_jobs((e.name for e in entries if _is_socket(e)), node)
    except OSError:
        return set()


def _is_socket(entry: os.DirEntry[str]) -> bool:
    try:
        return stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode)
    except OSError:
        return False


@dataclass(frozen=True)
class CgroupRoot:
    """Where SLURM keeps this node's job cgroups."""

    path: Path
    version: int


def cgroup_roots(mountinfo: str, node: str) -> list[CgroupRoot]:
    """The SLURM cgroup directories that exist on this node, the freezer hierarchy (proctrack/cgroup's) first."""
    found = []
    for mount in parse_mountinfo(mountinfo):
        if mount.fstype == "cgroup":
            names = [f"slurm_{node}", "slurm"] if node else ["slurm"]
            version, base = 1, Path(mount.mountpoint)
        elif mount.fstype == "cgroup2":
            names = [f"{node}_slurmstepd.scope", "slurmstepd.scope"] if node else ["slurmstepd.scope"]
            version, base = 2, Path(mount.mountpoint) / "system.slice"
        else:
            continue
        for name in names:
            if (base / name).is_dir():
                found.append(CgroupRoot(base / name, version))
                break
    return sorted(found, key=lambda r: (r.version != 1 or "freezer" not in str(r.path), r.version))


@dataclass(frozen=True)
class CgroupJob:
    job_id: str
    uid: int | None  # cgroup v1 names it in the path (slurmstepd made it); v2 does not
    pids: tuple[int, ...]


def _job_dirs(root: CgroupRoot) -> list[tuple[str, int | None, Path]]:
    """(job id, uid, directory) of every job directory under the root, without reading any file."""
    out: list[tuple[str, int | None, Path]] = []
    parents: list[tuple[int | None, Path]]
    if root.version == 1:
        parents = [(int(m.group(1)), root.path / name) for name in _listdir(root.path) if (m := _UID_DIR.match(name))]
    else:
        parents = [(None, root.path)]
    for uid, parent in parents:
        for name in _listdir(parent):
            match = _JOB_DIR.match(name)
            if match:
                out.append((match.group(1), uid, parent / name))
            if len(out) >= MAX_JOBS:
                return out
    return out


def cgroup_job_ids(root: CgroupRoot) -> frozenset[str]:
    """The job ids under the root: one directory listing per user (v1) or one in all (v2)."""
    return frozenset(job for job, _, _ in _job_dirs(root))


def cgroup_job_owners(root: CgroupRoot) -> dict[str, int | None]:
    """job id -> uid (v1's `uid_N` directory; None on v2) of every job under the root, from the listings alone."""
    return {job: uid for job, uid, _ in _job_dirs(root)}


def cgroup_jobs(root: CgroupRoot) -> dict[str, CgroupJob]:
    """Every job under the root with the pids of its steps' tasks (not its slurmstepds: v1 keeps those in the job
    directory itself, v2 in each step's `slurm` directory)."""
    jobs = {}
    for job_id, uid, path in _job_dirs(root):
        pids: list[int] = []
        for step in _listdir(path):
            if step.startswith("step_"):
                tasks = path / step / "user" if root.version == 2 else path / step
                _collect_procs(tasks, pids)
        jobs[job_id] = CgroupJob(job_id, uid, tuple(dict.fromkeys(pids)))
    return jobs


def _collect_procs(top: Path, pids: list[int]) -> None:
    stack = [top]
    while stack and len(pids) < MAX_PIDS:
        here = stack.pop()
        pids.extend(_read_pids(here / "cgroup.procs"))
        stack.extend(here / name for name in _listdir(here) if _is_dir(here / name))


def _read_pids(path: Path) -> list[int]:
    try:
        text = path.read_text()
    except OSError:
        return []
    return [int(w) for w in text.split() if w.isascii() and w.isdigit() and len(w) <= 10]


def _listdir(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _is_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False
