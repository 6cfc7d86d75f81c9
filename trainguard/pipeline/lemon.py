"""The lemon policy's face: a check of the agent's own (`lemon`) that is CRITICAL while a rule holds the node (its
incident drains the node with the rule's reason, and resolves when an operator clears it), the gate that keeps the
`resume` action from lifting that drain, and the ledger's metrics (docs/node-lifecycle.md)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from trainguard.actions.base import ActionContext
from trainguard.checks.base import Check, CheckContext, CheckSettings
from trainguard.core.model import Metric, Result, Status
from trainguard.pipeline.ledger import DAY, Hold, Ledger, LedgerSettings, episodes
from trainguard.pipeline.ledger import FAULTS as LEDGER_FAULTS

NAME = "lemon"  # reserved: no configured check may take it
HELD = Metric("trainguard_lemon_held", "1 while a lemon rule holds this node drained (until an operator clears it), "
                                       "by rule; 0 for each other rule.", ("rule",))
FAULTS = Metric("trainguard_ledger_faults", "Hardware faults in this node's ledger over the window, by component kind, "
                                            "fault class (the check type), model (a GPU's name) and severity "
                                            "(critical, warning); one fault seen by several checks counts once.",
                ("kind", "class", "model", "severity", "window"))
COMPONENTS = Metric("trainguard_ledger_components", "GPUs of this node the ledger knows this boot, by model: with "
                                                    "trainguard_ledger_faults, the MTBF per model.", ("kind", "model"))
WINDOWS = {"1d": DAY, "7d": 7 * DAY, "30d": 30 * DAY}
METRICS = (HELD, FAULTS, COMPONENTS)


def clear_hint(hold: Hold) -> str:
    return f"`trainguard clear {NAME}/{hold.subject} --reason ...` once repaired"


class LemonCheck(Check):
    metrics = METRICS

    def __init__(self, context: CheckContext, ledger: Ledger, settings: LedgerSettings) -> None:
        super().__init__(NAME, CheckSettings(interval=60.0, jitter=0.0, timeout=10.0, actions=settings.actions), context)
        self.ledger = ledger
        self.rules = tuple(settings.rules)
        self.gap = settings.same_fault_within

    def run(self) -> Sequence[Result]:
        self.ledger.prune()
        holds = self.ledger.held()
        out = [self.result(h.subject, Status.CRITICAL, f"{h.reason}; held drained: {clear_hint(h)}",
                           {"rule": h.rule, "component_kind": h.kind, "component": h.component, "since": h.since,
                            "history": h.history, "scope": "node"})
               for h in holds.values()]
        rules = {h.rule for h in holds.values()}
        samples = [HELD(1 if rule in rules else 0, {"rule": rule}) for rule in self.rules]
        samples += self.fault_samples()
        out.append(self.result("ledger", Status.OK, f"{len(holds)} held", {"held": sorted(holds)}, samples))
        return out

    def fault_samples(self) -> list:  # type: ignore[type-arg]
        now = self.context.clock()
        rows = self.ledger.store.ledger_rows(now - max(WINDOWS.values()), events=LEDGER_FAULTS)
        per: dict[tuple[str, str, str, str, str], list[float]] = {}
        for r in rows:
            severity = str(r.data.get("status") or "").lower()
            if severity in ("critical", "warning"):
                per.setdefault((r.kind, r.cls, r.model, severity, r.component), []).append(r.at)
        counts: Counter[tuple[str, str, str, str, str]] = Counter()
        for (kind, cls, model, severity, _), times in per.items():
            for first in episodes(times, self.gap):
                for window, size in WINDOWS.items():
                    if first >= now - size:
                        counts[(kind, cls, model or "unknown", severity, window)] += 1
        samples = [FAULTS(n, {"kind": k, "class": c, "model": m, "severity": s, "window": w})
                   for (k, c, m, s, w), n in sorted(counts.items())]
        models = Counter(self.ledger.present())
        samples += [COMPONENTS(n, {"kind": "gpu", "model": m}) for m, n in sorted(models.items())]
        return samples

    def clear(self, subject: str, at: float) -> None:
        self.ledger.release(subject)


class HoldGate:
    """The `resume` action's gate (trainguard.actions.base.ResumeGate): no resume while a lemon rule holds the node."""

    name = NAME

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def check(self, ctx: ActionContext) -> tuple[bool, str]:
        holds = self.ledger.held()
        if not holds:
            return True, ""
        hold = next(iter(holds.values()))
        return False, f"held as a lemon ({hold.rule}): {hold.reason}; {clear_hint(hold)}"
