"""Jobs: what the agent knows about a training job on this node, and how a pid is trusted."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import psutil

from trainguard.jobs.hostlist import expand

ACTIVE_STATES = frozenset({"RUNNING", "PENDING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"})


@dataclass(frozen=True)
class ProcessRef:
    """A pid is trusted only together with its start time: a recycled pid never matches."""

    pid: int
    create_time: float

    @classmethod
    def of(cls, pid: int) -> ProcessRef | None:
        try:
            return cls(pid, psutil.Process(pid).create_time())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, ValueError):
            return None

    def uid(self) -> int | None:
        """The real uid the process runs as now; None when it is gone."""
        try:
            return psutil.Process(self.pid).uids().real
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, ValueError):
            return None

    def gone(self) -> bool:
        """It has exited (or its pid was reused). One this process may not read counts as alive: unsure is not
        gone."""
        try:
            return abs(psutil.Process(self.pid).create_time() - self.create_time) >= 0.01
        except (psutil.NoSuchProcess, ValueError):  # a zombie (NoSuchProcess's subclass) has exited too
            return True
        except psutil.AccessDenied:
            return False

    def matches(self) -> bool:
        try:
            return abs(psutil.Process(self.pid).create_time() - self.create_time) < 0.01
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, ValueError):
            return False


@dataclass(frozen=True)
class Job:
    key: str  # stable identity: "slurm:<job id>" or "process:<name>"
    source: str
    name: str
    state: str
    job_id: str | None = None
    array_job_id: str | None = None
    array_task_id: str | None = None
    user: str | None = None
    uid: int | None = None
    reason: str | None = None
    start_time: float | None = None
    end_time: float | None = None
    exit_code: str | None = None
    workdir: str | None = None
    stdout: str | None = None
    stderr: str | None = None
    on_this_node: bool = False
    processes: tuple[ProcessRef, ...] = ()
    log_paths: tuple[str, ...] = ()
    switch_dir: str | None = None
    requeue: bool = True  # SLURM lets the job be requeued (not submitted with --no-requeue)
    batch_host: str | None = None  # SLURM: the node running the batch script
    node_list: str | None = None  # SLURM: the job's nodes, a hostlist expression
    restarts: int | None = None  # SLURM: requeues so far; a requeued job keeps its id, and this is its life
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def running(self) -> bool:
        return self.state in ("RUNNING", "COMPLETING")

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    @property
    def owner(self) -> str | None:
        """The node that speaks for the job as a whole (job-scoped checks, see checks.base.Check.scope): its BatchHost,
        else the first node of its NodeList; None when the controller has not said (every node speaks then)."""
        if self.batch_host:
            return self.batch_host
        if self.node_list:
            try:
                first = expand(self.node_list)
            except ValueError:
                return None
            return first[0] if first else None
        return None

    def spoken_for_by(self, node: str) -> bool:
        """Whether `node` speaks for the job as a whole (a job-scoped check's alert and actions): only its owner does,
        where the job spans several nodes and `node` is among them by that name. Every node speaks where that is not
        known (no NodeList yet, a process job, a node SLURM names otherwise): a duplicate, never a silence."""
        if not self.node_list:
            return True
        try:
            nodes = expand(self.node_list)
        except ValueError:
            return True
        if len(nodes) <= 1 or node not in nodes:
            return True
        return node == (self.batch_host if self.batch_host in nodes else nodes[0])

    def label(self) -> str:
        if self.source == "slurm":
            if self.array_job_id and self.array_task_id:
                return f"job {self.array_job_id}_{self.array_task_id} ({self.job_id}" + (f", {self.name})" if self.name
                                                                                       else ")")
            return f"job {self.job_id}" + (f" ({self.name})" if self.name else "")
        return f"process job {self.name}"

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "source": self.source, "name": self.name, "state": self.state, "job_id": self.job_id,
                "array_job_id": self.array_job_id, "array_task_id": self.array_task_id, "user": self.user,
                "reason": self.reason, "start_time": self.start_time, "end_time": self.end_time,
                "exit_code": self.exit_code, "pids": [p.pid for p in self.processes], "switch_dir": self.switch_dir,
                **{k: v for k, v in self.extra.items() if k in ("found_by", "incomplete")}}
