"""XidCheck: GPU faults the NVIDIA driver reports in the kernel log, seen the moment they are written.

A KmsgFollower thread parses every record; an XID wakes this check at once, so the incident (and the
actions bound to it: save, drain, requeue) follows the kernel record within milliseconds. The
response to each XID is data: the classes below, configurable.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import Field

from trainguard.checks.base import ActionBinding, Check, CheckContext, CheckSettings
from trainguard.core.logs import kv
from trainguard.core.model import Metric, Result, Status, worst
from trainguard.core.settings import Duration, StatusName
from trainguard.core.units import format_duration
from trainguard.gpu.faults import XidEntry
from trainguard.gpu.xid import XidParser, describe
from trainguard.node.kmsg import KernelRecord, KmsgFollower

log = logging.getLogger("trainguard.checks.xid")

_XID = ("gpu", "uuid", "bus_id", "xid")
XID_ERRORS = Metric("trainguard_gpu_xid_errors_total", "XID events reported by the driver, counted one by one.", _XID,
                    counter=True)
XID_LAST = Metric("trainguard_gpu_xid_last_timestamp_seconds",
                  "Unix time of the latest XID event of this number on this GPU.", _XID)
KMSG_RECORDS = Metric("trainguard_kmsg_records_total", "Kernel log records read.", counter=True)
KMSG_LOST = Metric("trainguard_kmsg_lost_records_total", "Kernel log records overwritten before they were read.",
                   counter=True)
KMSG_UP = Metric("trainguard_kmsg_follower_up", "1 while the kernel log follower runs.", ("source",))
METRICS = (XID_ERRORS, XID_LAST, KMSG_RECORDS, KMSG_LOST, KMSG_UP)

_RECOVERY_STATUS = {"none": Status.OK, "drain p2p": Status.WARNING}


class XidSettings(CheckSettings):
    interval: Duration = Field(60.0, gt=0, description="Re-evaluation period (XIDs themselves wake the check at once).")
    jitter: Duration = Field(0.0, ge=0)
    kmsg_path: str = Field("/dev/kmsg", description="Kernel log device.")
    journalctl: str = Field("journalctl", description="Fallback when the device can't be read.")
    application: list[int] = Field([13, 31, 43, 69], description="Application-caused XIDs: WARNING.")
    hardware: list[int] = Field([48, 62, 64, 74, 79, 95, 109, 119, 120, 140, 143], description="Hardware faults: CRITICAL.")
    watch: list[int] = Field([63, 92, 94], description="XIDs to watch: WARNING.")
    ignore: list[int] = Field(default_factory=list, description="XIDs to ignore.")
    unlisted: StatusName = Field(Status.WARNING, description="Status of an XID in no list.")
    repeat_window: Duration = Field(24 * 3600.0, description="The same application XID twice on one GPU within this "
                                                              "points at the hardware: CRITICAL.")
    clear_after: Duration = Field(3600.0, description="A WARNING XID clears after this quiet time; CRITICAL ones stay "
                                                      "until the node reboots.")
    actions: ActionBinding = Field(default_factory=lambda: ActionBinding(critical=["signal", "drain", "requeue"]))


def classify(entry: XidEntry, s: XidSettings, now: float) -> tuple[Status, str]:
    """The status one XID entry warrants, and why."""
    xid = entry.xid
    if xid == 45:
        if entry.cause_xid is None:
            return Status.OK, "cleanup after a kill or reset (XID 45 alone is not a fault)"
        cause = XidEntry(entry.bus_id, entry.cause_xid, entry.count, entry.first, entry.last, entry.text)
        status, why = classify(cause, s, now)
        return status, f"follows XID {entry.cause_xid}: {why}"
    if xid == 154:
        recovery = (entry.recovery or "").strip()
        status = _RECOVERY_STATUS.get(recovery.lower(), Status.CRITICAL if recovery else Status.WARNING)
        return status, f"driver requires: {recovery or 'unknown recovery'}"
    if xid in s.ignore:
        return Status.OK, "ignored by configuration"
    if xid in s.hardware:
        return Status.CRITICAL, "hardware fault"
    if xid in s.application:
        if entry.count >= 2 and entry.last - entry.first <= s.repeat_window:
            return Status.CRITICAL, f"hardware suspect: repeated {entry.count}x within {format_duration(s.repeat_window)}"
        status, why = Status.WARNING, "application fault"
    elif xid in s.watch:
        status, why = Status.WARNING, "watch"
    else:
        status, why = s.unlisted, "not in any configured class"
    if now - entry.last > s.clear_after:
        return Status.OK, f"{why}; quiet for {format_duration(now - entry.last)}"
    return status, why


_ACTION_TEXT = {"none": "no action needed", "restart_app": "restart the application", "reset_gpu": "reset the GPU",
                "reboot_node": "drain and reboot the node", "follow_cause": "follow the causing XID",
                "watch": "watch for repeats"}


def summarize(label: str, graded: list[tuple[XidEntry, Status, str]]) -> str:
    active = sorted((g for g in graded if g[1] is not Status.OK), key=lambda g: -g[1].severity)
    if not active:
        return f"{label}: no active XID"
    parts = []
    for entry, _, why in active:
        info = describe(entry.xid)
        count = f" x{entry.count}" if entry.count > 1 else ""
        todo = _ACTION_TEXT.get(info.action, info.action)
        parts.append(f"XID {entry.xid} {info.mnemonic}{count}: {info.meaning} ({why}; {todo})")
    head = f"{label} fell off the bus (XID 79)" if any(e.xid == 79 for e, _, _ in active) else label
    return f"{head}: " + "; ".join(parts)


class XidCheck(Check):
    Settings = XidSettings
    metrics = METRICS
    settings: XidSettings

    def __init__(self, name: str, settings: CheckSettings, context: CheckContext) -> None:
        super().__init__(name, settings, context)
        self.parser = XidParser()
        self.ledger = context.xid_history
        self.follower = KmsgFollower(self._on_record, context.state, self.settings.kmsg_path, self.settings.journalctl,
                                     proc=context.proc)
        self.nvml = context.nvml
        self._gpu_names: dict[str, tuple[int | None, str | None]] = {}
        self._wake: Callable[[], None] | None = None
        self._started = False
        self._lock = threading.Lock()

    def start(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._started = True
        self.follower.start()

    def stop(self) -> None:
        self.follower.stop()
        self.ledger.save(force=True)

    def _on_record(self, record: KernelRecord) -> None:
        with self._lock:  # the parser is stateful across records
            event = self.parser.feed(record.message)
        if event is None:
            return
        entry = self.ledger.record(event)
        if entry.count == 1 or entry.count % 1000 == 0:  # a flood logs a few lines, not one per record
            log.warning("xid", extra=kv(xid=event.xid, bus_id=event.bus_id, count=entry.count, text=event.text[:160]))
        self.ledger.save()
        # Only a new entry or a second occurrence (repeat escalation) can change the verdict: a flood
        # of identical lines only bumps a counter, which the periodic run reports.
        if entry.count <= 2 and self._wake is not None:
            status, _ = classify(entry, self.settings, self.context.clock())
            if status is not Status.OK:
                self._wake()

    def _gpu(self, bus_id: str) -> tuple[int | None, str | None]:
        """(index, uuid) of a bus id: from the driver's own `GPU at PCI` lines, else NVML."""
        if bus_id not in self._gpu_names or self._gpu_names[bus_id][0] is None:
            index, uuid = None, self.parser.uuid_by_bus.get(bus_id)
            try:
                for gpu in self.nvml.gpus():
                    if gpu.bus_id == bus_id:
                        index, uuid = gpu.index, gpu.uuid or uuid
            except Exception:  # noqa: BLE001 - a lost GPU may break NVML too; the bus id still names it
                pass
            self._gpu_names[bus_id] = (index, uuid)
        return self._gpu_names[bus_id]

    def run(self) -> Sequence[Result]:
        if not self._started and self.follower.records == 0:
            self.follower.read_once()  # one-shot `trainguard check`: what this boot's buffer holds
        now = self.context.clock()
        by_gpu: dict[str, list[XidEntry]] = {}
        for entry in self.ledger.entries():
            by_gpu.setdefault(entry.bus_id, []).append(entry)
        results = [self._follower_result()]
        for bus_id, entries in sorted(by_gpu.items()):
            index, uuid = self._gpu(bus_id)
            graded = [(e, *classify(e, self.settings, now)) for e in entries]
            label = f"GPU {index} ({bus_id})" if index is not None else f"GPU {bus_id}"
            labels = {"gpu": "" if index is None else str(index), "uuid": uuid or "", "bus_id": bus_id}
            samples = []
            for e, _, _ in graded:
                xl = {**labels, "xid": str(e.xid)}
                samples += [XID_ERRORS(e.count, xl), XID_LAST(e.last, xl)]
            details: dict[str, Any] = {
                "bus_id": bus_id, "index": index, "uuid": uuid,
                "xids": [{"xid": e.xid, "mnemonic": describe(e.xid).mnemonic, "count": e.count, "first": e.first,
                          "last": e.last, "status": st.name, "why": why, "text": e.text, "pid": e.pid,
                          "process": e.process, "cause": describe(e.xid).cause,
                          "immediate_action": describe(e.xid).action} for e, st, why in graded]}
            worst_entry = max(graded, key=lambda g: g[1].severity)
            if worst_entry[1] is not Status.OK:
                action = describe(worst_entry[0].xid).action
                details["next_step"] = _ACTION_TEXT.get(action, action)
            results.append(self.result(uuid or f"pci:{bus_id}", worst(st for _, st, _ in graded),
                                       summarize(label, graded), details, samples))
        return results

    def _follower_result(self) -> Result:
        f = self.follower
        samples = [KMSG_RECORDS(f.records), KMSG_LOST(f.lost),
                   KMSG_UP(1 if f.running or not self._started else 0, {"source": f.source})]
        details = {"source": f.source, "records": f.records, "lost": f.lost, "last_seq": f.last_seq}
        if self._started and not f.running:
            return self.result("kernel-log", Status.UNKNOWN,
                               f"kernel log follower not running: {f.error or 'starting'}", details, samples)
        lost = f", {f.lost} lost to overruns" if f.lost else ""
        return self.result("kernel-log", Status.OK, f"reading {f.source}: {f.records} records{lost}", details, samples)
