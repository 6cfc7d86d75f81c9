"""StackDumper: where each process of a hung job is stuck, captured with py-spy before anything acts on it.

Python processes are dumped in parallel (`py-spy dump --nonblocking --pid N`), each with a timeout.
`--nonblocking` reads the process's memory without stopping it: ptrace-stopping a process that waits
on a dead filesystem turns its wait uninterruptible, and the dumper would hang with it. A process
already in uninterruptible sleep (D state) is not dumped at all. Each process's kernel wait channel
is reported too: `request_wait_answer` (FUSE) or an NFS RPC wait is what a dead filesystem looks like.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from trainguard.core.files import replace_file
from trainguard.core.text import linear
from trainguard.core.tools import run_tool
from trainguard.node.procfs import ProcFS

_FRAME = linear(r"^\s+(\S.*?) \((.+?)\)\s*$")
_THREAD = linear(r'^Thread (\S+) \(([^)]*)\)(?:: "(.*)")?')
_UNSAFE = linear(r"[^A-Za-z0-9_.-]+")
_RANK_VARS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "LOCAL_RANK")


@dataclass(frozen=True)
class ProcessStack:
    pid: int
    rank: str | None
    state: str  # psutil status: running, sleeping, disk-sleep, ...
    where: str  # the innermost frame of the main thread, or the kernel wait channel, or why there is none
    text: str = ""  # the full dump
    wchan: str | None = None  # the kernel function the process sleeps in

    def describe(self) -> str:
        rank = f" rank {self.rank}" if self.rank is not None else ""
        kernel = f", kernel wait {self.wchan}" if self.wchan and self.state != psutil.STATUS_DISK_SLEEP else ""
        return f"pid {self.pid}{rank}: {self.where}{kernel}"


def innermost(dump: str) -> str | None:
    """`function (file:line)` of the main thread's innermost Python frame in a py-spy dump (else the first thread's)."""
    first: str | None = None
    thread_name: str | None = None
    taken: set[str | None] = set()
    for line in dump.splitlines():
        thread = _THREAD.match(line)
        if thread:
            thread_name = thread.group(3) or thread.group(1)
            continue
        frame = _FRAME.match(line)
        if frame and thread_name not in taken:
            taken.add(thread_name)
            where = f"{frame.group(1)} ({frame.group(2)})"
            if thread_name == "MainThread":
                return where
            first = first or where
    return first


def _rank(proc: psutil.Process) -> str | None:
    try:
        env = proc.environ()
    except psutil.Error:
        return None
    # A rank is a small number; the environment is the job's, so anything else is not a rank.
    values = (env.get(v, "") for v in _RANK_VARS)
    return next((v for v in values if v.isascii() and v.isdigit() and len(v) <= 9), None)


def _is_python(proc: psutil.Process) -> bool:
    try:
        names = [os.path.basename(proc.exe()), os.path.basename((proc.cmdline() or [""])[0]), proc.name()]
    except psutil.Error:
        return False
    return any(n.startswith("python") for n in names)


# PTRACE_ATTACH (16) to pid 0 finds no such process (ESRCH) before any permission is weighed: EPERM can only come
# from a system call filter refusing ptrace itself (the unit's @system-service has none).
_PTRACE_PROBE = """
import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
refused = libc.ptrace(16, 0, None, None) == -1 and ctypes.get_errno() == errno.EPERM
print("the system call filter refuses ptrace (EPERM)" if refused else "allowed")
"""


class _ProbeError(Exception):
    pass


def ptrace_refusal(timeout: float = 10.0) -> str | None:
    """Why this process may not call ptrace, which `py-spy dump --native` needs to stop each process it reads; None
    when it may. Probed in a child: a filter without SystemCallErrorNumber= kills the caller instead of refusing."""
    try:
        said = run_tool([sys.executable, "-c", _PTRACE_PROBE], timeout, _ProbeError, label="the ptrace probe").strip()
    except _ProbeError as exc:  # e.g. "the ptrace probe exited -31" (SIGSYS): killed by the filter
        return str(exc)
    return None if said == "allowed" else said


def find_py_spy(configured: str = "") -> str | None:
    if configured:
        return configured if shutil.which(configured) else None
    beside = Path(sys.executable).parent / "py-spy"  # installed with trainguard into the same environment
    return str(beside) if beside.exists() else shutil.which("py-spy")


class StackDumper:
    def __init__(self, py_spy: str | None, native: bool = False, timeout: float = 10.0, proc: ProcFS | None = None) -> None:
        self.py_spy = py_spy
        self.native = native
        self.timeout = timeout
        self.proc = proc or ProcFS()

    def dump(self, procs: list[psutil.Process]) -> list[ProcessStack]:
        stacks: dict[int, ProcessStack] = {}
        running: dict[int, tuple[subprocess.Popen[str], str | None, str, str | None]] = {}
        for proc in procs:
            try:
                state = proc.status()
            except psutil.Error:
                continue
            rank, wchan = _rank(proc), self.proc.wchan(proc.pid)
            if state == psutil.STATUS_DISK_SLEEP:
                stacks[proc.pid] = ProcessStack(proc.pid, rank, state, f"D state (uninterruptible) in kernel "
                                                                       f"{wchan or '?'}", wchan=wchan)
            elif not _is_python(proc):
                continue
            elif self.py_spy is None:
                stacks[proc.pid] = ProcessStack(proc.pid, rank, state, "no stack: py-spy is not installed", wchan=wchan)
            else:
                cmd = [self.py_spy, "dump", "--pid", str(proc.pid), "--native" if self.native else "--nonblocking"]
                running[proc.pid] = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                                      stdin=subprocess.DEVNULL, errors="replace"), rank, state, wchan)
        deadline = time.monotonic() + self.timeout
        for pid, (child, rank, state, wchan) in running.items():
            try:
                out, _ = child.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.communicate()
                out, where = "", f"no stack: py-spy timed out after {self.timeout:g}s"
            else:
                if child.returncode != 0:
                    why = (out.strip().splitlines() or ["no output"])[-1][:200]
                    where = f"no stack: py-spy exited {child.returncode}: {why}"
                else:
                    where = innermost(out) or "no Python frame"
            stacks[pid] = ProcessStack(pid, rank, state, where, out, wchan)
        return [stacks[p] for p in sorted(stacks, key=lambda p: (int(stacks[p].rank or 1 << 30), p))]


def write_dumps(directory: Path, job_label: str, stacks: list[ProcessStack], when: float) -> Path:
    """One text file with every process's dump; the path goes into the incident."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o750)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.localtime(when))
    safe = _UNSAFE.sub("_", job_label)[:80]
    path = directory / f"{stamp}-{safe}.txt"
    parts = [f"# stacks of {job_label} captured {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(when))}\n"]
    for s in stacks:
        parts.append(f"\n## {s.describe()} (state {s.state})\n{s.text}")
    # 0600 whatever the umask: a dump holds the job's frames and arguments; py-spy's text may hold any character
    replace_file(path, "".join(parts).encode(errors="replace"), 0o600)
    return path
