"""The agent's own health as a check, so it reaches the channels like any other fault: whether its state can be
written (a full or failing state disk loses no alert, but the operator must know it is at risk), whether its config
has it watch anything at all, what an action refused to do (the drain circuit breaker): a fault nobody acted on, and
whether its file descriptors near their limit (at the limit its log reads, state and deliveries fail)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from trainguard.checks.base import Check, CheckContext, CheckSettings
from trainguard.core.model import Metric, Result, Status
from trainguard.pipeline.store import Store

NAME = "agent"  # reserved: no configured check may take it
FDS_NEAR_LIMIT = 0.8  # as the TrainguardAgentFdsNearLimit rule: said while the channels still work
STATE_WRITABLE = Metric("trainguard_state_writable",
                        "1 while the agent's state (incidents, outbox) is written to disk; 0 while it is only in memory.")


class AgentCheck(Check):
    metrics = (STATE_WRITABLE,)

    def __init__(self, context: CheckContext, store: Store, config_warnings: Sequence[str] = (),
                 refused: Callable[[], list[dict[str, Any]]] = list,
                 usage: Callable[[], Mapping[str, float]] = dict) -> None:
        super().__init__(NAME, CheckSettings(interval=10.0, jitter=0.0, timeout=10.0), context)
        self.store = store
        self.config_warnings = tuple(config_warnings)
        self.refused = refused
        self.usage = usage  # the engine's reading of the agent's own usage (trainguard.node.procfs.own_usage)

    def run(self) -> Sequence[Result]:
        return [*self.config_results(), self.state_result(), *self.refusals(), *self.fds_result()]

    def fds_result(self) -> list[Result]:
        """WARNING while over FDS_NEAR_LIMIT of RLIMIT_NOFILE is open; nothing where either is unknown."""
        usage = self.usage()
        fds, limit = usage.get("fds"), usage.get("max_fds")
        if fds is None or not limit:
            return []
        details = {"open": int(fds), "limit": int(limit)}
        if fds > FDS_NEAR_LIMIT * limit:
            return [self.result("fds", Status.WARNING, f"{fds:.0f} of {limit:.0f} file descriptors open: at the limit "
                                "log reads, state writes and deliveries fail (docs/runbooks/agent.md)", details)]
        return [self.result("fds", Status.OK, f"{fds:.0f} of {limit:.0f} file descriptors open", details)]

    def config_results(self) -> list[Result]:
        """A config that is valid but watches nothing: WARNING while it lasts (a restart with a fixed config resolves
        it, as the subject is no longer reported)."""
        if not self.config_warnings:
            return []
        return [self.result("config", Status.WARNING, "; ".join(self.config_warnings),
                            {"warnings": list(self.config_warnings)})]

    def state_result(self) -> Result:
        self.store.recover()  # no-op unless degraded: the disk may take the state again
        where = str(self.store.path.parent) if self.store.path else "memory"
        if self.store.degraded:
            return self.result("state", Status.CRITICAL,
                               f"state dir {where} not writable ({self.store.degraded}): incidents and notifications "
                               "carry on in memory and are written when it is writable again; free space or fix it "
                               "before the agent restarts", {"path": where, "error": self.store.degraded},
                               [STATE_WRITABLE(0)])
        return self.result("state", Status.OK, f"state written to {where}", {"path": where}, [STATE_WRITABLE(1)])

    def refusals(self) -> list[Result]:
        """Each action that refused to act (the drain circuit breaker), CRITICAL while the incident it answered lasts."""
        return [self.result(f"refused:{r['action']}:{r['check']}/{r['subject']}", Status.CRITICAL, r["detail"],
                            {k: r[k] for k in ("action", "check", "subject", "incident")})
                for r in self.refused()]
