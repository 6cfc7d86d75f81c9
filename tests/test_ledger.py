"""The node ledger (issue 50): faults, drains, resumes, reboots and repairs by hardware identity in the state
database, across an agent's restart and a reboot; a swapped GPU starts clean; the lemon rules hold the node drained
until an operator clears it, and `resume` refuses meanwhile; the state database's schema migrates forward and a newer
one is refused."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from trainguard.actions.diag import DiagReport
from trainguard.agent.configfile import parse_config
from trainguard.core.events import Event, EventKind
from trainguard.core.model import Result, Status
from trainguard.gpu import diagtools
from trainguard.gpu.nvml import Nvml
from trainguard.pipeline.engine import Engine
from trainguard.pipeline.incidents import Operator
from trainguard.pipeline.ledger import DAY, Component, Ledger, LedgerSettings, LemonRule, read_history, record_diag
from trainguard.pipeline.lemon import NAME as LEMON
from trainguard.pipeline.lemon import HoldGate
from trainguard.pipeline.store import SCHEMA_VERSION, SchemaTooNewError, Store

from .conftest import AgentProcess, wait_until
from .helpers.fake_nvml import FakeGpu, FakeNvml, NVMLError_ResetRequired, NVMLError_Unknown

ROOT = Path(__file__).resolve().parent.parent
BUS = b"00000000:18:00.0"

# A scripted scontrol and sinfo for one node, its state in a file beside them: `scontrol update` drains and resumes,
# `sinfo -o %N|%P|%T|%E` and `sinfo --Format=NODE_FORMAT` (jobs.slurm) print it as SLURM 22.05 does.
SCONTROL = """#!/bin/sh
state="$(dirname "$0")/node.state"
[ -f "$state" ] || printf 'IDLE\\n\\n' > "$state"
if [ "$1" = update ]; then
  case "$3" in
    state=drain) reason="${4#reason=}"; printf 'IDLE+DRAIN\\n%s\\n' "$reason" > "$state" ;;
    state=resume) printf 'IDLE\\n\\n' > "$state" ;;
  esac
  echo "$*" >> "$(dirname "$0")/calls"
  exit 0
fi
"""
SINFO = """#!/bin/sh
state="$(dirname "$0")/node.state"
[ -f "$state" ] || printf 'IDLE\\n\\n' > "$state"
s=$(sed -n 1p "$state" | tr 'A-Z' 'a-z'); r=$(sed -n 2p "$state")
case "$*" in
  *--Format=*) echo "node1|$s|root|2026-11-29T07:00:00|${r:-none}" ;;
  *) echo "node1|debug*|$s|${r:-none}" ;;
esac
"""


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def site(tmp_path: Path) -> dict[str, Any]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", SCONTROL), ("sinfo", SINFO)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    boot = tmp_path / "boot_id"
    boot.write_text("11111111-aaaa-4bbb-8ccc-000000000001\n")
    raw = {"agent": {"state_dir": str(tmp_path / "state"), "node_name": "node1", "listen": ""},
           "jobs": {"sources": [], "slurm_bin_dir": str(bin_dir)},
           "checks": {"gpu": {"interval": "30s", "actions": {"critical": ["drain"], "resolved": ["resume"]}}},
           "notifiers": {}, "ledger": {"boot_id_path": str(boot)}}
    (tmp_path / "trainguard.toml").write_text(toml(raw))
    return {"raw": raw, "bin": bin_dir, "boot": boot, "config": tmp_path / "trainguard.toml"}


def toml(raw: dict[str, Any]) -> str:
    """The few shapes this test's config has, as TOML."""
    lines = []

    def table(prefix: str, data: dict[str, Any]) -> None:
        scalars = {k: v for k, v in data.items() if not isinstance(v, dict)}
        lines.append(f"[{prefix}]")
        lines.extend(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in scalars.items())
        for k, v in data.items():
            if isinstance(v, dict):
                table(f"{prefix}.{json.dumps(k)}", v)

    for key, value in raw.items():
        table(key, value)
    return "\n".join(lines) + "\n"


def engine(site: dict[str, Any], gpus: list[FakeGpu], clock: Clock) -> Engine:
    return Engine(parse_config(site["raw"], "test.toml"), notifiers={}, nvml=Nvml(FakeNvml(gpus)), clock=clock,
                  ledger=True)


def settle(e: Engine) -> None:
    """Each check once, and the actions that started."""
    e.run_round()
    for thread in list(e.responder.threads):
        thread.join(30)


def node_state(site: dict[str, Any]) -> list[str]:
    path = site["bin"] / "node.state"
    return path.read_text().split("\n")[:2] if path.exists() else ["IDLE", ""]


def test_the_ledger_outlives_a_restart_and_a_reboot_and_a_swapped_gpu_starts_clean(
        site: dict[str, Any]) -> None:
    clock = Clock()
    gpu = FakeGpu("GPU-00000001-0000-4000-8000-000000000000", serial="1320000000001", bus_id=BUS, remap=(0, 1, 0, 1))
    first = engine(site, [gpu], clock)
    settle(first)
    first.stop()
    second = engine(site, [gpu], clock)  # a restart, same boot
    second.start()
    second.stop()
    rows = read_history(Path(site["raw"]["agent"]["state_dir"]), 0)[0]
    faults = [r for r in rows if r.event == "fault"]
    assert [(r.kind, r.component, r.uuid, r.cls, r.model) for r in faults] == [
        ("gpu", "1320000000001", gpu.uuid, "gpu", "NVIDIA H100 80GB HBM3")]
    assert "row remapping failed" in faults[0].summary
    assert not [r for r in rows if r.event == "reboot"]  # a restart is no reboot
    assert [r.event for r in rows if r.kind == "node"] == ["drain"]

    # A reboot with the GPU swapped: same slot, new board. Its faults are its own.
    site["boot"].write_text("11111111-aaaa-4bbb-8ccc-000000000002\n")
    clock.now += 3600
    new = FakeGpu("GPU-00000002-0000-4000-8000-000000000000", serial="1320000000002", bus_id=BUS, remap=(0, 1, 0, 1))
    third = engine(site, [new], clock)
    third.start()
    settle(third)
    third.stop()
    state = Path(site["raw"]["agent"]["state_dir"])
    rows, held = read_history(state, 0)
    assert [r.summary.startswith("booted") for r in rows if r.event == "reboot"] == [True]
    assert [r.component for r in rows if r.event == "fault"] == ["1320000000001", "1320000000002"]
    assert [r.component for r in rows if r.event == "resolve"] == ["1320000000001"]  # the old board's, by its serial
    assert held == []  # one fault each: no lemon (two of the same slot would have been)
    assert [r.component for r in read_history(state, 0, "1320000000002")[0]] == ["1320000000002"]

    out = subprocess.run([sys.executable, "-m", "trainguard", "history", "-c", str(site["config"]), "--gpu",
                          "1320000000001", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert [(e["event"], e["component"]) for e in shown["entries"]] == [("fault", "1320000000001"),
                                                                         ("resolve", "1320000000001")]
    table = subprocess.run([sys.executable, "-m", "trainguard", "history", "-c", str(site["config"]), "--node"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert table.returncode == 0 and " reboot " in table.stdout and " drain " in table.stdout, table


def test_the_agent_keeps_its_ledger_across_a_restart_and_records_a_reboot(
        tmp_path: Path, agent_process: Any) -> None:
    """The daemon itself (its settings passed as plain values): a GPU whose row remap failed, two restarts, a new
    boot id before the second."""
    boot = tmp_path / "boot_id"
    boot.write_text("22222222-aaaa-4bbb-8ccc-000000000001\n")
    state = tmp_path / "state"
    config = tmp_path / "trainguard.toml"
    config.write_text(f"""
[agent]
state_dir = "{state}"
listen = ""
node_name = "node7"
[jobs]
sources = []
[checks.gpu]
interval = "1s"
jitter = "0s"
actions = {{ critical = [], warning = [] }}
[ledger]
boot_id_path = "{boot}"
[notifiers.console]
""")
    env = {"TRAINGUARD_FAKE_GPUS": "2", "TRAINGUARD_FAKE_GPU_FAULT": "remap_failed"}

    def faults() -> list[Any]:
        return [r for r in read_history(state, 0)[0] if r.event == "fault" and r.data["status"] == "CRITICAL"]

    def run(log: str, until: Any) -> None:
        agent: AgentProcess = agent_process(config, env=env, log_name=log, module="tests.helpers.fake_gpu_agent")
        agent.wait_for("first round done", timeout=30)  # the gpu check ran and its results went in
        wait_until(until, 30, what=f"the ledger's entries ({log})")
        agent.signal(15)
        assert agent.wait(20) == 0

    run("first.log", faults)
    [fault] = faults()
    assert fault.kind == "gpu" and fault.component.startswith("1320") and len(fault.component) == 13
    assert "row remapping failed" in fault.summary and fault.model == "NVIDIA H100 80GB HBM3"
    run("second.log", lambda: True)  # a restart: the incident is still the one fired, no second fault, no reboot
    assert faults() == [fault] and not [r for r in read_history(state, 0)[0] if r.event == "reboot"]
    boot.write_text("22222222-aaaa-4bbb-8ccc-000000000002\n")
    run("third.log", lambda: [r for r in read_history(state, 0)[0] if r.event == "reboot"])
    assert faults() == [fault]
    out = subprocess.run([sys.executable, "-m", "trainguard", "history", "-c", str(config), "--node", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    [reboot] = json.loads(out.stdout)["entries"]
    assert (reboot["event"], reboot["component"], reboot["data"]["previous"]) == (
        "reboot", "node7", "22222222-aaaa-4bbb-8ccc-000000000001")


def test_a_lemon_is_held_drained_resume_refuses_until_an_operator_clears_it(site: dict[str, Any]) -> None:
    clock = Clock()
    gpu = FakeGpu("GPU-00000001-0000-4000-8000-000000000000", serial="1320000000004", bus_id=BUS, remap=(0, 1, 0, 1))
    e = engine(site, [gpu], clock)
    try:
        settle(e)  # the first fault: drained by the gpu check's incident
        assert node_state(site)[0] == "IDLE+DRAIN"
        gpu.remap = (0, 0, 0, 0)
        clock.now += 3600
        settle(e)  # repaired, resolved, resumed: one fault is no lemon
        assert node_state(site) == ["IDLE", ""]
        assert e.ledger is not None and e.ledger.held() == {}

        gpu.remap = (0, 1, 0, 1)
        clock.now += 5 * 3600
        settle(e)  # the same board again, 6 hours later: repeat-fault (2 in 7d)
        [hold] = e.ledger.held().values()
        assert (hold.rule, hold.component, hold.subject) == ("repeat-fault", "1320000000004", "1320000000004")
        assert hold.reason == "GPU 1320...0004 GPU fault 2x in 6h: RMA"
        samples = {(s.metric.name, tuple(sorted(s.labels.items()))): s.value
                   for r in e.checks[LEMON].run() for s in r.samples}
        model = ("model", "NVIDIA H100 80GB HBM3")
        assert samples[("trainguard_lemon_held", (("rule", "repeat-fault"),))] == 1
        assert samples[("trainguard_lemon_held", (("rule", "repeat-drain"),))] == 0
        for window in ("1d", "7d", "30d"):
            labels = (("class", "gpu"), ("kind", "gpu"), model, ("severity", "critical"), ("window", window))
            assert samples[("trainguard_ledger_faults", labels)] == 2
        assert samples[("trainguard_ledger_components", (("kind", "gpu"), model))] == 1
        e.run_check(LEMON)  # the hold's own incident (the daemon's schedule runs it at once)
        for thread in list(e.responder.threads):
            thread.join(30)
        [incident] = [i for i in e.tracker.incidents() if i.check == LEMON and i.firing]
        assert incident.status is Status.CRITICAL and incident.details["history"]
        assert incident.summary.startswith("GPU 1320...0004 GPU fault 2x in 6h: RMA; held drained: `trainguard "
                                           "clear lemon/1320000000004")
        assert node_state(site)[1].startswith("trainguard: GPU 1320...0004 GPU fault 2x in 6h: RMA")

        gpu.remap = (0, 0, 0, 0)
        clock.now += 60
        settle(e)  # the gpu fault resolves; its resume must not lift the lemon's drain
        assert node_state(site)[0] == "IDLE+DRAIN"
        [resume] = [a for a in e.tracker.actions_of(incident_id_of(e, "gpu")) if a["action"] == "resume"][-1:]
        assert resume["outcome"] == "skipped" and "lemon/1320000000004" in resume["detail"], resume
        ok, why = HoldGate(e.ledger).check(None)  # type: ignore[arg-type]  # the gate alone, as resume asks it
        assert not ok and "RMA" in why and "trainguard clear lemon/1320000000004" in why

        e.clear(f"{LEMON}/1320000000004", Operator("root", 0, "GPU replaced, dcgmi diag -r 3 passed"))
        for thread in list(e.responder.threads):
            thread.join(30)
        assert node_state(site) == ["IDLE", ""]  # the lemon's resolution resumed it
        assert e.ledger.held() == {}
        [cleared] = [r for r in e.ledger.history() if r.event == "clear"]
        assert (cleared.component, cleared.data["reason"]) == ("1320000000004", "GPU replaced, dcgmi diag -r 3 passed")
        assert [r.event for r in e.ledger.history(component="1320000000004")].count("lemon") == 1
    finally:
        e.stop()


def test_kernel_faults_of_the_hardware_are_recorded_against_their_gpu_and_users_crashes_not_at_all(
        site: dict[str, Any], tmp_path: Path) -> None:
    """Review item 9: a user's segfault and OOM kill are the kernel check's incidents but no fault of the node's
    hardware; a GPU's failure the kernel logs by PCI address is that GPU's, by its serial."""
    usec = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)
    kmsg = tmp_path / "kmsg-copy"  # a saved kernel log, read once by the one-shot run
    kmsg.write_text("".join(f"3,{n},{usec + n},-;{line}\n" for n, line in enumerate([
        "a.out[4242]: segfault at 0 ip 00007f3a1c2b3c4d sp 00007ffd5e6f7a80 error 4 in a.out[55d0c0a00000+1000]",
        "python invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0, oom_score_adj=0",
        "Memory cgroup out of memory: Killed process 31337 (python) total-vm:60000000kB, anon-rss:56623104kB, "
        "file-rss:0kB, shmem-rss:0kB, UID:1000 pgtables:1372kB oom_score_adj:0",
        "NVRM: GPU 0000:18:00.0: RmInitAdapter failed! (0x25:0x65:1457)"])))
    site["raw"]["checks"]["kernel"] = {"kmsg_path": str(kmsg), "actions": {"critical": []}}
    gpu = FakeGpu("GPU-00000001-0000-4000-8000-000000000000", serial="1320000000001", bus_id=BUS)
    e = engine(site, [gpu], Clock())
    try:
        e.run_check("gpu")  # the ledger learns which board sits at 18:00
        report = e.run_check("kernel")
        assert report is not None
        fired = {r.subject for r in report.results if r.status is not Status.OK}
        assert fired == {"process:a.out", "process:python", "pci:0000:18:00.0"}
        assert e.ledger is not None
        faults = [(r.kind, r.component, r.data["subject"]) for r in e.ledger.history() if r.event == "fault"]
        assert faults == [("gpu", "1320000000001", "pci:0000:18:00.0")]
    finally:
        e.stop()


def incident_id_of(e: Engine, check: str) -> str:
    """The latest incident of `check`, firing or not, from the actions recorded on it."""
    events = [r for r in e.ledger.history() if r.data.get("check") == check] if e.ledger else []
    return str(events[-1].data["incident"])


def ledger_at(tmp_path: Path, boot_id: str = "b1", **settings: Any) -> tuple[Ledger, Clock]:
    clock = Clock()
    tmp_path.mkdir(exist_ok=True)
    boot = tmp_path / "boot_id"
    boot.write_text(boot_id + "\n")
    return Ledger(Store(tmp_path), "node1", LedgerSettings(boot_id_path=boot, **settings), clock), clock


def fault(clock: Clock, details: dict[str, Any], check: str = "xid", status: Status = Status.CRITICAL) -> Event:
    return Event(EventKind.FIRED, f"i{clock.now}", check, "s", status, "a fault", "node1", clock.now,
                 clock.now, details=details)


def test_repeat_fault_counts_one_component_and_one_fault_seen_twice_once(tmp_path: Path) -> None:
    ledger, clock = ledger_at(tmp_path)
    gpu = {"uuid": "GPU-1", "serial": "1320000000009", "bus_id": "0000:18:00", "xids": [{"xid": 79}]}
    assert ledger.on_event(fault(clock, gpu), "xid") == []
    clock.now += 60
    assert ledger.on_event(fault(clock, gpu, "gpu"), "gpu") == []  # the same fault, seen by the gpu check
    clock.now += 8 * DAY
    assert ledger.on_event(fault(clock, gpu), "xid") == []  # the first is outside the 7 days
    clock.now += 6 * DAY
    other = {"uuid": "GPU-2", "serial": "1320000000010", "bus_id": "0000:18:00", "xids": [{"xid": 79}]}
    assert ledger.on_event(fault(clock, other), "xid") == []  # a swapped board in that slot: its own count
    clock.now += DAY
    [hold] = ledger.on_event(fault(clock, gpu), "xid")
    assert hold.reason == "GPU 1320...0009 XID 79 2x in 7d: RMA" and hold.rule == "repeat-fault"


def test_warnings_are_recorded_but_count_only_for_a_rule_that_asks_for_them(tmp_path: Path) -> None:
    ledger, clock = ledger_at(tmp_path)
    app = {"uuid": "GPU-1", "serial": "1320000000009", "xids": [{"xid": 31}]}  # an application's MMU fault
    for _ in range(3):
        assert ledger.on_event(fault(clock, app, status=Status.WARNING), "xid") == []
        clock.now += 3600
    assert [r.data["status"] for r in ledger.history()] == ["WARNING"] * 3
    strict, clock = ledger_at(tmp_path / "strict", rules={"xid31": LemonRule(severity="warning", count=3,
                                                                               classes=["xid"])})
    for check in ("xid", "gpu_config", "xid", "xid"):  # a config warning is not of the class counted
        held = strict.on_event(fault(clock, app if check == "xid" else {"uuid": "GPU-1"}, check,
                                     status=Status.WARNING), check)
        clock.now += 3600
    assert [h.reason for h in held] == ["GPU 1320...0009 XID 31 3x in 3h: inspect"]


def test_an_xid_that_names_only_the_bus_is_the_gpu_that_answered_there_this_boot(tmp_path: Path) -> None:
    ledger, _ = ledger_at(tmp_path)
    ledger.learn([Result("gpu", "GPU-7", Status.OK, "GPU 0", {"uuid": "GPU-7", "serial": "1320000000777",
                                                               "name": "NVIDIA H200", "bus_id": "0000:18:00"})])
    lost = {"bus_id": "0000:18:00", "uuid": None, "xids": [{"xid": 79}]}  # off the bus: the driver names no uuid
    assert ledger.identify(lost) == Component("gpu", "1320000000777", "GPU-7", "0000:18:00", "NVIDIA H200")
    again, _ = ledger_at(tmp_path, "b2")  # after a reboot the slot may hold another board
    assert again.identify(lost) == Component("gpu", "pci:0000:18:00", bus_id="0000:18:00")
    assert again.identify({"uuid": "GPU-7"}).id == "1320000000777"  # a UUID is the board's, whatever the boot


def test_nic_flap_holds_an_hca_after_three_degradations_in_an_hour(tmp_path: Path) -> None:
    ledger, clock = ledger_at(tmp_path)
    hca = {"device": "mlx5_0", "port": 1, "node_guid": "b8ce:f603:00a1:b2c3", "hca_type": "MT4129"}
    assert ledger.identify(hca) == Component("hca", "b8ce:f603:00a1:b2c3", bus_id="mlx5_0", model="MT4129")
    assert ledger.on_event(fault(clock, hca, "infiniband"), "infiniband") == []
    clock.now += 1200
    assert ledger.on_event(fault(clock, hca, "infiniband"), "infiniband") == []
    clock.now += 1200
    [hold] = ledger.on_event(fault(clock, hca, "infiniband"), "infiniband")
    assert hold.rule == "nic-flap" and hold.reason == "HCA b8ce...b2c3 link 3x in 40m: replace the HCA or its cable"


def test_repeat_drain_holds_the_node_after_three_drains_in_thirty_days(tmp_path: Path) -> None:
    ledger, clock = ledger_at(tmp_path)
    ev = fault(clock, {})
    for n in range(3):
        held = ledger.on_action(ev, "DrainAction", {"action": "drain", "outcome": "ok", "detail": "drained node1"})
        assert (held == []) == (n < 2)
        assert ledger.on_action(ev, "DrainAction", {"action": "drain", "outcome": "refused"}) == []  # not a drain
        clock.now += 10 * DAY
    [hold] = ledger.held().values()
    assert hold.subject == "node1" and hold.reason == "node node1 drained 3x in 20d: inspect the node"


def test_an_operators_clear_restarts_the_count_and_an_incident_counts_once(tmp_path: Path) -> None:
    """Review item 12: a hold cleared stays cleared until the rule's count is reached again after the clear, and
    one incident's `fault` and later `escalate` are one fault, however far apart."""
    ledger, clock = ledger_at(tmp_path)
    ev = fault(clock, {})
    drained = {"action": "drain", "outcome": "ok", "detail": "drained node1"}
    for _ in range(3):
        held = ledger.on_action(ev, "DrainAction", drained)
        clock.now += DAY
    assert [h.subject for h in held] == ["node1"]
    ledger.on_clear("lemon", "node1", "root", 0, "replaced the PSU")  # what the engine's clear does, in order
    ledger.release("node1")
    clock.now += DAY
    for n in range(3):  # unrelated drains after the repair: held again only at the third
        assert (ledger.on_action(ev, "DrainAction", drained) == []) == (n < 2)
        clock.now += DAY
    gpu = {"uuid": "GPU-1", "serial": "1320000000009", "xids": [{"xid": 79}]}
    ledger.on_event(fault(clock, gpu), "xid")
    clock.now += DAY
    [hold] = ledger.on_event(fault(clock, gpu), "xid")
    ledger.on_clear("lemon", hold.subject, "root", 0, "reseated")
    ledger.release(hold.subject)
    clock.now += DAY
    assert ledger.on_event(fault(clock, gpu), "xid") == []  # one fault since the reseat, not three
    strict, clock = ledger_at(tmp_path / "strict", rules={"xid31": LemonRule(severity="warning", count=2)})
    app = {"uuid": "GPU-1", "serial": "1320000000009", "xids": [{"xid": 31}]}
    fired = fault(clock, app, status=Status.WARNING)
    assert strict.on_event(fired, "xid") == []
    clock.now += 3600  # far past `same_fault_within`
    escalated = Event(EventKind.ESCALATED, fired.incident_id, "xid", "s", Status.CRITICAL, "worse", "node1",
                      clock.now, fired.since, details=app)
    assert strict.on_event(escalated, "xid") == []
    assert [r.event for r in strict.history()] == ["fault", "escalate"]


def test_no_rules_no_hold_and_entries_past_the_retention_are_pruned(tmp_path: Path) -> None:
    ledger, clock = ledger_at(tmp_path, rules={}, retention=DAY)
    gpu = {"uuid": "GPU-1", "serial": "1320000000009"}
    for _ in range(3):
        assert ledger.on_event(fault(clock, gpu), "xid") == []
        clock.now += 2 * DAY
    ledger.prune()
    assert ledger.history() == []


# The state database of the release before the ledger (this branch's base), as its store.py created it.
OLD_SCHEMA = """
CREATE TABLE IF NOT EXISTS incidents (
    check_name TEXT NOT NULL,
    subject TEXT NOT NULL,
    data TEXT NOT NULL,
    PRIMARY KEY (check_name, subject)
);
CREATE TABLE IF NOT EXISTS outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    channel TEXT NOT NULL,
    event TEXT NOT NULL,
    created REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_attempt REAL NOT NULL,
    last_error TEXT
);
CREATE INDEX IF NOT EXISTS outbox_channel ON outbox (channel, id);
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


def test_a_previous_release_database_migrates_forward_and_a_newer_one_is_refused(
        tmp_path: Path, site: dict[str, Any]) -> None:
    state = Path(site["raw"]["agent"]["state_dir"])
    state.mkdir()
    old = sqlite3.connect(state / "state.db")
    old.execute("PRAGMA journal_mode=WAL")
    old.executescript(OLD_SCHEMA)
    incident = {"check": "xid", "subject": "GPU-1", "status": "CRITICAL", "summary": "XID 79"}
    old.execute("INSERT INTO incidents VALUES (?, ?, ?)", ("xid", "GPU-1", json.dumps(incident)))
    old.execute("INSERT INTO outbox (channel, event, created, next_attempt, attempts, last_error) VALUES "
                "('slack', '{\"kind\": \"fired\"}', 1.0, 2.0, 3, 'timed out')")
    old.execute("INSERT INTO kv VALUES ('xid.ledger', '{}')")
    old.commit()
    old.close()

    store = Store(state)
    assert store.persistent and store.load_incidents() == [incident]
    row = store.next_outbox("slack")
    assert row is not None and (row.event, row.created, row.attempts, row.last_error) == (
        {"kind": "fired"}, 1.0, 3, "timed out")
    assert store.get("xid.ledger") == "{}" and store.ledger_rows() == []
    store.close()
    conn = sqlite3.connect(state / "state.db")
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 2
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")  # as a later release leaves it
    conn.commit()
    conn.close()

    with pytest.raises(SchemaTooNewError, match="schema version 3, newer than this trainguard's 2"):
        Store(state)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for command in (["run"], ["history"]):
        out = subprocess.run([sys.executable, "-m", "trainguard", *command, "-c", str(site["config"])], cwd=ROOT,
                             capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 65, out
        [line] = [x for x in out.stderr.splitlines() if "schema version" in x]
        assert "is schema version 3, newer than this trainguard's 2: a downgrade is refused" in line
    conn = sqlite3.connect(state / "state.db")
    assert conn.execute("SELECT COUNT(*) FROM incidents").fetchone()[0] == 1  # left as it was
    conn.close()


# GPU resets and diagnostics runs ---------------------------------------------------------------------------------------

def test_a_gpu_reset_is_recorded_against_its_serial_when_what_awaited_it_clears_on_the_same_boot(
        site: dict[str, Any]) -> None:
    """NVML's own evidence of a reset: a pending row remap, and a GPU that required a reset (lost), read clean again
    on the same boot. A reboot clears everything too, but is a reboot, not a reset."""
    clock = Clock()
    site["raw"]["checks"]["gpu"]["actions"] = {}
    gpu = FakeGpu("GPU-00000001-0000-4000-8000-000000000000", serial="1320000000001", bus_id=BUS, remap=(0, 0, 1, 0))
    e = engine(site, [gpu], clock)
    settle(e)  # WARNING: a row remap awaits a reset
    settle(e)
    gpu.remap = (0, 0, 0, 0)  # `nvidia-smi -r` done: the remap applied
    settle(e)
    gpu.fail = {"nvmlDeviceGetMemoryInfo": NVMLError_ResetRequired}
    settle(e)
    e.stop()
    again = engine(site, [gpu], clock)  # a restart of the agent while the GPU still requires its reset
    gpu.fail = {}
    settle(again)
    again.stop()
    rows = [r for r in read_history(Path(site["raw"]["agent"]["state_dir"]), 0)[0] if r.event == "reset"]
    assert [(r.kind, r.component, r.uuid, r.data["cleared"]) for r in rows] == [
        ("gpu", "1320000000001", gpu.uuid, ["row remap pending"]),
        ("gpu", "1320000000001", gpu.uuid, ["lost (reset required)"])]
    assert rows[0].summary == "GPU 1320...0001 reset: row remap pending cleared"

    gpu.remap = (0, 0, 1, 0)
    rebooted = engine(site, [gpu], clock)
    rebooted.start()  # the boot id noted: the next start's is a reboot
    settle(rebooted)
    rebooted.stop()
    site["boot"].write_text("11111111-aaaa-4bbb-8ccc-000000000009\n")
    gpu.remap = (0, 0, 0, 0)
    after = engine(site, [gpu], clock)
    after.start()
    settle(after)
    after.stop()
    events = [r.event for r in read_history(Path(site["raw"]["agent"]["state_dir"]), 0)[0]]
    assert events.count("reset") == 2 and events.count("reboot") == 1  # the reboot cleared it: no third reset


def test_a_failed_health_query_is_no_gpu_reset(site: dict[str, Any]) -> None:
    """A reading where the remap query fails (a transient NVML error: the field reads nothing) proves nothing: the
    pending remap is still awaited, and the one real reset later is recorded once."""
    clock = Clock()
    site["raw"]["checks"]["gpu"]["actions"] = {}
    gpu = FakeGpu("GPU-00000001-0000-4000-8000-000000000000", serial="1320000000001", bus_id=BUS, remap=(0, 0, 1, 0))
    e = engine(site, [gpu], clock)

    def resets() -> list[Any]:
        return [r for r in read_history(Path(site["raw"]["agent"]["state_dir"]), 0)[0] if r.event == "reset"]

    settle(e)  # a row remap awaits a reset
    gpu.fail = {"nvmlDeviceGetRemappedRows": NVMLError_Unknown}
    settle(e)
    assert resets() == []
    gpu.fail = {}
    settle(e)  # still pending
    gpu.remap = (0, 0, 0, 0)  # the reset
    settle(e)
    e.stop()
    assert [(r.uuid, r.data["cleared"]) for r in resets()] == [(gpu.uuid, ["row remap pending"])]


GB10 = {"index": 0, "uuid": "GPU-00000001-0000-4000-8000-000000000000", "serial": "1320000000001",
        "name": "NVIDIA GB10", "bus_id": "000f:01:00"}


def diag_report(level: str, *results: Result) -> DiagReport:
    return DiagReport(level, list(results), seconds=1.0)  # type: ignore[arg-type]


def test_a_failed_diagnostic_is_a_fault_of_the_gpu_it_names_and_a_repair_that_did_not_fix_it_is_held(
        tmp_path: Path) -> None:
    """dcgmi names the GPU by its id (NVML's index), the GB10 by no serial (tests/data/diag/dcgmi-r1-fail-gb10.json):
    the GPU the gpu check saw at that index this boot. Its history: the XID, the repair, the diagnostic failed."""
    from tests.test_diag import text

    ledger, clock = ledger_at(tmp_path)
    ledger.learn([Result("gpu", GB10["uuid"], Status.OK, "GPU 0", GB10)])
    assert ledger.on_event(fault(clock, {**GB10, "xids": [{"xid": 79}]}), "xid") == []
    clock.now += 3600
    ledger.on_clear("xid", "s", "root", 0, "GPU reseated")
    clock.now += 3600
    failed = diag_report("quick", diagtools.read_dcgmi(1, 226, text("dcgmi-r1-fail-gb10.json")))
    [hold] = ledger.on_diag(failed, "resume")
    assert hold.reason == "GPU 1320...0001 XID 79,diag failed 2x in 2h: RMA" and hold.rule == "repeat-fault"
    gpu = [(r.event, r.cls) for r in ledger.history(component="1320000000001")]
    assert gpu == [("fault", "xid"), ("fault", "diag"), ("lemon", "repeat-fault")]
    diag = ledger.history(component="1320000000001")[1]
    assert diag.summary.startswith("GPU 1320...0001 diag quick failed: dcgmi diag -r 1: software: Persistence Mode")
    assert (diag.uuid, diag.model, diag.data["source"]) == (GB10["uuid"], "NVIDIA GB10", "resume")
    node = [(r.event, r.cls, r.data.get("passed")) for r in ledger.history(component="node1")]
    assert node == [("clear", "xid", None), ("diag", "quick", False)]  # the run itself stays the node's


def test_a_failed_diagnostic_counts_once_with_the_fault_it_confirms_and_a_passed_one_not_at_all(
        tmp_path: Path) -> None:
    """`same_fault_within` as the others; nvidia-smi names the GPU by its bus id
    (tests/data/diag/nvidia-smi-q-a100-remap-pending.txt); a GPU the ledger can't tell stays the node's."""
    from tests.test_diag import text

    ledger, clock = ledger_at(tmp_path)
    a100 = {**GB10, "bus_id": "0000:10:1c", "name": "NVIDIA A100-SXM4-80GB"}
    ledger.learn([Result("gpu", a100["uuid"], Status.OK, "GPU 0", a100)])
    assert ledger.on_event(fault(clock, {**a100, "remap_pending": True}, "gpu"), "gpu") == []
    clock.now += 60
    remap = diagtools.read_nvidia_smi(0, text("nvidia-smi-q-a100-remap-pending.txt"), 8)
    assert ledger.on_diag(diag_report("quick", remap), "action") == []  # 60s after the fault: the same one
    assert [r.component for r in ledger.history() if r.cls == "diag"] == ["1320000000001"]
    clock.now += DAY
    passed = diagtools.read_dcgmi(3, 0, text("dcgmi-r3-pass-8gpu.json"))
    assert ledger.on_diag(diag_report("long", passed), "resume") == []
    assert [r.event for r in ledger.history(component="1320000000001")] == ["fault", "fault"]
    other, _ = ledger_at(tmp_path / "other")  # nothing learned: GPU 0 is no board it knows
    other.on_diag(diag_report("quick", diagtools.read_dcgmi(1, 226, text("dcgmi-r1-fail-gb10.json"))), "cli")
    assert [(r.kind, r.event) for r in other.history()] == [("node", "diag")]


def test_trainguard_diag_records_the_gpus_fault_from_another_process(tmp_path: Path) -> None:
    """`trainguard diag` and the prolog write into the agent's database: the GPU from the identities it keeps."""
    from tests.test_diag import text

    ledger, _ = ledger_at(tmp_path)
    ledger.learn([Result("gpu", GB10["uuid"], Status.OK, "GPU 0", GB10)])
    failed = diag_report("quick", diagtools.read_dcgmi(1, 226, text("dcgmi-r1-fail-gb10.json")))
    assert record_diag(tmp_path, "node1", failed, "cli", tmp_path / "boot_id") == ""
    assert [(r.kind, r.component, r.event, r.cls) for r in ledger.history()] == [
        ("node", "node1", "diag", "quick"), ("gpu", "1320000000001", "fault", "diag")]


def test_diagnostics_runs_go_into_the_ledger_the_metrics_and_history(site: dict[str, Any], tmp_path: Path) -> None:
    """The `diag` action's and the `resume` validation's runs (through the agent's responder), and `trainguard diag`
    (another process, into the agent's database): level, verdict, failed tests and duration, against the node."""
    from tests.test_diag import DATA, cat

    tools = tmp_path / "tools"
    tools.mkdir()
    cat(tools, "nvidia-smi", "nvidia-smi-q-h100-pass.txt")
    cat(tools, "dcgmi", "dcgmi-r1-fail-gb10.json", rc=226)
    assert DATA.exists()
    clock = Clock()
    site["raw"]["actions"] = {"diag": {"tool_dir": str(tools), "gpus": 1},
                              "resume": {"tool_dir": str(tools), "gpus": 1}}
    site["raw"]["jobs"]["slurm_timeout"] = "5s"
    e = engine(site, [FakeGpu("GPU-00000001-0000-4000-8000-000000000000", serial="1320000000001", bus_id=BUS)], clock)
    try:
        failed = e.responder.run_named("diag", fault(clock, {}))
        assert failed["outcome"] == "failed", failed
        (site["bin"] / "node.state").write_text("IDLE+DRAIN\ntrainguard: GPU 0 XID 79\n")
        cat(tools, "dcgmi", "dcgmi-r3-pass-8gpu.json")
        resumed = e.responder.run_named("resume", fault(clock, {}))
        assert resumed["outcome"] == "ok", resumed
        rows = [r for r in e.ledger.history() if r.event == "diag"] if e.ledger else []
        assert [(r.kind, r.component, r.cls, r.data["source"], r.data["passed"]) for r in rows] == [
            ("node", "node1", "quick", "action", False), ("node", "node1", "quick", "resume", True)]
        assert [f["test"] for f in rows[0].data["failed"]] == ["dcgmi diag -r 1"]
        assert "failed software" in rows[0].data["failed"][0]["summary"]
        assert rows[0].data["seconds"] >= 0 and rows[0].data["tests"] == 2

        config = tmp_path / "cli.toml"
        raw = {**site["raw"], "actions": {"diag": {"tool_dir": str(tools), "gpus": 1}}}
        raw["jobs"] = {**raw["jobs"], "slurm_bin_dir": str(tmp_path / "no-slurm")}
        config.write_text(toml(raw))
        cli = subprocess.run([sys.executable, "-m", "trainguard", "diag", "-c", str(config), "--level", "standard"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert cli.returncode == 0 and cli.stderr == "", cli
        [lemon] = e.checks[LEMON].run()[-1:]
        samples = {(s.metric.name, tuple(sorted(s.labels.items()))): s.value for s in lemon.samples}
        assert samples[("trainguard_diag_runs", (("level", "quick"), ("result", "fail"), ("window", "1d")))] == 1
        assert samples[("trainguard_diag_runs", (("level", "quick"), ("result", "pass"), ("window", "30d")))] == 1
        assert samples[("trainguard_diag_last_passed", (("level", "quick"),))] == 1
        assert ("trainguard_diag_last_seconds", (("level", "standard"),)) in samples
    finally:
        e.stop()
    table = subprocess.run([sys.executable, "-m", "trainguard", "history", "-c", str(site["config"]), "--node"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table
    diag_lines = [line for line in table.stdout.splitlines() if " diag " in line]
    assert len(diag_lines) == 3 and "diag quick failed: dcgmi diag -r 1: failed software" in diag_lines[0]
