"""Issue 20, item 2: what the kernel log held before the agent's first start on this boot is reported, but drains
nothing while its GPU reads healthy; a fault still present, or logged since the first start, is graded as logged.
And `trainguard check --since` for health checks and prologs."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.conftest import REPO, AgentProcess, free_port, http_get, require_root, wait_until
from tests.helpers.fake_nvml import FakeGpu, FakeNvml, NVMLError_GpuIsLost, NVMLError_LibraryNotFound
from trainguard.checks.base import CheckContext
from trainguard.checks.xid import MARKS_FILE, XidCheck, XidSettings
from trainguard.core.model import Result, Status
from trainguard.core.state import ScopedState
from trainguard.gpu.faults import XidLedger
from trainguard.gpu.nvml import Nvml
from trainguard.gpu.xid import XidEvent
from trainguard.node.kmsg import LogPoint
from trainguard.node.procfs import ProcFS
from trainguard.pipeline.store import Store

HISTORY = "before trainguard started; GPU {bus} reads healthy now: no drain"


def fake_proc(root: Path, boot_id: str) -> ProcFS:
    path = root / "sys" / "kernel" / "random" / "boot_id"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(boot_id + "\n")
    return ProcFS(root)


# the ledger ------------------------------------------------------------------------------------------------------
def test_first_start_is_kept_across_restarts_and_reset_by_a_new_boot(tmp_path: Path) -> None:
    store, proc = Store(tmp_path / "state"), fake_proc(tmp_path / "proc", "boot-a")
    ledger = XidLedger(store, proc=proc)
    point, new = ledger.mark_first_start(lambda: LogPoint(100, 5_000_000))
    assert (point, new) == (LogPoint(100, 5_000_000), True)
    ledger.record(XidEvent(79, "0000:3b:00", "off the bus", seq=90, usec=4_000_000))
    ledger.save(force=True)  # as the agent does when it stops

    again = XidLedger(store, proc=proc)  # a restart on the same boot: the first start stays where it was
    asked: list[int] = []
    point, new = again.mark_first_start(lambda: asked.append(1) or LogPoint(300, 9_000_000))  # type: ignore[func-returns-value]
    assert (point, new, asked) == (LogPoint(100, 5_000_000), False, [])
    [old] = again.entries()
    assert again.before_start(old)
    recorded = again.record(XidEvent(79, "0000:3b:00", "off the bus again", seq=250, usec=8_000_000))  # while down
    assert recorded is not None and recorded[1], "history with a record since is a change: the check must wake"
    [since] = again.entries()
    assert (since.seq, since.count) == (250, 2) and not again.before_start(since)

    rebooted = XidLedger(store, proc=fake_proc(tmp_path / "proc", "boot-b"))
    assert rebooted.first_start is None and rebooted.entries() == []
    point, new = rebooted.mark_first_start(lambda: LogPoint(3, 1_000_000))
    assert (point, new) == (LogPoint(3, 1_000_000), True)


def test_a_journal_first_start_places_records_by_their_time(tmp_path: Path) -> None:
    ledger = XidLedger(None, proc=fake_proc(tmp_path, "boot-a"))
    ledger.mark_first_start(lambda: LogPoint(-1, 5_000_000))  # no /dev/kmsg: the time alone places records
    ledger.record(XidEvent(79, "0000:3b:00", "old", usec=4_000_000))
    ledger.record(XidEvent(79, "0000:5e:00", "new", usec=6_000_000))
    ledger.record(XidEvent(79, "0000:86:00", "unknown place"))  # no position at all: counted as since
    assert {e.bus_id: ledger.before_start(e) for e in ledger.entries()} == \
        {"0000:3b:00": True, "0000:5e:00": False, "0000:86:00": False}


# grading ---------------------------------------------------------------------------------------------------------
def fake_board() -> list[FakeGpu]:
    return [FakeGpu("GPU-healthy", bus_id=b"00000000:3B:00.0"),
            FakeGpu("GPU-remap", bus_id=b"00000000:5E:00.0", remap=(0, 0, 1, 0)),  # a row remap awaits a reset
            FakeGpu("GPU-lost", bus_id=b"00000000:86:00.0", fail={"nvmlDeviceGetMemoryInfo": NVMLError_GpuIsLost})]


def started_check(tmp_path: Path, nvml: FakeNvml) -> XidCheck:
    """An xid check started as the agent starts it (its first start marked now), with no kernel log to follow: the
    test records into its ledger directly."""
    store = Store(None)
    context = CheckContext("n", tmp_path, nvml=Nvml(nvml), state=ScopedState(store, "check/xid"),
                           xid_history=XidLedger(store))
    check = XidCheck("xid", XidSettings(kmsg_path=str(tmp_path / "none"), journalctl=str(tmp_path / "nojournal")),
                     context)
    check.start(lambda: None)
    wait_until(lambda: check.follower.error is not None, 5, what="the follower to give up")
    return check


def by_subject(results: list[Result]) -> dict[str, Result]:
    return {r.subject: r for r in results}


def test_history_on_a_healthy_gpu_warns_a_present_fault_or_a_new_record_is_critical(tmp_path: Path) -> None:
    check = started_check(tmp_path, FakeNvml(fake_board()))
    first = check.ledger.first_start
    assert first is not None and first.seq == -1  # no /dev/kmsg here: the first start is placed by time
    # kernel times count from boot, and a test machine may have booted minutes ago: "before" is half-way there
    old, new = first.usec // 2, first.usec + 10**6
    for bus in ("0000:3b:00", "0000:5e:00", "0000:86:00", "0000:af:00"):  # af: a GPU NVML does not list
        check.ledger.record(XidEvent(79, bus, "GPU has fallen off the bus.", usec=old))
    try:
        results = by_subject(list(check.run()))
        healthy = results["GPU-healthy"]
        assert healthy.status is Status.WARNING, healthy.summary
        assert "logged at boot+" in healthy.summary and HISTORY.format(bus="0000:3b:00") in healthy.summary
        assert "fell off the bus (XID 79)" not in healthy.summary.split(":")[0]
        assert healthy.details["xids"][0]["before_start"] and healthy.details["xids"][0]["history"]
        samples = {(s.name, s.labels.get("xid")): s.value for s in healthy.samples}
        assert samples[("trainguard_gpu_xid_before_start", "79")] == 1
        for subject, why in (("GPU-remap", "has row remapping pending now"), ("GPU-lost", "is lost"),
                             ("pci:0000:af:00", "is missing (NVML does not list it) now")):
            assert results[subject].status is Status.CRITICAL, results[subject].summary
            assert "before trainguard started, and GPU" in results[subject].summary and why in results[subject].summary

        check.ledger.record(XidEvent(79, "0000:3b:00", "GPU has fallen off the bus.", usec=new))  # since the start
        healthy = by_subject(list(check.run()))["GPU-healthy"]
        assert healthy.status is Status.CRITICAL and "before trainguard started" not in healthy.summary
        samples = {(s.name, s.labels.get("xid")): s.value for s in healthy.samples}
        assert samples[("trainguard_gpu_xid_before_start", "79")] == 0
    finally:
        check.stop()


def test_history_is_graded_as_logged_when_nvml_cannot_be_read(tmp_path: Path) -> None:
    check = started_check(tmp_path, FakeNvml(fake_board(), init_error=NVMLError_LibraryNotFound))
    first = check.ledger.first_start
    assert first is not None
    check.ledger.record(XidEvent(48, "0000:3b:00", "DBE", usec=first.usec // 2))
    try:
        [gpu] = [r for r in check.run() if r.subject != "kernel-log"]
        assert gpu.status is Status.CRITICAL and "can't be read (NVML:" in gpu.summary
    finally:
        check.stop()


# the real agent --------------------------------------------------------------------------------------------------
def agent_config(base: Path, port: int, recorder: Path) -> Path:
    """The agent with the xid check alone; its CRITICAL actions replaced by one that records what would have been
    drained (the real drain would reach the test cluster), and the WARNING ones left as shipped (none)."""
    path = base / "trainguard.toml"
    path.write_text(f"""[agent]
node_name = "xidhist"
state_dir = "{base / "state"}"
listen = "127.0.0.1:{port}"
[jobs]
sources = []
[checks.xid]
actions = {{ critical = ["record"] }}
[notifiers.console]
[actions.record]
type = "exec"
command = ["sh", "-c", 'echo "$TRAINGUARD_EVENT $TRAINGUARD_SUBJECT" >> {recorder}']
""")
    return path


def xid_result(config: Path, subject: str) -> dict[str, Any] | None:
    """The xid check's last result for a subject, as `trainguard status --json` shows it."""
    done = subprocess.run([sys.executable, "-m", "trainguard", "status", "--json", "--config", str(config)],
                          capture_output=True, text=True, timeout=30, cwd=REPO)
    if done.returncode != 0:
        return None
    results = json.loads(done.stdout)["checks"].get("xid", {}).get("results", [])
    return next((r for r in results if r["subject"] == subject), None)


def before_start_metric(port: int, bus: str) -> float | None:
    text = http_get(f"http://127.0.0.1:{port}/metrics").text
    found = re.search(rf'^trainguard_gpu_xid_before_start\{{[^}}]*bus_id="{bus}"[^}}]*xid="79"[^}}]*\}} (\S+)$', text,
                      re.MULTILINE)
    return float(found.group(1)) if found else None


def acted_on(recorder: Path, subject: str) -> list[str]:
    lines = recorder.read_text().splitlines() if recorder.exists() else []
    return [line for line in lines if line.split()[-1] == subject]


def test_a_restart_with_old_kernel_log_xids_and_a_healthy_gpu_does_not_drain(kmsg: Any, tmp_path: Path,
                                                                               agent_process: Any) -> None:
    """The issue's test: XIDs in the ring buffer before the agent's first start, on a scripted GPU that reads healthy:
    reported (status, metrics), never drained, not at the first start nor after a restart. A GPU NVML does not list
    is drained for its old XID; an XID logged while the agent was down, or while it runs, is acted on."""
    domain = random.randint(0x40, 0xFF)  # the scripted board's PCI domain: no other test's GPUs, no real one
    healthy, other, missing = (f"{domain:04x}:{b}:00" for b in ("18", "19", "30"))
    uuid0, uuid1 = (f"GPU-{i:08x}-0000-4000-8000-{domain:012x}" for i in (0, 1))
    for bus in (healthy, missing):
        kmsg.write(f"NVRM: Xid (PCI:{bus}): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus. [t]")
    port, recorder = free_port(), tmp_path / "actions"
    config = agent_config(tmp_path, port, recorder)
    env = {"TRAINGUARD_FAKE_GPUS": "2", "TRAINGUARD_FAKE_GPU_DOMAIN": f"{domain:04x}", "TRAINGUARD_FAKE_GPU_HEALTHY": "1"}

    def start(name: str) -> AgentProcess:
        agent: AgentProcess = agent_process(config, env, log_name=name, module="tests.helpers.fake_gpu_agent")
        agent.wait_for("kernel log replayed", 30)
        return agent

    def health_check() -> dict[str, Any]:  # `trainguard check` as a SLURM HealthCheckProgram runs it, beside the agent
        done = subprocess.run([sys.executable, "-m", "tests.helpers.fake_gpu_agent", "check", "--json", "--config",
                               str(config)], capture_output=True, text=True, timeout=60, cwd=REPO,
                              env={**os.environ, **env})
        return {r["subject"]: r for r in json.loads(done.stdout)["results"] if r["check"] == "xid"}

    assert health_check()[uuid0]["status"] == "CRITICAL"  # no agent yet on this boot: every XID counts as logged
    agent = start("agent0.log")
    assert "first start on this boot" in agent.output()
    # the health check now places records by the agent's first start: the same history, no drain for it
    checked = health_check()
    assert checked[uuid0]["status"] == "WARNING" and HISTORY.format(bus=healthy) in checked[uuid0]["summary"]
    assert checked[f"pci:{missing}"]["status"] == "CRITICAL"
    wait_until(lambda: acted_on(recorder, f"pci:{missing}"), 15, what="the missing GPU's old XID to be acted on")
    result = wait_until(lambda: (r := xid_result(config, uuid0)) and r["status"] == "WARNING" and r, 15,
                        what="the healthy GPU's old XID in the status")
    assert HISTORY.format(bus=healthy) in result["summary"]  # type: ignore[index]
    assert before_start_metric(port, healthy) == 1
    time.sleep(2)  # more runs: none may grade it CRITICAL
    assert acted_on(recorder, uuid0) == []
    agent.signal(signal.SIGTERM)
    assert agent.wait(15) == 0

    kmsg.write(f"NVRM: Xid (PCI:{other}): 48, pid=77, name=python, DBE (double bit error). [t]")  # while down
    again = start("agent1.log")
    assert "started before on this boot" in again.output()
    wait_until(lambda: acted_on(recorder, uuid1), 15, what="the XID logged while the agent was down to be acted on")
    result = wait_until(lambda: (r := xid_result(config, uuid0)) and r["status"] == "WARNING" and r, 15,
                        what="the old XID still reported after the restart")
    assert HISTORY.format(bus=healthy) in result["summary"]  # type: ignore[index]
    time.sleep(2)
    assert acted_on(recorder, uuid0) == [], "an old XID on a healthy GPU drained the node after a restart"
    assert acted_on(recorder, f"pci:{missing}") == [f"fired pci:{missing}"]  # the restart did not act on it again

    kmsg.write(f"NVRM: Xid (PCI:{healthy}): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus. [t]")
    wait_until(lambda: acted_on(recorder, uuid0), 10, what="a new XID on the healthy GPU to be acted on")
    assert before_start_metric(port, healthy) == 0
    again.signal(signal.SIGTERM)
    assert again.wait(15) == 0


# trainguard check --since ----------------------------------------------------------------------------------------
def one_shot(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainguard", "check", "--json", "--config", str(config), *args],
                          capture_output=True, text=True, timeout=60, cwd=REPO)


def test_check_since_counts_only_newer_kernel_records(kmsg: Any, tmp_path: Path) -> None:
    bus = f"{random.randint(0x40, 0xFF):04x}:{random.randint(0, 255):02x}:00"
    kmsg.write(f"NVRM: Xid (PCI:{bus}): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus. [t]")
    config = tmp_path / "trainguard.toml"
    config.write_text(f'[agent]\nstate_dir = "{tmp_path / "state"}"\nlisten = ""\n[jobs]\nsources = []\n'
                      '[checks.xid]\nactions = { critical = [] }\n')
    subjects = lambda done: {r["subject"] for r in json.loads(done.stdout)["results"]}  # noqa: E731

    whole = one_shot(config, "--since", "boot")
    assert whole.returncode == int(Status.CRITICAL) and f"pci:{bus}" in subjects(whole), whole.stdout[-2000:]
    time.sleep(2.2)
    recent = one_shot(config, "--since", "2s")
    assert f"pci:{bus}" not in subjects(recent), recent.stdout[-2000:]
    assert one_shot(config, "--since", "1d").returncode == int(Status.CRITICAL)  # longer than the test's past: all
    kmsg.write(f"NVRM: Xid (PCI:{bus}): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus. [t]")
    fresh = one_shot(config, "--since", "1m")
    assert fresh.returncode == int(Status.CRITICAL) and f"pci:{bus}" in subjects(fresh), fresh.stdout[-2000:]


def test_check_since_refuses_a_bad_value_naming_it(tmp_path: Path) -> None:
    done = one_shot(tmp_path / "none.toml", "--since", "yesterday")
    assert done.returncode != 0 and done.stdout == ""
    assert "--since" in done.stderr and "'yesterday'" in done.stderr and "'boot'" in done.stderr, done.stderr


def test_history_of_a_recovery_action_stays_critical_on_a_gpu_that_reads_healthy(tmp_path: Path) -> None:
    """XID 154 names a state the driver keeps until the GPU is reset or the node rebooted, which NVML's health fields
    do not show: an old one is still a fault present, never history."""
    check = started_check(tmp_path, FakeNvml(fake_board()))
    first = check.ledger.first_start
    assert first is not None
    check.ledger.record(XidEvent(154, "0000:3b:00", "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot "
                                 "Required)", recovery="Node Reboot Required", usec=first.usec // 2))
    try:
        healthy = by_subject(list(check.run()))["GPU-healthy"]
        assert healthy.status is Status.CRITICAL, healthy.summary
        assert "before trainguard started, and GPU 0000:3b:00 may read healthy" in healthy.summary
        assert not healthy.details["xids"][0]["history"]
    finally:
        check.stop()


class RefusingStore:
    """A state store whose writes fail, as a corrupt SQLite file's do."""

    def get(self, key: str) -> str | None:
        return None

    def put(self, key: str, value: str) -> None:
        raise sqlite3.DatabaseError("database disk image is malformed")


def test_a_state_store_that_refuses_the_first_start_still_leaves_the_kernel_log_followed(tmp_path: Path) -> None:
    context = CheckContext("n", tmp_path, nvml=Nvml(FakeNvml(fake_board())), xid_history=XidLedger(RefusingStore()))
    check = XidCheck("xid", XidSettings(kmsg_path=str(tmp_path / "none"), journalctl=str(tmp_path / "nojournal")),
                     context)
    check.start(lambda: None)  # raised the store's error, and never started the follower, before
    try:
        assert check.ledger.first_start is not None  # kept in memory for this life
        # the follower ran: no /dev/kmsg here, so it tried the journal, and says why that failed
        wait_until(lambda: check.follower.error is not None, 5, what="the follower to run and give up")
        assert "nojournal" in check.follower.error or "journal" in check.follower.error.lower(), check.follower.error
    finally:
        check.stop()


# trainguard check beside a running agent: the same history, the same clears ----------------------------------------
def one_shot_check(state_dir: Path) -> XidCheck:
    """`trainguard check`'s xid check: a ledger of its own (no store), the agent's state directory, never started."""
    store = Store(None)
    context = CheckContext("n", state_dir, nvml=Nvml(FakeNvml(fake_board())), state=ScopedState(store, "check/xid"),
                           xid_history=XidLedger(store))
    empty = state_dir / "empty-kmsg"  # a kernel log with nothing in it: the test records into the ledger itself
    empty.touch()
    return XidCheck("xid", XidSettings(kmsg_path=str(empty), journalctl=str(state_dir / "nojournal")), context)


def test_a_one_shot_check_places_records_by_the_agents_first_start_and_clears(tmp_path: Path) -> None:
    """Without the agent's marks a health check graded every XID of the boot as logged: CRITICAL, drained, for an
    XID the agent reports as history; and it never saw an operator's clear."""
    before = one_shot_check(tmp_path)
    before.run()  # no agent has started with this state directory: nothing to place records by
    assert before.ledger.first_start is None

    agent = started_check(tmp_path, FakeNvml(fake_board()))
    first = agent.ledger.first_start
    assert first is not None
    marks = json.loads((tmp_path / MARKS_FILE).read_text())
    assert marks["first_start"] == [first.seq, first.usec] and marks["boot_id"] == agent.ledger.boot_id
    old = first.usec // 2  # kernel times count from boot: "before the first start" is half-way there

    check = one_shot_check(tmp_path)
    check.run()
    assert check.ledger.first_start == first
    check.ledger.record(XidEvent(79, "0000:3b:00", "GPU has fallen off the bus.", usec=old))
    check.ledger.record(XidEvent(79, "0000:86:00", "GPU has fallen off the bus.", usec=old))
    results = by_subject(list(check.run()))
    assert results["GPU-healthy"].status is Status.WARNING and HISTORY.format(bus="0000:3b:00") in \
        results["GPU-healthy"].summary
    assert results["GPU-lost"].status is Status.CRITICAL  # a GPU that does not read healthy: as logged

    agent.ledger.record(XidEvent(79, "0000:86:00", "GPU has fallen off the bus.", usec=old))  # as the agent saw it
    agent.clear("GPU-lost", time.time())  # an operator: the GPU was reset, its XIDs are over
    agent.stop()
    check = one_shot_check(tmp_path)
    check.run()
    assert check.ledger.record(XidEvent(79, "0000:86:00", "GPU has fallen off the bus.", usec=old)) is None
    assert check.ledger.record(XidEvent(79, "0000:3b:00", "GPU has fallen off the bus.", usec=old)) is not None
    results = by_subject(list(check.run()))
    assert "GPU-lost" not in results and results["GPU-healthy"].status is Status.WARNING


def said(caplog: Any) -> str:
    """Why the marks were not taken, as the log line's error field says it."""
    return " ".join(str(r.kv.get("error")) for r in caplog.records if r.getMessage().startswith("XID marks not taken"))


def test_marks_of_another_boot_unknown_boot_or_anyone_s_are_not_taken(tmp_path: Path, caplog: Any) -> None:
    """The marks silence a drain, so only the agent's own are taken: of this boot (a boot id that can't be read
    tells no boot from another), in a file of root or the state directory's owner that no one else may write."""
    require_root()  # to give the file to another user
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    path = state / MARKS_FILE
    ledger = XidLedger(None, proc=fake_proc(tmp_path / "proc", "boot-b"))
    assert not ledger.adopt_marks({"boot_id": "boot-a", "first_start": [5, 100], "cleared": []})  # a reboot since
    assert not ledger.adopt_marks(["not", "a", "dict"])
    assert not XidLedger(None, proc=fake_proc(tmp_path / "noboot", "")).adopt_marks(
        {"boot_id": "", "first_start": [5, 100], "cleared": []})
    assert ledger.adopt_marks({"boot_id": "boot-b", "first_start": ["x", None], "cleared": [["xid", "0000:3b:00", 9, 9],
                                                                                            "junk", [1, 2]]})
    assert ledger.first_start is None  # what does not parse is left out, the rest is taken
    assert ledger.record(XidEvent(79, "0000:3b:00", "old", seq=8, usec=8)) is None  # before the clear

    good = json.dumps({"boot_id": XidLedger(None).boot_id, "first_start": [1, 1], "cleared": []}).encode()
    cases = [(b"{not json", "Expecting"), (b"[" * 100_000, "recursion"), (b"x" * (2 << 20), "larger than"),
             (good, "not trusted")]  # the last one group-writable: anyone in the group could have written it
    for content, why in cases:
        caplog.clear()
        path.write_bytes(content)
        path.chmod(0o664 if content is good else 0o644)
        check = one_shot_check(state)
        results = check.run()  # still runs: every record counts as logged
        assert check.ledger.first_start is None and not [r for r in results if r.status is Status.CRITICAL]
        assert why in said(caplog), (why, said(caplog))
    path.chmod(0o644)
    os.chown(path, 12345, 12345)  # another user's file
    check = one_shot_check(state)
    check.run()
    assert check.ledger.first_start is None and "owned by uid 12345" in said(caplog)
    os.chown(path, os.getuid(), os.getgid())
    state.chmod(0o777)  # a directory anyone may write: its files are anyone's
    check = one_shot_check(state)
    check.run()
    assert check.ledger.first_start is None
    state.chmod(0o700)
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere.json")  # not followed
    (tmp_path / "elsewhere.json").write_bytes(good)
    check = one_shot_check(state)
    check.run()
    assert check.ledger.first_start is None
    path.unlink()
    path.write_bytes(good)
    check = one_shot_check(state)
    check.run()
    assert check.ledger.first_start == LogPoint(1, 1)  # the same file, the agent's: taken


def test_a_first_start_the_store_refused_is_not_published(tmp_path: Path) -> None:
    """Kept in memory only, it moves with every restart of a crash-looping agent: published, it would make history,
    for the health check, of what an earlier life saw logged. The health check grades everything as logged instead."""
    (tmp_path / MARKS_FILE).write_text("{}")  # an older life's
    context = CheckContext("n", tmp_path, nvml=Nvml(FakeNvml(fake_board())), xid_history=XidLedger(RefusingStore()))
    check = XidCheck("xid", XidSettings(kmsg_path=str(tmp_path / "none"), journalctl=str(tmp_path / "nojournal")),
                     context)
    check.start(lambda: None)
    try:
        assert check.ledger.first_start is not None and not (tmp_path / MARKS_FILE).exists()
    finally:
        check.stop()
