"""The SLURM prolog and epilog gates: `trainguard slurm-prolog --check` and `slurm-epilog --check`.

slurmd runs them as root in every job's start and end path, after the hook has written the job's record (the record
always comes first, and its contract stays: exit 0, no SLURM command). The gate's exit status is then SLURM's verdict
on the node: non-zero drains it ("Prolog error", the job requeued; "Epilog error", before the next job starts).
Neither gate calls a SLURM command (a prolog or epilog that does can deadlock slurmd): the reason goes to stderr,
which slurmd logs, and into `<gate dir>/<gate>.json`, where an operator (and `trainguard status` readers) find it.

The prolog gate runs the config's gate checks once (default: gpu, xid and every disk check that names paths) within
a budget; a gate that overruns its budget lets the job start (its slowness is the daemon's to report, not a reason to
refuse every job). With `--diag ACTION`, the quick diagnostics of that diag action follow, when their own budget fits
what is left of the gate's (a CRITICAL test refuses the node; a test killed at its timeout does not). At a pass it
records each idle GPU's memory in use: the epilog's baseline.

The epilog gate checks the job let go of the node: no process of the job left (of its user and marked as the job's: in
its cgroup or with its SLURM_JOB_ID, or on its GPUs per NVML with no mark of another job), none a zombie or in D state,
its GPUs' memory back to the prolog's baseline (less other jobs' processes' on a shared GPU), and the job's user's
files in /dev/shm (and `--tmp` dirs) that no running process of the user holds under a threshold. A node runs other
jobs meanwhile: nothing of theirs is charged to the job that ended.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import stat
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass, field
from pathlib import Path

from trainguard.actions.diag import DiagToolSettings, gpu_holders, run_level
from trainguard.core.files import read_small, replace_file
from trainguard.core.model import Result, Status
from trainguard.core.text import one_line
from trainguard.core.units import format_bytes
from trainguard.gpu.nvml import GpuState, Nvml, NvmlUnavailableError
from trainguard.jobs.slurmnode import jobs_of_proc_cgroup
from trainguard.node.procfs import ProcFS
from trainguard.pipeline.config import Config
from trainguard.pipeline.ledger import record_diag

BUDGET_S = 10.0
DEFAULT_GATE_CHECKS = ("gpu", "xid")
SHM_MAX = 64 << 20
GPU_SLACK = 512 << 20
GRACE_S = 3.0
WALK_MAX = 20000  # entries of other users a tmp walk looks at
WALK_S = 2.0  # the tmp walk's deadline
HELD_S = 2.0  # the deadline of the look at what the user's processes hold (its own: a long walk does not cut it)
NAMED_MAX = 10  # leftovers named in the reason
EXIT_FAIL = 2


# the prolog gate -----------------------------------------------------------------------------------------------------
def gate_checks(config: Config, names: Sequence[str] = ()) -> list[str]:
    """The checks the prolog gate runs: those named, else gpu and xid (configured or not) and every disk check that
    names its paths (a filesystem the jobs need)."""
    if names:
        missing = [n for n in names if n not in config.checks]
        if missing:
            raise KeyError(f"no check {', '.join(missing)} in {config.source or 'the built-in config'}")
        return list(names)
    chosen = [n for n in DEFAULT_GATE_CHECKS if n in config.checks]
    chosen += [n for n, s in config.checks.items()
               if s.enabled and config.kind_of_check(n) == "disk" and getattr(s, "paths", None) and n not in chosen]
    return chosen


def gate_config(config: Config, names: Sequence[str]) -> Config:
    """The config with only the gate's checks, and no job source: a job listing would ask SLURM."""
    from trainguard.agent.configfile import parse_config

    checks = dict(config.checks)
    missing = {n: {} for n in DEFAULT_GATE_CHECKS if n not in checks}
    if missing:  # gpu and xid at their defaults where the config has none
        checks |= parse_config({"checks": missing}, "(the gate's defaults)").checks
    chosen = {n: checks[n] for n in gate_checks(dataclasses.replace(config, checks=checks), names)}
    return dataclasses.replace(config, checks=chosen, jobs=config.jobs.model_copy(update={"sources": []}))


def passive_round(config: Config, budget: float, since_usec: int | None) -> list[Result] | None:
    """The gate checks' results, once; None while they still run after `budget` (a hung NVML call)."""
    from trainguard.pipeline.engine import Engine
    from trainguard.pipeline.store import Store

    outcome: dict[str, list[Result]] = {}

    def round_() -> None:
        engine = Engine(config, store=Store(None), notifiers={}, kernel_since_usec=since_usec)
        outcome["results"] = [r for report in engine.run_round(ingest=False) for r in report.results]

    worker = threading.Thread(target=round_, name="prolog-gate", daemon=True)
    worker.start()
    worker.join(budget)
    return outcome.get("results")


def diag_settings(config: Config, action: str) -> DiagToolSettings:
    """The tools and budgets of the diag action named (`diag`, or `resume` for its validation's); KeyError if none."""
    settings = config.actions.get(action)
    if not isinstance(settings, DiagToolSettings):
        raise KeyError(f"no diag action {action!r} in {config.source or 'the built-in config'}")
    return settings


def prolog_diag(config: Config, settings: DiagToolSettings, left: float, nvml: Nvml) -> list[Result]:
    """The quick diagnostics, when their budget (`budget_quick` of the diag action named) fits what is left of the
    gate's: their results, recorded in the agent's ledger. Skipped, with a line, when it does not fit, and refused
    (said) while a process holds the GPUs; no SLURM command is asked (a prolog that calls one can deadlock slurmd)."""
    need = settings.budget("quick")
    if need > left:
        print(f"trainguard prolog gate: quick diag skipped: its budget ({need:g}s) does not fit what is left of the "
              f"gate's ({max(left, 0):.1f}s)", file=sys.stderr)
        return []
    report = run_level(settings, "quick", lambda: gpu_holders(None, nvml=nvml))
    unrecorded = record_diag(config.agent.state_dir, config.agent.node_name, report, "prolog",
                             config.ledger.boot_id_path)
    if report.refused or unrecorded not in ("", "nothing ran"):
        print(f"trainguard prolog gate: {report.summary() if report.refused else unrecorded}", file=sys.stderr)
    return report.results


def run_prolog_gate(config: Config, gate_dir: str, budget: float = BUDGET_S, since_usec: int | None = None,
                    nvml: Nvml | None = None, diag: DiagToolSettings | None = None) -> int:
    """Run the gate checks once, then the quick diagnostics of `diag` if given and they fit the budget left: EXIT_FAIL
    on a CRITICAL result (SLURM drains the node and requeues the job), else 0. Prints one line per result that is
    not OK; the reason of a failure also goes to `<gate_dir>/prolog.json`."""
    start = time.monotonic()
    nvml = nvml or Nvml()
    results = passive_round(config, budget, since_usec)
    if results is None:  # still running: its slowness is not the node's verdict
        print(f"trainguard prolog gate: checks still running after the budget of {budget:g}s: node not refused",
              file=sys.stderr)
        return 0
    if diag is not None and not any(r.status is Status.CRITICAL for r in results):
        results = results + prolog_diag(config, diag, budget - (time.monotonic() - start), nvml)
    elapsed = time.monotonic() - start
    critical = [r for r in results if r.status is Status.CRITICAL]
    for r in sorted(results, key=lambda r: -r.status.severity):
        if r.status is not Status.OK:
            print(f"trainguard prolog gate: {r.status.name} {r.check} {r.subject}: {one_line(r.summary, 300)}",
                  file=sys.stderr)
    if critical:
        reason = "; ".join(f"{r.check}: {one_line(r.summary, 200)}" for r in critical[:3])
        reason += f" (and {len(critical) - 3} more CRITICAL)" if len(critical) > 3 else ""
        _verdict(gate_dir, "prolog", reason, elapsed)
        print(f"trainguard prolog gate: FAIL: {reason}", file=sys.stderr)
        return EXIT_FAIL
    _verdict(gate_dir, "prolog", "", elapsed)
    record_baseline(gate_dir, nvml)
    return 0


def record_baseline(gate_dir: str, nvml: Nvml) -> None:
    """Each GPU's memory in use while no process holds it: what the epilog expects back. Merged per GPU: a GPU busy
    now (another job's) keeps the baseline an earlier prolog recorded for it, which its job's epilog compares with.
    Prologs of jobs starting at once take turns (a lock file), so neither loses the other's GPUs."""
    try:
        gpus = nvml.gpus()
    except NvmlUnavailableError:
        return
    idle = {g.uuid: g.memory_used for g in gpus if g.memory_used is not None and g.processes == ()}
    if not idle:
        return
    with _locked(gate_dir, "gpu-baseline.lock"):
        earlier = _read(gate_dir, "gpu-baseline.json").get("used")
        kept = {k: v for k, v in earlier.items() if isinstance(v, int)} if isinstance(earlier, dict) else {}
        _write(gate_dir, "gpu-baseline.json", {"at": time.time(), "used": kept | idle})


# the epilog gate -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Leftover:
    pid: int
    uid: int | None
    comm: str
    state: str  # the kernel's: R, S, D, Z, ...
    why: str  # "on GPU 0", "in the job's cgroup", "SLURM_JOB_ID", "child of 1234"

    def describe(self) -> str:
        kind = {"Z": " zombie", "D": " in D state (uninterruptible)"}.get(self.state, "")
        return f"pid {self.pid} {self.comm!r} uid {self.uid}{kind} ({self.why})"


@dataclass(frozen=True)
class EpilogJob:
    job_id: str
    uid: int | None
    gpus: tuple[int, ...]  # SLURM_JOB_GPUS: slurmd sets it only for a job given GPUs (unset: the job had none)

    @staticmethod
    def from_env(env: Mapping[str, str]) -> EpilogJob | None:
        job_id = env.get("SLURM_JOB_ID", "")
        if not (job_id.isascii() and job_id.isdigit() and len(job_id) <= 10):
            return None
        uid = env.get("SLURM_JOB_UID", "")
        raw = env.get("SLURM_JOB_GPUS", "")  # set by slurmd for Prolog and Epilog (its CUDA_VISIBLE_DEVICES is not the job's)
        gpus = tuple(int(g) for g in raw.split(",") if g.strip().isdigit())
        return EpilogJob(job_id, int(uid) if uid.isdigit() else None, gpus)


@dataclass
class EpilogFindings:
    leftovers: list[Leftover] = field(default_factory=list)
    gpu_memory: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def failures(self) -> list[str]:
        out = []
        if self.leftovers:
            shown = "; ".join(p.describe() for p in self.leftovers[:NAMED_MAX])
            more = f" and {len(self.leftovers) - NAMED_MAX} more" if len(self.leftovers) > NAMED_MAX else ""
            out.append(f"{len(self.leftovers)} process(es) of the job left: {shown}{more}")
        return out + self.gpu_memory + self.files


def job_processes(job: EpilogJob, proc: ProcFS, gpu_pids: Mapping[int, str]) -> list[Leftover]:
    """The job's processes still here: of its user and marked as the job's (its SLURM cgroup, its SLURM_JOB_ID), or
    of its user on its GPUs (`gpu_pids`) with no readable mark saying otherwise, and their descendants (a zombie has no
    environment, but its parent). Another user's process, or one of another job of the user, is never the job's, on
    its GPUs (shared, MPS) or not."""
    table: dict[int, tuple[int, str, str, int | None]] = {}  # pid -> (ppid, comm, state, uid)
    for pid in proc.pids():
        text = proc.read_text(pid, "stat")
        if not text or ")" not in text:
            continue
        comm = text[text.find("(") + 1:text.rfind(")")]
        fields = text[text.rfind(")") + 2:].split()
        if len(fields) < 2 or not fields[1].isdigit():
            continue
        table[pid] = (int(fields[1]), comm, fields[0], proc.real_uid(pid))
    ours = _ancestors(os.getpid(), table)  # the epilog script and slurmd carry the job's SLURM_JOB_ID too
    found: dict[int, str] = {}
    for pid, (_, _, _, uid) in table.items():
        if pid in ours or job.uid is None or uid != job.uid:
            continue
        mark = _job_mark(proc, pid, job.job_id)
        if pid in gpu_pids and mark is not None:
            found[pid] = gpu_pids[pid]
        elif mark:
            found[pid] = mark
    children: dict[int, list[int]] = {}
    for pid, (ppid, *_rest) in table.items():
        children.setdefault(ppid, []).append(pid)
    todo = list(found)
    while todo:
        parent = todo.pop()
        for child in children.get(parent, []):
            if child not in found and child not in ours:
                found[child] = f"child of {parent}"
                todo.append(child)
    return [Leftover(pid, table[pid][3], one_line(table[pid][1], 32), table[pid][2], why)
            for pid, why in sorted(found.items())]


def _job_mark(proc: ProcFS, pid: int, job_id: str) -> str | None:
    """Why a process of the job's user is the job's ("in the job's cgroup", "SLURM_JOB_ID=N"); "" when nothing
    readable says (a zombie's or a kernel-cleared environment is empty); None when its environment or its cgroup (in
    SLURM's own tree, `jobs_of_proc_cgroup`) says it is not: another job's, or started outside any job (an ssh
    session)."""
    jobs = jobs_of_proc_cgroup(proc.cgroup(pid) or "")
    if job_id in jobs:
        return "in the job's cgroup"
    environ = proc.read_text(pid, "environ") or ""
    if environ:
        value = next((e[13:] for e in environ.split("\0") if e.startswith("SLURM_JOB_ID=")), None)
        return f"SLURM_JOB_ID={job_id}" if value == job_id else None
    return None if jobs else ""


def _ancestors(pid: int, table: Mapping[int, tuple[int, str, str, int | None]]) -> set[int]:
    out = set()
    while pid in table and pid not in out:
        out.add(pid)
        pid = table[pid][0]
    return out | {pid}


def job_gpus(job: EpilogJob, nvml: Nvml) -> tuple[list[GpuState], str]:
    """The job's GPUs as NVML sees them now, and a note when NVML is not there."""
    if not job.gpus:
        return [], ""
    try:
        return [g for g in nvml.gpus() if g.index in job.gpus], ""
    except NvmlUnavailableError as exc:
        return [], f"no NVML ({exc}): leftovers found by cgroup and environment only"


def gpu_memory(gpus: Sequence[GpuState], baseline: Mapping[str, object], job_pids: Set[int],
               slack: int) -> tuple[list[str], list[str]]:
    """(the job's GPUs whose memory is not back to their baseline, notes): memory other jobs' processes hold on a
    shared GPU is not the job's; a GPU without a baseline (none recorded while it was idle) is not compared, said."""
    held, notes = [], []
    for g in gpus:
        base = baseline.get(g.uuid)
        if g.memory_used is None:
            continue
        if not isinstance(base, int):
            notes.append(f"GPU {g.index}: no memory baseline (the prolog gate records it while the GPU is idle): "
                         "memory not compared")
            continue
        others = [p.used for p in g.processes or () if p.pid not in job_pids]
        if None in others:
            notes.append(f"GPU {g.index}: shared with another job's process whose memory NVML does not give: "
                         "memory not compared")
            continue
        theirs = sum(n for n in others if n is not None)
        if g.memory_used - theirs - base > slack:
            shared = f", {format_bytes(theirs)} of it other jobs' processes'" if theirs else ""
            held.append(f"GPU {g.index} holds {format_bytes(g.memory_used - theirs - base)} more memory than before "
                        f"the job ({format_bytes(g.memory_used)} used{shared}, baseline {format_bytes(base)})")
    return held, notes


_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_File = tuple[int, str, tuple[int, int]]  # (bytes, path, (device, inode))
_Dir = tuple[str, tuple[str, ...], tuple[int, int]]  # (path, its names below the top, (device, inode) when listed)


@dataclass
class _Walk:
    """One tmp dir's walk for `uid`'s files: entries of other users looked at, and why it stopped early ("" while
    not)."""
    uid: int
    deadline: float
    dev: int = 0  # the top's device: entries on another (a mount point) are not entered
    others: int = 0
    cut: str = ""
    found: list[_File] = field(default_factory=list)
    todo: deque[_Dir] = field(default_factory=deque)


def _user_files(top: str, walk: _Walk) -> list[_File]:
    """`walk.uid`'s files under `top`. The directories are read lazily, one entry at a time; entries of other users
    count towards WALK_MAX, and the walk stops there or at the deadline (`walk.cut`). Directories of another user that
    the user cannot write to are not entered (none of the user's files can be there), and the user's own are walked
    first: another user's files cannot use up the walk to hide the job's. A directory is opened from the top one name
    at a time on descriptors, never through a symlink, and only if it is still the one listed: another user who swaps
    a writable directory for a symlink (to a third user's files, to a hung mount) between the two gets nothing."""
    try:
        top_fd = os.open(top, _DIR)
    except OSError:
        return walk.found
    try:
        st = os.fstat(top_fd)
        walk.dev = st.st_dev
        walk.todo.append((top, (), (st.st_dev, st.st_ino)))
        while walk.todo:
            path, names, key = walk.todo.pop()
            fd = _open_below(top_fd, names, key)
            if fd is not None and not _list(fd, path, names, walk):
                break
    finally:
        os.close(top_fd)
    return walk.found


def _open_below(top_fd: int, names: Sequence[str], key: tuple[int, int]) -> int | None:
    """A descriptor of the directory `names` below the top, opened one name at a time with O_NOFOLLOW; None when one is
    gone, a symlink or not a directory, or when it is no longer the (device, inode) that was listed."""
    fd = os.dup(top_fd)
    try:
        for name in names:
            fd, parent = os.open(name, _DIR, dir_fd=fd), fd
            os.close(parent)
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) == key:
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _list(fd: int, path: str, names: tuple[str, ...], walk: _Walk) -> bool:
    """Look at one directory's entries (closes `fd`); False once the walk is cut."""
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                if time.monotonic() > walk.deadline:
                    walk.cut = f"after {WALK_S:g}s"
                    return False
                try:
                    st = entry.stat(follow_symlinks=False)  # fstatat on `fd`: no path is resolved again
                except OSError:
                    continue
                if st.st_dev != walk.dev:
                    continue
                if st.st_uid != walk.uid:
                    walk.others += 1
                    if walk.others > WALK_MAX:
                        walk.cut = f"at {WALK_MAX} entries of other users"
                        return False
                inside = f"{path.rstrip('/')}/{entry.name}"
                if stat.S_ISDIR(st.st_mode):
                    below = (inside, (*names, entry.name), (st.st_dev, st.st_ino))
                    if st.st_uid == walk.uid:
                        walk.todo.append(below)
                    elif st.st_uid == 0 or st.st_mode & 0o022:
                        walk.todo.appendleft(below)
                elif st.st_uid == walk.uid:
                    walk.found.append((st.st_blocks * 512, inside, (st.st_dev, st.st_ino)))
    except OSError:  # a directory that fails while listed (EIO) ends its listing
        pass
    finally:
        os.close(fd)
    return True


@dataclass
class Held:
    """What the live processes of a user hold: the paths of their open descriptors and the (device, inode) of their
    mapped files, each with the first pid seen holding it, and whether the deadline cut the look short (then some were
    not seen)."""
    paths: dict[str, int] = field(default_factory=dict)
    keys: dict[tuple[int, int], int] = field(default_factory=dict)
    cut: bool = False

    def holder(self, path: str, key: tuple[int, int]) -> int | None:
        """The pid that holds the file (`path` open, or `key` mapped); None when none does."""
        return self.paths.get(path, self.keys.get(key))


def held_files(proc: ProcFS, uid: int, deadline: float) -> Held:
    """What the live processes of `uid` hold, as far as the deadline lets the look go."""
    held = Held()
    for pid in proc.pids():
        if time.monotonic() > deadline:
            held.cut = True
            break
        if proc.real_uid(pid) != uid:
            continue
        for path in proc.open_paths(pid):
            held.paths.setdefault(path, pid)
        for key in proc.mapped_files(pid):
            held.keys.setdefault(key, pid)
    return held


def job_files(uid: int, dirs: Sequence[str], limit: int, proc: ProcFS) -> tuple[list[str], list[str]]:
    """(failures, notes): the job user's files in each of `dirs` (/dev/shm) that no live process of the user holds
    open or maps (those are a running job's: another of the user's, or a leftover already named), when they add up to
    more than `limit`, the largest named. Symlinks are not followed; a walk cut short says so."""
    failures, notes = [], []
    deadline = time.monotonic() + WALK_S
    held: Held | None = None
    for top in dirs:
        walk = _Walk(uid, deadline)
        files = _user_files(os.path.realpath(top), walk)  # realpath: what /proc/PID/fd's links name
        if walk.cut:
            notes.append(f"{top}: walk cut {walk.cut}: the job's user's files after it not counted")
        if sum(n for n, _, _ in files) <= limit:
            continue
        if held is None:  # once, on its own deadline: what a running job holds must not be charged to this one
            held = held_files(proc, uid, time.monotonic() + HELD_S)
        if held.cut:
            notes.append(f"{top}: the look at what the job's user's processes hold was cut after {HELD_S:g}s: "
                         f"{len(files)} file(s) of the user ({format_bytes(sum(n for n, _, _ in files))}) not "
                         "checked, not counted")
            continue
        free, taken, holders = [], [], set()
        for n, p, key in files:  # one pass: a user's files and what their processes hold can each be 100,000s
            pid = held.holder(p, key)
            (free if pid is None else taken).append((n, p))
            if pid is not None:
                holders.add(pid)
        if taken:  # the pids that hold these files, not every process of the user that holds any file
            notes.append(f"{top}: {len(taken)} file(s) of the job's user ({format_bytes(sum(n for n, _ in taken))}) "
                         f"held open or mapped by its running processes (pid {', '.join(map(str, sorted(holders)[:5]))}"
                         f"{', ...' if len(holders) > 5 else ''}): not counted")
        total = sum(n for n, _ in free)
        if total > limit:
            largest = ", ".join(f"{one_line(p, 120)} ({format_bytes(n)})" for n, p in sorted(free, reverse=True)[:3])
            failures.append(f"{top}: the job's user left {format_bytes(total)} in {len(free)} file(s) (over "
                            f"{format_bytes(limit)}{', walk cut' if walk.cut else ''}): {largest}")
    return failures, notes


def check_epilog(job: EpilogJob, nvml: Nvml, proc: ProcFS, gate_dir: str, tmp_dirs: Sequence[str],
                 shm_max: int = SHM_MAX, gpu_slack: int = GPU_SLACK, grace: float = GRACE_S,
                 sleep: Callable[[float], None] = time.sleep) -> EpilogFindings:
    """What the job left; its processes are looked at again for up to `grace` while they are still exiting (slurmd
    SIGKILLs a job's tasks just before its epilog, and a dying process takes a moment)."""
    findings = EpilogFindings()
    baseline = _read(gate_dir, "gpu-baseline.json").get("used")
    baseline = baseline if isinstance(baseline, dict) else {}
    end = time.monotonic() + grace
    while True:
        gpus, note = job_gpus(job, nvml)
        leftovers = job_processes(job, proc, {p.pid: f"on GPU {g.index}" for g in gpus for p in g.processes or ()})
        held, notes = gpu_memory(gpus, baseline, {p.pid for p in leftovers}, gpu_slack)
        if (not leftovers and not held) or time.monotonic() >= end:
            break
        sleep(0.2)
    findings.leftovers, findings.gpu_memory = leftovers, held
    findings.notes += ([note] if note else []) + notes
    if job.uid is not None and job.uid != 0:  # root's files in /dev/shm are the system's, not a job's
        findings.files, notes = job_files(job.uid, tmp_dirs, shm_max, proc)
        findings.notes += notes
    return findings


def run_epilog_gate(env: Mapping[str, str], gate_dir: str, tmp_dirs: Sequence[str], shm_max: int = SHM_MAX,
                    gpu_slack: int = GPU_SLACK, grace: float = GRACE_S, nvml: Nvml | None = None) -> int:
    """EXIT_FAIL when the job left something behind (SLURM drains the node before the next job), the leftovers named
    on stderr (slurmd's log) and in `<gate_dir>/epilog.json`; else 0."""
    start = time.monotonic()
    job = EpilogJob.from_env(env)
    if job is None:
        print("trainguard epilog gate: no SLURM_JOB_ID in the environment: nothing checked", file=sys.stderr)
        return 0
    findings = check_epilog(job, nvml or Nvml(), ProcFS(), gate_dir, tmp_dirs, shm_max, gpu_slack, grace)
    for note in findings.notes:
        print(f"trainguard epilog gate: job {job.job_id}: {note}", file=sys.stderr)
    failures = findings.failures()
    reason = f"job {job.job_id}: " + "; ".join(failures) if failures else ""
    _verdict(gate_dir, "epilog", reason, time.monotonic() - start)
    if failures:
        print(f"trainguard epilog gate: FAIL: {reason}", file=sys.stderr)
        return EXIT_FAIL
    return 0


# the verdict files ---------------------------------------------------------------------------------------------------
def _verdict(gate_dir: str, gate: str, reason: str, elapsed: float) -> None:
    _write(gate_dir, f"{gate}.json", {"at": time.time(), "pass": not reason, "reason": reason,
                                      "elapsed_s": round(elapsed, 3)})


def _write(gate_dir: str, name: str, data: Mapping[str, object]) -> None:
    try:
        folder = Path(gate_dir)
        folder.mkdir(mode=0o755, parents=True, exist_ok=True)
        replace_file(folder / name, json.dumps(data, ensure_ascii=True).encode(), 0o644)
    except OSError as exc:  # the exit status is the verdict: a file not written is said, never fatal
        print(f"trainguard gate: {gate_dir}/{name} not written: {exc}", file=sys.stderr)


@contextlib.contextmanager
def _locked(gate_dir: str, name: str, wait: float = 2.0) -> Iterator[None]:
    """Hold `<gate_dir>/<name>` (flock) for a read-modify-write; past `wait`, or where it cannot be opened, go on
    without it (said): a gate never hangs on another's lock."""
    try:
        Path(gate_dir).mkdir(mode=0o755, parents=True, exist_ok=True)
        fd = os.open(Path(gate_dir) / name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        print(f"trainguard gate: {gate_dir}/{name} not opened, going on unlocked: {exc}", file=sys.stderr)
        yield
        return
    try:
        end = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= end:
                    print(f"trainguard gate: {gate_dir}/{name} still locked after {wait:g}s, going on unlocked",
                          file=sys.stderr)
                    break
                time.sleep(0.02)
        yield
    finally:
        os.close(fd)  # the lock goes with it


def _read(gate_dir: str, name: str) -> dict[str, object]:
    path = Path(gate_dir) / name
    try:
        st = path.lstat()
        if not stat.S_ISREG(st.st_mode) or st.st_uid not in (0, os.geteuid()):
            return {}
        data = json.loads(read_small(path, 1 << 20))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
