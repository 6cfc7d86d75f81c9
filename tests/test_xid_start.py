"""The XID check at start and after: a kernel ring buffer that already holds XIDs when the agent starts (issue 26:
each fault fired, resolved and fired again), and an operator's clear of a GPU's XID history."""

from __future__ import annotations

import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.conftest import REPO, AgentProcess, wait_until

INSTALLED = REPO / "trainguard" / "default.toml"  # what `trainguard install` writes
# XIDs NVIDIA's catalog leaves out of any response (trainguard `ignore`): recorded, graded OK. Fourteen per GPU make
# the ledger overflow (MAX_ENTRIES = 512) with 40 GPUs, the way a shared node's ring buffer did.
FILLER = (14, 37, 38, 43, 44, 63, 66, 67, 92, 93, 106, 107, 108, 121)


def installed_config(base: Path, recorder: Path, extra: str = "") -> Path:
    """The installed config, with its own state dir, no listener, and the xid check's critical actions replaced by a
    recording one (the real signal/drain/requeue would reach the test cluster's node)."""
    text = INSTALLED.read_text()
    text = text.replace("[agent]\n", f'[agent]\nnode_name = "xidstart"\nstate_dir = "{base / "state"}"\nlisten = ""\n',
                        1)
    text = text.replace("[checks.xid]", '[checks.xid]\nactions = { critical = ["record"] }', 1)
    text += f"""
[actions.record]
type = "exec"
command = ["sh", "-c", 'echo "$TRAINGUARD_EVENT $TRAINGUARD_SUBJECT" >> {recorder}']
{extra}"""
    path = base / "trainguard.toml"
    path.write_text(text)
    return path


def alerts(agent: AgentProcess, kind: str, buses: list[str]) -> list[str]:
    """Subjects of the console notifier's lines of one kind, for these GPUs only (the ring buffer is shared)."""
    mine = {f"pci:{b}" for b in buses}
    found = re.findall(rf"logger=trainguard\.alert event={kind} \S+ \S+ check=xid subject=(\S+)", agent.output())
    return [s for s in found if s in mine]


def test_first_start_on_a_kernel_log_holding_xids_fires_each_once(kmsg: Any, tmp_path: Path,
                                                                  agent_process: Any) -> None:
    domain = f"00{random.randint(0x40, 0xff):02x}"
    buses = [f"{domain}:{i:02x}:00" for i in range(40)]
    for bus in buses:  # the faults first, then noise on the same GPUs: an oldest-first ledger drops the faults
        kmsg.write(f"NVRM: Xid (PCI:{bus}): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus. [t]")
    for xid in FILLER:
        for bus in buses:
            kmsg.write(f"NVRM: Xid (PCI:{bus}): {xid}, pid=1, name=python, noise [t]")
    recorder = tmp_path / "actions"
    config = installed_config(tmp_path, recorder)
    for start in range(3):
        agent = agent_process(config, log_name=f"agent{start}.log")
        agent.wait_for("first round done", 30)
        if start == 0:
            wait_until(lambda agent=agent: len(alerts(agent, "fired", buses)) >= len(buses), 15, what="every GPU to fire")
        agent.wait_for("kernel log replayed")
        time.sleep(3)  # runs after the replay (the kernel-log subject's and the first round's): none may resolve
        agent.signal(signal.SIGTERM)
        assert agent.wait(15) == 0
        fired, resolved = alerts(agent, "fired", buses), alerts(agent, "resolved", buses)
        assert resolved == [], f"start {start}: resolved {resolved}"
        assert sorted(fired) == (sorted(f"pci:{b}" for b in buses) if start == 0 else []), f"start {start}"
    lines = recorder.read_text().splitlines()
    mine = sorted(line for line in lines if line.split()[-1] in {f"pci:{b}" for b in buses})
    assert mine == sorted(f"fired pci:{b}" for b in buses), "each GPU's action ran once, over three starts"


def clear(config: Path, target: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainguard", "clear", target, "--reason", "GPU reset",
                           "--config", str(config)], capture_output=True, text=True, timeout=30, cwd=REPO)


def test_clear_forgets_a_gpus_xids_and_a_new_one_fires_as_new(kmsg: Any, tmp_path: Path, agent_process: Any) -> None:
    """`trainguard clear xid/pci:BUS` through the control socket: the incident resolves, the old XIDs never come back
    (not at the next runs, not after a restart that replays from the saved cursor), a new XID fires as new; another
    GPU's history stays."""
    bus, other = f"00{random.randint(0x40, 0xff):02x}:01:00", f"00{random.randint(0x40, 0xff):02x}:02:00"
    for b in (bus, other):
        kmsg.write(f"NVRM: Xid (PCI:{b}): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus. [t]")
    recorder = tmp_path / "actions"
    config = installed_config(tmp_path, recorder)
    agent = agent_process(config)
    wait_until(lambda: len(alerts(agent, "fired", [bus, other])) == 2, 20, what="both GPUs to fire")
    done = clear(config, f"xid/pci:{bus}")
    assert done.returncode == 0, done.stderr
    agent.wait_for("cleared by root: GPU reset")
    assert alerts(agent, "resolved", [bus]) == [f"pci:{bus}"]
    agent.wait_for("XID history cleared")
    time.sleep(2)  # the run the clear triggers, and the next: the old XID must not come back
    assert alerts(agent, "fired", [bus]) == [f"pci:{bus}"]

    agent.signal(signal.SIGTERM)
    assert agent.wait(15) == 0
    again = agent_process(config, log_name="agent-again.log")
    again.wait_for("first round done", 30)
    time.sleep(2)
    assert alerts(again, "fired", [bus, other]) == [] and alerts(again, "resolved", [bus, other]) == []
    kmsg.write(f"NVRM: Xid (PCI:{bus}): 48, pid=77, name=python, DBE (double bit error). [t]")
    wait_until(lambda: alerts(again, "fired", [bus]) == [f"pci:{bus}"], 10, what="the new XID to fire")
    assert "XID 48" in again.output() and "XID 79" not in re.findall(r"event=fired .*?subject=pci:" + bus + r".*",
                                                                       again.output())[0]
    again.signal(signal.SIGTERM)
    assert again.wait(15) == 0
    # Only this test's GPUs: the ring buffer holds other tests' XIDs too, and the agent fires on each once.
    fired = [line for line in recorder.read_text().splitlines() if line in (f"fired pci:{bus}", f"fired pci:{other}")]
    assert sorted(fired) == sorted([f"fired pci:{bus}", f"fired pci:{other}", f"fired pci:{bus}"])
