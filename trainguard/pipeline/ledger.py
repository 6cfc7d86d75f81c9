"""The node ledger: every fault, drain, resume, reboot, GPU reset, diagnostics run and operator's clear of this node,
recorded against the component's hardware identity and kept across reboots (`ledger.retention`, 90 days by default),
in the state database. It answers `trainguard history`, and the lemon policy (`ledger.rules`) reads it when a fault
or a drain is recorded: a component or node that failed again and again is held drained until an operator clears it
(docs/node-lifecycle.md).

Identity: a GPU is its board serial from NVML (its UUID where NVML has no serial), an HCA its node GUID, an NVSwitch
its PCI address, anything else the node. A swapped part is a new component with a clean record, even in the same
slot: the PCI bus id names where a part sits, never which part it is. A GPU a diagnostic names (dcgmi by its index
and serial, nvidia-smi by its bus id, serial and UUID) is the one that answered there this boot: its failure is a
fault of that GPU (class `diag`).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from trainguard.checks.base import ActionBinding
from trainguard.core.events import Event, EventKind
from trainguard.core.logs import kv
from trainguard.core.model import Result, Status
from trainguard.core.settings import Duration, Field, SettingsModel, field_validator
from trainguard.gpu.diagtools import FAILED_GPUS
from trainguard.pipeline.store import LedgerRow, SchemaTooNewError, Store, ledger_append, ledger_query, open_read_only

if TYPE_CHECKING:
    from trainguard.actions.diag import DiagReport

log = logging.getLogger("trainguard.ledger")

DAY = 86400.0
BOOT_KEY = "ledger.boot_id"
HELD_KEY = "ledger.held"
IDENTITIES_KEY = "ledger.identities"
KINDS = ("gpu", "hca", "nvswitch", "node")
RECORDED = {EventKind.FIRED: "fault", EventKind.ESCALATED: "escalate", EventKind.RESOLVED: "resolve"}
FAULTS = ("fault", "escalate")  # an incident that fired, or got worse: what the rules and the metrics count
SEVERITY = {"critical": ("CRITICAL",), "warning": ("CRITICAL", "WARNING")}  # counted at each rule's `severity`
PRUNE_EVERY_S = 3600.0
HISTORY_IN_HOLD = 10  # the latest entries a hold (and its alert) quotes
DIAG = "diag"  # the event of a diagnostics run (its class: the level)
RESET = "reset"
# What a GPU's health fields show until it is reset (NVML's): seen, then gone on the same boot, the GPU was reset.
AWAITS_RESET = (("lost", "lost (reset required)"), ("remap_pending", "row remap pending"),
                ("retired_pages_pending", "retired pages pending"))
EXTERNAL_TIMEOUT_S = 1.0  # how long `trainguard diag` or a prolog waits for the agent's database to take an entry


class LemonRule(SettingsModel):
    """One lemon rule: `count` faults (or drains) within `within` hold the node drained until an operator clears it."""

    scope: Literal["component", "node"] = Field(
        "component", description="`component`: counts the faults of one component (a GPU by its serial, an HCA by "
                                 "its GUID); `node`: counts those of the whole node.")
    event: Literal["fault", "drain"] = Field("fault", description="What is counted: hardware faults (an incident of "
                                                                    "a hardware check firing) or drains of the node.")
    kinds: list[str] = Field(default_factory=list, description="Component kinds counted (gpu, hca, nvswitch, node); "
                                                               "empty: every kind.")
    classes: list[str] = Field(default_factory=list, description="Fault classes counted: the hardware checks' types "
                                                                 "(xid, gpu, nvlink, pcie, infiniband, fabric, ...); "
                                                                 "empty: every class.")
    count: int = Field(2, ge=1, le=1000, description="Held at this many within `within`.")
    within: Duration = Field(7 * DAY, gt=0, description="The window the count is over.")
    verdict: str = Field("inspect", max_length=40, description="What to do, the drain reason's last words.")
    severity: Literal["critical", "warning"] = Field(
        "critical", description="The least severe fault counted: `critical` (a GPU off the bus, a failed row remap, a "
                                "link down), or `warning` too (an application's XID 31, a pending row remap).")

    @field_validator("kinds")
    @classmethod
    def _kinds(cls, value: list[str]) -> list[str]:
        unknown = [k for k in value if k not in KINDS]
        if unknown:
            raise ValueError(f"unknown component kind {', '.join(unknown)} (expected {', '.join(KINDS)})")
        return value


def default_rules() -> dict[str, LemonRule]:
    """Defaults from the peers' figures (docs/node-lifecycle.md): gpud escalates an XID to inspection after 2 reboots
    that did not fix it, NVSentinel flags multiple remediations of a node within 7 days and repeated NIC degradation
    (3 in an hour)."""
    return {
        "repeat-fault": LemonRule(kinds=["gpu", "nvswitch"], count=2, within=7 * DAY, verdict="RMA"),
        "nic-flap": LemonRule(kinds=["hca"], count=3, within=3600.0, verdict="replace the HCA or its cable"),
        "repeat-drain": LemonRule(scope="node", event="drain", count=3, within=30 * DAY, verdict="inspect the node"),
    }


class LedgerSettings(SettingsModel):
    """The node ledger and its lemon policy (docs/node-lifecycle.md)."""

    enabled: bool = Field(True, description="Keep the ledger and apply the lemon rules (the daemon only).")
    retention: Duration = Field(90 * DAY, gt=0, description="Entries older than this are pruned.")
    same_fault_within: Duration = Field(
        600.0, ge=0, description="Faults of one component this close together count once for the lemon rules: one "
                                 "fault is often several incidents (a GPU off the bus is `xid` and `gpu`).")
    boot_id_path: Path = Field(Path("/proc/sys/kernel/random/boot_id"),
                               description="Where this boot's id is read; a new one is recorded as a reboot.")
    rules: dict[str, LemonRule] = Field(
        default_factory=default_rules,
        description="The lemon rules, by name; a table given here replaces the defaults (`rules = {}`: none).",
        json_schema_extra={"default_doc": "`repeat-fault` (a GPU or NVSwitch, 2 faults in 7d: RMA), `nic-flap` (an "
                                          "HCA, 3 faults in 1h), `repeat-drain` (the node, 3 drains in 30d)"})
    actions: ActionBinding = Field(
        default_factory=lambda: ActionBinding(critical=["drain"], resolved=["resume"]),
        description="The actions of the `lemon` incident: it fires when a rule holds the node, and resolves when an "
                    "operator clears it (`trainguard clear lemon/SUBJECT --reason ...`).")


@dataclass(frozen=True)
class Component:
    kind: str  # gpu, hca, nvswitch, node
    id: str  # serial (else UUID), node GUID, PCI address, node name
    uuid: str = ""
    bus_id: str = ""
    model: str = ""

    def label(self) -> str:
        name = {"gpu": "GPU", "hca": "HCA", "nvswitch": "NVSwitch", "node": "node"}.get(self.kind, self.kind)
        return f"{name} {short(self.id)}"


@dataclass(frozen=True)
class Hold:
    """A lemon rule matched: the node stays drained for `reason` until an operator clears `subject`."""

    subject: str
    rule: str
    kind: str
    component: str
    reason: str
    since: float
    history: list[str]


@dataclass
class Identities:
    """What the hardware checks told the ledger: kept in the state database (kv `ledger.identities`), read by the
    agent and by `trainguard diag` or a prolog into it."""

    serials: dict[str, dict[str, str]]  # uuid -> serial, model
    slots: dict[str, str]  # bus id -> uuid, this boot's only: a part can only be swapped with the power off
    indexes: dict[str, str]  # GPU index -> uuid, this boot's only (NVML's order follows the slots)

    @classmethod
    def stored(cls, ids: Mapping[str, Any], boot_id: str) -> Identities:
        same_boot = ids.get("boot_id") == boot_id
        return cls(dict(ids.get("uuid") or {}), dict(ids.get("bus") or {}) if same_boot else {},
                   dict(ids.get("index") or {}) if same_boot else {})

    def learn(self, details: Mapping[str, Any]) -> bool:
        """A GPU result's serial, model, bus id and index for its UUID: whether anything changed."""
        uuid, bus, index = details.get("uuid"), details.get("bus_id"), details.get("index")
        if not isinstance(uuid, str) or not uuid:
            return False
        known = {"serial": str(details.get("serial") or ""), "model": str(details.get("name") or "")}
        old = self.serials.get(uuid, {})
        merged = {k: known[k] or old.get(k, "") for k in known}
        places = [(self.slots, bus)] if isinstance(bus, str) and bus else []
        if isinstance(index, int) and not isinstance(index, bool):
            places.append((self.indexes, str(index)))
        changed = merged != old or any(table.get(key) != uuid for table, key in places)
        self.serials[uuid] = merged
        for table, key in places:
            table[key] = uuid
        return changed

    def resolve(self, details: Mapping[str, Any], node: str) -> Component:
        """The component a result's or an event's details name (the module's docstring says how)."""
        uuid, bus, serial = (str(details.get(k) or "") for k in ("uuid", "bus_id", "serial"))
        if not uuid and bus and not details.get("switch"):
            uuid = self.slots.get(bus, "")
        if not uuid and details.get("index") is not None:  # a diagnostic naming a GPU by its index alone
            uuid = self.indexes.get(str(details.get("index")), "")
        known = self.serials.get(uuid, {}) if uuid else {}
        if uuid:
            return Component("gpu", serial or known.get("serial") or uuid, uuid, bus,
                             str(details.get("name") or known.get("model") or ""))
        if details.get("node_guid"):
            return Component("hca", str(details["node_guid"]), bus_id=str(details.get("device") or ""),
                             model=str(details.get("hca_type") or ""))
        if details.get("switch") and bus:
            return Component("nvswitch", bus, bus_id=bus)
        if serial:  # a diagnostic's GPU by its serial: the board, whatever this boot's UUIDs
            return Component("gpu", serial, bus_id=bus)
        if bus:  # a GPU that never answered NVML this boot (off the bus at start): its slot is all there is
            return Component("gpu", f"pci:{bus}", bus_id=bus)
        return Component("node", node)


def short(ident: str) -> str:
    """`1320...0004` for a long serial or GUID: a drain reason is one short line."""
    return ident if len(ident) <= 12 else f"{ident[:4]}...{ident[-4:]}"


def span(seconds: float) -> str:
    """`6d`, `5h`, `12m`: how long a run of faults took, for a reason."""
    for unit, size in (("d", DAY), ("h", 3600.0), ("m", 60.0)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def fault_label(cls: str, details: Mapping[str, Any]) -> str:
    """What a fault was, in a few words: `XID 79`, `NVLink`."""
    if cls == "xid":
        xids = sorted({e.get("xid") for e in details.get("xids") or () if isinstance(e, dict)
                       and isinstance(e.get("xid"), int)})
        return "XID " + ",".join(map(str, xids)) if xids else "XID"
    names = {"gpu": "GPU fault", "diag": "diag failed", "nvlink": "NVLink", "pcie": "PCIe", "infiniband": "link",
             "fabric": "fabric"}
    return names.get(cls, cls or "fault")


def episodes(times: Iterable[float], gap: float) -> list[float]:
    """The first time of each run of `times` (sorted) less than `gap` apart: one fault seen several ways."""
    out: list[float] = []
    last = None
    for t in sorted(times):
        if last is None or t - last >= gap:
            out.append(t)
        last = t
    return out


def by_incident(rows: Iterable[LedgerRow]) -> list[float]:
    """The time each incident was first recorded (rows oldest first): an incident's `fault` and its later `escalate`
    are one fault, however far apart. An entry without an incident id is its own. (Drains count each: one incident
    re-drained after an operator's resume is drained again.)"""
    first: dict[str, float] = {}
    for r in rows:
        first.setdefault(str(r.data.get("incident") or f"#{r.id}"), r.at)
    return list(first.values())


def _reset_fields(details: Mapping[str, Any]) -> list[tuple[str, bool | None]]:
    """Each health field a GPU reset clears, in words, and whether it awaits one: None where it reads nothing (a
    query that failed, or a GPU without it)."""
    out = [(words, None if details.get(key) is None else bool(details.get(key))) for key, words in AWAITS_RESET]
    ecc = details.get("ecc_uncorrected_volatile")  # volatile: the counter starts again at a reset
    out.append(("uncorrected ECC errors", ecc > 0 if isinstance(ecc, int) else None))
    return out


def awaiting_reset(details: Mapping[str, Any]) -> list[str]:
    """What a GPU's health fields (the gpu check's result details) say awaits a reset."""
    return [words for words, awaits in _reset_fields(details) if awaits]


def diag_row(node: str, boot_id: str, report: DiagReport, source: str, at: float) -> LedgerRow | None:
    """A diagnostics run as a ledger entry (None: it ran nothing). `source`: action, resume, cli, prolog."""
    if report.refused or not report.results:
        return None
    failed = [{"test": r.subject, "status": r.status.name, "summary": r.summary[:200]} for r in report.failed]
    data = {"level": report.level, "source": source, "passed": report.passed, "status": report.status.name,
            "seconds": round(report.seconds, 2), "tests": len(report.results), "failed": failed,
            "absent": report.absent}
    return LedgerRow(at, boot_id, "node", node, DIAG, report.level, report.summary()[:500], data=data)


def diag_faults(boot_id: str, report: DiagReport, source: str, at: float,
                identify: Callable[[Mapping[str, Any]], Component]) -> list[LedgerRow]:
    """A `fault` (class `diag`, CRITICAL) against each GPU a failed test names (FAILED_GPUS) that `identify`
    knows: a repair that did not fix it, which the lemon rules count. A GPU it does not know stays in the run's
    entry, against the node."""
    named: dict[str, tuple[Component, list[str]]] = {}
    for result in report.failed:
        failed_gpus = result.details.get(FAILED_GPUS)
        for gpu in failed_gpus if isinstance(failed_gpus, list) else ():
            component = identify(gpu) if isinstance(gpu, dict) else None
            if component is not None and component.kind == "gpu":
                reasons = named.setdefault(component.id, (component, []))[1]
                reasons.extend(f"{result.subject}: {why}" for why in gpu.get("reasons") or ["failed"])
    data = {"check": DIAG, "subject": f"diag {report.level}", "status": Status.CRITICAL.name, "label": "diag failed",
            "level": report.level, "source": source}
    return [LedgerRow(at, boot_id, c.kind, c.id, "fault", DIAG, f"{c.label()} diag {report.level} failed: "
                      f"{'; '.join(reasons)}"[:500], c.uuid, c.bus_id, c.model, dict(data))
            for c, reasons in named.values()]


def stored_identities(state_dir: Path, boot_id: str) -> Identities:
    """The agent's identities, for another process's diagnostics; none where they can't be read (the output's own
    serials and UUIDs still name their GPUs)."""
    try:
        conn = open_read_only(state_dir)
        try:
            row = conn.execute("SELECT value FROM kv WHERE key = ?", (IDENTITIES_KEY,)).fetchone()
        finally:
            conn.close()
        ids = json.loads(row[0]) if row else {}
    except (OSError, ValueError, SchemaTooNewError, sqlite3.Error):
        ids = {}
    return Identities.stored(ids if isinstance(ids, dict) else {}, boot_id)


def record_diag(state_dir: Path, node: str, report: DiagReport, source: str,
                boot_id_path: Path = Path("/proc/sys/kernel/random/boot_id")) -> str:
    """A run of another process (`trainguard diag`, the prolog gate) into the agent's ledger: "" once recorded,
    else why not, in words (no agent database here, busy, another schema, not permitted): never raises, and
    waits at most EXTERNAL_TIMEOUT_S for a busy database. Its GPU faults count at the agent's next judgement of
    that GPU (another fault of it)."""
    boot_id, at = read_boot_id(boot_id_path), time.time()
    row = diag_row(node, boot_id, report, source, at)
    if row is None:
        return "nothing ran"
    known = stored_identities(state_dir, boot_id) if report.failed else Identities({}, {}, {})
    faults = diag_faults(boot_id, report, source, at, lambda details: known.resolve(details, node))
    try:
        ledger_append(state_dir, [row, *faults], EXTERNAL_TIMEOUT_S)
    except (OSError, ValueError, SchemaTooNewError, sqlite3.Error) as exc:
        return f"not recorded in the ledger: {exc}"
    return ""


def read_boot_id(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()[:64]
    except OSError:
        return ""


class Ledger:
    """Records into the store's `ledger` table and keeps the holds (kv `ledger.held`). Thread-safe: checks' threads
    and actions' threads record at once. `on_hold` is called (outside the lock) when a rule holds something new."""

    def __init__(self, store: Store, node: str, settings: LedgerSettings, clock: Callable[[], float] = time.time,
                 on_hold: Callable[[], None] | None = None) -> None:
        self.store = store
        self.node = node
        self.settings = settings
        self.clock = clock
        self.on_hold = on_hold
        self.boot_id = read_boot_id(settings.boot_id_path)
        self._lock = threading.Lock()
        self._judging = threading.Lock()  # one judgement at a time: two checks' faults at once hold a part once
        self._pruned_at = -PRUNE_EVERY_S
        ids = self._load(IDENTITIES_KEY)
        self._known = Identities.stored(ids, self.boot_id)
        same_boot = ids.get("boot_id") == self.boot_id
        # GPU index -> what it awaited a reset for, this boot's only (a reboot resets every GPU, recorded as such)
        self._awaiting: dict[str, list[str]] = dict(ids.get("awaiting") or {}) if same_boot else {}

    def _load(self, key: str) -> dict[str, Any]:
        try:
            data = json.loads(self.store.get(key) or "{}")
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {}

    # identity ------------------------------------------------------------------------------------------------
    def learn(self, results: Sequence[Result]) -> None:
        """A hardware check's results: which serial each GPU UUID is, and which UUID sits at each bus id this boot
        (an XID names the bus; a lost GPU no longer answers for its serial); a GPU whose health fields awaited a
        reset and read clean now, on the same boot, was reset (recorded)."""
        changed = False
        resets = []
        with self._lock:
            awaited = dict(self._awaiting)
            for r in results:
                cleared = self._reset_seen(r)
                if cleared:
                    resets.append((r, cleared))
                changed = self._known.learn(r.details) or changed
            changed = changed or self._awaiting != awaited
            data = json.dumps({"uuid": self._known.serials, "bus": self._known.slots, "index": self._known.indexes,
                               "boot_id": self.boot_id, "awaiting": self._awaiting})
        if changed:
            self.store.put(IDENTITIES_KEY, data)
        for r, cleared in resets:
            gpu = self.identify(r.details)
            self._add(gpu, RESET, "gpu", f"{gpu.label()} reset: {', '.join(cleared)} cleared", {"cleared": cleared})
            log.info("GPU reset recorded in the ledger", extra=kv(component=gpu.id, cleared=",".join(cleared)))

    def _reset_seen(self, r: Result) -> list[str] | None:
        """What a GPU result (the gpu check's: it carries the health fields) no longer awaits a reset for, when it
        awaited one at its last reading this boot; keeps what it awaits now. Under the lock."""
        if "remap_pending" not in r.details:
            return None
        index = str(r.details.get("index"))
        fields = dict(_reset_fields(r.details))
        now = [words for words, awaits in fields.items() if awaits]
        before = self._awaiting.pop(index, [])
        # A reading that failed proves nothing: what it awaited still stands, where the GPU was not read (no UUID)
        # or the field was not (a transient NVML error reads None). Only a definite False or 0 clears it.
        unknown = before if not r.details.get("uuid") else [w for w in before if fields.get(w) is None]
        if now or unknown:
            self._awaiting[index] = now + [w for w in unknown if w not in now]
            return None
        return before or None

    def present(self) -> list[str]:
        """The model of each GPU seen this boot (one entry per GPU)."""
        with self._lock:
            return [self._known.serials.get(uuid, {}).get("model") or "unknown" for uuid in self._known.slots.values()]

    def identify(self, details: Mapping[str, Any]) -> Component:
        with self._lock:
            return self._known.resolve(details, self.node)

    # recording -----------------------------------------------------------------------------------------------
    def _add(self, component: Component, event: str, cls: str = "", summary: str = "",
             data: Mapping[str, Any] | None = None, at: float | None = None) -> None:
        self.store.ledger_add([LedgerRow(self.clock() if at is None else at, self.boot_id, component.kind, component.id,
                                         event, cls, summary[:500], component.uuid, component.bus_id, component.model,
                                         dict(data or {}))])

    def note_boot(self) -> bool:
        """At the agent's start: a boot id unlike the last one recorded is a reboot (the first start ever is not)."""
        last = self.store.get(BOOT_KEY)
        if last == self.boot_id or not self.boot_id:
            return False
        self.store.put(BOOT_KEY, self.boot_id)
        if last is None:
            return False
        self._add(Component("node", self.node), "reboot", summary=f"booted (boot id {self.boot_id[:8]}, was "
                                                                   f"{last[:8]})", data={"previous": last})
        log.info("reboot recorded in the ledger", extra=kv(boot_id=self.boot_id, previous=last))
        return True

    def on_event(self, event: Event, cls: str) -> list[Hold]:
        """A hardware check's incident fired, escalated or resolved: recorded against its component; a fault is
        judged by the lemon rules."""
        what = RECORDED.get(event.kind)
        if what is None:
            return []
        component = self.identify(event.details)
        data = {"check": event.check, "subject": event.subject, "status": event.status.name,
                "incident": event.incident_id, "label": fault_label(cls, event.details)}
        self._add(component, what, cls, event.summary, data, at=event.at)
        return self.judge(component, "fault") if what in FAULTS else []

    def on_action(self, event: Event, kind: str, record: Mapping[str, Any]) -> list[Hold]:
        """An action's outcome: a drain or resume done is recorded against the node, and a drain judged."""
        what = {"DrainAction": "drain", "ResumeAction": "resume"}.get(kind)
        if what is None or record.get("outcome") != "ok":
            return []
        node = Component("node", self.node)
        self._add(node, what, summary=str(record.get("detail") or ""), data={
            "action": record.get("action"), "check": event.check, "subject": event.subject,
            "incident": event.incident_id})
        return self.judge(node, "drain") if what == "drain" else []

    def on_diag(self, report: DiagReport, source: str) -> list[Hold]:
        """A diagnostics run (the `diag` action, the `resume` action's validation): its level, verdict, failed tests
        and duration, against the node; a fault against each GPU its failed tests name, judged. A run refused, or
        with no tool to run, ran nothing and is not recorded."""
        at = self.clock()
        row = diag_row(self.node, self.boot_id, report, source, at)
        if row is None:
            return []
        faults = diag_faults(self.boot_id, report, source, at, self.identify)
        self.store.ledger_add([row, *faults])
        return [h for f in faults for h in self.judge(Component(f.kind, f.component, f.uuid, f.bus_id, f.model),
                                                      "fault")]

    def on_clear(self, check: str, subject: str, by: str, uid: int, reason: str) -> None:
        """An operator's clear: the repair, recorded against the component held (or the node)."""
        held = self.held().get(subject) if check == "lemon" else None
        component = Component(held.kind, held.component) if held else Component("node", self.node)
        self._add(component, "clear", check, f"cleared {check}/{subject} by {by}: {reason}",
                  {"by": by, "uid": uid, "reason": reason, "check": check, "subject": subject})

    # the lemon policy ----------------------------------------------------------------------------------------
    def judge(self, component: Component, event: str) -> list[Hold]:
        """The rules that count `event`s, on the entries of `component` (or the node); new holds are kept, recorded
        and announced through `on_hold`."""
        with self._judging:
            new = self._judge(component, event)
        if new and self.on_hold is not None:
            self.on_hold()
        return new

    def _judge(self, component: Component, event: str) -> list[Hold]:
        now = self.clock()
        held = self.held()
        new: list[Hold] = []
        for name, rule in self.settings.rules.items():
            if rule.event != event or (rule.kinds and component.kind not in rule.kinds):
                continue
            whole = rule.scope == "node"
            subject = self.node if whole else component.id
            if subject in held or any(h.subject == subject for h in new):
                continue
            since = self._cleared(subject, now - rule.within)
            rows = self.store.ledger_rows(now - rule.within, None if whole else component.id,
                                          events=FAULTS if event == "fault" else ("drain",))
            rows = [r for r in rows if (r.at, r.id) > since and (not rule.kinds or r.kind in rule.kinds)
                    and (event != "fault" or (r.data.get("status") in SEVERITY[rule.severity]
                                              and (not rule.classes or r.cls in rule.classes)))]
            firsts = episodes(by_incident(rows) if event == "fault" else [r.at for r in rows],
                              self.settings.same_fault_within)
            if len(firsts) < rule.count:
                continue
            labels = sorted({str(r.data.get("label") or r.cls or r.event) for r in rows})
            who = Component("node", self.node) if whole else component
            what = ",".join(labels) if event == "fault" else "drained"
            reason = f"{who.label()} {what} {len(firsts)}x in {span(now - firsts[0])}: {rule.verdict}"
            history = [f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime(r.at))} {r.event} {short(r.component)} "
                       f"{r.summary}"[:200] for r in rows[-HISTORY_IN_HOLD:]]
            new.append(Hold(subject, name, who.kind, who.id, reason, now, history))
        if not new:
            return []
        with self._lock:
            data = {k: asdict(h) for k, h in self.held().items()}
            data.update({h.subject: asdict(h) for h in new})
            self.store.put(HELD_KEY, json.dumps(data))
        for hold in new:
            self._add(Component(hold.kind, hold.component), "lemon", hold.rule, hold.reason, {"rule": hold.rule})
            log.warning("lemon: held drained until an operator clears it", extra=kv(
                rule=hold.rule, component=hold.component, reason=hold.reason))
        return new

    def _cleared(self, subject: str, since: float) -> tuple[float, int]:
        """When (time, entry id) an operator last cleared the hold of `subject` (`trainguard clear lemon/SUBJECT`),
        since `since`: the repair, after which the rules count afresh; else `since`."""
        clears = [(r.at, r.id) for r in self.store.ledger_rows(since, events=("clear",))
                  if r.data.get("check") == "lemon" and r.data.get("subject") == subject]
        return max(clears, default=(since, -1))

    def held(self) -> dict[str, Hold]:
        out = {}
        for subject, raw in self._load(HELD_KEY).items():
            try:
                out[subject] = Hold(**raw)
            except TypeError:
                continue
        return out

    def held_reason(self) -> str:
        """The reason of the oldest hold standing, "" for none: what a drain of the node says meanwhile."""
        holds = sorted(self.held().values(), key=lambda h: h.since)
        return holds[0].reason if holds else ""

    def release(self, subject: str) -> Hold | None:
        """An operator cleared the hold."""
        with self._lock:
            holds = self.held()
            gone = holds.pop(subject, None)
            if gone is not None:
                self.store.put(HELD_KEY, json.dumps({k: asdict(h) for k, h in holds.items()}))
        return gone

    # upkeep and reading --------------------------------------------------------------------------------------
    def prune(self) -> None:
        """Entries past the retention go (at most once an hour)."""
        now = time.monotonic()
        if now - self._pruned_at < PRUNE_EVERY_S:
            return
        self._pruned_at = now
        self.store.ledger_prune(self.clock() - self.settings.retention)

    def history(self, since: float = 0.0, component: str | None = None, kind: str | None = None) -> list[LedgerRow]:
        return self.store.ledger_rows(since, component, kind)


def read_history(state_dir: Path, since: float, component: str | None = None,
                 kind: str | None = None) -> tuple[list[LedgerRow], list[Hold]]:
    """`trainguard history`: the entries and the holds standing, read from the state database without changing it
    (a database from before the ledger has neither). PermissionError when this user may not read it."""
    path = state_dir / Store.FILENAME
    if path.exists() and not os.access(path, os.R_OK):
        raise PermissionError(13, "permission denied", str(path))
    conn = open_read_only(state_dir)
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "ledger" not in tables:
            return [], []
        rows = ledger_query(conn, since, component, kind)
        row = conn.execute("SELECT value FROM kv WHERE key = ?", (HELD_KEY,)).fetchone()
    finally:
        conn.close()
    held = []
    try:
        raw = json.loads(row[0]) if row else {}
    except ValueError:
        raw = {}
    for value in raw.values() if isinstance(raw, dict) else ():
        try:
            held.append(Hold(**value))
        except TypeError:
            continue
    return rows, held
