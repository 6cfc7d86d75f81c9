"""KernelCheck: the node's own faults from the kernel log (hung tasks, lockups, machine checks, PCIe AER, disks and
file systems, NFS and Lustre, the NIC driver, the OOM killer, NVIDIA driver failures that are not XIDs), graded by
the catalog in trainguard/node/kernel_events.toml.

It reads through the node's one kernel log reader (the follower the xid check reads XIDs with: one cursor, each
record parsed once, the XID handler first). One result per subject (a device, a file system, a server, a process);
the first-start policy is the xid check's: what was logged before the agent's first start on this boot is reported
but capped at WARNING (not acted on), unless the fault is still there (a file system still mounted read-only).
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainguard.checks.base import ActionBinding, Check, CheckContext, CheckSettings, PartialView
from trainguard.checks.xid import KernelLogSettings, adopt_marks
from trainguard.core.logs import kv
from trainguard.core.model import Metric, Result, Status, worst
from trainguard.core.settings import Duration, Field
from trainguard.core.text import linear
from trainguard.core.units import format_bytes, format_duration
from trainguard.gpu.nvml import GpuState, NvmlUnavailableError, normalize_bus_id
from trainguard.jobs.model import Job
from trainguard.jobs.slurmnode import job_of_cgroup
from trainguard.jobs.tree import job_pids
from trainguard.node.kernel_events import KernelClass, KernelEvent, KernelEventParser, catalog, number
from trainguard.node.kmsg import KernelRecord, LogPoint
from trainguard.node.mounts import Mount, device_mounts, read_mounts

log = logging.getLogger("trainguard.checks.kernel")

EVENTS = Metric("trainguard_kernel_events_total", "Kernel log events of each class of the kernel event catalog "
                "(trainguard kernel), by the kind of device they name; corrected errors included.", ("class", "kind"),
                counter=True)
ACTIVE = Metric("trainguard_kernel_event_active", "1 while an event of this class is graded WARNING or CRITICAL on "
                "some subject.", ("class", "kind"))
METRICS = (EVENTS, ACTIVE)
STATE_KEY = "kernel-events"
SAVED_TIMES = 100
REPLAY_WAIT_S = 5.0
PCI_KINDS = {"nvidia": "gpu", "mlx5_core": "nic", "nvme": "disk"}
# The catalog's kinds that are the node's hardware, for the node ledger (`node`: the firmware's CPER records); an OOM
# kill (kind memory, block oom), a process's crash, a file system or a network file server are not.
HARDWARE_KINDS = frozenset({"cpu", "memory", "pcie", "gpu", "nic", "disk", "node"})
_NAMESPACE = linear(r"^nvme\d{1,4}(?:c\d{1,4})?n\d{1,4}$")  # a controller's namespaces (block devices) in sysfs
_PCI = linear(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}(?:\.[0-7])?$")
PCI_NAMES = ("source", "pci", "gpu", "xid_pci")  # what names a PCI address, the most precise first (an AER source)
DEVICE_NAMES = (*PCI_NAMES, "ctrl", "dev")  # what may name a device of the node
MAX_WHAT = 80  # characters of a node fault's "what" (the head of the drain reason)


class KernelSettings(KernelLogSettings):
    interval: Duration = Field(60.0, gt=0, description="Re-evaluation period (a kernel event wakes the check at once).")
    ignore: list[str] = Field(default_factory=list, description="Event classes counted but never graded above OK "
                              "(`trainguard kernel` lists the classes).")
    critical_mounts: list[str] = Field(default_factory=lambda: ["/", "/tmp", "/var", "/scratch", "/local"],
                                       description="Mount points whose file system read-only or shut down is a node "
                                       "fault (CRITICAL); elsewhere it is a WARNING.")
    max_subjects: int = Field(1024, gt=0, description="Subjects kept; the oldest quiet ones go first.")
    infiniband_root: str = Field("/sys/class/infiniband", description="Where sysfs lists the HCAs: a PCI address an "
                                 "event names is reported as the HCA's device name (mlx5_0).")
    nvme_root: str = Field("/sys/class/nvme", description="Where sysfs lists the NVMe controllers: a PCI address or "
                           "controller an event names is reported with the drive's block devices.")
    actions: ActionBinding = Field(default_factory=lambda: ActionBinding(critical=["signal", "drain", "requeue"]))


@dataclass
class Entry:
    """One class of event on one subject this boot."""

    klass: str
    subject: str
    names: dict[str, Any]
    line: str
    first: float
    last: float
    count: int = 0
    last_seq: int = -1
    last_usec: int = -1
    cleared: float = 0.0  # when a clearing event (nfs: server X OK) came
    status: Status = Status.OK  # as graded after the last record (a change wakes the check)
    times: list[float] = field(default_factory=list)  # counted classes: when, oldest first (bounded, see _record)

    def to_json(self) -> dict[str, Any]:
        return {"klass": self.klass, "subject": self.subject, "names": self.names, "line": self.line,
                "first": self.first, "last": self.last, "count": self.count, "last_seq": self.last_seq,
                "last_usec": self.last_usec, "cleared": self.cleared,
                "times": self.times[-SAVED_TIMES:]}  # enough for a trend after a restart; a storm restarts counting


@dataclass(frozen=True)
class Grade:
    status: Status
    why: str


def grade(c: KernelClass, e: Entry, now: float, s: KernelSettings, mount_critical: bool | None,
          explain: bool = True) -> Grade:
    """The status one class's events on one subject warrant now, and why (without the first-start policy; without
    `explain`, the status alone: the per-record path of a storm)."""
    if c.name in s.ignore:
        return Grade(Status.OK, "ignored by configuration")
    if e.cleared >= e.last:
        return Grade(Status.OK, f"cleared ({' / '.join(c.cleared_by)})")
    quiet = now - e.last
    if c.counted:
        recent = len(e.times) - bisect.bisect_left(e.times, now - c.rate_window)  # O(log n): a storm is cheap
        burst = len(e.times) - bisect.bisect_left(e.times, now - c.storm_window)
        if burst >= c.storm_count:
            return Grade(c.storm_status, f"storm: {burst} in {format_duration(c.storm_window)}" if explain else "")
        if recent >= c.warning_count:
            return Grade(Status.WARNING, f"trend: {recent} in {format_duration(c.rate_window)}" if explain else "")
        return Grade(Status.OK, "" if not explain else f"counted: {recent} in {format_duration(c.rate_window)} "
                                f"(a trend from {c.warning_count})")
    if c.clear == "window" or (c.clear == "pair" and c.clear_after):
        limit = c.clear_after or 3600
        if quiet > limit:
            return Grade(Status.OK, f"over: quiet for {format_duration(quiet)}")
    status = c.severity
    why = "until the node reboots" if c.clear == "reboot" else c.clearing()
    if c.mount_fault and status is Status.CRITICAL and not mount_critical:
        status, why = Status.WARNING, f"{why}; not a critical mount ({', '.join(s.critical_mounts)})"
    return Grade(status, why)


@dataclass(frozen=True)
class Device:
    """A device of this node that a kernel event names by its PCI address or its driver's name."""

    kind: str  # gpu, nic, disk
    label: str  # in words: "GPU 2 (serial 1652823054967)", "HCA mlx5_0", "NVMe nvme0 (nvme0n1)"
    details: dict[str, Any]
    pids: tuple[int, ...] = ()  # the processes using it: a GPU's compute processes, as NVML lists them


def node_devices(gpus: Sequence[GpuState], infiniband_root: str, nvme_root: str) -> dict[str, Device]:
    """The node's GPUs (from NVML), HCAs and NVMe drives (from sysfs), by every name a kernel line gives them: a PCI
    address (a GPU's without its function, as NVML gives it), an HCA's or an NVMe controller's name, an NVMe
    namespace or partition (block devices)."""
    out: dict[str, Device] = {}
    for g in gpus:
        out[g.bus_id] = Device("gpu", f"GPU {g.index}" + (f" (serial {g.serial})" if g.serial else ""),
                               {"index": g.index, "uuid": g.uuid, "serial": g.serial, "bus_id": g.bus_id},
                               tuple(p.pid for p in g.processes or ()))
    for hca in _listdir(infiniband_root):
        pci = _pci_of(os.path.join(infiniband_root, hca))
        out[hca] = Device("nic", f"HCA {hca}", {"hca": hca, "pci": pci})
        if pci:
            out[pci] = out[hca]
    for ctrl in _listdir(nvme_root):
        path = os.path.join(nvme_root, ctrl)
        pci = _pci_of(path)
        disks = [n for n in _listdir(path) if _NAMESPACE.search(n)]
        parts = [p for d in disks for p in _listdir(os.path.join(path, d)) if p.startswith(f"{d}p")]
        device = Device("disk", f"NVMe {ctrl}" + (f" ({', '.join(disks)})" if disks else ""),
                        {"controller": ctrl, "pci": pci, "block_devices": disks + parts})
        for key in (ctrl, *disks, *parts, *([pci] if pci else [])):
            out[key] = device
    return out


def device_of(names: dict[str, Any], devices: dict[str, Device]) -> Device | None:
    """The device an event names, the most precise name first (an AER error's source before its reporting port)."""
    for key in DEVICE_NAMES:
        value = str(names.get(key) or "").lower()
        if not value:
            continue
        found = devices.get(value) or (devices.get(normalize_bus_id(value)) if _PCI.search(value) else None)
        if found is not None:
            return found
    return None


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _pci_of(path: str) -> str:
    """The PCI address a sysfs class device sits on (its `device` link: ../../../0000:3b:00.0), "" when not PCI."""
    try:
        name = os.path.basename(os.readlink(os.path.join(path, "device")))
    except OSError:
        return ""
    return name.lower() if _PCI.search(name.lower()) else ""


class KernelCheck(Check):
    layer = "hardware"  # a node fault takes down every job on the node: its alerts group with theirs

    Settings = KernelSettings
    metrics = METRICS
    settings: KernelSettings

    def __init__(self, name: str, settings: CheckSettings, context: CheckContext) -> None:
        super().__init__(name, settings, context)
        self.parser = KernelEventParser()
        self.ledger = context.xid_history  # the node's first start on this boot, shared with the xid check
        self.kernel_log = context.kernel_log
        self.follower = self.kernel_log.subscribe(name, self._on_record, path=self.settings.kmsg_path,
                                                  journalctl=self.settings.journalctl, cursor=context.state,
                                                  priority=10)
        self.boot_id = context.proc.boot_id()
        self.entries: dict[tuple[str, str], Entry] = {}
        self.totals: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self._wake: Callable[[], None] | None = None
        self._started = False
        self._boot_time = context.proc.boot_time()
        self._pci_kind: dict[str, str] = {}
        self._xid: bool | None = None  # whether an xid check reads the same log (asked once, after all subscribed)
        self._first = (-1, -1)  # the first record read (seq, usec): what a one-shot read could still see
        self._load()

    # lifecycle ---------------------------------------------------------------------------
    def start(self, wake: Callable[[], None]) -> None:
        self._wake, self._started = wake, True
        try:
            self.ledger.mark_first_start(lambda: LogPoint.now(self.settings.kmsg_path))
        except Exception as exc:  # noqa: BLE001 - a store refusing the write: events are still read, all as logged
            log.error("first start not saved", extra=kv(error=exc))
        self.kernel_log.start(self.name, self.follower)

    def stop(self) -> None:
        self.kernel_log.stop(self.name, self.follower)
        self._save()

    def clear(self, subject: str, at: float) -> None:
        """`trainguard clear kernel/SUBJECT` (after the repair): the subject's events are forgotten; a new record of
        it fires as new. (The follower does not read records again; a one-shot `trainguard check` re-reads the whole
        buffer and does not know of the clear.)"""
        with self._lock:
            gone = [k for k in self.entries if k[1] == subject]
            for key in gone:
                del self.entries[key]
        log.info("kernel events cleared", extra=kv(subject=subject, entries=len(gone)))
        self._save()

    def _load(self) -> None:
        data = self.load_state(STATE_KEY)
        if data.get("boot_id") != self.boot_id:
            return  # another boot: its events are gone with it
        for raw in data.get("entries", [])[: self.settings.max_subjects]:
            try:
                e = Entry(**{**raw, "times": sorted(raw.get("times", []))})
            except TypeError:
                continue
            if e.klass in catalog():
                self.entries[(e.klass, e.subject)] = e
        self.totals = {tuple(k.split("|", 1)): v for k, v in data.get("totals", {}).items()}  # type: ignore[misc]

    def _save(self) -> None:
        with self._lock:
            data = {"boot_id": self.boot_id, "entries": [e.to_json() for e in self.entries.values()],
                    "totals": {"|".join(k): v for k, v in self.totals.items()}}
        self.save_state(STATE_KEY, data)

    # reading -----------------------------------------------------------------------------
    def _on_record(self, record: KernelRecord) -> None:
        since = self.context.kernel_since_usec
        if since is not None and 0 <= record.usec < since:
            return
        if self._first[0] < 0:
            self._first = (record.seq, record.usec)
        events = self.parser.feed(record.message, record.usec, record.seq)
        for event in events:
            self._record(event, record)

    def _when(self, usec: int) -> float:
        """Wall time of a kernel timestamp: a record's age counts from when it was logged, not from when read."""
        return self._boot_time + usec / 1e6 if usec >= 0 and self._boot_time > 0 else self.context.clock()

    def _record(self, event: KernelEvent, record: KernelRecord) -> None:
        c = catalog()[event.klass]
        if c.reported_by == "xid" and self._xid_reads():
            return  # the xid check acts on it (XID 79): no second incident, no run competing with its actions
        when = min(self._when(record.usec), self.context.clock())
        with self._lock:
            if c.role == "clear":
                for other in c.clears:
                    e = self.entries.get((other, event.subject))
                    if e is not None:
                        e.cleared = when
                return
            key = (c.name, event.subject)
            e = self.entries.get(key)
            if e is None:
                self._make_room()
                e = self.entries[key] = Entry(c.name, event.subject, dict(event.names), event.line, when, when)
            before = e.status
            e.count += event.count
            e.last, e.last_seq, e.last_usec = when, record.seq, record.usec
            if not event.repeat:
                e.names, e.line = dict(event.names), event.line
                if c.block == "oom":
                    e.names.update(self._job_of(e.names))
            if c.counted:
                e.times.extend([max(when, e.times[-1]) if e.times else when] * min(event.count, c.storm_count))
                keep = max(c.storm_count, c.warning_count)
                if len(e.times) > 2 * keep:  # trimmed in halves: amortized O(1) a record
                    del e.times[:-keep]
            kind = self._kind(c, e)
            self.totals[(c.name, kind)] = self.totals.get((c.name, kind), 0) + event.count
            after = e.status = self._grade(c, e, self.context.clock(), explain=False).status
        if e.count == event.count or e.count % 1000 == 0:
            log.warning("kernel event", extra=kv(event=c.name, subject=event.subject, count=e.count,
                                                 line=event.line[:160]))
        if after.severity > before.severity and self._wake is not None:
            self._save()
            self._wake()

    def _job_of(self, names: dict[str, Any]) -> dict[str, str]:
        """The job (and SLURM task) an OOM kill hit: from the memory cgroup the record names (SLURM's job_N/task_M),
        else the job whose processes held the pid in the last listing (the process is gone by now)."""
        memcg, pid = names.get("memcg", ""), number(names.get("pid"))
        job_id, task = job_of_cgroup(memcg)  # SLURM's own tree only: a user's `job_N` names no job
        out = {"task": task} if task else {}
        view = self.context.jobs.cached() if self.context.jobs is not None else None
        for job in view.jobs if view is not None else ():
            if (job_id and job.job_id == job_id) or any(p.pid == pid for p in job.processes):
                return {**out, "job": job.key, "job_name": job.name, **({"job_id": job.job_id} if job.job_id else {})}
        return {**out, "job_id": job_id} if job_id else out

    def _make_room(self) -> None:
        if len(self.entries) < self.settings.max_subjects:
            return
        now = self.context.clock()
        quiet = sorted(self.entries.values(), key=lambda e: (self._grade(catalog()[e.klass], e, now).status.severity,
                                                             e.last))
        del self.entries[(quiet[0].klass, quiet[0].subject)]

    def _kind(self, c: KernelClass, e: Entry) -> str:
        """The device kind: the catalog's, or for a PCI address the driver bound to it (a GPU, an HCA, an NVMe)."""
        pci = e.names.get("source") or e.names.get("pci")
        if c.kind != "pcie" or not pci:
            return c.kind
        if pci not in self._pci_kind:
            try:
                driver = os.path.basename(os.readlink(f"/sys/bus/pci/devices/{pci}/driver"))
            except OSError:
                driver = ""
            self._pci_kind[pci] = PCI_KINDS.get(driver, "pcie")
        return self._pci_kind[pci]

    # grading -----------------------------------------------------------------------------
    def _mounts(self, e: Entry, mounts: list[Mount] | None = None) -> list[Mount] | None:
        """The mounts of the block device the event names (its partitions' too); None when it names none or the
        mount table can't be read."""
        dev = e.names.get("dev")
        if not dev:
            return None
        try:
            return device_mounts(dev, mounts if mounts is not None else read_mounts(self.context.proc))
        except OSError:
            return None

    def _mount_critical(self, e: Entry) -> bool | None:
        mounts = self._mounts(e)
        return None if mounts is None else any(m.mountpoint in self.settings.critical_mounts for m in mounts)

    def _grade(self, c: KernelClass, e: Entry, now: float, explain: bool = True) -> Grade:
        return grade(c, e, now, self.settings, self._mount_critical(e) if c.mount_fault else None, explain)

    def _history(self, c: KernelClass, e: Entry, g: Grade) -> Grade:
        """The first-start policy: logged before the agent's first start on this boot: at most WARNING (no drain),
        unless the fault is still there (a file system still read-only)."""
        first = self.ledger.first_start
        if g.status is not Status.CRITICAL or first is None or not first.before(e.last_seq, e.last_usec):
            return g
        if c.mount_fault and any(m.went_read_only or "ro" in m.options.split(",") for m in self._mounts(e) or ()):
            return Grade(g.status, f"{g.why}; logged before trainguard started and still mounted read-only")
        return Grade(Status.WARNING, f"logged at boot+{format_duration(max(e.last_usec, 0) / 1e6)}, before trainguard "
                                     f"started: reported, not acted on; {g.status.name} if logged now ({g.why})")

    def run(self) -> Sequence[Result]:
        if not self._started and self.follower.records == 0:  # one-shot `trainguard check`: this boot's buffer
            self.kernel_log.read_once(self.follower, lambda: adopt_marks(self.context, self.ledger))
        elif self._started:
            self.follower.caught_up.wait(min(REPLAY_WAIT_S, self.settings.timeout / 2))
        results = self._results()
        if self._started and not self.follower.caught_up.is_set():
            return PartialView(results, f"replaying the kernel log ({self.follower.records} records so far)")
        self._save()
        return results

    def _results(self) -> list[Result]:
        now = self.context.clock()
        skip = {name for name, c in catalog().items() if c.reported_by == "xid"} if self._xid_reads() else set()
        by_subject: dict[str, list[tuple[KernelClass, Entry, Grade]]] = {}
        with self._lock:
            entries = list(self.entries.values())
            totals = dict(self.totals)
        for e in entries:
            c = catalog()[e.klass]
            if c.name in skip:
                continue
            g = self._history(c, e, self._grade(c, e, now))
            by_subject.setdefault(e.subject, []).append((c, e, g))
        devices = self._devices(entries)
        mounts = self._mount_table(entries)
        results = []
        active: set[tuple[str, str]] = set()
        for subject, graded in sorted(by_subject.items()):
            active |= {(c.name, self._kind(c, e)) for c, e, g in graded if g.status is not Status.OK}
            results.append(self._subject_result(subject, graded, devices, mounts))
        samples = [EVENTS(v, {"class": k, "kind": kind}) for (k, kind), v in sorted(totals.items())]
        samples += [ACTIVE(1 if key in active else 0, {"class": key[0], "kind": key[1]}) for key in sorted(totals)]
        results.insert(0, self.result("kernel-log", Status.OK, *self._reading(sum(totals.values())), samples))
        return results

    def _hardware(self, graded: list[tuple[KernelClass, Entry, Grade]]) -> dict[str, Any]:
        """What the node ledger reads (trainguard.pipeline.engine `_to_ledger`): `hardware`, whether the events (those
        graded above OK, else all the subject's) are of the node's hardware; `bus_id`, the GPU one of them names by its
        PCI address (the ledger knows which board sits there)."""
        hardware = [(c, e) for c, e, _ in graded if c.kind in HARDWARE_KINDS and c.block != "oom"]
        out: dict[str, Any] = {"hardware": bool(hardware)}
        pci = next((e.names.get("source") or e.names.get("pci") for c, e in hardware if self._kind(c, e) == "gpu"),
                   None)
        if pci:
            out["bus_id"] = normalize_bus_id(str(pci))
        return out

    def _reading(self, events: int) -> tuple[str, dict[str, Any]]:
        """What was read. A one-shot run (`trainguard check`) reads this boot's buffer once and grades it by the
        same windows, counted from each record's kernel timestamp; it says what it cannot know."""
        f = self.follower
        details: dict[str, Any] = {"source": f.source, "records": f.records}
        head = f"reading {f.source}: {f.records} records, {events} kernel events"
        if self._started:
            return head, details
        first_seq, first_usec = self._first
        details.update(one_shot=True, first_seq=first_seq, first_usec=first_usec)
        since = (f"seq {first_seq} on (boot+{format_duration(first_usec / 1e6)}); the "
                 f"{first_seq} older records were overwritten" if first_seq > 0 else "the whole boot")
        return (f"one-shot read of {f.source}: {f.records} records of this boot ({since}), {events} kernel events, "
                f"windows counted from each record's kernel timestamp; not known to a one-shot read: events the "
                f"buffer no longer holds and operator clears (`trainguard clear kernel/...`); the agent's "
                f"`trainguard status` has both", details)

    def _devices(self, entries: list[Entry]) -> dict[str, Device]:
        """The node's devices, when some event names one by PCI address or name (NVML asked once per run)."""
        named = {k for e in entries for k in DEVICE_NAMES if e.names.get(k)}
        if not named:
            return {}
        gpus: list[GpuState] = []
        if named & set(PCI_NAMES):
            try:
                gpus = self.context.nvml.gpus()
            except NvmlUnavailableError:
                pass  # no GPU driver here: no GPU to name
            except Exception as exc:  # noqa: BLE001 - a GPU off the bus can fail NVML: the kernel's word still stands
                log.warning("GPUs not listed: kernel events name PCI addresses only", extra=kv(error=exc))
        return node_devices(gpus, self.settings.infiniband_root, self.settings.nvme_root)

    def _mount_table(self, entries: list[Entry]) -> list[Mount] | None:
        if not any(e.names.get("dev") for e in entries):
            return None
        try:
            return read_mounts(self.context.proc)
        except OSError:
            return None

    def _jobs_using(self, device: Device | None) -> list[Job]:
        """The jobs whose processes use the device (a GPU's compute processes); none known: [] (then the actions act
        on every job of the node, as for any hardware fault)."""
        if device is None or not device.pids or self.context.jobs is None:
            return []
        pids = set(device.pids)
        try:
            view, table = self.context.jobs.view(), self.context.processes.get()
        except Exception as exc:  # noqa: BLE001 - a failing job source must not lose the device's fault
            log.warning("jobs using the device unknown", extra=kv(device=device.label, error=exc))
            return []
        return [job for job in view.on_node() if pids.intersection(job_pids(job, table))]

    def _subject_result(self, subject: str, graded: list[tuple[KernelClass, Entry, Grade]],
                        devices: dict[str, Device], mounts: list[Mount] | None) -> Result:
        status = worst(g.status for _, _, g in graded)
        bad = sorted(((c, e, g) for c, e, g in graded if g.status is not Status.OK), key=lambda t: -t[2].status.severity)
        lead = (bad or graded)[0][1]
        device = device_of(lead.names, devices)
        on = [m.mountpoint for m in self._mounts(lead, mounts) or ()] if mounts is not None else []
        jobs = self._jobs_using(device)
        details: dict[str, Any] = {"events": [
            {"class": c.name, "title": c.title, "count": e.count, "first": e.first, "last": e.last,
             "status": g.status.name, "why": g.why, "names": e.names, "line": e.line, "lever": c.lever,
             "node_fault": c.node_fault and g.status is Status.CRITICAL} for c, e, g in graded]}
        if device is not None:
            details["device"] = {"kind": device.kind, "label": device.label, **device.details}
        if on:
            details["mounts"] = on
        if jobs:
            details["jobs"] = [j.label() for j in jobs]
            if len(jobs) == 1:  # the actions act on the one job using the device, not on every job of the node
                details["job_key"] = jobs[0].key
        if bad:
            details["next_step"] = bad[0][0].lever
        details.update(self._hardware(bad or graded))
        where = [x for x in (device.label if device else "", f"on {', '.join(on)}" if on else "",
                             f"used by {', '.join(details['jobs'])}" if jobs else "") if x]
        head = f"{subject} ({'; '.join(where)})" if where else subject
        fault = self._what(lead, device, on) + (f" (used by {', '.join(details['jobs'])})" if jobs else "")
        return self.result(subject, status, self._summary(head, graded, bad, fault), details)

    def _what(self, e: Entry, device: Device | None, on: list[str]) -> str:
        """The node fault in a few words (the head of the drain reason): `mce_uncorrected CPU 3 bank 5`."""
        n = e.names
        if device is None and not on and n.get("cpu"):
            what = f"CPU {n['cpu']}" + (f" bank {n['bank']}" if n.get("bank") else "")
        else:
            what = " ".join(x for x in (device.label if device else "", e.subject, f"on {', '.join(on)}" if on else "")
                            if x)
        return f"{self.name}: {e.klass} {what}"[:MAX_WHAT]

    def _xid_reads(self) -> bool:
        """Whether an xid check reads this log too (then it acts on the classes it grades as XIDs)."""
        if self._xid is None:
            self._xid = self.kernel_log.subscribed(self.follower, "xid")
        return self._xid

    @staticmethod
    def _summary(head: str, graded: list[tuple[KernelClass, Entry, Grade]],
                 bad: list[tuple[KernelClass, Entry, Grade]], fault: str) -> str:
        """A node fault's summary (the drain reason) starts with what it is (`kernel: mce_uncorrected CPU 3 bank 5`);
        the others with their subject and what it is (a GPU, the mount points, the jobs using it)."""
        if not bad:
            total = sum(e.count for _, e, _ in graded)
            return f"{head}: no active kernel event ({total} recorded)"
        parts = []
        for c, e, g in bad:
            count = f" x{e.count}" if e.count > 1 else ""
            tag = "node fault: " if c.node_fault and g.status is Status.CRITICAL else ""
            parts.append(f"{tag}{_victim(e)}{c.title}{count} ({g.why}): {e.line[:160]}")
        c, _, g = bad[0]
        prefix = f"{fault}: " if c.node_fault and g.status is Status.CRITICAL else f"{head}: "
        return prefix + "; ".join(parts)


def _victim(e: Entry) -> str:
    """Whom an OOM kill hit, in words, when the record or the job catalog says ("job 123 task 3: ")."""
    n = e.names
    job = f"job {n['job_id']}" if n.get("job_id") else f"job {n['job_name']}" if n.get("job_name") else ""
    task = f"task {n['task']}" if n.get("task") else ""
    anon = f", {format_bytes(kb * 1024)} anon" if (kb := number(n.get("anon_kb"))) else ""
    who = " ".join(x for x in (job, task) if x)
    return f"{who} ({n.get('comm', '?')}, pid {n.get('pid', '?')}{anon}) killed: " if who else ""


def explain_lines(lines: Sequence[str], s: KernelSettings) -> list[dict[str, Any]]:
    """What the kernel check makes of pasted kernel log lines (`trainguard kernel LINE`, `-` for stdin): per event, its
    class, what it names, the status a fresh one gets, the actions that status runs, and why."""
    parser = KernelEventParser()
    out: list[dict[str, Any]] = []
    for record in join_continuations(lines):
        events = parser.feed(record)
        for event in events:
            c = event.cls
            if c.role == "clear":
                status, why = Status.OK, f"ends {' / '.join(c.clears)} of {event.subject}"
            elif c.counted:
                status, why = Status.OK, c.clearing()
            elif c.name in s.ignore:
                status, why = Status.OK, "ignored by configuration"
            else:
                status = c.severity
                why = c.clearing() + ("; CRITICAL on a critical mount (" + ", ".join(s.critical_mounts) + "), "
                                      "WARNING elsewhere" if c.mount_fault else "")
            if c.reported_by:
                why += f"; acted on by the {c.reported_by} check (XID 79)"
            out.append({"line": record, "class": c.name, "title": c.title, "kind": c.kind, "subject": event.subject,
                        "names": dict(event.names), "status": status.name, "node_fault": c.node_fault,
                        "actions": s.actions.for_status(status), "why": why, "lever": c.lever})
    return out


def join_continuations(lines: Sequence[str]) -> list[str]:
    """Pasted lines as records: an indented line without a prefix of its own continues the record before it (dmesg
    prints a record of several lines so: NVRM's fallen off the bus)."""
    from trainguard.node.kmsg import strip_prefix

    records: list[str] = []
    for raw in lines:
        line = raw.rstrip("\n")
        if records and line[:1].isspace() and strip_prefix(line) == line.strip():
            records[-1] += "\n" + line
        elif line.strip():
            records.append(line)
    return records
