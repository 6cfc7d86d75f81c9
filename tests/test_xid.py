"""XIDs: the parser over every format, the response classes, and the kernel-log follower on the real /dev/kmsg."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.conftest import unique_bus, wait_until, xid79
from trainguard.agent.configfile import parse_config
from trainguard.agent.http import HttpEndpoint
from trainguard.checks.base import CheckContext
from trainguard.checks.xid import XidCheck, XidSettings, classify, grade
from trainguard.core.model import Status
from trainguard.core.state import ScopedState
from trainguard.gpu.faults import XidEntry, XidLedger
from trainguard.gpu.xid import XidEvent, XidParser
from trainguard.gpu.xid_catalog import describe
from trainguard.node.kmsg import KernelRecord, KmsgFollower, LogPoint, newest_seq, parse_journal, parse_kmsg
from trainguard.pipeline.engine import Engine
from trainguard.pipeline.store import Store

# (line, xid, bus id, pid, process) -- formats from driver sources and public reports
MATCHING = [
    ("NVRM: Xid (PCI:0000:9b:00): 119, pid=2024380, name=nvidia-smi, Timeout after 6s of waiting for RPC response "
     "from GPU4 GSP! Expected function 103 (GSP_RM_ALLOC) (0x2081 0x4).", 119, "0000:9b:00", 2024380, "nvidia-smi"),
    ("NVRM: Xid (PCI:0000:05:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
     79, "0000:05:00", None, None),
    ("NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked for remapping, reset gpu to activate.",
     63, "0000:10:1c", 1896, None),
    ("NVRM: Xid (PCI:0000:07:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error (DBE) has "
     "been detected on GPU in the framebuffer at physAddr 0x7fffa8860 partition 7, subpartition 1.",
     48, "0000:07:00", None, None),
    ("NVRM: Xid (PCI:0000:b5:00): 31, pid=2079991, name=pt_main_thread, Ch 00000007, intr 00000000.",
     31, "0000:b5:00", 2079991, "pt_main_thread"),
    ("NVRM: Xid (PCI:0004:01:00 GPU-I:05 GPU-CI:01): 94, pid=12, name=nvc:[driver], Contained: SM (0x1).",
     94, "0004:01:00", 12, "nvc:[driver]"),
    ("NVRM: Xid (PCI:0018:01:00 GPU-I:02): 31, pid=77, name=python3, Ch 00000008", 31, "0018:01:00", 77, "python3"),
    ("NVRM: Xid (0000:03:00): 13, Graphics Exception: ESR 0x405840=0x2000000", 13, "0000:03:00", None, None),
    ("NVRM: Xid (PCI:0000:02:00): 31, Ch 0000005a, engmask 00000101", 31, "0000:02:00", None, None),
    ("NVRM: Xid (PCI:0000:02:00): 13, channel 0x0000000c, Class 0000c5c0", 13, "0000:02:00", None, None),
    ("NVRM: Xid (PCI:0000:AB:00): 74, pid=5, name=torchrun, NVLink: fatal error", 74, "0000:ab:00", 5, "torchrun"),
    ("[ 1843.308145] NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
     79, "0000:3b:00", None, None),
    ("[Sun Feb 23 16:24:18 2025] NVRM: Xid (PCI:0000:3b:00): 95, pid=9, name=python, Uncontained: FBHUB.",
     95, "0000:3b:00", 9, "python"),
    ("kern  :warn  : 2025-02-23T16:24:18,123456+00:00 NVRM: Xid (PCI:0000:3b:00): 62, pid='<unknown>', "
     "name=<unknown>, 0000(0000) 00000000 00000000", 62, "0000:3b:00", None, None),
    ("kernel: NVRM: Xid (PCI:0000:3b:00): 109, pid=1, name=x, Ch 00000010, errorString CTX SWITCH TIMEOUT",
     109, "0000:3b:00", 1, "x"),
    ("Feb 23 16:24:18 gpu01 kernel: NVRM: Xid (PCI:0000:3b:00): 120, pid=3, name=y, GSP task timeout",
     120, "0000:3b:00", 3, "y"),
    ("NVRM: GPU 0000:29:00.0: GPU has fallen off the bus.", 79, "0000:29:00", None, None),
]
NOT_MATCHING = [
    "epoch 3 step 100: my notes say NVRM: Xid (PCI:0000:05:00): 79 happened last week",
    "grep Xid /var/log/syslog",
    "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15",
    "NVRM: Xid (PCI:0000:05:00): seventy-nine, bogus",
    "",
]


@pytest.mark.parametrize(("line", "xid", "bus", "pid", "process"), MATCHING)
def test_parser_formats(line: str, xid: int, bus: str, pid: int | None, process: str | None) -> None:
    event = XidParser().feed(line)
    assert event is not None
    assert (event.xid, event.bus_id, event.pid, event.process) == (xid, bus, pid, process)


@pytest.mark.parametrize("line", NOT_MATCHING)
def test_parser_rejects(line: str) -> None:
    assert XidParser().feed(line) is None


def test_parser_details() -> None:
    p = XidParser()
    mig = p.feed(MATCHING[5][0])
    assert mig is not None and (mig.gpu_instance, mig.compute_instance) == (5, 1)
    cause = p.feed("NVRM: Xid (PCI:0000:03:00): 45, pid=1, name=python, Ch 00000010, caused by previous Xid 79")
    assert cause is not None and cause.cause_xid == 79
    rec = p.feed("NVRM: Xid (PCI:0000:3b:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)")
    assert rec is not None and rec.recovery == "GPU Reset Required"
    assert p.feed("NVRM: GPU at PCI:0000:9b:00: GPU-509665ad-b600-ac93-3616-d754b23d636d") is None
    assert p.uuid_by_bus["0000:9b:00"] == "GPU-509665ad-b600-ac93-3616-d754b23d636d"


def test_three_record_fallen_off_the_bus() -> None:
    p = XidParser()
    assert p.feed("NVRM: The NVIDIA GPU 0000:b3:00.0") is None
    assert p.feed("NVRM: (PCI ID: 10de:26b5) installed in this system has") is None
    event = p.feed("NVRM: fallen off the bus and is not responding to commands.")
    assert event is not None and (event.xid, event.bus_id) == (79, "0000:b3:00")
    assert XidParser().feed("NVRM: fallen off the bus and is not responding to commands.") is None


def test_catalog_is_package_data() -> None:
    info = describe(79)
    assert (info.mnemonic, info.immediate, info.response) == ("ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS", "RESTART_BM",
                                                              "reboot_node")
    assert describe(13).response == "restart_app"
    assert describe(9999).mnemonic == "UNKNOWN_XID" and not describe(9999).known


def entry(xid: int, count: int = 1, first: float = 1000.0, last: float = 1000.0, **kw: Any) -> XidEntry:
    return XidEntry("0000:3b:00", xid, count, first, last, "text", **kw)


@pytest.mark.parametrize(("e", "status", "why"), [
    (entry(79), Status.CRITICAL, "NVIDIA RESTART_BM"),
    (entry(48), Status.CRITICAL, "NVIDIA WORKFLOW_XID_48, read as reset_gpu"),
    (entry(13, pids=[7]), Status.WARNING, "NVIDIA RESTART_APP"),
    (entry(31, count=40, pids=[7]), Status.WARNING, "NVIDIA RESTART_APP"),  # one fault, many lines: one job
    (entry(31, count=2, first=1000, last=5000, pids=[7, 8]), Status.CRITICAL, "hardware suspect: 2 jobs"),
    (entry(13, count=2, first=1000, last=5000, bursts=2), Status.CRITICAL, "hardware suspect"),  # pid-less bursts
    (entry(31, count=2, first=0, last=100000, pids=[7, 8]), Status.WARNING, "NVIDIA RESTART_APP"),  # a day apart
    (entry(63), Status.OK, "NVIDIA IGNORE"),
    (entry(92), Status.OK, "NVIDIA IGNORE"),
    (entry(43), Status.OK, "NVIDIA IGNORE"),
    (entry(61), Status.WARNING, "NVIDIA CONTACT_SUPPORT, read as investigate"),
    (entry(45), Status.OK, "XID 45 alone is not a fault"),
    (entry(45, cause_xid=79), Status.CRITICAL, "follows XID 79"),
    (entry(45, cause_xid=13), Status.WARNING, "follows XID 13"),
    (entry(154, recovery="GPU Reset Required"), Status.CRITICAL, "GPU Reset Required"),
    (entry(154, recovery="Node Reboot Required"), Status.CRITICAL, "Node Reboot Required"),
    (entry(154, recovery="Drain P2P"), Status.CRITICAL, "Drain P2P"),
    (entry(154, recovery="None"), Status.OK, "None"),
    (entry(167), Status.CRITICAL, "NVIDIA gives no bucket, read as reboot_node"),
    (entry(999), Status.WARNING, "not in NVIDIA's catalog"),
])
def test_classes(e: XidEntry, status: Status, why: str) -> None:
    got, reason = classify(e, XidSettings(), now=1001.0)
    assert got is status and why in reason


@pytest.mark.parametrize("xid", [46, 110, 136, 155, 156, 158])
def test_reset_gpu_xids_a_new_user_saw_as_unknown(xid: int) -> None:
    """The issue's report: these came out WARNING "not in the catalog" with no action; NVIDIA says RESET_GPU."""
    g = grade(entry(xid), XidSettings(), now=1001.0)
    assert (g.status, g.response, g.why) == (Status.CRITICAL, "reset_gpu", "NVIDIA RESET_GPU")


def test_warning_xids_clear_critical_ones_stay() -> None:
    s = XidSettings(clear_after="1h")
    assert classify(entry(13), s, now=1000 + 3601)[0] is Status.OK
    assert classify(entry(79), s, now=1000 + 10**6)[0] is Status.CRITICAL
    assert classify(entry(31, count=2, pids=[1, 2]), s, now=1000 + 10**6)[0] is Status.CRITICAL  # hardware suspect stays
    assert classify(entry(79), XidSettings(ignore=[79]), now=1001)[0] is Status.OK


def test_configured_classes_override_the_catalog_and_must_not_overlap() -> None:
    s = XidSettings(hardware=[13], application=[48], watch=[79], ignore=[31])
    assert classify(entry(13), s, 1001.0) == (Status.CRITICAL, "hardware by configuration")
    assert classify(entry(48), s, 1001.0) == (Status.WARNING, "application by configuration")
    assert classify(entry(79), s, 1001.0) == (Status.WARNING, "watch by configuration")
    assert classify(entry(31), s, 1001.0) == (Status.OK, "ignore by configuration")
    with pytest.raises(ValueError, match="XID 13 is in both hardware and ignore"):
        XidSettings(hardware=[13], ignore=[13])


def test_parse_kmsg_record() -> None:
    rec = parse_kmsg(b"3,1234,5678901,-;NVRM: Xid (PCI:0000:05:00): 79, \\x1b[1mbold\n"
                     b" SUBSYSTEM=pci\n DEVICE=+pci:0000:05:00.0\n")
    assert rec is not None
    assert (rec.priority, rec.facility, rec.seq, rec.usec) == (3, 0, 1234, 5678901)
    assert rec.message == "NVRM: Xid (PCI:0000:05:00): 79, \x1b[1mbold"
    assert rec.fields == {"SUBSYSTEM": "pci", "DEVICE": "+pci:0000:05:00.0"}
    assert parse_kmsg(b"garbage without header") is None
    assert parse_kmsg(b"x,y,z;msg") is None
    assert parse_kmsg(b"6,1,2,-;\xff\xfe invalid utf-8").message.endswith("invalid utf-8")  # type: ignore[union-attr]


def test_parse_journal_entry() -> None:
    rec, cursor = parse_journal(json.dumps({"MESSAGE": "NVRM: Xid (PCI:0000:05:00): 79, x", "__CURSOR": "s=abc;i=1",
                                            "PRIORITY": "3"})) or (None, None)
    assert rec is not None and cursor == "s=abc;i=1" and rec.priority == 3
    raw = parse_journal(json.dumps({"MESSAGE": list(b"bytes \xff"), "__CURSOR": "c"}))
    assert raw is not None and raw[0].message.startswith("bytes ")
    assert parse_journal("not json") is None


def test_ledger_aggregates_and_survives_restart(tmp_path: Path) -> None:
    store = Store(tmp_path)
    ledger = XidLedger(store)
    event = XidEvent(95, "0000:3b:00", "Uncontained")
    for _ in range(10_000):
        ledger.record(event)
    ledger.save(force=True)
    [agg] = XidLedger(store).entries()
    assert (agg.xid, agg.count) == (95, 10_000)


def test_a_full_ledger_keeps_every_gpu_and_its_worst_fault(tmp_path: Path) -> None:
    """Issue 26: 40 GPUs with XID 79 and then 14 ignored XIDs each overflow the ledger (512 entries); dropping the
    oldest entries first lost the XID 79s, so GPUs read healthy or vanished during the replay. Now the least severe
    entries of GPUs that have others go first."""
    store = Store(tmp_path)
    ledger = XidLedger(store)
    ledger.rank_by(lambda e: grade(e, XidSettings(), time.time()).status.severity)
    buses = [f"00aa:{i:02x}:00" for i in range(40)]
    for bus in buses:
        ledger.record(XidEvent(79, bus, "fallen off the bus"))
    for xid in (14, 37, 38, 43, 44, 63, 66, 67, 92, 93, 106, 107, 108, 121):
        for bus in buses:
            ledger.record(XidEvent(xid, bus, "noise", pid=1))
    assert ledger.evicted == 40 * 15 - 512
    kept = ledger.entries()
    assert len(kept) == 512
    assert sorted(e.bus_id for e in kept if e.xid == 79) == buses
    ledger.save(force=True)
    reloaded = XidLedger(store)  # entries read back unranked are ranked when the next eviction needs them
    reloaded.rank_by(lambda e: grade(e, XidSettings(), time.time()).status.severity)
    reloaded.record(XidEvent(13, "00ab:00:00", "a new GPU"))
    assert {e.bus_id for e in reloaded.entries() if e.xid == 79} == set(buses)
    assert any(e.bus_id == "00ab:00:00" for e in reloaded.entries())


def test_a_cleared_gpu_records_only_what_comes_after_the_clear(tmp_path: Path) -> None:
    store = Store(tmp_path)
    ledger = XidLedger(store)
    ledger.record(XidEvent(79, "0000:3b:00", "off the bus", seq=10, usec=1_000))
    ledger.record(XidEvent(79, "0000:5e:00", "off the bus", seq=11, usec=1_100))
    assert ledger.forget("xid", "0000:3b:00", LogPoint(seq=20, usec=2_000)) == 1
    assert ledger.record(XidEvent(79, "0000:3b:00", "off the bus", seq=10, usec=1_000)) is None  # replayed
    assert ledger.record(XidEvent(79, "0000:3b:00", "from the journal", usec=1_500)) is None
    ledger.save(force=True)
    again = XidLedger(store)  # the clear holds after a restart on the same boot
    assert [e.bus_id for e in again.entries()] == ["0000:5e:00"]
    assert again.record(XidEvent(79, "0000:3b:00", "off the bus", seq=12, usec=1_200)) is None
    recorded = again.record(XidEvent(48, "0000:3b:00", "DBE", seq=21, usec=2_100))
    assert recorded is not None and recorded[1]


# real /dev/kmsg ------------------------------------------------------------------------------------
def test_follower_sees_records_within_milliseconds(kmsg: Any, tmp_path: Path) -> None:
    seen: list[tuple[float, KernelRecord]] = []
    follower = KmsgFollower(lambda r: seen.append((time.time(), r)), Store(tmp_path))
    follower.start()
    try:
        wait_until(lambda: follower.running, 5)
        wait_until(lambda: not seen or time.time() - seen[-1][0] > 0.3, 10)  # the backlog is read
        tag = f"trainguard-test {time.time_ns()}"
        latencies = []
        for _ in range(5):
            written = kmsg.write(tag)
            wait_until(lambda: any(r.message == tag for _, r in seen[-50:]), 2)
            latencies.append(max(t for t, r in seen if r.message == tag) - written)
            seen.clear()
        assert max(latencies) < 0.5, latencies
        assert follower.source == "kmsg"
    finally:
        follower.stop()


def test_restart_resumes_after_the_last_record(kmsg: Any, tmp_path: Path) -> None:
    store = Store(tmp_path)
    tag = f"trainguard-test-resume {time.time_ns()}"
    first: list[str] = []
    a = KmsgFollower(lambda r: first.append(r.message), store)
    a.start()
    kmsg.write(f"{tag} before")
    wait_until(lambda: f"{tag} before" in first, 5)
    a.stop()
    kmsg.write(f"{tag} while down")
    second: list[str] = []
    b = KmsgFollower(lambda r: second.append(r.message), store)
    b.start()
    kmsg.write(f"{tag} after")
    wait_until(lambda: f"{tag} after" in second, 5)
    b.stop()
    mine = [m for m in second if m.startswith(tag)]
    assert mine == [f"{tag} while down", f"{tag} after"]  # none missed, none repeated


def test_overrun_counts_lost_records_and_continues(kmsg: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    got: list[str] = []

    def slow(record: KernelRecord) -> None:  # a reader far slower than the writer: overrun again and again
        time.sleep(0.001)
        got.append(record.message)

    follower = KmsgFollower(slow, Store(tmp_path))
    follower.start()
    wait_until(lambda: follower.running, 5)
    tag = f"trainguard-test-flood {time.time_ns()}"
    for i in range(20_000):  # far more than the ring buffer holds
        kmsg.write(f"{tag} {i:05d} " + "x" * 150, prio=6)
    kmsg.write(f"{tag} end")
    wait_until(lambda: f"{tag} end" in got, 30)
    follower.stop()
    assert follower.lost > 0
    assert follower.records + follower.lost >= 20_000
    warnings = [r for r in caplog.records if r.getMessage() == "kernel log records lost (reader overrun)"]
    assert len(warnings) == 1, f"{len(warnings)} lines: an overrun logs one line per interval, not one per gap"


def _xid_engine(tmp_path: Path, **check: Any) -> Engine:
    raw = {"agent": {"state_dir": str(tmp_path / "state"), "node_name": "node1", "listen": ""},
           "jobs": {"sources": []},
           "checks": {"xid": {"actions": {"critical": []}, **check}}, "notifiers": {"console": {}}}
    return Engine(parse_config(raw, "t.toml"))


def test_xid_to_incident_fast_and_three_record_form(kmsg: Any, tmp_path: Path) -> None:
    engine = _xid_engine(tmp_path)
    engine.start()
    try:
        bus = unique_bus()
        written = kmsg.write(xid79(bus))
        wait_until(lambda: any(i.subject == f"pci:{bus}" and i.firing for i in engine.tracker.incidents()), 5)
        [incident] = [i for i in engine.tracker.incidents() if i.subject == f"pci:{bus}"]
        assert incident.fired_at is not None and incident.fired_at - written < 1.0
        assert incident.status is Status.CRITICAL and "fell off the bus (XID 79)" in incident.summary

        other = unique_bus()
        kmsg.write(f"NVRM: The NVIDIA GPU {other}.0")
        kmsg.write("NVRM: (PCI ID: 10de:26b5) installed in this system has")
        kmsg.write("NVRM: fallen off the bus and is not responding to commands.")
        wait_until(lambda: any(i.subject == f"pci:{other}" and i.firing for i in engine.tracker.incidents()), 5)
    finally:
        engine.stop()


def test_flood_of_100k_identical_lines_is_one_incident(kmsg: Any, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="trainguard.engine")
    engine = _xid_engine(tmp_path)
    engine.start()
    endpoint = HttpEndpoint(engine, "127.0.0.1", 0)
    endpoint.start()
    try:
        bus = unique_bus()
        line = f"NVRM: Xid (PCI:{bus}): 95, pid=1, name=python, Uncontained: FBHUB. [trainguard-test]"
        for _ in range(100_000):
            kmsg.write(line)
            if _ % 20_000 == 0:
                assert requests.get(f"http://127.0.0.1:{endpoint.address[1]}/metrics", timeout=5).status_code == 200
        xid = engine.checks["xid"]
        assert isinstance(xid, XidCheck)

        def counted() -> int:
            mine = [e.count for e in xid.ledger.entries() if e.bus_id == bus]
            return mine[0] if mine else 0

        wait_until(lambda: counted() + xid.follower.lost >= 100_000, 60, what="the flood to be read")
        before = counted()  # the follower may still be counting the last lines while the check runs
        engine.run_check("xid")
        after = counted()
        mine = [i for i in engine.tracker.incidents() if i.subject == f"pci:{bus}"]
        assert len(mine) == 1 and mine[0].firing
        shown = re.search(r" x(\d+):", mine[0].summary)  # one incident, carrying the count
        assert shown is not None and before <= int(shown.group(1)) <= after, (before, mine[0].summary, after)
        events = [r.__dict__["kv"] for r in caplog.records if r.getMessage() == "incident event"]
        assert [e["event"] for e in events if e["subject"] == f"pci:{bus}"] == ["fired"]
        metrics = requests.get(f"http://127.0.0.1:{endpoint.address[1]}/metrics", timeout=5).text
        assert f'trainguard_gpu_xid_errors_total{{bus_id="{bus}",gpu="",uuid="",xid="95"}}' in metrics
    finally:
        endpoint.stop()
        engine.stop()


def test_journal_fallback_with_persisted_cursor(tmp_path: Path) -> None:
    fake = tmp_path / "journalctl"
    args_log = tmp_path / "args"
    fake.write_text(f"""#!/bin/sh
echo "$@" >> {args_log}
printf '%s\\n' '{{"MESSAGE": "NVRM: Xid (PCI:0000:05:00): 79, off the bus.", "__CURSOR": "s=1;i=7", "PRIORITY": "3"}}'
sleep 30
""")
    fake.chmod(0o755)
    store = Store(tmp_path)
    got: list[str] = []
    follower = KmsgFollower(lambda r: got.append(r.message), store, path=str(tmp_path / "no-kmsg"), journalctl=str(fake),
                            save_every_s=0)
    follower.start()
    wait_until(lambda: got, 5)
    follower.stop()
    assert follower.source == "journal"
    assert "-k -f -o json --no-pager -b --lines=all" in args_log.read_text()
    again = KmsgFollower(lambda r: None, store, path=str(tmp_path / "no-kmsg"), journalctl=str(fake))
    again.start()
    wait_until(lambda: args_log.read_text().count("\n") == 2, 5)
    again.stop()
    assert "--after-cursor=s=1;i=7" in args_log.read_text().splitlines()[1]


def test_no_kernel_log_source_is_unknown(tmp_path: Path) -> None:
    check = XidCheck("xid", XidSettings(kmsg_path=str(tmp_path / "none"), journalctl=str(tmp_path / "nojournal")),
                     CheckContext("n", tmp_path, state=ScopedState(Store(None), "check/xid")))
    check.start(lambda: None)
    wait_until(lambda: check.follower.error is not None, 5)
    [result] = check.run()
    assert result.status is Status.UNKNOWN
    assert result.summary.startswith("kernel log follower not running: kernel log unavailable")
    check.stop()


def test_a_kernel_log_that_is_a_plain_file_is_read_as_lines_and_never_followed(tmp_path: Path) -> None:
    """`kmsg_path` pointing at a regular file (a saved copy of the log, a mistake): the one-shot read spun on the
    empty reads for ever (a health check that never returns), and took one record per 16 KiB read (the device gives
    one a read). Read as lines now; following it is refused (it is always readable and never waits) for the journal."""
    path = tmp_path / "kmsg"
    path.write_bytes(b"")
    seen: list[KernelRecord] = []
    assert KmsgFollower(seen.append, path=str(path)).read_once() == 0
    path.write_bytes(b"4,17,5000000,-;NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.\n"
                     b" SUBSYSTEM=pci\n"
                     b"4,18,6000000,-;NVRM: Xid (PCI:0000:5e:00): 48, DBE (double bit error).\n")
    assert KmsgFollower(seen.append, path=str(path)).read_once() == 2
    assert [r.seq for r in seen] == [17, 18] and "0000:5e:00" in seen[1].message
    assert newest_seq(str(path)) == 18

    follower = KmsgFollower(seen.append, path=str(path), journalctl=str(tmp_path / "nojournal"))
    follower.start()
    try:
        wait_until(lambda: follower.error is not None, 5, what="the follower to refuse the file and give up")
        assert follower.records == 0 and follower.source != "kmsg"
    finally:
        follower.stop()
