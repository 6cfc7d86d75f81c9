"""The agent under the service's user and capability set (setpriv, without systemd as PID 1): each privileged
feature still works, and without the capabilities it would not."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from trainguard.install import Installer

from .conftest import AgentProcess, require_root, require_tool, unique_bus, wait_until, xid79
from .slurm_cluster import ensure_user

SERVICE_USER = "trainguard"
JOB_USER = "tgpriv"
CAPS = "+kill,+syslog,+dac_read_search,+sys_ptrace"  # the unit's CapabilityBoundingSet / AmbientCapabilities
OOM = ("[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
       "of 79.15 GiB of which 1.06 GiB is free.")


def setpriv(caps: str) -> list[str]:
    """The service user with exactly `caps` (none when empty), as the unit's Ambient/BoundingSet give them."""
    keep = f"-all,{caps}" if caps else "-all"
    return [require_tool("setpriv"), f"--reuid={SERVICE_USER}", f"--regid={SERVICE_USER}", "--init-groups",
            f"--inh-caps={keep}", f"--ambient-caps={keep}", f"--bounding-set={keep}", "--no-new-privs"]


@pytest.fixture
def restricted_kmsg() -> Iterator[None]:
    """kernel.dmesg_restrict=1, as on most distributions: reading /dev/kmsg then needs CAP_SYSLOG."""
    require_root()
    knob = Path("/proc/sys/kernel/dmesg_restrict")
    old = knob.read_text().strip()
    knob.write_text("1\n")
    yield
    knob.write_text(old + "\n")


@pytest.fixture
def job_in_home() -> Iterator[tuple[subprocess.Popen[bytes], Path, str]]:
    """A training process of another user, logging into its 0700 home, that records the signals it gets."""
    require_root()
    Installer().ensure_user()  # the service user, as `trainguard install` creates it
    ensure_user(JOB_USER)
    home = Path(pwd.getpwnam(JOB_USER).pw_dir)
    home.chmod(0o700)
    run = home / f"run-{uuid.uuid4().hex[:6]}"
    run.mkdir()
    shutil.chown(run, JOB_USER, JOB_USER)
    marker = f"privjob-{uuid.uuid4().hex[:8]}"
    code = ("import signal, sys, time, pathlib\n"
            f"got = pathlib.Path({str(run / 'signals')!r})\n"
            "signal.signal(signal.SIGUSR1, lambda *a: got.write_text('USR1'))\n"
            "time.sleep(120)\n")
    proc = subprocess.Popen([require_tool("setpriv"), f"--reuid={JOB_USER}", f"--regid={JOB_USER}", "--init-groups",
                             sys.executable, "-c", code, marker])
    yield proc, run, marker
    proc.kill()
    proc.wait()
    shutil.rmtree(run, ignore_errors=True)


def test_without_the_capabilities_the_features_are_denied(restricted_kmsg: None,
                                                          job_in_home: tuple[Any, Path, str]) -> None:
    _, run, _ = job_in_home
    (run / "train.log").write_text("step 1\n")
    probe = ("import os, sys\n"
             "for what, f in (('kmsg', lambda: os.open('/dev/kmsg', os.O_RDONLY)),\n"
             f"                 ('log', lambda: open({str(run / 'train.log')!r}).read()),\n"
             f"                 ('kill', lambda: os.kill({job_in_home[0].pid}, 0))):\n"
             "    try:\n        f(); print(what, 'ok')\n"
             "    except PermissionError: print(what, 'denied')\n")
    plain = subprocess.run([*setpriv(""), sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
    assert plain.stdout.split("\n")[:3] == ["kmsg denied", "log denied", "kill denied"], plain.stderr
    capable = subprocess.run([*setpriv(CAPS), sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
    assert capable.stdout.split("\n")[:3] == ["kmsg ok", "log ok", "kill ok"], capable.stderr


def test_agent_as_the_service_user_reads_kmsg_signals_a_job_and_reads_its_log(
        tmp_path: Path, kmsg: Any, restricted_kmsg: None, job_in_home: tuple[Any, Path, str],
        agent_process: Callable[..., AgentProcess]) -> None:
    _, run, marker = job_in_home
    log = run / "train.log"  # found by a glob: its private directory listed by the service user as the job's user
    log.write_text("step 1 loss=2.0\n")
    shutil.chown(log, JOB_USER, JOB_USER)
    state = tmp_path / "state"
    state.mkdir()
    shutil.chown(state, SERVICE_USER, SERVICE_USER)
    config = tmp_path / "trainguard.toml"
    config.write_text(f"""
[agent]
state_dir = "{state}"
listen = ""
[jobs]
sources = ["process"]
refresh = "0s"
[jobs.processes.trainer]
cmdline = "{marker}"
user = "{JOB_USER}"
logs = ["{run}/*.log"]
[checks.xid]
actions = {{ critical = ["signal"] }}
[checks.training_log]
interval = "1s"
jitter = "0s"
[notifiers.console]
""")
    config.chmod(0o644)
    agent = agent_process(config, wrapper=setpriv(CAPS))
    agent.wait_for("check=xid", timeout=20)
    time.sleep(1)
    bus = unique_bus()
    kmsg.write(xid79(bus))
    agent.wait_for("action=signal", timeout=15)
    wait_until((run / "signals").exists, 10, what="USR1 delivered to the other user's job")
    assert (run / "signals").read_text() == "USR1"
    with log.open("a") as f:
        f.write(OOM + "\n")
    agent.wait_for("CUDA out of memory", timeout=15)
    out = agent.output()
    assert "outcome=ok" in out and "Permission denied" not in out, out
    assert os.stat(state).st_uid == pwd.getpwnam(SERVICE_USER).pw_uid


@pytest.fixture
def hidepid_proc(tmp_path: Path) -> Iterator[Path]:
    """A /proc instance mounted as systemd's ProtectProc=invisible mounts it in the unit's namespace."""
    require_root()
    mountpoint = tmp_path / "proc"
    mountpoint.mkdir()
    tmp_path.chmod(0o755)  # the service user must reach the mount point
    subprocess.run(["mount", "-t", "proc", "-o", "hidepid=invisible", "proc", str(mountpoint)], check=True, timeout=30)
    yield mountpoint
    subprocess.run(["umount", "-l", str(mountpoint)], check=True, timeout=30)


def test_agent_says_when_other_users_processes_are_invisible(hidepid_proc: Path,
                                                              job_in_home: tuple[Any, Path, str]) -> None:
    """The "No ptrace" recipe: without CAP_SYS_PTRACE under hidepid every other user's process is gone (jobs look
    ABSENT), and hidden_processes() says so; with it, or with hidepid off, nothing is hidden."""
    job = job_in_home[0]
    probe = ("import sys, pathlib; sys.path.insert(0, sys.argv[1]); from trainguard.node.procfs import ProcFS\n"
             "root = pathlib.Path(sys.argv[2])\n"
             f"print((root / '{job.pid}').exists(), ProcFS(root).hidden_processes())\n")
    repo = str(Path(__file__).parent.parent)
    for caps, proc_root, expected in (
            ("+kill,+syslog,+dac_read_search", hidepid_proc,
             f"False {hidepid_proc} is mounted hidepid=invisible and this process lacks CAP_SYS_PTRACE"),
            (CAPS, hidepid_proc, "True None"),
            ("+kill,+syslog,+dac_read_search", Path("/proc"), "True None")):
        out = subprocess.run([*setpriv(caps), sys.executable, "-c", probe, repo, str(proc_root)],
                             capture_output=True, text=True, timeout=30)
        assert out.stdout.strip() == expected, (caps, proc_root, out.stderr)
