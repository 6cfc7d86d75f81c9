"""The /status document: the agent's snapshot, its incidents and the jobs it sees, as JSON for `trainguard status`."""

from __future__ import annotations

import os
from typing import Any

from trainguard import __version__
from trainguard.pipeline.engine import Engine


def status_document(engine: Engine) -> dict[str, Any]:
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
                "results": [r.to_dict() for r in st.last.results] if st.last else [],
            }
            for name, st in snap.checks.items()
        },
        "incidents": [i.to_dict() for i in engine.tracker.incidents()],
        "jobs": {"sources": engine.catalog.sources, "errors": view.errors, "jobs": [j.to_dict() for j in view.on_node()]}
        if engine.catalog and view else None,
        "outbox": {ch: {"queued": n, "oldest": oldest} for ch, (n, oldest) in snap.outbox.items()},
    }
