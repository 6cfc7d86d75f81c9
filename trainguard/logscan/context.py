"""What the node knows around a log finding: the step it came at, whether the losses in between were
finite, and the state of the GPU an OOM names (who else holds its memory, ECC and row-remap faults)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import psutil

from trainguard.core.text import linear
from trainguard.gpu.health import gpu_faults
from trainguard.gpu.nvml import GpuState, Nvml, NvmlUnavailableError
from trainguard.logscan.lines import MAX_LINE, plain, timestamp
from trainguard.logscan.oom import CoTenant, GpuContext
from trainguard.node.procfs import ProcFS
from trainguard.node.users import UserNames

STEP_WINDOW = 64 << 10  # step lines are printed every step or few: the last one is close by
# `step 100`, `Step: 100`, `global_step=100`, Megatron's `iteration      100/  500000`; not `Skipping step.`
# Lightning's progress bar prints it in scientific notation: `global_step=3.2e+4`; mmengine's iteration is the first
# number in its second bracket: `Epoch(train) [1][240/735]`
# The digit after the number (group 2) is captured to refuse a longer one: RE2 has no lookahead, and the first 15
# digits of a 10,000-digit "step" are no step.
_STEP = linear(rb"(?i)(?:\bglobal_step|\bstep|\biteration|\biter)\b\s*[:=#]?\s*(\d{1,15}(?:\.\d{1,6}e\+?\d{1,2})?)(\d?)"
               rb"|Epoch\(train\) {0,4}\[\d{1,9}\]\[(\d{1,12})/")
_FINITE_LOSS = linear(rb"""(?i)\bloss['"]?\s*[:=]\s*['"]?[-+]?\.?\d""")


def step_marks(data: bytes) -> dict[str | None, tuple[int, float | None]]:
    """The last step each rank printed in `data` (its last STEP_WINDOW bytes), with the line's own timestamp (`lines.
    timestamp`: seconds in its year) or None; keyed by the rank the line names (None: a line that names none)."""
    marks: dict[str | None, tuple[int, float | None]] = {}
    for found in _STEP.finditer(data, max(0, len(data) - STEP_WINDOW)):
        step = _step(found)
        if step is None:
            continue
        start = data.rfind(b"\n", 0, found.start()) + 1
        end = data.find(b"\n", found.end())
        line = data[start:end if end >= 0 else len(data)][:MAX_LINE].decode("utf-8", errors="replace")
        marks[plain(line).rank] = (step, timestamp(line))
    return marks


def last_step(data: bytes, end: int | None = None, start: int = 0) -> int | None:
    """The step of the last step line in data[start:end] (within STEP_WINDOW bytes before `end`), or None (also when
    its number is 1e15 or more: a 10,000-digit step is no step)."""
    end = len(data) if end is None else end
    found = None
    for found in _STEP.finditer(data, max(0, start, end - STEP_WINDOW), end):  # noqa: B007 - the last one is wanted
        pass
    return None if found is None else _step(found)


def _step(found: Any) -> int | None:
    """The step a match of _STEP names: None when the number runs on past 15 digits or reaches 1e15."""
    if found.group(2):
        return None
    step = float(found.group(1) or found.group(3))
    return int(step) if step < 1e15 else None


# The trainer helper's relaunch loop, when it starts the job's command again for a restart in place (its stderr, in
# the job's log; trainguard/trainer.py prints it, tests/test_training_log.py reads the real loop's line). At a line's
# start, or after a carriage return (a killed rank's progress bar left without its newline).
_AGAIN = b": starting it again"
_RELAUNCH = linear(rb"(?m)(?:^|\r)trainguard relaunch: restart [^\n]*: starting it again[^\n]*\n?")
_WINDOW = 4096


def relaunched(data: bytes) -> int:
    """The end of the last line of `data` (complete lines) on which the relaunch loop says it starts the command
    again, or -1: what comes before it is the earlier start's. Searched on RE2 from the end, in windows that double:
    a log that never says it costs one substring search, and a user's flood of such lines the last window's."""
    if _AGAIN not in data:
        return -1
    size = _WINDOW
    while True:
        start = max(0, len(data) - size)
        start = data.rfind(b"\n", 0, start) + 1 if start else 0  # from a line's start: `^` holds there
        last = None
        for last in _RELAUNCH.finditer(data[start:]):  # noqa: B007 - the last one is wanted
            pass
        if last is not None:
            return start + last.end()
        if start == 0:
            return -1
        size *= 2


def finite_loss(data: bytes, start: int, end: int) -> bool:
    """Whether a finite loss value (`loss=2.31`, `'loss': 0.5`) is printed in data[start:end]."""
    return _FINITE_LOSS.search(data, start, end) is not None


def visible_devices(pids: Collection[int], proc: ProcFS | None = None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES of the first of these processes that sets it: how the job's ordinals map to GPUs."""
    proc = proc or ProcFS()
    for pid in pids:
        value = proc.environ_var(pid, "CUDA_VISIBLE_DEVICES")
        if value is not None:
            return [d.strip() for d in value.split(",") if d.strip()]
    return None


def pick_gpu(gpus: list[GpuState], ordinal: int | None, job_pids: Collection[int],
             visible: list[str] | None) -> GpuState | None:
    """The physical GPU behind the job's CUDA ordinal: through CUDA_VISIBLE_DEVICES (indexes or UUIDs), else
    the one GPU the job holds memory on, else the ordinal as an NVML index (a job that sees every GPU)."""
    if ordinal is not None and visible and ordinal < len(visible):
        entry = visible[ordinal]
        for gpu in gpus:
            if (entry.isdigit() and gpu.index == int(entry)) or (not entry.isdigit() and gpu.uuid.startswith(entry)):
                return gpu
    held = [g for g in gpus if any(p.pid in job_pids for p in g.processes or ())]
    if len(held) == 1:
        return held[0]
    if ordinal is not None and not visible:
        return next((g for g in gpus if g.index == ordinal), None)
    return None


def _who(pid: int, names: UserNames) -> tuple[str | None, str | None]:
    """A process's command name and user, None where it is gone or hidden."""
    try:
        proc = psutil.Process(pid)
        return proc.name(), names.name(proc.uids().real)
    except psutil.Error:
        return None, None


def oom_gpu(nvml: Nvml, ordinal: int | None, job_pids: Collection[int], names: UserNames, proc: ProcFS | None = None,
            job_of: Callable[[int], str | None] | None = None) -> GpuContext | None:
    """The OOMed GPU as NVML sees it now: the other processes holding its memory (command, user, and the job they
    belong to, `job_of(pid)`: a job's label or None), its faults, and whether the job runs on a MIG slice.
    None when NVML is not available or the GPU can't be told."""
    visible = visible_devices(job_pids, proc)
    mig = bool(visible) and all(d.startswith("MIG-") for d in visible or ())
    try:
        gpus = nvml.gpus()
    except NvmlUnavailableError:
        return GpuContext(mig=True) if mig else None
    gpu = pick_gpu(gpus, ordinal, job_pids, visible)
    if gpu is None:
        return GpuContext(mig=True) if mig else None
    others = []
    for p in gpu.processes or ():
        if p.pid in job_pids:
            continue
        command, user = _who(p.pid, names)
        others.append(CoTenant(p.pid, p.used, command, user, job_of(p.pid) if job_of else None))
    return GpuContext(gpu.index, tuple(others), tuple(gpu_faults(gpu)), mig)
