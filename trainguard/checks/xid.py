"""XidCheck: GPU faults the NVIDIA driver reports in the kernel log, seen the moment they are written.

A KmsgFollower thread parses every record; an XID wakes this check at once, so the incident (and the
actions bound to it: save, drain, requeue) follows the kernel record within milliseconds. The
response to each XID is data: NVIDIA's catalog and trainguard's policy (`trainguard.gpu.xid_catalog`), with single
codes overridden by the settings below.

History: what the buffer held at the agent's first start on this boot was logged while nothing watched. It is
reported as found, but a GPU that reads healthy in NVML now gets at most a WARNING for it, so the actions bound to
CRITICAL (drain, requeue) run only for a fault still present (the GPU lost or missing, a memory fault pending, NVML
unreadable) or logged since the agent started (docs/gpu-faults.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from trainguard.checks.base import ActionBinding, Check, CheckContext, CheckSettings, PartialView
from trainguard.core.files import read_small, replace_file
from trainguard.core.logs import kv
from trainguard.core.model import Metric, Result, Sample, Status, worst
from trainguard.core.settings import Duration, Field, StatusName, model_validator
from trainguard.core.units import format_duration
from trainguard.gpu.faults import XidEntry, XidLedger
from trainguard.gpu.health import gpu_faults
from trainguard.gpu.nvml import GpuState
from trainguard.gpu.xid import XidEvent, XidParser
from trainguard.gpu.xid_catalog import describe, describe_sxid, nvlink5_rules, nvlink5_verdict, policy
from trainguard.node.kmsg import KernelRecord, LogPoint

log = logging.getLogger("trainguard.checks.xid")

# How long a run waits for the follower to finish replaying the buffer found at start (at most half the timeout).
REPLAY_WAIT_S = 5.0

_XID = ("gpu", "uuid", "bus_id", "xid")
XID_ERRORS = Metric("trainguard_gpu_xid_errors_total", "XID events reported by the driver, counted one by one.", _XID,
                    counter=True)
XID_LAST = Metric("trainguard_gpu_xid_last_timestamp_seconds",
                  "Unix time of the latest XID event of this number on this GPU.", _XID)
_SXID = ("switch", "bus_id", "sxid")
SXID_ERRORS = Metric("trainguard_nvswitch_sxid_errors_total", "NVSwitch SXid events reported by the driver, counted one "
                     "by one.", _SXID, counter=True)
SXID_LAST = Metric("trainguard_nvswitch_sxid_last_timestamp_seconds",
                   "Unix time of the latest SXid event of this number on this NVSwitch.", _SXID)
KMSG_RECORDS = Metric("trainguard_kmsg_records_total", "Kernel log records read.", counter=True)
KMSG_LOST = Metric("trainguard_kmsg_lost_records_total", "Kernel log records overwritten before they were read.",
                   counter=True)
KMSG_UP = Metric("trainguard_kmsg_follower_up", "1 while the kernel log follower runs.", ("source",))
XID_BEFORE_START = Metric("trainguard_gpu_xid_before_start",
                          "1 if this XID on this GPU was last logged before the agent's first start on this boot "
                          "(history: at most WARNING while the GPU reads healthy, no drain), 0 if logged since.", _XID)
METRICS = (XID_ERRORS, XID_LAST, XID_BEFORE_START, SXID_ERRORS, SXID_LAST, KMSG_RECORDS, KMSG_LOST, KMSG_UP)


class KernelLogSettings(CheckSettings):
    """Settings of a check that reads the kernel log (xid, kernel): checks reading one device share its reader."""

    jitter: Duration = Field(0.0, ge=0)
    kmsg_path: str = Field("/dev/kmsg", description="Kernel log device (the checks reading one device share its "
                           "reader: one cursor, each record read once).")
    journalctl: str = Field("journalctl", description="Fallback when the device can't be read.")


class XidSettings(KernelLogSettings):
    interval: Duration = Field(60.0, gt=0, description="Re-evaluation period (XIDs themselves wake the check at once).")
    hardware: list[int] = Field(default_factory=list, description="XIDs graded as hardware faults whatever NVIDIA's "
                                "bucket (RESET_GPU): CRITICAL until the node reboots. Empty: `trainguard xid`.")
    application: list[int] = Field(default_factory=list, description="XIDs graded as application faults (RESTART_APP): "
                                   "WARNING, CRITICAL when jobs hit it repeatedly on one GPU.")
    watch: list[int] = Field(default_factory=list, description="XIDs only warned about (WARNING, cleared after "
                             "`clear_after`).")
    ignore: list[int] = Field(default_factory=list, description="XIDs recorded and counted, never an incident.")
    unlisted: StatusName = Field(Status.WARNING, description="Status of an XID not in NVIDIA's catalog.")
    repeat_window: Duration = Field(24 * 3600.0, description="An application XID from a second job (another process) on "
                                                              "one GPU within this points at the hardware: CRITICAL.")
    clear_after: Duration = Field(3600.0, description="A WARNING XID clears after this quiet time; CRITICAL ones stay "
                                                      "until the node reboots.")
    actions: ActionBinding = Field(default_factory=lambda: ActionBinding(critical=["signal", "drain", "requeue"]))

    @model_validator(mode="after")
    def _one_list_per_xid(self) -> XidSettings:
        seen: dict[int, str] = {}
        for name in ("hardware", "application", "watch", "ignore"):
            for xid in getattr(self, name):
                if xid in seen:
                    raise ValueError(f"XID {xid} is in both {seen[xid]} and {name}: give each XID one class")
                seen[xid] = name
        return self


_CONFIGURED = {"hardware": "reset_gpu", "application": "restart_app", "watch": "investigate", "ignore": "ignore"}


@dataclass(frozen=True)
class Grade:
    """What one XID entry warrants: the status, why (the bucket or rule that decided), and the advice."""

    status: Status
    why: str
    todo: str
    response: str
    history: bool = False  # logged before the agent's first start, on a GPU that reads healthy now: not acted on


def response_of(xid: int, s: XidSettings) -> tuple[str, str]:
    """(response, where it comes from): the config's lists first, then the catalog (NVIDIA's bucket or trainguard's
    documented difference)."""
    for name, response in _CONFIGURED.items():
        if xid in getattr(s, name):
            return response, f"{name} by configuration"
    info = describe(xid)
    if not info.known:
        return "unlisted", "not in NVIDIA's catalog"
    if info.why:  # a bucket that is a workflow, or a code trainguard grades differently: `trainguard xid N` says why
        return info.response, f"NVIDIA {info.immediate or 'gives no bucket'}, read as {info.response}"
    return info.response, f"NVIDIA {info.immediate}"


def grade(entry: XidEntry, s: XidSettings, now: float) -> Grade:
    p = policy()
    response, source = response_of(entry.xid, s)
    if response == "unlisted":
        base = Grade(s.unlisted, source, p.responses["investigate"].todo, "investigate")
        return _cleared(base, entry, s, now, sticky=False)
    if response == "follow_cause":
        if entry.cause_xid is None:
            return Grade(Status.OK, "cleanup after a kill or reset (XID 45 alone is not a fault)",
                         p.responses["follow_cause"].todo, response)
        cause = grade(replace(entry, xid=entry.cause_xid, cause_xid=None, variant=""), s, now)
        return replace(cause, why=f"follows XID {entry.cause_xid}: {cause.why}")
    if response == "recovery_action":
        recovery = (entry.recovery or "").strip()
        status = Status.OK if recovery.lower() == "none" else Status.CRITICAL if recovery else Status.WARNING
        todo = f"{recovery}: {_RECOVERY_TODO.get(recovery.lower(), p.responses[response].todo)}" if recovery else \
            "the driver's message names no recovery action: look at the XIDs before it"
        return Grade(status, f"driver requires: {recovery or 'unknown recovery'}", todo, response)
    if response == "nvlink5":
        verdict, rule, event = nvlink5_verdict(entry.xid, entry.text)
        verdict = entry.variant if entry.variant in p.nvlink5 else verdict
        response = p.nvlink5[verdict][0]
        if rule is not None and rule.resolution == verdict:
            source = f"NVLink5 {rule.unit}: NVIDIA {rule.resolution}"
        else:
            source = f"NVLink5 {event.unit or 'unit unknown'}, no decode row: the driver says " + \
                ("Nonfatal" if verdict == "undecoded_nonfatal" else "Fatal")
    r = p.responses[response]
    base = Grade(r.status, source, r.todo, response)
    if response == "restart_app" and entry.occurrences >= 2 and entry.last - entry.first <= s.repeat_window:
        return Grade(Status.CRITICAL, f"hardware suspect: {entry.occurrences} jobs hit it on this GPU within "
                                      f"{format_duration(s.repeat_window)}", "drain the node and run GPU diagnostics",
                     response)
    return _cleared(base, entry, s, now, sticky=r.sticky)


# What each XID 154 recovery action asks of the operator (NVIDIA, "Error recovery and response flags").
_RECOVERY_TODO = {
    "gpu reset required": "end the GPU's processes, then nvidia-smi -r",
    "node reboot required": "drain and reboot the node",
    "drain p2p": "end the processes doing peer-to-peer traffic (the job), then follow the next XID 154",
    "drain and reset": "end the processes doing peer-to-peer traffic, then reset the GPU",
}


def _cleared(g: Grade, entry: XidEntry, s: XidSettings, now: float, sticky: bool) -> Grade:
    """A WARNING XID that stayed quiet for clear_after is over; sticky (CRITICAL) ones last until the node reboots."""
    if sticky or g.status is Status.OK or now - entry.last <= s.clear_after:
        return g
    return replace(g, status=Status.OK, why=f"{g.why}; quiet for {format_duration(now - entry.last)}")


def grade_sxid(entry: XidEntry, s: XidSettings, now: float) -> Grade:
    """An NVSwitch SXid: its class in the small SXid table, at least fatal when the driver says Fatal."""
    info = describe_sxid(entry.xid, entry.variant == "fatal")
    word = {"fatal": "Fatal", "data_only": "Data record only"}.get(entry.variant, "Non-fatal")
    unknown = " (not in the SXid table: the driver's word)" if entry.variant != "data_only" else \
        " (not in the SXid table, no severity logged: non-fatal)"
    why = f"{word}, {info.klass.replace('_', '-')}" + ("" if info.known else unknown)
    return _cleared(Grade(info.response.status, why, info.response.todo, info.klass), entry, s, now,
                    sticky=info.response.sticky)


def classify(entry: XidEntry, s: XidSettings, now: float) -> tuple[Status, str]:
    """The status one XID entry warrants, and why."""
    g = grade(entry, s, now)
    return g.status, g.why


def summarize(label: str, graded: list[tuple[XidEntry, Grade]]) -> str:
    kind = "SXid" if graded and graded[0][0].kind == "sxid" else "XID"
    active = sorted((g for g in graded if g[1].status is not Status.OK), key=lambda g: -g[1].status.severity)
    if not active:
        recorded = sum(e.count for e, _ in graded)
        return f"{label}: no active {kind} ({recorded} recorded)" if recorded else f"{label}: no active {kind}"
    parts = []
    for entry, g in active:
        count = f" x{entry.count}" if entry.count > 1 else ""
        if entry.kind == "sxid":
            name, text = describe_sxid(entry.xid, entry.variant == "fatal").name, entry.text[:120]
            parts.append(f"SXid {entry.xid} {name}{count}" + (f": {text}" if text else "") + f" ({g.why}; {g.todo})")
        else:
            info = describe(entry.xid)
            parts.append(f"XID {entry.xid} {info.name}{count}: {info.description} ({g.why}; {g.todo})")
    fell_off = any(e.xid == 79 and e.kind == "xid" and not g.history for e, g in active)
    head = f"{label} fell off the bus (XID 79)" if fell_off else label
    return f"{head}: " + "; ".join(parts)


def explain(xid: int, s: XidSettings) -> dict[str, Any]:
    """What the agent knows and does about one XID, for `trainguard xid`: NVIDIA's entry, the response, its status
    and how long it lasts, the advice, why trainguard reads the bucket as it does, and the most severe status it can
    reach (which decides the actions it runs)."""
    info, p = describe(xid), policy()
    response, source = response_of(xid, s)
    quiet = f"until quiet for {format_duration(s.clear_after)} (clear_after)"
    out: dict[str, Any] = {"xid": xid, "known": info.known, "mnemonic": info.mnemonic, "description": info.description,
                           "nvidia_immediate": info.immediate, "nvidia_investigatory": info.investigatory,
                           "source": source, "why": info.why if "configuration" not in source else ""}
    if response == "unlisted":
        return {**out, "response": "investigate", "status": f"{s.unlisted.name} {quiet}", "worst": s.unlisted.name,
                "todo": p.responses["investigate"].todo}
    r = p.responses[response]
    status = {
        "restart_app": f"WARNING {quiet}; CRITICAL until the node reboots when a second job hits it on one GPU within "
                       f"{format_duration(s.repeat_window)} (repeat_window)",
        "follow_cause": "OK alone; with `caused by previous Xid N`, graded as N",
        "recovery_action": "per message: OK for None, CRITICAL until the node reboots for any other action",
        "nvlink5": "per event, from NVIDIA's NVLink5 decode table",
        "ignore": "OK: recorded and counted (trainguard_gpu_xid_errors_total), never an incident",
    }.get(response, f"{r.status.name} {'until the node reboots' if r.sticky else quiet}")
    out.update(response=response, status=status, todo=r.todo,
               worst=r.status.name if response in ("reset_gpu", "reboot_node", "investigate", "ignore") else "CRITICAL")
    if response == "recovery_action":
        out["recovery_actions"] = {"none": "nothing: the GPU can be used again", **_RECOVERY_TODO}
    elif response == "nvlink5":
        rows = nvlink5_rules().get(xid, ())
        decode = {}
        for verdict, (resp, why) in p.nvlink5.items():
            count = sum(1 for row in rows if row.resolution == verdict)
            if count or verdict.startswith("undecoded"):
                decode[verdict] = {"response": resp, "status": p.responses[resp].status.name, "why": why, "rows": count}
        out["decode"] = decode
    return out


def _entry_details(e: XidEntry, g: Grade, before_start: bool = False) -> dict[str, Any]:
    info = describe(e.xid)
    return {"xid": e.xid, "mnemonic": info.mnemonic, "count": e.count, "first": e.first, "last": e.last,
            "status": g.status.name, "why": g.why, "todo": g.todo, "response": g.response, "text": e.text,
            "pid": e.pid, "process": e.process, "occurrences": e.occurrences, "nvidia_immediate": info.immediate,
            "nvidia_investigatory": info.investigatory, "before_start": before_start, "history": g.history,
            "kernel_usec": e.usec if e.usec >= 0 else None, **({"nvlink5": e.variant} if e.variant else {})}


def _samples(entries: list[XidEntry], labels: dict[str, str], errors: Metric, last_at: Metric,
             before_start: Callable[[XidEntry], bool] | None = None) -> list[Sample]:
    """One count per code (XID or SXid): entries of one code with different variants add up. With `before_start`, also
    whether each code was logged only before the agent's first start."""
    totals: dict[int, tuple[int, float, bool]] = {}
    for e in entries:
        count, last, old = totals.get(e.xid, (0, 0.0, True))
        totals[e.xid] = (count + e.count, max(last, e.last), old and before_start is not None and before_start(e))
    key = "sxid" if errors is SXID_ERRORS else "xid"
    samples = []
    for code, (count, last, old) in sorted(totals.items()):
        code_labels = {**labels, key: str(code)}
        samples += [errors(count, code_labels), last_at(last, code_labels)]
        if before_start is not None:
            samples.append(XID_BEFORE_START(1 if old else 0, code_labels))
    return samples


def gpu_problem(gpus: list[GpuState] | str, bus_id: str) -> str | None:
    """What keeps a GPU from reading healthy now, in words (None: it does): missing from NVML, lost, unreadable, or a
    memory fault that awaits a reset (uncorrected ECC errors, a pending or failed row remap, pending page retirement).
    `gpus` is NVML's list, or why NVML could not be read."""
    if isinstance(gpus, str):
        return f"can't be read (NVML: {gpus})"
    gpu = next((g for g in gpus if g.bus_id == bus_id), None)
    if gpu is None:
        return "is missing (NVML does not list it)"
    if gpu.lost:
        return f"is lost ({gpu.error})"
    if gpu.error:
        return f"can't be read (NVML: {gpu.error})"
    faults = gpu_faults(gpu)
    return "has " + ", ".join(faults) if faults else None


def history(entry: XidEntry, g: Grade, problem: str | None) -> Grade:
    """An entry logged before the agent's first start: at most WARNING while its GPU reads healthy now (`problem` is
    None), so what is bound to CRITICAL (drain, requeue) does not run for an old record of a fault that is gone; as
    graded otherwise, saying why."""
    if g.status is Status.OK:
        return g
    when = f"logged at boot+{format_duration(entry.usec / 1e6)}" if entry.usec >= 0 else "logged"
    if problem is None and g.response == "recovery_action":
        # XID 154 names a state the driver keeps until the GPU is reset or the node rebooted; NVML's health fields
        # do not show it, so a GPU that reads healthy may still be one the driver refuses to trust
        problem = "may read healthy, but the driver's recovery action lasts until it is done"
    if problem is not None:
        return replace(g, why=f"{g.why}; {when}, before trainguard started, and GPU {entry.bus_id} {problem} now")
    status = Status.WARNING if g.status is Status.CRITICAL else g.status
    return replace(g, status=status, history=True,
                   why=f"{when}, before trainguard started; GPU {entry.bus_id} reads healthy now: no drain; "
                       f"{g.status.name} if logged now: {g.why}",
                   todo=f"check the GPU (nvidia-smi -q -d ECC,ROW_REMAPPER -i {entry.bus_id}) before long jobs, then "
                        f"trainguard clear it; if it faults again: {g.todo}")


MARKS_FILE = "xid-marks.json"  # in the state directory: the ledger's first start and clears (XidCheck._publish_marks)
MARKS_MAX = 1 << 20


def adopt_marks(context: CheckContext, ledger: XidLedger) -> None:
    """One-shot: the running (or last) agent's first start and clears on this boot, if it published them."""
    path = context.state_dir / MARKS_FILE
    try:
        # They silence a drain: the agent's word only (its user's or root's file, in a directory no one else
        # may write), never a file anyone could have put there.
        folder = os.stat(context.state_dir)
        if folder.st_mode & 0o022:
            raise OSError(f"{context.state_dir}: group or others may write it: its files are not trusted")
        raw = read_small(path, MARKS_MAX, owners={0, folder.st_uid})
        if len(raw) >= MARKS_MAX:
            raise ValueError(f"larger than {MARKS_MAX} bytes: not what the agent writes")
        data = json.loads(raw)
    except FileNotFoundError:
        return  # no agent started with this state directory yet: every record of the boot counts as logged
    except (OSError, ValueError, RecursionError) as exc:
        log.warning("XID marks not taken: grading this boot's XIDs as logged", extra=kv(path=path, error=exc))
        return
    if ledger.adopt_marks(data):
        first = ledger.first_start
        log.info("kernel log records placed by the agent's first start and clears", extra=kv(
            path=path, kmsg_seq=None if first is None else first.seq, boot_usec=None if first is None else first.usec))


DATA_WAIT_S = 1.0  # an SXid's records come in one printk burst: a Data record alone this long has no severity line


class XidCheck(Check):
    layer = "hardware"

    Settings = XidSettings
    metrics = METRICS
    settings: XidSettings

    def __init__(self, name: str, settings: CheckSettings, context: CheckContext) -> None:
        super().__init__(name, settings, context)
        self.parser = XidParser()
        self.ledger = context.xid_history
        # The node's one kernel log reader, first in line: nothing else runs on a record before its XID is acted on
        self.kernel_log = context.kernel_log
        self.follower = self.kernel_log.subscribe(name, self._on_record, path=self.settings.kmsg_path,
                                                  journalctl=self.settings.journalctl, cursor=context.state,
                                                  priority=0, kind="xid")
        self.nvml = context.nvml
        self.ledger.rank_by(self._severity)
        self._gpu_names: dict[str, tuple[int | None, str | None]] = {}
        self._wake: Callable[[], None] | None = None
        self._started = False
        self._lock = threading.Lock()
        self._publish_lock = threading.Lock()
        self._first_start_saved = False

    def start(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._started = True
        # Before the follower replays the buffer: what it holds now was logged before this start. Kept through
        # restarts on this boot, so a record logged while the agent was down counts as since, and is acted on.
        try:
            point, new = self.ledger.mark_first_start(lambda: LogPoint.now(self.settings.kmsg_path))
            log.info("first start on this boot" if new else "started before on this boot",
                     extra=kv(kmsg_seq=point.seq, boot_usec=point.usec))
            self._first_start_saved = True
        except (sqlite3.Error, OSError) as exc:  # a state store that refuses the write (corrupt): XIDs still watched
            log.error("first start not saved: a restart on this boot takes its own start as the first",
                      extra=kv(error=exc))
        finally:
            self._publish_marks()
            self.kernel_log.start(self.name, self.follower)

    def stop(self) -> None:
        self.kernel_log.stop(self.name, self.follower)
        self.ledger.save(force=True)

    def _severity(self, entry: XidEntry) -> int:
        """What an entry is worth keeping when the ledger is full: its status now."""
        grader = grade_sxid if entry.kind == "sxid" else grade
        return grader(entry, self.settings, self.context.clock()).status.severity

    def _on_record(self, record: KernelRecord) -> None:
        with self._lock:  # the parser is stateful across records
            event = self.parser.feed(record.message, record.seq, record.usec)
        if event is not None:
            # an SXid's lone Data record, released by a later record, keeps its own place in the log
            self._take(event if event.seq >= 0 or event.usec >= 0 else replace(event, seq=record.seq, usec=record.usec))

    def _take(self, event: XidEvent) -> None:
        since = self.context.kernel_since_usec
        if since is not None and event.usec < since:  # `trainguard check --since`: older records do not count
            return
        recorded = self.ledger.record(event)
        if recorded is None:  # from before an operator's clear of its device
            return
        entry, changed = recorded
        if entry.count == 1 or entry.count % 1000 == 0:  # a flood logs a few lines, not one per record
            log.warning(event.kind, extra=kv(**{event.kind: event.xid}, bus_id=event.bus_id, device=event.device or None,
                                             count=entry.count, text=event.text[:160]))
        self.ledger.save()
        # Only a new entry or a new occurrence (another job: repeat escalation) can change the verdict: a flood of
        # identical lines only bumps a counter, which the periodic run reports.
        grader = grade_sxid if entry.kind == "sxid" else grade
        if changed and self._wake is not None and grader(entry, self.settings, self.context.clock()).status \
                is not Status.OK:
            self._wake()

    def clear(self, subject: str, at: float) -> None:
        """`trainguard clear xid/SUBJECT` (after a GPU reset, say): the ledger forgets the device's XIDs (SXids for an
        NVSwitch), and the records before now never come back, not from a replay nor after a restart; a new one fires
        as new."""
        if subject.startswith("nvswitch:"):
            kind, buses = "sxid", [subject.removeprefix("nvswitch:")]
        else:  # pci:BUS, or the GPU's uuid when the driver or NVML named it
            kind = "xid"
            buses = [e.bus_id for e in self.ledger.entries() if subject in (f"pci:{e.bus_id}", self._gpu(e.bus_id)[1])]
        point = LogPoint.now(self.settings.kmsg_path)
        for bus in sorted(set(buses)):
            gone = self.ledger.forget(kind, bus, point)
            log.info("XID history cleared", extra=kv(subject=subject, bus_id=bus, entries=gone, kmsg_seq=point.seq))
        self.ledger.save(force=True)
        self._publish_marks()

    def _publish_marks(self) -> None:
        """The ledger's first start and clears, in a file of their own beside the state store, for `trainguard check`:
        a SLURM health check or prolog run while the agent runs must place records as the agent does, or it drains a
        node for an XID the agent calls history, or one an operator cleared. It does not open the agent's SQLite
        store: a reader of another user could leave files there the agent cannot open."""
        path = self.context.state_dir / MARKS_FILE
        if not self._first_start_saved:
            # One kept in memory only moves with every restart: a later one would make history of what an earlier
            # life of the agent saw logged, for the health check. Nothing published: it grades all as logged.
            with contextlib.suppress(OSError):
                path.unlink()
            return
        try:
            with self._publish_lock:  # a clear and the start at once: the newer marks are the ones left
                replace_file(path, json.dumps(self.ledger.marks()).encode(), 0o600)
        except OSError as exc:
            log.warning("XID marks not published: trainguard check grades this boot's XIDs as logged, clears unseen",
                        extra=kv(path=path, error=exc))

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
        if not self._started and self.follower.records == 0:  # one-shot `trainguard check`: this boot's buffer,
            # with what the agent calls history and what an operator cleared (read once for every subscriber)
            self.kernel_log.read_once(self.follower, lambda: adopt_marks(self.context, self.ledger))
        elif self._started:  # at start the follower replays the buffer: judge the whole of it, not a part
            self.follower.caught_up.wait(min(REPLAY_WAIT_S, self.settings.timeout / 2))
        with self._lock:  # an SXid Data record with no record after it for a while: no severity line follows
            pending = self.parser.flush(DATA_WAIT_S if self._started else 0.0)
        if pending is not None:
            self._take(pending)
        results = self._results()
        if self._started and not self.follower.caught_up.is_set():
            return PartialView(results, f"replaying the kernel log ({self.follower.records} records so far)")
        if self.ledger.evicted:
            return PartialView(results, f"XID ledger full: {self.ledger.evicted} entries dropped")
        return results

    def _results(self) -> list[Result]:
        now = self.context.clock()
        by_gpu: dict[str, list[XidEntry]] = {}
        for entry in self.ledger.entries():
            by_gpu.setdefault(entry.bus_id, []).append(entry)
        results = [self._follower_result()]
        gpus: list[GpuState] | str | None = None  # NVML now, read once a run and only for history
        for bus_id, entries in sorted(by_gpu.items()):
            index, uuid = self._gpu(bus_id)
            graded = [(e, grade(e, self.settings, now)) for e in entries]
            if any(g.status is not Status.OK and self.ledger.before_start(e) for e, g in graded):
                gpus = self._gpus_now() if gpus is None else gpus
                problem = gpu_problem(gpus, bus_id)
                graded = [(e, history(e, g, problem) if self.ledger.before_start(e) else g) for e, g in graded]
            label = f"GPU {index} ({bus_id})" if index is not None else f"GPU {bus_id}"
            labels = {"gpu": "" if index is None else str(index), "uuid": uuid or "", "bus_id": bus_id}
            details: dict[str, Any] = {"bus_id": bus_id, "index": index, "uuid": uuid,
                                       "xids": [_entry_details(e, g, self.ledger.before_start(e))
                                                for e, g in graded]}
            worst_entry = max(graded, key=lambda eg: eg[1].status.severity)
            if worst_entry[1].status is not Status.OK:
                details["next_step"] = worst_entry[1].todo
            results.append(self.result(uuid or f"pci:{bus_id}", worst(g.status for _, g in graded),
                                       summarize(label, graded), details,
                                       _samples(entries, labels, XID_ERRORS, XID_LAST, self.ledger.before_start)))
        results += self._switch_results(now)
        return results

    def _gpus_now(self) -> list[GpuState] | str:
        """NVML's GPUs now, or why they can't be read (then no history is taken as over)."""
        try:
            return self.nvml.gpus()
        except Exception as exc:  # noqa: BLE001 - any NVML failure reads as "can't tell": graded as logged
            return f"{type(exc).__name__}: {exc}"

    def _switch_results(self, now: float) -> list[Result]:
        """One result per NVSwitch that logged SXids this boot."""
        by_switch: dict[str, list[XidEntry]] = {}
        for entry in self.ledger.entries("sxid"):
            by_switch.setdefault(entry.bus_id, []).append(entry)
        results = []
        for bus_id, entries in sorted(by_switch.items()):
            device = entries[0].device
            graded = [(e, grade_sxid(e, self.settings, now)) for e in entries]
            samples = _samples(entries, {"switch": device, "bus_id": bus_id}, SXID_ERRORS, SXID_LAST)
            details: dict[str, Any] = {"bus_id": bus_id, "switch": device, "sxids": [
                {"sxid": e.xid, "name": describe_sxid(e.xid, e.variant == "fatal").name, "count": e.count,
                 "first": e.first, "last": e.last, "status": g.status.name, "why": g.why, "todo": g.todo,
                 "class": g.response, "text": e.text} for e, g in graded]}
            worst_grade = max((g for _, g in graded), key=lambda g: g.status.severity)
            if worst_grade.status is not Status.OK:
                details["next_step"] = worst_grade.todo
            results.append(self.result(f"nvswitch:{bus_id}", worst_grade.status,
                                       summarize(f"NVSwitch {device} ({bus_id})", graded), details, samples))
        return results

    def _follower_result(self) -> Result:
        f = self.follower
        samples = [KMSG_RECORDS(f.records), KMSG_LOST(f.lost),
                   KMSG_UP(1 if f.running or not self._started else 0, {"source": f.source})]
        first = self.ledger.first_start
        details = {"source": f.source, "records": f.records, "lost": f.lost, "last_seq": f.last_seq,
                   "replayed": f.caught_up.is_set() or not self._started, "ledger_dropped": self.ledger.evicted,
                   "first_start": None if first is None else {"seq": first.seq, "usec": first.usec}}
        if self._started and not f.running:
            return self.result("kernel-log", Status.UNKNOWN,
                               f"kernel log follower not running: {f.error or 'starting'}", details, samples)
        lost = f", {f.lost} lost to overruns" if f.lost else ""
        dropped = f", {self.ledger.evicted} XID entries dropped (ledger full)" if self.ledger.evicted else ""
        return self.result("kernel-log", Status.OK, f"reading {f.source}: {f.records} records{lost}{dropped}", details,
                           samples)
