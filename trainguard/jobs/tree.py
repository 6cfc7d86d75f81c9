"""The live processes of a job: its trusted top pids and all their descendants."""

from __future__ import annotations

import psutil

from trainguard.jobs.model import Job


def job_processes(job: Job) -> list[psutil.Process]:
    """Every process of the job on this node, each once; pids whose identity changed are left out."""
    found: dict[int, psutil.Process] = {}
    for ref in job.processes:
        if not ref.matches():
            continue
        try:
            top = psutil.Process(ref.pid)
            found.setdefault(top.pid, top)
            for child in top.children(recursive=True):
                found.setdefault(child.pid, child)
        except psutil.Error:
            continue
    return list(found.values())
