"""XidLedger: what the kernel log said about each GPU (XIDs) and NVSwitch (SXids) this boot, aggregated so that a
flood of identical lines is one entry with a count, and kept in the store so a restart forgets nothing."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from trainguard.core.state import KeyValue
from trainguard.gpu.xid import XidEvent
from trainguard.node.procfs import ProcFS

LEDGER_KEY = "xid.ledger"
MAX_ENTRIES = 512  # distinct (gpu, xid, variant) entries kept: bounded memory whatever the kernel prints
MAX_PIDS = 16  # distinct processes remembered per entry
BURST_GAP_S = 60.0  # without a pid, lines this far apart are separate faults; one fault often prints a burst


@dataclass
class XidEntry:
    bus_id: str
    xid: int
    count: int
    first: float
    last: float
    text: str
    pid: int | None = None
    process: str | None = None
    cause_xid: int | None = None
    recovery: str | None = None
    gpu_instance: int | None = None
    variant: str = ""  # XIDs 144-150: the NVLink5 decode verdict; SXids: fatal | non_fatal
    kind: str = "xid"  # xid (a GPU) | sxid (an NVSwitch)
    device: str = ""  # SXids: the switch, e.g. nvswitch3
    pids: list[int] = field(default_factory=list)  # distinct processes the driver named
    bursts: int = 0  # pid-less lines more than BURST_GAP_S apart

    @property
    def occurrences(self) -> int:
        """Separate faults: one per distinct process (a job's rank), one per pid-less burst. A single fault that
        prints many lines counts once, so `repeated on one GPU across jobs` means what it says."""
        return len(self.pids) + self.bursts


class XidLedger:
    def __init__(self, store: KeyValue | None, clock: Callable[[], float] = time.time, save_every_s: float = 1.0,
                 proc: ProcFS | None = None) -> None:
        self._store = store
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, str, int, str], XidEntry] = {}
        self._dirty = False
        self._saved_at = 0.0
        self._save_every_s = save_every_s
        self.boot_id = (proc or ProcFS()).boot_id()
        self._load()

    def _load(self) -> None:
        if self._store is None:
            return
        try:
            data = json.loads(self._store.get(LEDGER_KEY) or "{}")
        except ValueError:
            return
        if data.get("boot_id") != self.boot_id:
            return  # a reboot resets the GPUs: the old boot's XIDs no longer describe them
        for raw in data.get("entries", []):
            try:
                entry = XidEntry(**raw)
            except TypeError:
                continue
            self._entries[(entry.kind, entry.bus_id, entry.xid, entry.variant)] = entry

    def record(self, event: XidEvent) -> tuple[XidEntry, bool]:
        """The entry after this event, and whether it changed beyond its count (new, or a new occurrence)."""
        now = self._clock()
        with self._lock:
            key = (event.kind, event.bus_id, event.xid, event.variant)
            entry = self._entries.get(key)
            if entry is None:
                if len(self._entries) >= MAX_ENTRIES:
                    oldest = min(self._entries, key=lambda k: self._entries[k].last)
                    del self._entries[oldest]
                entry = XidEntry(event.bus_id, event.xid, 0, now, now, event.text, variant=event.variant,
                                 kind=event.kind, device=event.device)
                self._entries[key] = entry
            before = entry.occurrences
            if event.pid is not None:
                if event.pid not in entry.pids and len(entry.pids) < MAX_PIDS:
                    entry.pids.append(event.pid)
            elif entry.count == 0 or now - entry.last > BURST_GAP_S:
                entry.bursts += 1
            entry.count += 1
            entry.last = now
            entry.text = event.text
            entry.pid, entry.process = event.pid, event.process
            entry.cause_xid, entry.recovery, entry.gpu_instance = event.cause_xid, event.recovery, event.gpu_instance
            self._dirty = True
            return XidEntry(**asdict(entry)), entry.count == 1 or entry.occurrences != before

    def entries(self, kind: str = "xid") -> list[XidEntry]:
        """This boot's entries of one kind: GPU XIDs (the default), or NVSwitch SXids."""
        with self._lock:
            return [XidEntry(**asdict(e)) for e in self._entries.values() if e.kind == kind]

    def save(self, force: bool = False) -> None:
        if self._store is None:
            return
        with self._lock:
            if not self._dirty or (not force and time.monotonic() - self._saved_at < self._save_every_s):
                return
            payload: dict[str, Any] = {"boot_id": self.boot_id, "entries": [asdict(e) for e in self._entries.values()]}
            self._dirty = False
            self._saved_at = time.monotonic()
        self._store.put(LEDGER_KEY, json.dumps(payload))
