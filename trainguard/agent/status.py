"""The /status document: the agent's snapshot, its incidents and the jobs it sees, as JSON for `trainguard status`."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

from trainguard import __version__
from trainguard.pipeline.engine import Engine


def status_document(engine: Engine, details: bool = True) -> dict[str, Any]:
    """`details=False` (the TCP endpoint, open to every local user): summaries only, no result or incident details,
    no user names; the full document goes to the control socket (root and the agent's group)."""
    snap = engine.snapshot()
    view = engine.catalog.cached() if engine.catalog else None
    return {
        "node": snap.node,
        "version": __version__,
        "pid": os.getpid(),
        "started": snap.started,
        "healthy": engine.healthy(),
        "checks": {
            name: {
                "type": st.kind,
                "interval_s": st.interval,
                "last_run": st.last.started if st.last else None,
                "duration_s": round(st.last.duration, 4) if st.last else None,
                "outcome": st.last.outcome if st.last else None,
                "idle_reason": st.last.idle_reason if st.last else None,
                "runs": st.runs,
                "timeouts": st.timeouts,
                "results": [_result(r.to_dict(), details) for r in st.last.results] if st.last else [],
            }
            for name, st in snap.checks.items()
        },
        "incidents": [_result(i.to_dict(), details) for i in engine.tracker.incidents()],
        "jobs": {"sources": engine.catalog.sources, "errors": view.errors,
                 "jobs": [_job(j.to_dict(), details) for j in view.on_node()]} if engine.catalog and view else None,
        "details": details,
        "silences": [asdict(s) for s in engine.tracker.silences() if s.until > snap.agent.get("now", 0.0)],
        "outbox": {ch: {"queued": n, "oldest": oldest} for ch, (n, oldest) in snap.outbox.items()},
    }


def _result(data: dict[str, Any], details: bool) -> dict[str, Any]:
    return data if details else {**data, "details": {}}


def _job(data: dict[str, Any], details: bool) -> dict[str, Any]:
    return data if details else {**data, "user": None, "switch_dir": None}
