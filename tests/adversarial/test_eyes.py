"""Freezing, blinding and borrowing the agent's eyes, through the real agent process: one job's user writes the
worst they can (lines that made the regexes backtrack for seconds, poison sizes, a FIFO and /dev/zero as the
heartbeat, a StdOut path naming root's secret) while another job OOMs. The agent keeps answering, reports the honest
job's OOM, stays small, and never shows what the hostile user could not read themselves."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import requests

from tests.conftest import AgentProcess, control_status, free_port, require_root
from tests.slurm_cluster import JOB_USER, SlurmCluster, ensure_user
from tests.test_training_log import OOM_H100

ASSERT_BOMB = ("/x/Indexing.cu:1: indexSelect: block: [0,0,0], thread: [0,0,0] Assertion `" + "srcIndex < " * 1150
               + "` failed.\nRuntimeError: CUDA error: an illegal memory access was encountered\n")  # ~12.6 KB
STEP_BOMB = "step" + " " * 60_000 + "\n"
POISON = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.2.3 GiB. GPU 0 has a total capacity of "
          + "9" * 400 + " GiB of which 1 GiB is free.\n")


@pytest.fixture
def hostile_and_honest() -> Iterator[tuple[Path, Path, list[subprocess.Popen[bytes]], str]]:
    require_root()
    ensure_user(JOB_USER)
    base = Path(tempfile.mkdtemp(prefix="trainguard-eyes-", dir="/tmp"))
    base.chmod(0o755)
    marker = uuid.uuid4().hex[:8]
    hostile, honest = base / "hostile", base / "honest"
    for d in (hostile, honest):
        (d / "switch").mkdir(parents=True)
        shutil.chown(d, JOB_USER, JOB_USER)
        shutil.chown(d / "switch", JOB_USER, JOB_USER)
    os.mkfifo(hostile / "switch" / "heartbeat.json")  # a heartbeat that would block whoever opens it
    procs = [subprocess.Popen(["sleep", "600", f"{marker}-{n}"], user=JOB_USER, cwd="/") for n in ("hostile", "honest")]
    yield hostile, honest, procs, marker
    for p in procs:
        p.kill()
        p.wait()
    shutil.rmtree(base, ignore_errors=True)


def test_one_hostile_log_neither_freezes_nor_blinds_the_agent(
        tmp_path: Path, hostile_and_honest: tuple[Path, Path, list[subprocess.Popen[bytes]], str],
        agent_process: Callable[..., AgentProcess]) -> None:
    hostile, honest, _, marker = hostile_and_honest
    port = free_port()
    config = tmp_path / "trainguard.toml"
    config.write_text(f"""
[agent]
node_name = "eyes"
state_dir = "{tmp_path / 'state'}"
listen = "127.0.0.1:{port}"
[jobs]
sources = ["process"]
refresh = "0s"
[jobs.processes.hostile]
cmdline = "{marker}-hostile"
user = "{JOB_USER}"
logs = ["{hostile}/train.log"]
switch_dir = "{hostile}/switch"
[jobs.processes.honest]
cmdline = "{marker}-honest"
user = "{JOB_USER}"
logs = ["{honest}/train.log"]
switch_dir = "{honest}/switch"
[checks.training_log]
interval = "1s"
[checks.hang]
interval = "1s"
stale_after = "1h"
[notifiers.console]
""")
    agent = agent_process(config)
    agent.wait_for("msg=ready")
    (hostile / "train.log").write_text("step 1 loss=2.0\n")
    bombs = ASSERT_BOMB * 8 + STEP_BOMB * 16 + POISON * 4 + ("x" * (1 << 20) + "\n")
    with (hostile / "train.log").open("a") as f:
        f.write(bombs)
    shutil.chown(hostile / "train.log", JOB_USER, JOB_USER)
    (honest / "train.log").write_text("step 41 loss=1.1\n" + OOM_H100 + "\n")
    shutil.chown(honest / "train.log", JOB_USER, JOB_USER)

    latencies = []
    deadline = time.monotonic() + 12
    while time.monotonic() < deadline:
        t0 = time.monotonic()
        assert requests.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
        latencies.append(time.monotonic() - t0)
        if "event=fired check=training_log subject=process:honest" in agent.output():
            break
        time.sleep(0.05)
    agent.wait_for("event=fired check=training_log subject=process:honest", timeout=20)
    latencies.sort()
    assert latencies[int(len(latencies) * 0.98)] < 0.1 and latencies[-1] < 0.5, (
        f"/healthz median {statistics.median(latencies) * 1000:.1f} ms, slowest {latencies[-1] * 1000:.0f} ms")
    assert "CUDA out of memory (fragmentation)" in agent.output()
    # the FIFO heartbeat blocked nothing; pointing it at /dev/zero reads nothing either
    (hostile / "switch" / "heartbeat.json").unlink()
    (hostile / "switch" / "heartbeat.json").symlink_to("/dev/zero")
    with (honest / "train.log").open("a") as f:
        f.write("step 42 loss=1.0\n")
    time.sleep(3)
    assert requests.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
    assert agent.proc is not None and psutil.Process(agent.proc.pid).memory_info().rss < 400 << 20
    assert "Traceback" not in agent.output()


def test_a_failed_jobs_stdout_naming_roots_secret_never_reaches_an_alert(
        slurm: SlurmCluster, tmp_path: Path, agent_process: Callable[..., AgentProcess]) -> None:
    secret = tmp_path.parent / f"root-secret-{uuid.uuid4().hex[:6]}"
    secret.write_text("RuntimeError: password=hunter3\n")
    secret.chmod(0o600)
    name = f"tg-eyes-{uuid.uuid4().hex[:6]}"
    workdir = slurm.workdir()
    port = free_port()
    config = tmp_path / "trainguard.toml"
    config.write_text(f"""
[agent]
state_dir = "{tmp_path / 'state'}"
listen = "127.0.0.1:{port}"
node_name = "{slurm.node}"
[jobs]
sources = ["slurm"]
refresh = "0s"
prolog_dir = "{tmp_path / 'records'}"
[checks.training_log]
interval = "1s"
[notifiers.console]
""")
    # The agent knows the jobs of its node, not every finished job of the queue (issue 19). This one never runs a
    # process (slurmstepd can't open root's file as its stdout): only the Prolog/Epilog hook tells of it.
    with slurm.trainguard_hooks(tmp_path / "records"):
        agent = agent_process(config)
        agent.wait_for("msg=ready")
        job_id = slurm.submit("exit 3", f"--output={secret}", workdir=workdir, name=name)
        slurm.wait_state(job_id, ("FAILED", "COMPLETED"))
        agent.wait_for(f"event=fired check=training_log subject=slurm:{job_id}", timeout=30)
    assert "hunter3" not in agent.output()
    status = requests.get(f"http://127.0.0.1:{port}/status", timeout=5).json()
    assert "hunter3" not in str(status) and status["details"] is False
    assert all(not i.get("details") and not i.get("summary") for i in status["incidents"])  # TCP: no job's text
    full = control_status(tmp_path / "state")  # root's view: the agent never read the file to begin with
    assert full["details"] is True and "hunter3" not in str(full)
    assert secret.read_text() == "RuntimeError: password=hunter3\n"
