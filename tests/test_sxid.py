"""NVSwitch SXids: real-format lines through the same kernel log follower as XIDs, graded by the small SXid table
(fatal vs non-fatal, from NVIDIA's Fabric Manager User Guide) and by the driver's own word."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, unique_bus, wait_until
from tests.test_xid import _xid_engine
from trainguard.checks.xid import XidSettings, grade_sxid
from trainguard.core.model import Status
from trainguard.gpu.faults import XidEntry, XidLedger
from trainguard.gpu.xid import XidParser
from trainguard.gpu.xid_catalog import describe_sxid, sxid_catalog

CAPTURE = REPO / "tests" / "data" / "nvidia" / "sxid-dmesg.txt"

# (line, sxid, switch, bus, fatal): the driver's format (`nvidia-%s: SXid (PCI:%04x:%02x:%02x.%x): %05d, ...`), the
# example of /work/shared/reference/gpu-faults.md, and the lines NVIDIA/NVSentinel's end-to-end test injects
# through syslog (tests/.../syslog: `kernel: [123.456789] nvidia-nvswitch0: SXid ...`).
LINES = [
    ("nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 20034, Fatal, Link 63 LTSSM Fault Up", 20034, "nvswitch0",
     "0000:05:00", True),
    ("kernel: [123.456789] nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 20009, Non-fatal, Link 28 RX Short Error Rate",
     20009, "nvswitch0", "0000:c3:00", False),
    ("kernel: [123.456791] nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 24007, Fatal, Link 30 sourcetrack timeout error",
     24007, "nvswitch0", "0000:c3:00", True),
    ("nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error (First)",
     12028, "nvswitch3", "0000:05:00", False),
]


@pytest.mark.parametrize(("line", "sxid", "switch", "bus", "fatal"), LINES)
def test_sxid_lines(line: str, sxid: int, switch: str, bus: str, fatal: bool) -> None:
    event = XidParser().feed(line)
    assert event is not None
    assert (event.kind, event.xid, event.device, event.bus_id, event.variant) == (
        "sxid", sxid, switch, bus, "fatal" if fatal else "non_fatal")


def test_a_real_capture_counts_each_event_once() -> None:
    """Each SXid event is three records (Data, the severity line, Severity N ...): only the severity line counts. The
    capture's last record, SXid 12028, is its Data record alone: one event of its own."""
    parser = XidParser()
    events = [e for line in CAPTURE.read_text().splitlines() if (e := parser.feed(line)) is not None]
    events += [e for e in [parser.flush()] if e is not None]  # the end of the capture: nothing follows the Data record
    assert [(e.xid, e.device, e.variant, e.text[:21]) for e in events] == [
        (22013, "nvswitch3", "non_fatal", "Link 44 Minion Link D"),
        (22013, "nvswitch3", "non_fatal", "Link 45 Minion Link D"),
        (12028, "nvswitch1", "data_only", "Data {0x000001c0, 0x0")]


def test_an_sxid_printed_as_its_data_record_alone_is_graded_by_nvidias_table() -> None:
    """The issue's case: SXid 12028 (egress non-posted PRIV error) as its Data record alone is one event, graded as the
    Fabric Manager guide grades 12028 (NVLink traffic through the port stalls): CRITICAL."""
    [data_line] = [line for line in CAPTURE.read_text().splitlines() if "12028, Data {" in line]  # leptonai/gpud#338
    parser = XidParser()
    assert parser.feed(data_line, seq=7, usec=1234) is None  # its severity line may follow
    event = parser.feed("usb 1-1: new high-speed USB device number 2 using xhci_hcd", seq=8, usec=2000)
    assert event is not None and (event.kind, event.xid, event.device, event.bus_id, event.seq, event.usec) == (
        "sxid", 12028, "nvswitch1", "0000:84:00", 7, 1234)  # the Data record's own place in the log
    ledger = XidLedger(None)
    recorded = ledger.record(event)
    assert recorded is not None
    g = grade_sxid(recorded[0], XidSettings(), 1001.0)
    assert (g.status, g.response) == (Status.CRITICAL, "stall") and g.why.startswith("Data record only, stall")


def test_a_data_record_and_its_severity_line_are_one_event_and_an_xid_is_not_delayed() -> None:
    parser = XidParser()
    data = "nvidia-nvswitch2: SXid (PCI:0000:05:00.0): 24007, Data {0x00000000, 0x00000001}"
    assert parser.feed(data) is None
    fatal = parser.feed("nvidia-nvswitch2: SXid (PCI:0000:05:00.0): 24007, Fatal, Link 30 sourcetrack timeout error")
    assert fatal is not None and fatal.variant == "fatal"
    assert parser.feed("nvidia-nvswitch2: SXid (PCI:0000:05:00.0): 24007, Severity 5 Engine instance 30") is None
    assert parser.flush() is None  # nothing left over: one event for the three records
    # a Data record, then an XID: the XID first, the Data record (no severity line came) with the next record
    assert parser.feed(data) is None
    xid = parser.feed("NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.")
    assert xid is not None and xid.xid == 79
    late = parser.feed("nvidia-nvswitch2: SXid (PCI:0000:05:00.0): 24007, Severity 5 Engine instance 30")
    assert late is not None and (late.xid, late.variant) == (24007, "data_only")
    assert parser.feed(data) is None and parser.flush(min_age=60) is None  # read just now: its burst may go on


@pytest.mark.parametrize("line", [
    "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): garbled, Fatal",
    "my notes: nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 20034, Fatal, Link 63",
    "nvidia-nvswitch0 SXid 20034 Fatal",
])
def test_not_sxid_lines(line: str) -> None:
    assert XidParser().feed(line) is None


@pytest.mark.parametrize(("sxid", "fatal", "status", "klass"), [
    (22013, False, Status.OK, "benign"),  # NVIDIA: can be safely ignored
    (11012, False, Status.OK, "corrected"),  # single-bit ECC, corrected by the switch
    (20001, False, Status.WARNING, "non_fatal"),
    (12028, False, Status.CRITICAL, "stall"),  # "non-fatal", but NVLink traffic through the port stalls
    (24007, True, Status.CRITICAL, "fatal"),
    (23001, True, Status.CRITICAL, "always_fatal"),
    (11012, True, Status.CRITICAL, "fatal"),  # the driver's Fatal wins over the table's corrected
    (29999, True, Status.CRITICAL, "fatal"),  # not in the table: the driver's word
    (29999, False, Status.WARNING, "non_fatal"),
])
def test_sxid_classes(sxid: int, fatal: bool, status: Status, klass: str) -> None:
    entry = XidEntry("0000:05:00", sxid, 1, 1000.0, 1000.0, "Link 1", variant="fatal" if fatal else "non_fatal",
                     kind="sxid", device="nvswitch0")
    g = grade_sxid(entry, XidSettings(), 1001.0)
    assert (g.status, g.response) == (status, klass)
    assert describe_sxid(sxid, fatal).klass == klass


def test_non_fatal_sxids_clear_fatal_ones_stay() -> None:
    s = XidSettings(clear_after="1h")
    warn = XidEntry("0000:05:00", 20001, 1, 1000.0, 1000.0, "", variant="non_fatal", kind="sxid")
    fatal = XidEntry("0000:05:00", 24007, 1, 1000.0, 1000.0, "", variant="fatal", kind="sxid")
    assert grade_sxid(warn, s, 1000 + 3601).status is Status.OK
    assert grade_sxid(fatal, s, 1000 + 10**6).status is Status.CRITICAL


def test_every_sxid_class_is_defined() -> None:
    classes, codes = sxid_catalog()
    assert {klass for _, klass in codes.values()} <= set(classes)
    assert {"corrected", "non_fatal", "fatal", "always_fatal"} <= set(classes)


def test_sxids_and_xids_share_the_ledger_but_not_its_gpu_entries() -> None:
    ledger = XidLedger(None)
    parser = XidParser()
    for line in ("nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 24007, Fatal, Link 30 sourcetrack timeout error",
                 "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."):
        event = parser.feed(line)
        assert event is not None
        ledger.record(event)
    assert [e.xid for e in ledger.entries()] == [79]  # what training_log and the GPU results read
    assert [(e.xid, e.device) for e in ledger.entries("sxid")] == [(24007, "nvswitch0")]


# real /dev/kmsg ------------------------------------------------------------------------------------------------------
def test_sxid_to_incident_through_the_kernel_log(kmsg: Any, tmp_path: Path) -> None:
    engine = _xid_engine(tmp_path)
    engine.start()
    try:
        fatal_bus, quiet_bus, data_bus = unique_bus(), unique_bus(), unique_bus()
        # SXid 12028 as its Data record alone (leptonai/gpud#338): the next record says no severity line follows
        kmsg.write(f"nvidia-nvswitch1: SXid (PCI:{data_bus}.0): 12028, Data {{0x000001c0, 0x00bd5c8a, 0x00000500}}")
        kmsg.write(f"nvidia-nvswitch2: SXid (PCI:{fatal_bus}.0): 24007, Data {{0x00000000, 0x00000001}}")
        kmsg.write(f"nvidia-nvswitch2: SXid (PCI:{fatal_bus}.0): 24007, Fatal, Link 30 sourcetrack timeout error")
        kmsg.write(f"nvidia-nvswitch5: SXid (PCI:{quiet_bus}.0): 22013, Non-fatal, Link 44 Minion Link DLREQ interrupt")
        subject = f"nvswitch:{fatal_bus}"
        wait_until(lambda: any(i.subject == subject and i.firing for i in engine.tracker.incidents()), 5,
                   what="a CRITICAL incident for the NVSwitch")
        [incident] = [i for i in engine.tracker.incidents() if i.subject == subject]
        assert incident.status is Status.CRITICAL
        assert incident.summary.startswith(f"NVSwitch nvswitch2 ({fatal_bus}): SXid 24007 sourcetrack timeout: "
                                           "Link 30 sourcetrack timeout error (Fatal, fatal;")
        wait_until(lambda: any(i.subject == f"nvswitch:{data_bus}" and i.firing for i in engine.tracker.incidents()),
                   5, what="a CRITICAL incident for the NVSwitch whose SXid 12028 came as its Data record alone")
        engine.run_check("xid")
        assert f"nvswitch:{quiet_bus}" not in {i.subject for i in engine.tracker.incidents()}
        last = engine.snapshot().checks["xid"].last
        assert last is not None
        counts = {(s.labels["switch"], s.labels["sxid"]): s.value for r in last.results for s in r.samples
                  if s.name == "trainguard_nvswitch_sxid_errors_total"
                  and s.labels["bus_id"] in (fatal_bus, quiet_bus, data_bus)}
        # the Data record before its severity line is not counted; the one alone is
        assert counts == {("nvswitch2", "24007"): 1, ("nvswitch5", "22013"): 1, ("nvswitch1", "12028"): 1}
    finally:
        engine.stop()
