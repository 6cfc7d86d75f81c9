"""The kernel event catalog on real lines: each fixture (tests/data/kernel/fixtures.toml, with its source) through the
parser in every prefix form users paste; benign look-alikes quiet; a block of lines is one event; the parse bounded."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import tomllib

from trainguard.core.model import Status
from trainguard.node.kernel_events import KernelEventParser, catalog
from trainguard.node.kmsg import strip_prefix

FIXTURES = tomllib.loads((Path(__file__).parent / "data/kernel/fixtures.toml").read_text())["fixture"]

# The forms of one kernel line as tools print it (the kernel's text goes in {}).
FORMS = {
    "kmsg": "4,1234,5678901,-;{}",
    "dmesg": "[  123.456789] {}",
    "dmesg -T": "[Sun Nov 29 06:46:19 2026] {}",
    "dmesg -H": "[  +0.000123] {}",
    "dmesg iso": "2026-11-29T06:46:19,123456+00:00 {}",
    "dmesg -x": "kern  :warn  : [  123.456789] {}",
    "syslog": "Nov 29 06:46:19 gpu-node-17 kernel: [  123.456789] {}",
    "journalctl -k": "Nov 29 06:46:19 gpu-node-17 kernel: {}",
    "bare": "{}",
}


def lines_of(text: str) -> list[str]:
    """A pasted excerpt as records: an indented line without a prefix continues the record before it (dmesg prints a
    record of several lines so)."""
    records: list[str] = []
    for line in text.splitlines():
        if records and line[:1].isspace() and strip_prefix(line) == line.strip():
            records[-1] += "\n" + line
        else:
            records.append(line)
    return records


def events_of(text: str, form: str = "{}") -> list[Any]:
    parser = KernelEventParser()
    found = []
    for record in lines_of(text):
        found += parser.feed(form.format(strip_prefix(record)) if form != "{}" else record)
    return found


def check(fixture: dict[str, Any], form: str) -> str:
    """What is wrong with the events of one fixture in one prefix form ("" when nothing)."""
    found = events_of(fixture["text"], FORMS[form])
    if not fixture["class"]:
        return f"a benign line made {found}" if found else ""
    # `Skipped N previous similar messages` after the report adds N to its event
    events = [e for e in found if not e.repeat]
    repeats = sum(e.count for e in found if e.repeat and e.klass == fixture["class"])
    if not events or events[-1].klass != fixture["class"]:
        return f"made {found}"
    # one event per report; a later line of it that grades it higher (an MCE's UC status after `Machine check
    # events logged`) reports it again, higher
    if len(events) > 1 and events[-1].cls.severity.severity <= events[0].cls.severity.severity:
        return f"one report made {len(events)} events: {events}"
    if repeats != fixture.get("repeats", 0):
        return f"Skipped N counted {repeats}, not {fixture.get('repeats', 0)}"
    wrong = {k: (events[-1].names.get(k), v) for k, v in fixture.get("names", {}).items() if events[-1].names.get(k) != v}
    return f"names (found, expected): {wrong}" if wrong else ""


@pytest.mark.parametrize("fixture", FIXTURES, ids=[f"{i}-{f['class'] or 'quiet'}" for i, f in enumerate(FIXTURES)])
def test_each_real_line_in_each_prefix_form(fixture: dict[str, Any]) -> None:
    """One case per fixture, every prefix form inside it (a case per form cost 800 cases of pytest overhead)."""
    assert fixture["source"].startswith(("https://", "http://"))
    failures = {form: why for form in FORMS if (why := check(fixture, form))}
    assert not failures, f"{fixture['text']!r}: " + "; ".join(f"[{form}] {why}" for form, why in failures.items())


def test_every_class_that_reports_has_a_real_fixture_or_is_listed_as_lacking_one() -> None:
    covered = {f["class"] for f in FIXTURES}
    reporting = {c.name for c in catalog().values() if c.role in ("event", "clear") and c.pattern is not None}
    # No real line found yet (docs/kernel-events.md says so): matched from the kernel's format strings only.
    lacking = {"lustre_evicted"}
    assert reporting - covered == lacking


def test_the_catalog_is_complete_data() -> None:
    for c in catalog().values():
        assert c.lever and c.title and c.kind
        if c.role == "event" and c.pattern is not None:
            assert c.severity in (Status.WARNING, Status.CRITICAL), c.name
            assert c.needles, c.name
        assert not c.node_fault or c.severity is Status.CRITICAL, c.name


def test_mce_status_decides_corrected_from_uncorrected() -> None:
    # MCi_STATUS 0xbe... has UC (bit 61) set, 0x8c... does not
    uc = KernelEventParser().feed("mce: [Hardware Error]: CPU 0: Machine Check Exception: 5 Bank 4: be00000000800400")
    ce = KernelEventParser().feed("EDAC sbridge MC1: CPU 1: Machine Check Event: 0 Bank 11: 8c00004f000800c2")
    assert [e.klass for e in uc + ce] == ["mce_uncorrected", "mce_corrected"]


def test_a_report_is_one_event_and_the_next_report_another() -> None:
    aer = ["pcieport 0000:00:1c.5: AER: Corrected error received: 0000:00:1c.5",
           "pcieport 0000:00:1c.5: AER: PCIe Bus Error: severity=Corrected, type=Physical Layer, (Receiver ID)",
           "pcieport 0000:00:1c.5: AER:   device [8086:9d15] error status/mask=00000001/00002000"]
    parser = KernelEventParser()
    events = [e for usec in (1_000_000, 1_000_100) for line in aer for e in parser.feed(line, usec)]
    assert [(e.klass, e.subject) for e in events] == [("aer_corrected", "pci:0000:00:1c.5")] * 2


def test_skipped_n_adds_to_the_last_lustre_event() -> None:
    parser = KernelEventParser()
    first = parser.feed("LNet: 2431:0:(o2iblnd_cb.c:3174:kiblnd_check_conns()) Timed out tx for 172.31.126.87@o2ib: "
                        "403055 seconds")
    skipped = parser.feed("LNet: 2431:0:(o2iblnd_cb.c:3174:kiblnd_check_conns()) Skipped 24 previous similar messages")
    assert [(e.klass, e.count, e.repeat) for e in first + skipped] == [("lnet_timeout", 1, False),
                                                                        ("lnet_timeout", 24, True)]


def test_a_hostile_record_is_bounded() -> None:
    parser = KernelEventParser()
    huge = "nfs: server " + "a" * (1 << 20) + " not responding, still trying"
    start = time.process_time()
    events = parser.feed(huge) + parser.feed("x" * (1 << 20)) + parser.feed("blocked for more than " * 50000)
    assert time.process_time() - start < 1.0  # the explicit bound of the issue: a 1 MiB record costs like a line
    assert all(len(e.line) <= 512 and all(len(v) <= 128 for v in e.names.values()) for e in events)


def test_the_kernel_events_page_table_is_the_catalogs() -> None:
    from trainguard.reference import KERNEL_BEGIN, KERNEL_END, kernel_markdown

    text = (Path(__file__).parent.parent / "docs/kernel-events.md").read_text()
    table = text[text.index(KERNEL_BEGIN):text.index(KERNEL_END) + len(KERNEL_END)] + "\n"
    assert table == kernel_markdown(), "docs/kernel-events.md's table drifted: paste `trainguard kernel --markdown`"


@pytest.mark.parametrize("form", FORMS)
def test_xids_are_read_in_every_prefix_form_through_the_same_stripper(form: str) -> None:
    from trainguard.gpu.xid import XidParser

    line = "NVRM: Xid (PCI:0000:02:00): 79, GPU has fallen off the bus."  # wilicc/gpu-burn#1
    event = XidParser().feed(FORMS[form].format(line))
    assert event is not None and (event.xid, event.bus_id) == (79, "0000:02:00")
