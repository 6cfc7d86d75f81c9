"""The /status document: the agent's snapshot, its incidents and the jobs it sees, as JSON for `trainguard status`."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

from trainguard import __version__
from trainguard.core.model import Result
from trainguard.jobs.catalog import JobView
from trainguard.pipeline.engine import Engine

# What /status over TCP keeps (`details=False`): any local user reads it, so nothing a job's user wrote (log lines,
# summaries, job names, paths) and nothing of another user (names, pids). The control socket (root and the agent's
# group) has the whole document.
RESULT_KEYS = ("check", "subject", "status")
INCIDENT_KEYS = ("id", "check", "subject", "status", "since", "bad_runs", "firing", "fired_at", "announced",
                 "last_notified")
JOB_KEYS = ("key", "source", "state", "job_id", "array_job_id", "array_task_id", "start_time", "end_time",
            "exit_code")
SILENCE_KEYS = ("id", "check", "subject", "until", "by", "at")
ENDED_PROBE_MAX = 64  # a job's listed processes looked at to tell it ended: /status costs the same whatever the job


def status_document(engine: Engine, details: bool = True) -> dict[str, Any]:
    """`details=False` (the TCP endpoint, open to every local user): names, subjects, statuses and times only
    (the *_KEYS above); the full document goes to the control socket (root and the agent's group)."""
    snap = engine.snapshot()
    view = engine.catalog.cached() if engine.catalog else None
    return {
        "node": snap.node,
        "version": __version__,
        "pid": os.getpid(),
        "started": snap.started,
        "now": snap.agent.get("now"),  # what a result's `last_run` is measured against: its age, whatever the reader's clock
        "healthy": engine.healthy(),
        "checks": {
            name: {
                "type": st.kind,
                "interval_s": st.interval,
                "last_run": st.last.started if st.last else None,
                "duration_s": round(st.last.duration, 4) if st.last else None,
                "outcome": st.last.outcome if st.last else None,
                "idle_reason": st.last.idle_reason if st.last else None,
                "partial": st.last.partial if st.last else None,  # why the last run saw only part of its sources
                "runs": st.runs,
                "timeouts": st.timeouts,
                "results": [_result(r, details, view) for r in st.last.results] if st.last else [],
            }
            for name, st in snap.checks.items()
        },
        "incidents": [_incident(i.to_dict(), details) for i in engine.tracker.incidents()],
        "jobs": {"sources": engine.catalog.sources,
                 "errors": view.errors if details else dict.fromkeys(view.errors, "failed"),
                 "jobs": [_only(j.to_dict(), details, JOB_KEYS) for j in view.on_node()]}
        if engine.catalog and view else None,
        "details": details,
        "silences": [_only(asdict(s), details, SILENCE_KEYS) for s in engine.tracker.silences()
                     if s.until > snap.agent.get("now", 0.0)],
        "outbox": {ch: {"queued": n, "oldest": oldest} for ch, (n, oldest) in snap.outbox.items()},
    }


def _result(result: Result, details: bool, view: JobView | None) -> dict[str, Any]:
    """A job check's result stays its last until the check runs again (up to its interval): one about a job that has
    ended since says so (`job_ended`), so that it is not read as the job's state now."""
    data = _only(result.to_dict(), details, RESULT_KEYS)
    key = result.details.get("job_key")
    if key and view is not None and _ended(key, view):
        data["job_ended"] = True
    return data


def _ended(key: str, view: JobView) -> bool:
    """Not running in the last listing (a check or an action listed the jobs after the result's run), or every process
    the listing had for it gone (no listing since: /status lists nothing itself, so that no reader drives the job
    sources)."""
    job = next((j for j in view.on_node() if j.key == key), None)
    if job is None:
        return True
    refs = job.processes
    return 0 < len(refs) <= ENDED_PROBE_MAX and all(ref.gone() for ref in refs)


def _only(data: dict[str, Any], details: bool, keys: tuple[str, ...]) -> dict[str, Any]:
    return data if details else {k: data.get(k) for k in keys}


def _incident(data: dict[str, Any], details: bool) -> dict[str, Any]:
    """Over TCP: who acknowledged it and which actions ran with what outcome, not the reason or what they said."""
    if details:
        return data
    acked = data.get("acked")
    return {**_only(data, False, INCIDENT_KEYS),
            "acked": {k: acked.get(k) for k in ("by", "at")} if acked else None,
            "actions": [{k: a.get(k) for k in ("action", "outcome", "at")} for a in data.get("actions") or []]}
