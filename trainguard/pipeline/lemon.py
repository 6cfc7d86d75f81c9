"""The lemon policy's face: a check of the agent's own (`lemon`) that is CRITICAL while a rule holds the node (its
incident drains the node with the rule's reason, and resolves when an operator clears it), the gate that keeps the
`resume` action from lifting that drain, and the ledger's metrics (docs/node-lifecycle.md)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from trainguard.actions.base import ActionContext
from trainguard.checks.base import Check, CheckContext, CheckSettings
from trainguard.core.model import Metric, Result, Status
from trainguard.pipeline.ledger import DAY, DIAG, Hold, Ledger, LedgerSettings, episodes
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
DIAG_RUNS = Metric("trainguard_diag_runs", "Diagnostics runs in this node's ledger over the window (the `diag` "
                                          "action, the `resume` action's validation, `trainguard diag`, the prolog "
                                          "gate's), by level and result (pass, fail).", ("level", "result", "window"))
DIAG_SECONDS = Metric("trainguard_diag_last_seconds", "How long the latest diagnostics run of each level in this "
                                                      "node's ledger took.", ("level",))
DIAG_PASSED = Metric("trainguard_diag_last_passed", "1 if the latest diagnostics run of each level in this node's "
                                                    "ledger passed, else 0.", ("level",))
WINDOWS = {"1d": DAY, "7d": 7 * DAY, "30d": 30 * DAY}
METRICS = (HELD, FAULTS, COMPONENTS, DIAG_RUNS, DIAG_SECONDS, DIAG_PASSED)


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
        samples += self.fault_samples() + self.diag_samples()
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

    def diag_samples(self) -> list:  # type: ignore[type-arg]
        now = self.context.clock()
        runs: Counter[tuple[str, str, str]] = Counter()
        latest = {}
        for r in self.ledger.store.ledger_rows(now - max(WINDOWS.values()), events=(DIAG,)):
            result = "pass" if r.data.get("passed") else "fail"
            runs.update((r.cls, result, w) for w, size in WINDOWS.items() if r.at >= now - size)
            latest[r.cls] = r  # oldest first: the last one stays
        samples = [DIAG_RUNS(n, {"level": lv, "result": res, "window": w}) for (lv, res, w), n in sorted(runs.items())]
        for level, r in sorted(latest.items()):
            seconds = r.data.get("seconds")
            if isinstance(seconds, (int, float)):
                samples.append(DIAG_SECONDS(float(seconds), {"level": level}))
            samples.append(DIAG_PASSED(1 if r.data.get("passed") else 0, {"level": level}))
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
