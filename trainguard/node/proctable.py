"""One pass over /proc shared by every check of a round: each process's parent, start time and resident memory.

The per-job checks (job_memory, hang, gpu_memory) need each job's process tree, and the memory check the largest
processes. Walking /proc for each of them (psutil's `children(recursive=True)` reads every process's stat file per
call) made a round's cost grow with jobs times checks; one snapshot, reused for a few seconds, makes it one pass.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from trainguard.node.procfs import PAGE_SIZE, ProcFS

TICKS = os.sysconf("SC_CLK_TCK")
SAME_PROCESS_S = 0.01  # start times this close name the same process (ProcessRef's rule)


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    create_time: float  # Unix time, computed as psutil does (boot time + start ticks / CLK_TCK)
    rss: int  # bytes
    comm: str
    cpu_ticks: int = 0  # user + system CPU time since it started, in clock ticks (job_pace's co-tenants)


def parse_stat(pid: int, text: str, boot_time: float) -> ProcInfo | None:
    """One /proc/PID/stat line; None when it does not have the kernel's shape. The command name (between the first
    "(" and the last ")") is the process's own text: it may hold spaces and parentheses."""
    open_at, close_at = text.find("("), text.rfind(")")
    if open_at < 0 or close_at < open_at:
        return None
    rest = text[close_at + 2:].split()
    if len(rest) < 22:
        return None
    try:
        ppid, start, rss, cpu = int(rest[1]), int(rest[19]), int(rest[21]), int(rest[11]) + int(rest[12])
    except ValueError:
        return None
    return ProcInfo(pid, ppid, start / TICKS + boot_time, max(0, rss) * PAGE_SIZE, text[open_at + 1:close_at][:64],
                    max(0, cpu))


@dataclass(frozen=True)
class ProcessTable:
    """The processes of this node at one moment (`taken`, monotonic)."""

    procs: Mapping[int, ProcInfo] = field(default_factory=dict)
    taken: float = 0.0
    _children: dict[int, list[int]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for info in self.procs.values():
            self._children.setdefault(info.ppid, []).append(info.pid)

    def is_alive(self, pid: int, create_time: float) -> bool:
        """`pid` is still the process that started at `create_time` (a recycled pid is another process)."""
        info = self.procs.get(pid)
        return info is not None and abs(info.create_time - create_time) < SAME_PROCESS_S

    def descendants(self, roots: Iterable[int]) -> list[int]:
        """`roots` that exist and all their descendants, each once, breadth first: the roots, their children, their
        grandchildren. A job's ranks come before their workers, so what caps how many of a job's processes are looked
        at (the hang check's `inspect_processes`) keeps the ranks."""
        seen: dict[int, None] = {}
        queue = deque(pid for pid in roots if pid in self.procs)
        while queue:
            pid = queue.popleft()
            if pid in seen:
                continue
            seen[pid] = None
            queue.extend(self._children.get(pid, ()))
        return list(seen)

    def rss(self, pids: Iterable[int]) -> int:
        return sum(self.procs[p].rss for p in pids if p in self.procs)

    def largest(self, n: int) -> list[ProcInfo]:
        """The `n` processes with the most resident memory."""
        return sorted(self.procs.values(), key=lambda p: p.rss, reverse=True)[:n] if n > 0 else []


def read_table(proc: ProcFS | None = None, clock: Callable[[], float] = time.monotonic) -> ProcessTable:
    """Every process's stat line, read once; a process that exits while we read is simply not in the table."""
    proc = proc or ProcFS()
    boot = proc.boot_time()
    procs = {}
    for pid in proc.pids():
        text = proc.read_text(pid, "stat")
        info = parse_stat(pid, text, boot) if text else None
        if info is not None:
            procs[pid] = info
    return ProcessTable(procs, clock())


class ProcessSnapshots:
    """The shared snapshot: a table at most `max_age` seconds old, read by the first caller that needs a newer one.
    Checks scheduled at the same moment (their intervals are multiples of each other) share one pass."""

    def __init__(self, proc: ProcFS | None = None, max_age: float = 3.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.proc = proc or ProcFS()
        self.max_age = max_age
        self.clock = clock
        self._lock = threading.Lock()
        self._table: ProcessTable | None = None

    def peek(self) -> ProcessTable | None:
        """The table as it is, however old, without reading /proc."""
        with self._lock:
            return self._table

    def get(self, max_age: float | None = None) -> ProcessTable:
        limit = self.max_age if max_age is None else max_age
        with self._lock:
            if self._table is None or self.clock() - self._table.taken > limit:
                self._table = read_table(self.proc, self.clock)
            return self._table
