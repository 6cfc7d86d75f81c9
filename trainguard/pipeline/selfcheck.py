"""The agent's own health as a check, so it reaches the channels like any other fault: whether its state can be
written (a full or failing state disk loses no alert, but the operator must know it is at risk), and what an action
refused to do (the drain circuit breaker): a fault nobody acted on."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from trainguard.checks.base import Check, CheckContext, CheckSettings
from trainguard.core.model import Metric, Result, Status
from trainguard.pipeline.store import Store

NAME = "agent"  # reserved: no configured check may take it
STATE_WRITABLE = Metric("trainguard_state_writable",
                        "1 while the agent's state (incidents, outbox) is written to disk; 0 while it is only in memory.")


class AgentCheck(Check):
    metrics = (STATE_WRITABLE,)

    def __init__(self, context: CheckContext, store: Store,
                 refused: Callable[[], list[dict[str, Any]]] = list) -> None:
        super().__init__(NAME, CheckSettings(interval=10.0, jitter=0.0, timeout=10.0), context)
        self.store = store
        self.refused = refused

    def run(self) -> Sequence[Result]:
        self.store.recover()  # no-op unless degraded: the disk may take the state again
        where = str(self.store.path.parent) if self.store.path else "memory"
        if self.store.degraded:
            return [self.result("state", Status.CRITICAL,
                                f"state dir {where} not writable ({self.store.degraded}): incidents and notifications "
                                "carry on in memory and are written when it is writable again; free space or fix it "
                                "before the agent restarts", {"path": where, "error": self.store.degraded},
                                [STATE_WRITABLE(0)]), *self._refusals()]
        return [self.result("state", Status.OK, f"state written to {where}", {"path": where}, [STATE_WRITABLE(1)]),
                *self._refusals()]

    def _refusals(self) -> list[Result]:
        return [self.result(f"refused:{r['action']}:{r['check']}/{r['subject']}", Status.CRITICAL, r["detail"],
                            {k: r[k] for k in ("action", "check", "subject", "incident")})
                for r in self.refused()]
