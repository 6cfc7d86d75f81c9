"""Blinding the log check with many files, through the real agent process: one job's user fills their job's own
documented log glob (`.../logs/*.log`) with 300,000 empty files, while another user's job hits a CUDA OOM. The agent
reads the newest files of the glob only (as the hostile user may list them, examining a capped number of entries),
reports the honest job's OOM within its normal time, never times out, and its state stays small."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import AgentProcess, free_port, require, require_root
from tests.slurm_cluster import JOB_USER, OTHER_USER, ensure_user
from tests.test_training_log import OOM_H100

FILES = 300_000
SYSTEM_PYTHON = "/usr/bin/python3"  # the job users' own: the test's venv lies under /root
INTERVAL = 2.0  # the log check's interval here: the OOM is due within 3 of them, plus room to start


@pytest.fixture
def base() -> Iterator[Path]:
    require_root()
    require(os.access(SYSTEM_PYTHON, os.X_OK), f"needs {SYSTEM_PYTHON} for the job users")
    for user in (JOB_USER, OTHER_USER):
        ensure_user(user)
    made = Path(tempfile.mkdtemp(prefix="trainguard-files-", dir="/tmp"))  # job users reach it (pytest's is private)
    made.chmod(0o755)
    yield made
    shutil.rmtree(made, ignore_errors=True)


def make_files(logs: Path, count: int) -> float:
    """`count` empty files in `logs`, created by the hostile user themselves (chown afterwards would take longer);
    the seconds it took."""
    t0 = time.monotonic()
    subprocess.run([SYSTEM_PYTHON, "-c", "import os, sys\n"
                    "d, n = sys.argv[1], int(sys.argv[2])\n"
                    "for i in range(n):\n"
                    "    os.close(os.open(f'{d}/{i}.log', os.O_CREAT | os.O_WRONLY, 0o644))\n", str(logs), str(count)],
                   user=JOB_USER, group=JOB_USER, extra_groups=[], check=True, timeout=120)
    return time.monotonic() - t0


def test_300000_files_in_one_jobs_glob_blind_no_other_job(
        tmp_path: Path, base: Path, tmpfs: Callable[..., Path], agent_process: Callable[..., AgentProcess]) -> None:
    marker = uuid.uuid4().hex[:8]
    hostile = tmpfs(size="256m", inodes=FILES + 1000, parent=base)  # 300,000 inodes, gone at once when unmounted
    honest = base / "honest"
    honest.mkdir()
    shutil.chown(honest, OTHER_USER, OTHER_USER)
    (hostile / "logs").mkdir()
    shutil.chown(hostile / "logs", JOB_USER, JOB_USER)
    made_in = make_files(hostile / "logs", FILES)
    procs = [subprocess.Popen(["/bin/sh", "-c", "sleep 600; :", f"{marker}-{name}"], user=user, cwd="/")
             for name, user in (("hostile", JOB_USER), ("honest", OTHER_USER))]
    try:
        port = free_port()
        config = tmp_path / "trainguard.toml"
        state = tmp_path / "state"
        config.write_text(f"""
[agent]
node_name = "files"
state_dir = "{state}"
listen = "127.0.0.1:{port}"
[jobs]
sources = ["process"]
refresh = "0s"
[jobs.processes.hostile]
cmdline = "{marker}-hostile"
user = "{JOB_USER}"
logs = ["{hostile}/logs/*.log"]
[jobs.processes.honest]
cmdline = "{marker}-honest"
user = "{OTHER_USER}"
logs = ["{honest}/train.log"]
[checks.training_log]
interval = "{INTERVAL:g}s"
[checks.hang]
interval = "{INTERVAL:g}s"
stale_after = "1h"
[notifiers.console]
""")
        agent = agent_process(config)
        agent.wait_for("msg=ready")
        agent.wait_for("a job's log globs match more than is read", timeout=3 * INTERVAL + 10)
        (honest / "train.log").write_text("step 41 loss=1.1\n" + OOM_H100 + "\n")
        shutil.chown(honest / "train.log", OTHER_USER, OTHER_USER)
        written = time.monotonic()
        agent.wait_for("event=fired check=training_log subject=process:honest", timeout=3 * INTERVAL + 10)
        took = time.monotonic() - written
        time.sleep(2 * INTERVAL)  # a few more runs over the 300,000 files
        output = agent.output()
        assert "CUDA out of memory (fragmentation)" in output
        assert "check timed out" not in output and "Traceback" not in output, output[-3000:]
        assert "the first 10000 examined" in output  # said once, per check that globs it
        db = sum(p.stat().st_size for p in state.glob("state.db*"))
        assert db < 5 << 20, f"state.db and its WAL: {db} bytes"
        print(f"{FILES} files made in {made_in:.1f}s; the honest OOM fired {took:.1f}s after it was written")
    finally:
        for p in procs:
            p.kill()
            p.wait()
