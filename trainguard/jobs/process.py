"""Plain-process jobs declared in config by a command-line regex or a pidfile."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import psutil

from trainguard.core.text import linear
from trainguard.jobs.model import Job, ProcessRef
from trainguard.jobs.settings import JobsSettings, ProcessJobSettings
from trainguard.jobs.slurm import SlurmClient


def _read_pid(pidfile: Path) -> int | None:
    try:
        text = pidfile.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


class ProcessSource:
    """The jobs declared in `[jobs.processes]`, found by command-line regex or pidfile."""

    def __init__(self, settings: JobsSettings, node: str, slurm: SlurmClient) -> None:
        self.declared = settings.processes

    def _find(self, spec: ProcessJobSettings, table: list[tuple[psutil.Process, str]]) -> list[psutil.Process]:
        me = os.getpid()
        if spec.pidfile is not None:
            pid = _read_pid(spec.pidfile)
            if pid is None or pid in (0, 1, me) or not psutil.pid_exists(pid):
                return []
            procs = [psutil.Process(pid)]
        else:
            assert spec.cmdline is not None
            pattern = linear(spec.cmdline)
            procs = [p for p, cmd in table if p.pid not in (1, me) and pattern.search(cmd)]
        if spec.user is not None:
            procs = [p for p in procs if _username(p) == spec.user]
        pids = {p.pid for p in procs}
        # A launcher and its workers may all match: the job's main processes are the topmost ones.
        return [p for p in procs if _ppid(p) not in pids]

    def jobs(self) -> Sequence[Job]:
        jobs = []
        # One pass over /proc for all declared jobs: reading every command line is most of a refresh's cost.
        table: list[tuple[psutil.Process, str]] = []
        if any(spec.pidfile is None for spec in self.declared.values()):
            table = [(p, cmd) for p in psutil.process_iter(["cmdline"]) if (cmd := " ".join(p.info.get("cmdline") or []))]
        for name, spec in self.declared.items():
            roots = self._find(spec, table)
            refs = tuple(r for r in (ProcessRef.of(p.pid) for p in roots) if r)
            user = _username(roots[0]) if roots else spec.user
            uid = _uid(roots[0]) if roots else None
            start = min((r.create_time for r in refs), default=None)
            jobs.append(Job(key=f"process:{name}", source="process", name=name, state="RUNNING" if refs else "ABSENT",
                            user=user, uid=uid, start_time=start, on_this_node=True, processes=refs,
                            log_paths=tuple(spec.logs), switch_dir=spec.switch_dir))
        return jobs


def _username(p: psutil.Process) -> str | None:
    try:
        return p.username()
    except (psutil.Error, KeyError):
        return None


def _uid(p: psutil.Process) -> int | None:
    try:
        return p.uids().real
    except psutil.Error:
        return None


def _ppid(p: psutil.Process) -> int | None:
    try:
        return p.ppid()
    except psutil.Error:
        return None
