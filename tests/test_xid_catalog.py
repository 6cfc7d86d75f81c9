"""NVIDIA's XID catalog as package data: held to the reference copies, every code and bucket given a response, the
NVLink5 decode on real lines, every XID format graded by its bucket, `trainguard xid`, and the kernel log path."""

from __future__ import annotations

import csv
import io
import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, unique_bus, wait_until
from tests.test_xid import MATCHING, _xid_engine
from trainguard.checks.xid import XidSettings, grade
from trainguard.cli import main
from trainguard.core.model import Status
from trainguard.gpu.faults import XidEntry
from trainguard.gpu.xid import XidParser
from trainguard.gpu.xid_catalog import (
    CATALOG_FILE,
    NVLINK5_FILE,
    catalog,
    decode_nvlink5,
    describe,
    nvlink5_rules,
    parse_nvlink5,
    policy,
)

DATA = REPO / "tests" / "data" / "nvidia"


def package_text(name: str) -> str:
    return resources.files("trainguard.gpu").joinpath(name).read_text(encoding="utf-8")


@pytest.mark.parametrize(("shipped", "reference"), [(CATALOG_FILE, "xid-catalog.tsv"),
                                                    (NVLINK5_FILE, "xid-nvlink5-decode.tsv")])
def test_package_data_is_nvidias_table_verbatim(shipped: str, reference: str) -> None:
    assert package_text(shipped) == (DATA / reference).read_text(encoding="utf-8"), \
        f"trainguard/gpu/{shipped} drifted from NVIDIA's table (tests/data/nvidia/{reference})"


def test_all_172_codes_known_each_with_a_response() -> None:
    rows = list(csv.DictReader(io.StringIO((DATA / "xid-catalog.tsv").read_text()), delimiter="\t"))
    assert [int(r["xid"]) for r in rows] == list(range(1, 173))
    cat = catalog()
    assert sorted(cat) == list(range(1, 173))
    p = policy()
    for row in rows:
        info = cat[int(row["xid"])]
        assert (info.mnemonic, info.description, info.immediate) == (row["mnemonic"].strip(), row["description"].strip(),
                                                                    row["immediate_resolution"].strip())
        assert info.response in p.responses, info
        if not info.immediate:  # NVIDIA gives no bucket: trainguard's own choice, written down with its reason
            assert info.xid in p.overrides and info.why, f"XID {info.xid}: no bucket and no documented response"


def test_every_bucket_nvidia_uses_is_mapped_and_every_difference_says_why() -> None:
    p = policy()
    buckets = {i.immediate for i in catalog().values() if i.immediate}
    assert buckets <= set(p.buckets), f"buckets without a response: {sorted(buckets - set(p.buckets))}"
    for name, (response, why) in {**p.buckets, **{str(x): v for x, v in p.overrides.items()}, **p.nvlink5}.items():
        assert response in p.responses, name
        if (name.startswith("WORKFLOW_") and response != "nvlink5") or name.isdigit() or name.startswith("undecoded"):
            assert len(why.split()) >= 6, f"{name}: a deliberate reading of NVIDIA's catalog needs its reason"
    # the buckets that name an action map to that action, not to a judgement
    assert {b: p.buckets[b][0] for b in ("RESET_GPU", "RESTART_BM", "RESTART_APP", "IGNORE", "XID_154")} == {
        "RESET_GPU": "reset_gpu", "RESTART_BM": "reboot_node", "RESTART_APP": "restart_app", "IGNORE": "ignore",
        "XID_154": "recovery_action"}
    assert p.responses["reset_gpu"].status is Status.CRITICAL and p.responses["reset_gpu"].sticky
    assert p.responses["reboot_node"].status is Status.CRITICAL and p.responses["reboot_node"].sticky
    assert p.responses["restart_app"].status is Status.WARNING and not p.responses["restart_app"].sticky
    assert p.responses["ignore"].status is Status.OK


def test_nvlink5_decode_table_rows_are_all_loaded() -> None:
    rows = list(csv.DictReader(io.StringIO((DATA / "xid-nvlink5-decode.tsv").read_text()), delimiter="\t"))
    assert sum(len(r) for r in nvlink5_rules().values()) == len(rows) == 91
    assert set(nvlink5_rules()) == set(range(144, 151))


# Real kernel log lines of XIDs 144-150, as quoted (kmsg input) in leptonai/gpud pull requests #1160 and #1174
# (github.com/leptonai/gpud/pull/1160, /pull/1174), with the row of NVIDIA's decode sheet each selects.
NVLINK5_LINES = [
    ("NVRM: Xid (PCI:0000:01:00): 144, SAW_MVB Nonfatal XC0 i0 Link 0 (0x00000001 0x00000008 0x00000000 0x00000000 "
     "0x00000000 0x00000000)", "SAW_MVB", "IGNORE", Status.OK),
    ("NVRM: Xid (PCI:0000:00:00): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 00 (0x026001c6 0x00000000 0x00000000 "
     "0x00000000 0x00000000 0x00000000)", "NETIR_LINK_EVT/NETIR_LINK_DOWN", "IGNORE", Status.OK),
    ("NVRM: Xid (PCI:0000:00:00): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 00 (0x025001c6 0x00000000 0x00000000 "
     "0x00000000 0x00000000 0x00000000)", "NETIR_LINK_EVT/NETIR_LINK_DOWN", "RESET_GPU", Status.CRITICAL),
    ("NVRM: Xid (PCI:0019:01:00): 149, NETIR Fatal XC0 i0 Link -1 (0x000fe406 0x00000000 0x00000000 0x00000000 "
     "0x00000000 0x00000000)", "NETIR/NETIR_INT", "RESET_GPU", Status.CRITICAL),
    ("NVRM: Xid (PCI:0018:01:00): 145, RLW_RXPIPE Nonfatal XC0 i0 Link 13 (0x0409a0c2 0x00000008 0x00000001 "
     "0x00000000 0x00100000 0x00000004)", "RLW_RXPIPE", "IGNORE", Status.OK),
]


@pytest.mark.parametrize(("line", "unit", "resolution", "status"), NVLINK5_LINES)
def test_nvlink5_lines_decode_by_intrinfo_and_error_status(line: str, unit: str, resolution: str, status: Status) -> None:
    event = XidParser().feed(line)
    assert event is not None and event.variant == resolution
    rule = decode_nvlink5(event.xid, parse_nvlink5(event.text))
    assert rule is not None and (rule.unit, rule.resolution) == (unit, resolution)
    entry = XidEntry(event.bus_id, event.xid, 1, 1000.0, 1000.0, event.text, variant=event.variant)
    assert grade(entry, XidSettings(), 1001.0).status is status


def test_nvlink5_status_bits_and_undecodable_events() -> None:
    # RLW_REMAP (XID 145, intrinfo ...0010000010): status bits 0x100 (IGNORE) and 0x40 (RESET_GPU) together
    both = parse_nvlink5("RLW_REMAP Nonfatal XC0 i0 Link 2 (0x00000082 0x00000140 0x0 0x0 0x0 0x0)")
    rule = decode_nvlink5(145, both)
    assert rule is not None and rule.resolution == "RESET_GPU"  # the most severe of the rows its bits select
    for text, verdict, status in [
        ("NEWUNIT Fatal XC0 i0 Link 4 (0x3ff00fff 0x00000001 0x0 0x0 0x0 0x0)", "undecoded_fatal", Status.CRITICAL),
        ("NEWUNIT Nonfatal XC0 i0 Link 4 (0x3ff00fff 0x00000001 0x0 0x0 0x0 0x0)", "undecoded_nonfatal", Status.WARNING),
        ("garbage without registers", "undecoded_fatal", Status.CRITICAL),
    ]:
        event = XidParser().feed(f"NVRM: Xid (PCI:0000:07:00): 146, {text}")
        assert event is not None and event.variant == verdict
        g = grade(XidEntry(event.bus_id, 146, 1, 1000.0, 1000.0, event.text, variant=event.variant), XidSettings(),
                  1001.0)
        assert g.status is status and "no decode row" in g.why


@pytest.mark.parametrize(("line", "xid", "bus", "pid", "process"), MATCHING)
def test_every_xid_format_is_graded_by_nvidias_bucket(line: str, xid: int, bus: str, pid: int | None,
                                                      process: str | None) -> None:
    event = XidParser().feed(line)
    assert event is not None
    entry = XidEntry(event.bus_id, event.xid, 1, 1000.0, 1000.0, event.text, pid=event.pid, cause_xid=event.cause_xid,
                     recovery=event.recovery, pids=[event.pid] if event.pid else [], bursts=0 if event.pid else 1)
    g = grade(entry, XidSettings(), 1001.0)
    info = describe(xid)
    assert g.response == info.response
    assert g.status is policy().responses[info.response].status
    assert g.why.startswith(f"NVIDIA {info.immediate}")


def test_xid_154_recovery_formats() -> None:
    p = XidParser()
    stated = p.feed("NVRM: Xid (PCI:0000:02:00): 154, Node Reboot Required")
    assert stated is not None and stated.recovery == "Node Reboot Required"
    changed = p.feed("NVRM: Xid (PCI:0000:02:00): 154, GPU recovery action changed from 0x0 (None) to 0x3 (Drain P2P)")
    assert changed is not None and changed.recovery == "Drain P2P"


def test_a_second_job_on_one_gpu_escalates_but_one_faults_many_lines_do_not(tmp_path: Path) -> None:
    from trainguard.gpu.faults import XidLedger
    from trainguard.gpu.xid import XidEvent

    now = [1000.0]
    ledger = XidLedger(None, clock=lambda: now[0])
    s = XidSettings()
    for _ in range(5):  # one crashing process prints XID 13 once per SM
        entry, _changed = ledger.record(XidEvent(13, "0000:3b:00", "Graphics SM Warp Exception", pid=4242))
    assert (entry.count, entry.occurrences, grade(entry, s, now[0]).status) == (5, 1, Status.WARNING)
    now[0] += 3600  # the requeued job, another process, hits it again on the same GPU
    entry, changed = ledger.record(XidEvent(13, "0000:3b:00", "Graphics SM Warp Exception", pid=5151))
    assert changed and entry.occurrences == 2
    g = grade(entry, s, now[0])
    assert g.status is Status.CRITICAL and g.why.startswith("hardware suspect: 2 jobs hit it on this GPU")


def test_trainguard_xid_command(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = tmp_path / "t.toml"
    config.write_text(f"[agent]\nstate_dir = '{tmp_path}'\n[checks.xid]\nhardware = [13]\n"
                      "actions = { critical = ['drain'] }\n")
    assert main(["xid", "79", "13", "149", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "XID 79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS" in out
    assert "immediate RESTART_BM, investigatory CONTACT_SUPPORT" in out
    assert "reboot_node (NVIDIA RESTART_BM): CRITICAL until the node reboots" in out
    assert "reset_gpu (hardware by configuration): CRITICAL until the node reboots" in out  # XID 13, overridden
    assert "decode      RESET_GPU: reset_gpu (CRITICAL), 24 table rows" in out
    assert out.count("actions     drain ([checks.xid])") == 3
    assert main(["xid", "--json", "--config", str(config)]) == 0
    data: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert len(data["xids"]) == 172 and data["config"] == "[checks.xid]"
    by_xid = {e["xid"]: e for e in data["xids"]}
    assert by_xid[63]["response"] == "ignore" and by_xid[63]["actions"] == []
    assert by_xid[48]["why"].startswith("NVIDIA's XID 48 workflow")
    assert main(["xid", "--config", str(config)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["XID", "RESPONSE", "NVIDIA-IMMEDIATE", "MNEMONIC"] and len(table) == 1 + 172 + 2


# real /dev/kmsg ------------------------------------------------------------------------------------------------------
def test_nvidia_buckets_through_the_kernel_log(kmsg: Any, tmp_path: Path) -> None:
    """Real-format lines written to /dev/kmsg: RESET_GPU codes and a fatal NVLink5 decode fire CRITICAL within the
    second; an IGNORE-bucket XID and a non-fatal NVLink5 event are counted but open nothing."""
    engine = _xid_engine(tmp_path)
    engine.start()
    try:
        fatal, reset, quiet = unique_bus(), unique_bus(), unique_bus()
        kmsg.write(f"NVRM: Xid (PCI:{fatal}): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 00 (0x025001c6 0x00000000 "
                   "0x00000000 0x00000000 0x00000000 0x00000000)")
        kmsg.write(f"NVRM: Xid (PCI:{reset}): 46, pid='<unknown>', name=<unknown>, GPU stopped processing")
        kmsg.write(f"NVRM: Xid (PCI:{quiet}): 63, pid=1896, Row Remapper: New row marked for remapping, reset gpu to "
                   "activate.")
        kmsg.write(f"NVRM: Xid (PCI:{quiet}): 144, SAW_MVB Nonfatal XC0 i0 Link 0 (0x00000001 0x00000008 0x00000000 "
                   "0x00000000 0x00000000 0x00000000)")

        def firing(bus: str) -> bool:
            return any(i.subject == f"pci:{bus}" and i.firing for i in engine.tracker.incidents())

        wait_until(lambda: firing(fatal) and firing(reset), 5, what="CRITICAL incidents for the RESET_GPU XIDs")
        by_subject = {i.subject: i for i in engine.tracker.incidents()}
        assert by_subject[f"pci:{fatal}"].status is Status.CRITICAL
        assert "NVLink5 NETIR_LINK_EVT/NETIR_LINK_DOWN: NVIDIA RESET_GPU" in by_subject[f"pci:{fatal}"].summary
        assert "NVIDIA RESET_GPU" in by_subject[f"pci:{reset}"].summary
        engine.run_check("xid")
        assert f"pci:{quiet}" not in {i.subject for i in engine.tracker.incidents()}
        last = engine.snapshot().checks["xid"].last
        assert last is not None
        [quiet_result] = [r for r in last.results if r.subject == f"pci:{quiet}"]
        assert quiet_result.status is Status.OK and quiet_result.summary.endswith("no active XID (2 recorded)")
        counted = {s.labels["xid"]: s.value for s in quiet_result.samples if s.name == "trainguard_gpu_xid_errors_total"}
        assert counted == {"63": 1, "144": 1}
    finally:
        engine.stop()


def test_the_package_data_ships_in_the_wheel_manifest() -> None:
    text = (REPO / "pyproject.toml").read_text()
    assert '"gpu/*.tsv"' in text and '"gpu/*.toml"' in text
    assert sys.modules["trainguard.gpu.xid_catalog"].POLICY_FILE == "xid_policy.toml"
