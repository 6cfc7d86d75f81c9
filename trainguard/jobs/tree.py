"""A job on this node: its live processes (trusted top pids and their descendants) and its log files."""

from __future__ import annotations

import glob
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from trainguard.core.budget import NO_DEADLINE, Deadline
from trainguard.core.units import bounded_float, bounded_int
from trainguard.jobs.model import Job
from trainguard.jobs.settings import MAX_LOG_ENTRIES, MAX_LOG_FILES
from trainguard.node.access import NOBODY, Identity, read_as
from trainguard.node.flight import RankTrace, fetch, read_dumps
from trainguard.node.globs import newest_as
from trainguard.node.procfs import ProcFS
from trainguard.node.proctable import ProcessTable, read_table


def job_pids(job: Job, table: ProcessTable) -> list[int]:
    """Every process of the job on this node, from the shared snapshot: its trusted top pids (those whose start
    time still matches: a recycled pid is not the job's) and their descendants, each once."""
    return table.descendants(ref.pid for ref in job.processes if table.is_alive(ref.pid, ref.create_time))


def job_processes(job: Job, table: ProcessTable | None = None) -> list[psutil.Process]:
    """The job's processes as psutil objects, for what the snapshot does not hold (open files, I/O counters)."""
    found = []
    for pid in job_pids(job, table if table is not None else read_table()):
        try:
            found.append(psutil.Process(pid))
        except psutil.Error:
            continue
    return found


def job_fields(job: Job) -> dict[str, str]:
    """What path templates may use: {workdir} {job_id} {name} {user} {switch_dir}."""
    return {"workdir": job.workdir or "", "job_id": job.job_id or "", "name": job.name, "user": job.user or "",
            "switch_dir": job.switch_dir or ""}


@dataclass(frozen=True)
class LogFiles:
    """A job's log paths, and what the caps on its globs left out (one line per glob they cut)."""

    paths: list[str]
    notes: list[str]  # what the caps left out, said per glob
    capped: list[str]  # the globs the caps cut (what `notes` says changes with each file added; this does not)


def job_log_files(job: Job, patterns: Sequence[str] = (), identity: Identity = NOBODY, keep: int = MAX_LOG_FILES,
                  examine: int = MAX_LOG_ENTRIES, deadline: Deadline = NO_DEADLINE) -> LogFiles:
    """The job's own log paths (SLURM StdOut/StdErr, a process job's `logs`) and `patterns` filled in; a glob expands
    to its newest `keep` files as the job's user may list them, examining `examine` entries at most
    (`node.globs`)."""
    fields = job_fields(job)
    paths: list[str] = []
    notes: list[str] = []
    capped: list[str] = []
    for raw in [*job.log_paths, *patterns]:
        try:
            pattern = raw.format(**fields) if raw in patterns else raw
        except (KeyError, IndexError, ValueError):
            continue
        if not glob.has_magic(pattern):
            paths.append(pattern)
            continue
        found = newest_as(identity, pattern, keep, examine, deadline)
        paths.extend(found.paths)
        if found.cut or found.matched > len(found.paths):
            capped.append(pattern)
        if found.cut:
            notes.append(f"{pattern}: more than {examine} entries, the first {examine} examined ({found.matched} "
                         f"match); the newest {len(found.paths)} of those are read")
        elif found.matched > len(found.paths):
            notes.append(f"{pattern}: {found.matched} files match; the newest {len(found.paths)} are read")
    return LogFiles(list(dict.fromkeys(paths)), notes, capped)


HEARTBEAT = "{switch_dir}/heartbeat.json"  # where trainguard.trainer writes it by default


def heartbeat_path(job: Job, template: str = HEARTBEAT) -> str | None:
    """The job's heartbeat file from `template`; None when the template is empty or needs a switch dir it lacks."""
    if not template or (not job.switch_dir and "{switch_dir}" in template):
        return None
    return template.format(**job_fields(job))


HEARTBEAT_MAX = 64 << 10  # the trainer writes a few hundred bytes; a larger "heartbeat" is not one


def _beat(path: str, identity: Identity) -> dict[str, Any]:
    """The heartbeat file's JSON object, read with the job user's authority; {} when it is not one."""
    try:
        raw = read_as(identity, path, HEARTBEAT_MAX + 1)
        if len(raw) > HEARTBEAT_MAX:
            return {}
        data = json.loads(raw)
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


@dataclass(frozen=True)
class Beat:
    """The heartbeat's progress: its step, when the trainer wrote it, and the step time it measured (seconds per step
    since its previous heartbeat; None from a trainer before that field)."""

    step: int
    time: float
    pid: int | None
    step_time: float | None


def read_beat(path: str, identity: Identity) -> Beat | None:
    """The heartbeat's progress (`Beat`), None when the file is not a heartbeat with a step and a time."""
    data = _beat(path, identity)
    step, when, pid, took = data.get("step"), data.get("time"), data.get("pid"), data.get("step_time")
    step = bounded_int(step) if isinstance(step, int) else None
    when = bounded_float(when, 0.0)
    if step is None or when is None:
        return None
    return Beat(step, when, bounded_int(pid) if isinstance(pid, int) else None, bounded_float(took, 0.0))


def read_heartbeat(path: str, identity: Identity) -> tuple[int | None, dict[str, Any]]:
    """The heartbeat's step and metrics (`trainguard.trainer` writes non-finite values as strings), read with the job
    user's authority: a FIFO, a device, a link to a file they can't read or an oversized file is no heartbeat. The
    step is a non-negative int64 or None; a JSON NaN or Infinity among the metrics is read as the trainer writes it."""
    data = _beat(path, identity)
    if not data:
        return None, {}
    step = data.get("step")
    metrics = data.get("metrics") if isinstance(data.get("metrics"), dict) else {}
    return (bounded_int(step) if isinstance(step, int) else None,  # a string of digits is not the trainer's step
            {k: str(v) if isinstance(v, float) and bounded_float(v) is None else v for k, v in metrics.items()})


FLIGHT_RECORDER_DUMPS = "{switch_dir}/flight-recorder"  # where trainguard.trainer points the NCCL watchdog's dumps


def flight_traces(job: Job, procs: Sequence[psutil.Process], dumps: str, node: str | None, timeout: float,
                  proc: ProcFS | None = None) -> list[RankTrace]:
    """The job's flight recorders: live from its ranks' worker sockets, else the dumps its NCCL watchdog left in
    `dumps` (a path template as the logs'; empty: none), read only when owned by the job's user. Live ranks are this
    node's (`node`); a dump's node is not known."""
    traces = fetch(procs, node, timeout, proc) if procs else []
    if traces or not dumps or (not job.switch_dir and "{switch_dir}" in dumps):
        return traces
    try:
        directory = Path(dumps.format(**job_fields(job)))
    except (KeyError, IndexError, ValueError):
        return []
    return read_dumps(directory, job.uid)  # a shared switch dir holds other nodes' ranks too: node unknown
