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

The epilog gate checks the job let go of the node: no process of the job left (on its GPUs per NVML, or of its user
and marked as the job's: in its cgroup or with its SLURM_JOB_ID), none a zombie or in D state, its GPUs' memory back
to the prolog's baseline, and the job's user's files in /dev/shm (and `--tmp` dirs) under a threshold.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from trainguard.actions.diag import DiagToolSettings, gpu_holders, run_level
from trainguard.core.files import read_small, replace_file
from trainguard.core.model import Result, Status
from trainguard.core.text import one_line
from trainguard.core.units import format_bytes
from trainguard.gpu.nvml import GpuState, Nvml, NvmlUnavailableError
from trainguard.node.procfs import ProcFS
from trainguard.pipeline.config import Config
from trainguard.pipeline.ledger import record_diag

BUDGET_S = 10.0
DEFAULT_GATE_CHECKS = ("gpu", "xid")
SHM_MAX = 64 << 20
GPU_SLACK = 512 << 20
GRACE_S = 3.0
WALK_MAX = 20000  # directory entries a tmp walk looks at
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
    """Each GPU's memory in use while no process holds it: what the epilog expects back."""
    try:
        gpus = nvml.gpus()
    except NvmlUnavailableError:
        return
    baseline = {g.uuid: g.memory_used for g in gpus if g.memory_used is not None and g.processes == ()}
    if baseline:
        _write(gate_dir, "gpu-baseline.json", {"at": time.time(), "used": baseline})


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
    gpus: tuple[int, ...] | None  # SLURM_JOB_GPUS; None: not said (every GPU counts)

    @staticmethod
    def from_env(env: Mapping[str, str]) -> EpilogJob | None:
        job_id = env.get("SLURM_JOB_ID", "")
        if not (job_id.isascii() and job_id.isdigit() and len(job_id) <= 10):
            return None
        uid = env.get("SLURM_JOB_UID", "")
        raw = env.get("SLURM_JOB_GPUS", "")  # set by slurmd for Prolog and Epilog (its CUDA_VISIBLE_DEVICES is not the job's)
        gpus = tuple(int(g) for g in raw.split(",") if g.strip().isdigit()) if raw.strip() else None
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
    """The job's processes still here: on its GPUs (any user's), or of its user and marked as the job's (its SLURM
    cgroup, its SLURM_JOB_ID), and their descendants (a zombie has no environment, but its parent)."""
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
    marker = f"/job_{job.job_id}/"
    found: dict[int, str] = {}
    for pid, (_, _, _, uid) in table.items():
        if pid in ours:
            continue
        if pid in gpu_pids:
            found[pid] = gpu_pids[pid]
        elif job.uid is not None and uid == job.uid:
            if marker in (proc.cgroup(pid) or ""):
                found[pid] = "in the job's cgroup"
            elif proc.environ_var(pid, "SLURM_JOB_ID") == job.job_id:
                found[pid] = f"SLURM_JOB_ID={job.job_id}"
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


def _ancestors(pid: int, table: Mapping[int, tuple[int, str, str, int | None]]) -> set[int]:
    out = set()
    while pid in table and pid not in out:
        out.add(pid)
        pid = table[pid][0]
    return out | {pid}


def _job_gpus(job: EpilogJob, gpus: list[GpuState]) -> list[GpuState]:
    return [g for g in gpus if job.gpus is None or g.index in job.gpus]


def gpu_findings(job: EpilogJob, nvml: Nvml, gate_dir: str, slack: int) -> tuple[dict[int, str], list[str], str]:
    """(pids on the job's GPUs -> why, memory not back to baseline, a note); empty without NVML."""
    try:
        gpus = _job_gpus(job, nvml.gpus())
    except NvmlUnavailableError as exc:
        return {}, [], f"no NVML ({exc}): leftovers found by cgroup and environment only"
    pids = {p.pid: f"on GPU {g.index}" for g in gpus for p in (g.processes or ())}
    baseline = _read(gate_dir, "gpu-baseline.json").get("used", {})
    held = []
    for g in gpus:
        base = baseline.get(g.uuid) if isinstance(baseline, dict) else None
        if g.memory_used is None or not isinstance(base, int):
            continue
        if g.memory_used - base > slack:
            held.append(f"GPU {g.index} holds {format_bytes(g.memory_used - base)} more memory than before the job "
                        f"({format_bytes(g.memory_used)} used, baseline {format_bytes(base)})")
    note = "" if baseline else "no GPU memory baseline (the prolog gate records it): memory not compared"
    return pids, held, note


def job_files(uid: int, dirs: Sequence[str], limit: int) -> list[str]:
    """The job user's files in each of `dirs` (/dev/shm), when they add up to more than `limit`: the largest named.
    Symlinks are not followed; the walk stops at WALK_MAX entries (said)."""
    out = []
    for top in dirs:
        total, sizes, seen, capped = 0, [], 0, False
        stack = [top]
        while stack and not capped:
            try:
                entries = list(os.scandir(stack.pop()))
            except OSError:
                continue
            for entry in entries:
                seen += 1
                if seen > WALK_MAX:
                    capped = True
                    break
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    stack.append(entry.path)
                elif st.st_uid == uid:
                    used = st.st_blocks * 512
                    total += used
                    sizes.append((used, entry.path))
        if total > limit:
            largest = ", ".join(f"{one_line(p, 120)} ({format_bytes(n)})" for n, p in sorted(sizes, reverse=True)[:3])
            out.append(f"{top}: the job's user left {format_bytes(total)} in {len(sizes)} file(s) (over "
                       f"{format_bytes(limit)}{', walk capped' if capped else ''}): {largest}")
    return out


def check_epilog(job: EpilogJob, nvml: Nvml, proc: ProcFS, gate_dir: str, tmp_dirs: Sequence[str],
                 shm_max: int = SHM_MAX, gpu_slack: int = GPU_SLACK, grace: float = GRACE_S,
                 sleep: Callable[[float], None] = time.sleep) -> EpilogFindings:
    """What the job left; its processes are looked at again for up to `grace` while they are still exiting (slurmd
    SIGKILLs a job's tasks just before its epilog, and a dying process takes a moment)."""
    findings = EpilogFindings()
    end = time.monotonic() + grace
    while True:
        gpu_pids, held, note = gpu_findings(job, nvml, gate_dir, gpu_slack)
        leftovers = job_processes(job, proc, gpu_pids)
        if (not leftovers and not held) or time.monotonic() >= end:
            break
        sleep(0.2)
    findings.leftovers, findings.gpu_memory = leftovers, held
    if note:
        findings.notes.append(note)
    if job.uid is not None and job.uid != 0:  # root's files in /dev/shm are the system's, not a job's
        findings.files = job_files(job.uid, tmp_dirs, shm_max)
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
