"""The infiniband check on a real /sys/class/infiniband (an H100 host with NDR HCAs), copied into a temporary
directory and edited the way faults change it: a port DOWN/Polling, a rate that fell to 200 Gb/sec, link_downed
growing, symbol errors over their limit, counters reset by a driver reload or wrapping, an HCA gone."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.conftest import REPO
from tests.test_gpu import Clock
from trainguard.agent.configfile import parse_config
from trainguard.agent.http import HttpEndpoint
from trainguard.checks.base import CheckContext
from trainguard.checks.infiniband import InfinibandCheck, InfinibandSettings
from trainguard.core.model import Result, Status
from trainguard.core.state import ScopedState
from trainguard.pipeline.engine import Engine
from trainguard.pipeline.runner import CheckRunner
from trainguard.pipeline.store import Store

REAL_TREE = REPO / "tests" / "data" / "infiniband" / "sys-class-infiniband-h100"


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "infiniband"
    shutil.copytree(REAL_TREE, root)
    for path in root.rglob("*"):  # the reference copy is read-only; this one is ours to break
        path.chmod(0o755 if path.is_dir() else 0o644)
    return root


def write(root: Path, port: str, name: str, value: str) -> None:
    device, number = port.split("/")
    (root / device / "ports" / number / name).write_text(value + "\n")


def check(root: Path, clock: Clock | None = None, store: Store | None = None, **settings: Any) -> InfinibandCheck:
    ctx = CheckContext("node1", root.parent, clock or Clock(), state=ScopedState(store, "check/infiniband"))
    return InfinibandCheck("infiniband", InfinibandSettings.model_validate({"sysfs_root": str(root), **settings}), ctx)


def by_subject(results: Any) -> dict[str, Result]:
    return {r.subject: r for r in results}


def test_the_real_tree_is_healthy(tree: Path) -> None:
    results = by_subject(check(tree).run())
    assert len(results) == 9 + 1 and all(r.status is Status.OK for r in results.values())
    assert results["mlx5_0/1"].summary == "mlx5_0/1 InfiniBand: 400 Gb/sec (4X NDR)"
    assert results["mlx5_bond_0/1"].summary == "mlx5_bond_0/1 Ethernet: 200 Gb/sec (2X NDR)"
    assert results["ports"].summary == "9 of 9 InfiniBand/RoCE ports up (9 seen up on this node)"
    # mlx5_1's real link_downed is 255: the 8-bit counter is saturated, which is said, not alerted on
    assert "link_downed saturated at 255" in results["mlx5_1/1"].summary
    samples = {(s.name, s.labels.get("counter")): s.value for s in results["mlx5_0/1"].samples}
    assert samples[("trainguard_infiniband_port_rate_bytes_per_second", None)] == 400e9 / 8
    assert samples[("trainguard_infiniband_port_errors_total", "port_rcv_errors")] == 14
    assert samples[("trainguard_infiniband_port_up", None)] == 1


def test_a_port_that_was_up_goes_down(tree: Path, tmp_path: Path) -> None:
    store = Store(tmp_path / "state")
    check(tree, store=store).run()
    write(tree, "mlx5_4/1", "state", "1: DOWN")
    write(tree, "mlx5_4/1", "phys_state", "2: Polling")
    results = by_subject(check(tree, store=store).run())  # a restarted agent remembers the port was up
    assert results["mlx5_4/1"].status is Status.CRITICAL
    assert results["mlx5_4/1"].summary.startswith("mlx5_4/1 InfiniBand: DOWN (Polling), was up on this node")
    assert results["ports"].status is Status.CRITICAL and results["ports"].summary.startswith("8 of 9")


def test_a_port_never_up_and_not_expected_is_fine_unless_configured(tree: Path) -> None:
    write(tree, "mlx5_9/1", "state", "1: DOWN")
    write(tree, "mlx5_9/1", "phys_state", "3: Disabled")
    fresh = by_subject(check(tree).run())
    assert fresh["mlx5_9/1"].status is Status.OK and fresh["mlx5_9/1"].summary == "mlx5_9/1 InfiniBand: DOWN (Disabled)"
    configured = by_subject(check(tree, expected_ports=["mlx5_9/1"]).run())
    assert configured["mlx5_9/1"].status is Status.CRITICAL and "expected up" in configured["mlx5_9/1"].summary
    counted = by_subject(check(tree, expected_port_count=9).run())
    assert counted["ports"].status is Status.CRITICAL and counted["ports"].summary == \
        "8 of 9 InfiniBand/RoCE ports up (9 configured)"


def test_a_port_taken_out_of_service_on_purpose(tree: Path, tmp_path: Path) -> None:
    """The agent remembers the port was up; listing the ports that must be up replaces that memory."""
    store = Store(tmp_path / "state")
    check(tree, store=store).run()
    write(tree, "mlx5_9/1", "state", "1: DOWN")
    write(tree, "mlx5_9/1", "phys_state", "3: Disabled")
    assert by_subject(check(tree, store=store).run())["mlx5_9/1"].status is Status.CRITICAL
    others = [f"mlx5_{i}/1" for i in (0, 1, 4, 5, 6, 7, 8)] + ["mlx5_bond_0/1"]
    results = by_subject(check(tree, store=store, expected_ports=others).run())
    assert results["mlx5_9/1"].status is Status.OK
    assert results["ports"].status is Status.OK and results["ports"].summary == \
        "8 of 8 InfiniBand/RoCE ports up (8 configured)"


def test_a_rate_that_dropped_is_degraded(tree: Path) -> None:
    ib = check(tree)
    ib.run()
    write(tree, "mlx5_5/1", "rate", "200 Gb/sec (2X NDR)")
    result = by_subject(ib.run())["mlx5_5/1"]
    assert result.status is Status.WARNING
    assert result.summary == ("mlx5_5/1 InfiniBand: 200 Gb/sec (2X NDR), was 400 Gb/sec on this node: a degraded link "
                              "(lanes or speed lost); reseat or replace the cable")
    first_sight = by_subject(check(tree, expected_rate_gbps=400).run())["mlx5_5/1"]
    assert first_sight.status is Status.WARNING and "expected 400 Gb/sec" in first_sight.summary


def test_link_downed_growing_is_critical_then_clears(tree: Path) -> None:
    clock = Clock()
    ib = check(tree, clock, link_downed_for="1h")
    ib.run()
    write(tree, "mlx5_6/1", "counters/link_downed", "1")
    clock.now += 30
    result = by_subject(ib.run())["mlx5_6/1"]
    assert result.status is Status.CRITICAL
    assert "link went down 1x in the last 1h00m (link_downed)" in result.summary
    clock.now += 3601
    assert by_subject(ib.run())["mlx5_6/1"].status is Status.OK


def test_symbol_errors_over_their_limit_and_counter_resets(tree: Path) -> None:
    clock = Clock()
    ib = check(tree, clock)
    ib.run()
    write(tree, "mlx5_7/1", "counters/symbol_error", "100")
    clock.now += 600
    assert by_subject(ib.run())["mlx5_7/1"].status is Status.OK  # 100 in an hour: under the limit of 120
    write(tree, "mlx5_7/1", "counters/symbol_error", "30")  # driver reload: the counter restarted, 30 since
    clock.now += 600
    result = by_subject(ib.run())["mlx5_7/1"]
    assert result.status is Status.WARNING
    assert "symbol_error +130 in 1h00m (limit 120): a bad cable or transceiver" in result.summary
    write(tree, "mlx5_8/1", "counters/port_rcv_remote_physical_errors", "3")
    clock.now += 60
    assert "port_rcv_remote_physical_errors +3" in by_subject(ib.run())["mlx5_8/1"].summary


def test_a_counter_missing_from_one_read_keeps_its_window(tree: Path) -> None:
    clock = Clock()
    ib = check(tree, clock)
    write(tree, "mlx5_7/1", "counters/symbol_error", "0")
    ib.run()
    write(tree, "mlx5_7/1", "counters/symbol_error", "100")
    clock.now += 600
    assert by_subject(ib.run())["mlx5_7/1"].status is Status.OK  # 100 in an hour: under the limit of 120
    write(tree, "mlx5_7/1", "counters/symbol_error", "garbage")  # one read without it
    clock.now += 60
    assert "symbol_error" not in by_subject(ib.run())["mlx5_7/1"].details["counters"]
    write(tree, "mlx5_7/1", "counters/symbol_error", "130")
    clock.now += 60
    result = by_subject(ib.run())["mlx5_7/1"]
    assert result.status is Status.WARNING and "symbol_error +130 in 1h00m (limit 120)" in result.summary


def test_a_counter_taken_out_of_the_config_is_forgotten(tree: Path, tmp_path: Path) -> None:
    """Put back later, its reading from before would be a stale baseline: hours of growth as one burst."""
    store = Store(tmp_path / "state")
    first = check(tree, store=store)
    first.run()
    assert first.window.last("mlx5_7/1/symbol_error") is not None
    fewer = check(tree, store=store, error_limits={"port_rcv_errors": 100})
    fewer.run()
    assert fewer.window.last("mlx5_7/1/symbol_error") is None
    assert fewer.window.last("mlx5_7/1/port_rcv_errors") is not None
    store.close()


def test_a_wrapping_counter(tree: Path) -> None:
    clock = Clock()
    write(tree, "mlx5_0/1", "counters/port_rcv_errors", "65500")
    ib = check(tree, clock)
    ib.run()
    write(tree, "mlx5_0/1", "counters/port_rcv_errors", "70")  # a 16-bit counter that wrapped: +106, not +70
    clock.now += 60
    result = by_subject(ib.run())["mlx5_0/1"]
    assert result.status is Status.WARNING and "port_rcv_errors +106 in 1h00m (limit 100)" in result.summary


def test_a_saturated_counter_cleared_or_reloaded_is_no_link_down(tree: Path) -> None:
    """mlx5_1's real link_downed is 255, saturated: the summary says to clear it (perfquery -R), and a driver reload
    clears it too. Its fall to 0 is no link down (read as an 8-bit wrap it was +1: CRITICAL, and a drain)."""
    clock = Clock()
    ib = check(tree, clock)
    assert "link_downed saturated at 255" in by_subject(ib.run())["mlx5_1/1"].summary
    write(tree, "mlx5_1/1", "counters/link_downed", "0")
    clock.now += 60
    assert by_subject(ib.run())["mlx5_1/1"].status is Status.OK
    write(tree, "mlx5_1/1", "counters/link_downed", "1")  # a link down after the clear counts
    clock.now += 60
    result = by_subject(ib.run())["mlx5_1/1"]
    assert result.status is Status.CRITICAL and "link went down 1x" in result.summary, result.summary


def test_an_hca_that_vanished_and_idle_without_devices(tree: Path, tmp_path: Path) -> None:
    store = Store(tmp_path / "state")
    check(tree, store=store).run()
    shutil.rmtree(tree / "mlx5_9")
    results = by_subject(check(tree, store=store).run())
    assert results["mlx5_9/1"].status is Status.CRITICAL
    assert results["mlx5_9/1"].summary.startswith("mlx5_9/1: gone from")
    empty = tmp_path / "none"
    empty.mkdir()
    report = CheckRunner(check(empty)).run_once()
    assert (report.outcome, report.idle_reason) == ("idle", f"no InfiniBand or RoCE device under {empty}")
    missing = CheckRunner(check(tmp_path / "no-such-dir")).run_once()
    assert missing.outcome == "idle"


def test_garbage_in_sysfs_is_absent_not_fatal(tree: Path) -> None:
    write(tree, "mlx5_0/1", "rate", "fast")
    write(tree, "mlx5_0/1", "counters/symbol_error", "\x00\xff garbage")
    write(tree, "mlx5_0/1", "state", "")
    [result] = [r for r in check(tree).run() if r.subject == "mlx5_0/1"]
    assert result.status is Status.OK  # never seen up, not expected; nothing to read is not a crash
    assert "symbol_error" not in result.details["counters"]


def test_through_the_engine_to_an_incident_and_metrics(tree: Path, tmp_path: Path) -> None:
    raw = {"agent": {"state_dir": str(tmp_path / "state"), "node_name": "node1", "listen": ""},
           "jobs": {"sources": []}, "notifiers": {},
           "checks": {"infiniband": {"sysfs_root": str(tree), "actions": {"critical": []}}}}
    engine = Engine(parse_config(raw, "t.toml"), store=Store(tmp_path / "state"))
    endpoint = HttpEndpoint(engine, "127.0.0.1", 0)
    endpoint.start()
    try:
        engine.run_round()
        write(tree, "mlx5_1/1", "state", "1: DOWN")
        write(tree, "mlx5_1/1", "phys_state", "2: Polling")
        engine.run_round()
        firing = {(i.subject, i.status) for i in engine.tracker.incidents() if i.firing}
        assert firing == {("mlx5_1/1", Status.CRITICAL), ("ports", Status.CRITICAL)}
        text = requests.get(f"http://127.0.0.1:{endpoint.address[1]}/metrics", timeout=5).text
        for needle in ('trainguard_infiniband_port_up{device="mlx5_1",link_layer="InfiniBand",port="1"} 0.0',
                       'trainguard_infiniband_ports_up 8.0', 'trainguard_check_idle{check="infiniband"} 0.0',
                       'trainguard_infiniband_port_errors_total{counter="link_downed",device="mlx5_1",port="1"} 255.0'):
            assert needle in text, needle
    finally:
        endpoint.stop()
        engine.stop()
