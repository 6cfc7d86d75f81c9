"""XID lines from the NVIDIA driver, and SXid lines from its NVSwitch driver: parsing every format in the wild (the
catalogs that explain them are in `xid_catalog`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from trainguard.core.text import linear
from trainguard.gpu.nvml import normalize_bus_id
from trainguard.gpu.xid_catalog import NVLINK5_XIDS, nvlink5_verdict
from trainguard.node.kmsg import strip_prefix

# Prefixes tools add before the kernel's text (dmesg in every time format, syslog, journalctl -k, raw /dev/kmsg) are
# removed by the kernel log's own `strip_prefix`, after the cheap test: the patterns below match the kernel's text.
_PREFIX = "^"
_BUS = r"(?:PCI:)?(?P<bus>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-9a-fA-F])?)"
_XID = linear(_PREFIX + r"NVRM: Xid \(" + _BUS + r"(?: GPU-I:(?P<gi>\d+))?(?: GPU-CI:(?P<ci>\d+))?\):\s*"
                  r"(?P<xid>\d+),\s*(?P<rest>.*)$")
_PID = linear(r"^pid=(?P<pid>'<unknown>'|\d+|<unknown>),\s*(?:name=(?P<name>.*?),\s+)?(?P<text>.*)$")
_CAUSE = linear(r"caused by previous Xid (\d+)")
_RECOVERY = linear(r"recovery action changed from \S+ \((?P<old>[^)]*)\) to \S+ \((?P<new>[^)]*)\)")
# XID 154 as some drivers print it: the action alone (`154, Node Reboot Required`).
_RECOVERY_ALONE = ("none", "gpu reset required", "node reboot required", "drain p2p", "drain and reset")
_OFF_BUS_ONE = linear(_PREFIX + r"NVRM: GPU (?P<bus>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.\w)?): "
                          r"GPU has fallen off the bus")
_OFF_BUS_FIRST = linear(_PREFIX + r"NVRM: The NVIDIA GPU (?P<bus>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}"
                            r"(?:\.\w)?)\s*$")
# The same three lines as one record (printk with embedded newlines: what dmesg shows as one stamp and two indented
# lines), which comes with no XID at all (NVIDIA/NVSentinel#155).
_OFF_BUS_BLOCK = linear(r"NVRM: The NVIDIA GPU (?P<bus>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.\w)?)\s+"
                        r"(?:NVRM:\s*)?\(PCI ID: [0-9a-fA-F:]{9}\) installed in this system has\s+(?:NVRM:\s*)?"
                        r"fallen off the bus")
_OFF_BUS_LAST = linear(_PREFIX + r"NVRM: fallen off the bus and is not responding to commands")
# NVSwitch: `nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 20034, Fatal, Link 63 LTSSM Fault Up`. The driver prints one
# error as three records: `..., Data {0x...}`, the severity line, `..., Severity N Engine instance ...`. The severity
# line is the event; a Data record that no severity line follows (printk rate limits, a lost or pasted record) is one
# too, graded by the SXid table alone.
_SXID = linear(_PREFIX + r"nvidia-nvswitch(?P<sw>\d+): SXid \(" + _BUS + r"\):\s*(?P<sxid>\d+),\s*"
                   r"(?:(?P<sev>Fatal|Non-?fatal)(?:,\s*(?P<rest>.*))?|(?P<data>Data \{[^}]{0,400}\}?))$", ignore_case=True)
_GPU_UUID = linear(_PREFIX + r"NVRM: GPU at PCI:(?P<bus>[0-9a-fA-F:.]+): (?P<uuid>GPU-[0-9a-fA-F-]+)")


@dataclass(frozen=True)
class XidEvent:
    xid: int
    bus_id: str  # normalised: 0000:3b:00
    text: str
    pid: int | None = None
    process: str | None = None
    gpu_instance: int | None = None
    compute_instance: int | None = None
    cause_xid: int | None = None  # XID 45 "caused by previous Xid N"
    recovery: str | None = None  # XID 154: the recovery action now required
    line: str = ""
    variant: str = ""  # XIDs 144-150: the NVLink5 decode verdict; SXids: fatal | non_fatal | data_only (no severity
    # line logged: the SXid table grades it). Variants stay apart.
    kind: str = "xid"  # xid (a GPU) | sxid (an NVSwitch)
    device: str = ""  # SXids: the switch, e.g. nvswitch3
    seq: int = -1  # the kernel record's sequence number (-1: from the journal, or not from the log)
    usec: int = -1  # the kernel record's timestamp, microseconds since boot


class XidParser:
    """Stateful only for what spans records: the three-record fallen-off-the-bus message, bus -> uuid lines, and an
    SXid's Data record until the next record says whether its severity line follows."""

    def __init__(self) -> None:
        self.uuid_by_bus: dict[str, str] = {}
        self._pending_off_bus: str | None = None
        self._pending_data: XidEvent | None = None
        self._pending_since = 0.0  # monotonic time the pending Data record was read

    def feed(self, message: str, seq: int = -1, usec: int = -1) -> XidEvent | None:
        """The event a record completes, if any. `seq` and `usec` (the record's) are carried by a Data record's event,
        which a later record releases."""
        if "SXid" in message:
            return self._sxid(message, seq, usec)
        event = self._nvrm(message) if "NVRM" in message else None  # the cheap test: most lines are not the driver's
        if self._pending_data is not None and event is None:
            return self.flush()  # the burst ended without the Data record's severity line
        return event  # an XID is not delayed: a pending Data record waits for the next record or `flush`

    def flush(self, min_age: float = 0.0) -> XidEvent | None:
        """A Data record no severity line followed: at the end of input, or read at least `min_age` seconds ago (the
        driver prints an error's records in one burst, milliseconds apart)."""
        if self._pending_data is None or time.monotonic() - self._pending_since < min_age:
            return None
        event, self._pending_data = self._pending_data, None
        return event

    def _nvrm(self, message: str) -> XidEvent | None:
        line = message.rstrip("\n")
        text = strip_prefix(line)
        m = _XID.match(text)
        if m:
            return self._xid(m, line)
        m = _GPU_UUID.match(text)
        if m:
            self.uuid_by_bus[normalize_bus_id(m.group("bus"))] = m.group("uuid")
            return None
        m = _OFF_BUS_ONE.match(text)
        if m:
            return XidEvent(79, normalize_bus_id(m.group("bus")), "GPU has fallen off the bus", line=line)
        m = _OFF_BUS_BLOCK.search(text) if "\n" in text else None
        if m:
            return XidEvent(79, normalize_bus_id(m.group("bus")), "GPU has fallen off the bus and is not responding to "
                            "commands", line=line)
        m = _OFF_BUS_FIRST.match(text)
        if m:
            self._pending_off_bus = normalize_bus_id(m.group("bus"))
            return None
        if _OFF_BUS_LAST.match(text) and self._pending_off_bus:
            bus, self._pending_off_bus = self._pending_off_bus, None
            return XidEvent(79, bus, "GPU has fallen off the bus and is not responding to commands", line=line)
        return None

    def _sxid(self, message: str, seq: int, usec: int) -> XidEvent | None:
        line = message.rstrip("\n")
        m = _SXID.match(strip_prefix(line))
        pending, data = self._pending_data, None
        if m is not None:
            g = m.groupdict()
            device, bus, code = f"nvswitch{g['sw']}", normalize_bus_id(g["bus"]), int(g["sxid"])
            if g["data"] is not None:
                data = XidEvent(code, bus, g["data"][:160], line=line, variant="data_only", kind="sxid",
                                device=device, seq=seq, usec=usec)
            elif g["sev"] is not None:
                # the severity line: the event (its Data record, just before it, is the same error)
                if pending is not None and (pending.device, pending.bus_id, pending.xid) == (device, bus, code):
                    pending = None
                fatal = g["sev"].lower() == "fatal"
                event = XidEvent(code, bus, (g["rest"] or "").strip(), line=line,
                                 variant="fatal" if fatal else "non_fatal", kind="sxid", device=device)
                self._pending_data = pending
                return event  # a pending Data record of another error waits for the next record
        # another Data record, the `Severity N` record or a garbled SXid line: the pending Data record had no severity
        self._pending_data, self._pending_since = data, time.monotonic()
        return pending

    def _xid(self, match: Any, line: str) -> XidEvent:
        # One groupdict per match: the re2 wrapper builds its name -> index table again at each named group() (a
        # flood of XIDs spent most of its time there).
        m = match.groupdict()
        rest, pid, name = m["rest"], None, None
        found = _PID.match(rest)
        if found:
            pm = found.groupdict()
            pid = int(pm["pid"]) if pm["pid"].isdigit() else None
            name = pm["name"]
            name = None if name in (None, "<unknown>") else name
            rest = pm["text"]
        xid = int(m["xid"])
        cause = _CAUSE.search(rest)
        recovery = _RECOVERY.search(rest)
        action = recovery.group("new") if recovery else None
        if action is None and xid == 154 and rest.strip().rstrip(".").lower() in _RECOVERY_ALONE:
            action = rest.strip().rstrip(".")
        return XidEvent(
            xid=xid, bus_id=normalize_bus_id(m["bus"]), text=rest.strip(), pid=pid, process=name,
            gpu_instance=int(m["gi"]) if m["gi"] else None,
            compute_instance=int(m["ci"]) if m["ci"] else None,
            cause_xid=int(cause.group(1)) if cause else None, recovery=action, line=line,
            variant=nvlink5_verdict(xid, rest)[0] if xid in NVLINK5_XIDS else "")
