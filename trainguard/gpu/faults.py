"""XidLedger: what the kernel log said about each GPU (XIDs) and NVSwitch (SXids) this boot, aggregated so that a
flood of identical lines is one entry with a count, and kept in the store so a restart forgets nothing. It also keeps
where the kernel log stood at the agent's first start on this boot: what was logged before it is history the agent
reports but does not act on while the GPU reads healthy (issue 20)."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from trainguard.core.state import KeyValue
from trainguard.gpu.xid import XidEvent
from trainguard.node.kmsg import LogPoint
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
    seq: int = -1  # the latest record's place in the kernel log: sequence number (-1: the journal, or unknown)
    usec: int = -1  # and its kernel timestamp, microseconds since boot (-1: unknown)

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
        self._rank: dict[tuple[str, str, int, str], int] = {}  # what each entry is worth keeping (its severity)
        self._ranker: Callable[[XidEntry], int] | None = None
        self._cleared: dict[tuple[str, str], LogPoint] = {}  # (kind, device) -> an operator's clear: older is over
        self._first_start: LogPoint | None = None  # the kernel log at the agent's first start on this boot
        self.evicted = 0  # entries dropped this life of the agent to stay within MAX_ENTRIES
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
        if not self.boot_id or not isinstance(data, dict) or data.get("boot_id") != self.boot_id:
            return  # a reboot resets the GPUs: the old boot's XIDs no longer describe them, nor its first start
        self._first_start, self._cleared = _marks(data)
        for raw in data.get("entries", []):
            try:
                entry = XidEntry(**raw)
            except TypeError:
                continue
            self._entries[(entry.kind, entry.bus_id, entry.xid, entry.variant)] = entry

    def _evict(self) -> None:
        """Drop one entry to make room, never one that would change what the ledger says about a device while another
        choice exists: an entry of a device that has others (so the device stays listed), the least severe of those
        (so its worst fault stays), the oldest of those. A device with a single entry goes only when every device has
        one. Readers learn from `evicted` that the ledger no longer holds the whole log."""
        per_device = Counter((k[0], k[1]) for k in self._entries)
        if self._ranker is not None:  # entries loaded from the store were never ranked
            for key in self._entries.keys() - self._rank.keys():
                self._rank[key] = self._ranker(self._entries[key])
        victim = min(self._entries, key=lambda k: (per_device[(k[0], k[1])] == 1, self._rank.get(k, 0),
                                                   self._entries[k].last))
        del self._entries[victim]
        self._rank.pop(victim, None)
        self.evicted += 1

    def rank_by(self, ranker: Callable[[XidEntry], int]) -> None:
        """How much an entry is worth keeping when the ledger is full: the recorder's severity of it."""
        with self._lock:
            self._ranker = ranker
            self._rank.clear()

    def mark_first_start(self, now: Callable[[], LogPoint]) -> tuple[LogPoint, bool]:
        """The agent starts: on the first start of this boot the kernel log's position now (`now()`, read only then)
        is kept, and stays through restarts until the next boot. Returns it, and whether it was set now."""
        with self._lock:
            if self._first_start is not None:
                return self._first_start, False
            self._first_start = now()
            self._dirty = True
        self.save(force=True)  # a crash right after start must not move the first start to the next one
        return self._first_start, True

    @property
    def first_start(self) -> LogPoint | None:
        return self._first_start

    def before_start(self, entry: XidEntry) -> bool:
        """Whether the entry's latest record was logged before the agent's first start on this boot (an entry with a
        record since is not). An entry of unknown place (recorded by an older version) counts as since."""
        first = self._first_start
        return first is not None and first.before(entry.seq, entry.usec)

    def forget(self, kind: str, bus_id: str, point: LogPoint) -> int:
        """An operator cleared this device (`trainguard clear`): its entries go, and records from before `point`
        are not recorded again (a replay of the buffer, a restart that resumes from an older cursor). Returns how
        many entries went."""
        with self._lock:
            gone = [k for k in self._entries if k[0] == kind and k[1] == bus_id]
            for key in gone:
                del self._entries[key]
                self._rank.pop(key, None)
            self._cleared[(kind, bus_id)] = point
            self._dirty = True
            return len(gone)

    def record(self, event: XidEvent) -> tuple[XidEntry, bool] | None:
        """The entry after this event, and whether it changed beyond its count (new, a new occurrence, or a record
        since the first start of an entry of history); None for a record from before an operator cleared its
        device."""
        now = self._clock()
        with self._lock:
            mark = self._cleared.get((event.kind, event.bus_id))
            if mark is not None and mark.before(event.seq, event.usec):
                return None
            key = (event.kind, event.bus_id, event.xid, event.variant)
            entry = self._entries.get(key)
            if entry is None:
                if len(self._entries) >= MAX_ENTRIES:
                    self._evict()
                entry = XidEntry(event.bus_id, event.xid, 0, now, now, event.text, variant=event.variant,
                                 kind=event.kind, device=event.device)
                self._entries[key] = entry
            before = entry.occurrences
            # An entry of history (before the first start) with a record since now counts, and is graded as logged.
            first = self._first_start
            was_history = entry.count > 0 and first is not None and first.before(entry.seq, entry.usec)
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
            entry.seq, entry.usec = event.seq, event.usec
            self._dirty = True
            if self._ranker is not None:
                self._rank[key] = self._ranker(entry)
            now_since = was_history and first is not None and not first.before(entry.seq, entry.usec)
            return XidEntry(**asdict(entry)), entry.count == 1 or entry.occurrences != before or now_since

    def entries(self, kind: str = "xid") -> list[XidEntry]:
        """This boot's entries of one kind: GPU XIDs (the default), or NVSwitch SXids."""
        with self._lock:
            return [XidEntry(**asdict(e)) for e in self._entries.values() if e.kind == kind]

    def marks(self) -> dict[str, Any]:
        """What places records in time for a reader of this boot's kernel log: the first start and the operator's
        clears (`trainguard check` reads them as the agent published them, see XidCheck)."""
        with self._lock:
            return self._marks_now()

    def _marks_now(self) -> dict[str, Any]:  # under the lock
        first = self._first_start
        return {"boot_id": self.boot_id, "first_start": None if first is None else [first.seq, first.usec],
                "cleared": [[kind, bus, p.seq, p.usec] for (kind, bus), p in self._cleared.items()]}

    def adopt_marks(self, data: object) -> bool:
        """A one-shot reader takes the agent's marks (`marks()`) as its own, if they are of this boot and it has none:
        records before the agent's first start are then history to it too, and records before a clear are over.
        Nothing is saved. Returns whether it took them."""
        if not self.boot_id or not isinstance(data, dict) or data.get("boot_id") != self.boot_id:
            return False  # no boot id to tell this boot from another: marks of an older boot would hide faults
        with self._lock:
            if self._first_start is not None or self._cleared:
                return False
            self._first_start, self._cleared = _marks(data)
            return self._first_start is not None or bool(self._cleared)

    def save(self, force: bool = False) -> None:
        if self._store is None:
            return
        with self._lock:
            if not self._dirty or (not force and time.monotonic() - self._saved_at < self._save_every_s):
                return
            payload = {**self._marks_now(), "entries": [asdict(e) for e in self._entries.values()]}
            self._dirty = False
            self._saved_at = time.monotonic()
        self._store.put(LEDGER_KEY, json.dumps(payload))


def _marks(data: dict[str, Any]) -> tuple[LogPoint | None, dict[tuple[str, str], LogPoint]]:
    """The first start and the clears of a saved ledger or published marks; what does not parse is left out."""
    first: LogPoint | None = None
    try:
        seq, usec = data.get("first_start") or (None, None)
        first = LogPoint(int(seq), int(usec)) if seq is not None else None
    except (TypeError, ValueError):
        first = None
    cleared: dict[tuple[str, str], LogPoint] = {}
    raw_cleared = data.get("cleared")
    for raw in raw_cleared if isinstance(raw_cleared, list) else []:
        try:
            kind, bus, seq, usec = raw
            cleared[(str(kind), str(bus))] = LogPoint(int(seq), int(usec))
        except (TypeError, ValueError):
            continue
    return first, cleared
