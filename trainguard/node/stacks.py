"""StackDumper: where each process of a hung job is stuck, captured with py-spy before anything acts on it.

Python processes are dumped in parallel (`py-spy dump --nonblocking --pid N`) within a budget per hang (DumpLimits:
processes looked at, py-spy runs, one per rank, a few at a time, each with a timeout), every child reaped on every
path: the job's user picks how many processes it has, not how many children and descriptors the agent spends.
`--nonblocking` reads the process's memory without stopping it: ptrace-stopping a process that waits
on a dead filesystem turns its wait uninterruptible, and the dumper would hang with it. A process
already in uninterruptible sleep (D state) is not dumped at all. Each process's kernel wait channel
is reported too: `request_wait_answer` (FUSE) or an NFS RPC wait is what a dead filesystem looks like.
"""

from __future__ import annotations

import os
import selectors
import shutil
import subprocess
import sys
import time
from collections import deque
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


def rank_vars(proc: ProcFS, pid: int) -> tuple[str, ...]:
    """The rank variables of a process's environment (RANK, SLURM_PROCID, ...) in that order, "" for each unset or
    not a rank: a rank's forked or spawned child (a DataLoader worker) carries its parent's; torchrun, which sets RANK
    for its children, does not."""
    # A rank is a small number; the environment is the job's, so anything else is not a rank (nor kept).
    env = proc.environ_vars(pid, _RANK_VARS)
    return tuple(v if v.isascii() and v.isdigit() and len(v) <= 9 else "" for v in (env.get(n, "") for n in _RANK_VARS))


def process_rank(proc: ProcFS, pid: int) -> str | None:
    """The rank a process's environment names (RANK, SLURM_PROCID, ...); None when none or unreadable."""
    return next((v for v in rank_vars(proc, pid) if v), None)


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


@dataclass(frozen=True)
class DumpLimits:
    """What one hang may cost the agent: a job's user decides how many processes it has, never how many the agent
    reads or how many py-spy it runs."""

    inspected: int = 256  # processes whose state, wait channel and environment are read; the job's first (parents)
    dumps: int = 32  # py-spy runs: one per rank first, then the other Python processes in the job's order
    parallel: int = 4  # py-spy children at a time
    each: float = 5.0  # seconds one py-spy may take (and the job's dumps together the dumper's `timeout`)


@dataclass(frozen=True)
class Capture:
    """A hung job's stacks, and what was left out of them (said once: "1496 more processes not dumped ...")."""

    stacks: list[ProcessStack]
    note: str | None = None


@dataclass(frozen=True)
class _Target:
    pid: int
    rank: str | None
    state: str
    wchan: str | None


MAX_OUTPUT = 1 << 20  # kept of one py-spy dump (a process with a hundred threads prints ~100 KiB): 32 MiB per hang


class _Child:
    """One py-spy run: its output read as it comes (a full pipe would stall it), bounded, and the child reaped."""

    def __init__(self, popen: subprocess.Popen[bytes], until: float) -> None:
        self.popen = popen
        self.until = until
        self.started = time.monotonic()
        self.chunks: list[bytes] = []
        self.size = 0
        self.fd = popen.stdout.fileno() if popen.stdout is not None else -1

    @property
    def closed(self) -> bool:
        return self.popen.stdout is None or self.popen.stdout.closed

    def read(self) -> bool:
        """Take what is in the pipe; False at its end."""
        try:
            data = os.read(self.fd, 1 << 16)
        except OSError:
            data = b""
        if not data:
            return False
        if self.size < MAX_OUTPUT:
            self.chunks.append(data[:MAX_OUTPUT - self.size])
        self.size += len(data)
        return True

    def close(self) -> None:
        if not self.closed:
            self.popen.stdout.close()  # type: ignore[union-attr]

    def stop(self) -> None:
        """Killed if still running, reaped (a SIGKILLed child exits at once; one that does not within 2 s is left to
        subprocess's own reaping rather than block the check), its pipe closed."""
        try:
            if self.popen.poll() is None:
                self.popen.kill()
            self.popen.wait(timeout=2)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            self.close()

    def outcome(self) -> tuple[str, str]:
        out = b"".join(self.chunks).decode("utf-8", errors="replace")
        if self.size > MAX_OUTPUT:
            out += f"\n[{self.size - MAX_OUTPUT} more bytes not kept]\n"
        if self.popen.returncode != 0:
            why = (out.strip().splitlines() or ["no output"])[-1][:200]
            return f"no stack: py-spy exited {self.popen.returncode}: {why}", out
        return innermost(out) or "no Python frame", out


class StackDumper:
    def __init__(self, py_spy: str | None, native: bool = False, timeout: float = 10.0, proc: ProcFS | None = None,
                 limits: DumpLimits | None = None) -> None:
        self.py_spy = py_spy
        self.native = native
        self.timeout = timeout  # all of one job's dumps
        self.proc = proc or ProcFS()
        self.limits = limits or DumpLimits()

    def dump(self, procs: list[psutil.Process]) -> Capture:
        """The stacks of the job's processes (parents first, as job_processes gives them), within `limits`: D-state
        processes with their kernel wait, one py-spy per rank, then other Python processes."""
        stacks: dict[int, ProcessStack] = {}
        candidates: list[_Target] = []
        for proc in procs[:self.limits.inspected]:
            try:
                state = proc.status()
            except psutil.Error:
                continue
            target = _Target(proc.pid, self._rank(proc.pid), state, self.proc.wchan(proc.pid))
            if state == psutil.STATUS_DISK_SLEEP:
                stacks[proc.pid] = ProcessStack(proc.pid, target.rank, state, "D state (uninterruptible) in kernel "
                                                f"{target.wchan or '?'}", wchan=target.wchan)
            elif _is_python(proc):
                candidates.append(target)
        chosen = self._choose(candidates)
        outcomes = self._run(chosen) if self.py_spy else {t.pid: ("no stack: py-spy is not installed", "")
                                                          for t in chosen}
        for t in chosen:
            where, text = outcomes[t.pid]
            stacks[t.pid] = ProcessStack(t.pid, t.rank, t.state, where, text, t.wchan)
        left = len(procs) - min(len(procs), self.limits.inspected) + len(candidates) - len(chosen)
        note = (f"{left} more processes not dumped (at most {self.limits.inspected} inspected and "
                f"{self.limits.dumps} dumped per hang, one per rank)") if left else None
        ordered = sorted(stacks, key=lambda p: (int(stacks[p].rank or 1 << 30), p))
        return Capture([stacks[p] for p in ordered], note)

    def _rank(self, pid: int) -> str | None:
        return process_rank(self.proc, pid)

    def _choose(self, candidates: list[_Target]) -> list[_Target]:
        """One process per rank (the first that holds it: the rank itself, its data-loader workers inherit its
        environment), then the processes that name no rank, up to `dumps` in all."""
        ranks: dict[str, _Target] = {}
        for t in candidates:
            if t.rank is not None:
                ranks.setdefault(t.rank, t)
        others = [t for t in candidates if t.rank is None]
        return [*ranks.values(), *others][:self.limits.dumps]

    def _start(self, pid: int, until: float) -> _Child | str:
        assert self.py_spy is not None
        cmd = [self.py_spy, "dump", "--pid", str(pid), "--native" if self.native else "--nonblocking"]
        try:
            return _Child(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL), until)
        except (OSError, subprocess.SubprocessError) as exc:  # EMFILE, EAGAIN (no more processes), ENOMEM
            return f"no stack: py-spy could not start: {getattr(exc, 'strerror', None) or exc}"

    def _run(self, targets: list[_Target]) -> dict[int, tuple[str, str]]:
        """py-spy for each target, `parallel` at a time, each within `each` seconds and all within `timeout`; every
        child is killed and reaped and its pipe closed on every way out, an exception's included."""
        done: dict[int, tuple[str, str]] = {}
        queue = deque(targets)
        running: dict[int, _Child] = {}
        deadline = time.monotonic() + self.timeout
        try:
            selector = selectors.DefaultSelector()
        except OSError as exc:  # EMFILE: no descriptor for the selector itself
            return {t.pid: (f"no stack: {exc.strerror or exc}", "") for t in targets}
        try:
            while queue or running:
                now = time.monotonic()
                while queue and len(running) < self.limits.parallel and now < deadline:
                    pid = queue.popleft().pid
                    child = self._start(pid, min(deadline, now + self.limits.each))
                    if isinstance(child, str):
                        done[pid] = (child, "")
                    else:
                        running[pid] = child
                        selector.register(child.fd, selectors.EVENT_READ, pid)
                if not running:
                    break
                wait = min(c.until for c in running.values()) - now
                for key, _ in selector.select(timeout=min(max(wait, 0.0), 0.2)):
                    if not running[key.data].read():  # its end: unregistered before closed (the number is reused)
                        selector.unregister(key.fd)
                        running[key.data].close()
                now = time.monotonic()
                for pid, child in list(running.items()):
                    finished = child.closed and child.popen.poll() is not None
                    if not finished and now < child.until:
                        continue
                    if not child.closed:
                        selector.unregister(child.fd)
                    child.stop()
                    del running[pid]
                    done[pid] = child.outcome() if finished else (
                        f"no stack: py-spy timed out after {now - child.started:.1f}s", "")
        finally:
            for child in running.values():
                child.stop()
            selector.close()
        for t in queue:
            done[t.pid] = (f"no stack: the job's dump_timeout ({self.timeout:g}s) ran out", "")
        return done


def write_dumps(directory: Path, job_label: str, stacks: list[ProcessStack], when: float,
                note: str | None = None) -> Path:
    """One text file with every process's dump (and what was left out); the path goes into the incident."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o750)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.localtime(when))
    safe = _UNSAFE.sub("_", job_label)[:80]
    path = directory / f"{stamp}-{safe}.txt"
    parts = [f"# stacks of {job_label} captured {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(when))}\n"]
    if note:
        parts.append(f"# {note}\n")
    for s in stacks:
        parts.append(f"\n## {s.describe()} (state {s.state})\n{s.text}")
    # 0600 whatever the umask: a dump holds the job's frames and arguments; py-spy's text may hold any character
    replace_file(path, "".join(parts).encode(errors="replace"), 0o600)
    return path
