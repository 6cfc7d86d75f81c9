"""`trainguard check` inside SLURM, run by the real slurmd: as the HealthCheckProgram (drains through the agent's
drain logic, with the reason) and in a job prolog (a CRITICAL GPU fault refuses the node before the job starts)."""

from __future__ import annotations

import shlex
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import REPO, wait_until
from .slurm_cluster import SlurmCluster, sh


@pytest.fixture
def hooks(slurm: SlurmCluster) -> Iterator[SlurmCluster]:
    yield slurm
    for hook in ("prolog", "healthcheck"):
        slurm.set_hook(hook, "exit 0")
    time.sleep(3)  # a health check already running when the hook was reset may still drain: let it finish
    slurm.resume_node()
    wait_until(lambda: "DRAIN" not in slurm.node_info()["State"], 20, what="node resumed")


def trainguard(slurm: SlurmCluster, module: str, *args: str, env: str = "") -> str:
    # slurmd runs hooks with its own environment: this cluster's config is not at the default path
    return (f"cd {shlex.quote(str(REPO))} && SLURM_CONF={slurm.conf} {env} exec {shlex.quote(sys.executable)} "
            f"-m {module} " + shlex.join(args))


def test_health_check_program_drains_the_node_with_the_reason(hooks: SlurmCluster, tmp_path: Path) -> None:
    config = tmp_path / "healthcheck.toml"
    config.write_text(f'[agent]\nstate_dir = "{tmp_path}"\nlisten = ""\n[jobs]\nsources = ["slurm"]\n'
                      '[checks.scratch]\ntype = "disk"\npaths = ["/"]\nfree_critical = "99%"\n')
    out = tmp_path / "healthcheck.out"
    hooks.set_hook("healthcheck", trainguard(hooks, "trainguard", "check", "--critical-only", "--drain", "--config",
                                             str(config)) + f" > {out} 2>&1")
    wait_until(lambda: "DRAIN" in hooks.node_info()["State"], 30, interval=0.5, what="slurmd's health check to drain")
    reason = hooks.node_info()["Reason"]
    assert reason.startswith("trainguard:") and "below the 99% critical threshold" in reason, reason
    text = out.read_text()
    assert "CRITICAL  scratch" in text and "drain: ok: drained" in text, text


def test_prolog_refuses_a_node_with_a_critical_gpu_fault(hooks: SlurmCluster, tmp_path: Path) -> None:
    config = tmp_path / "prolog.toml"
    config.write_text(f'[agent]\nstate_dir = "{tmp_path}"\nlisten = ""\n[jobs]\nsources = []\n[checks.gpu]\n')
    out = tmp_path / "prolog.out"
    hooks.set_hook("prolog", trainguard(hooks, "tests.helpers.fake_gpu_agent", "check", "--critical-only", "--config",
                                        str(config), env="TRAINGUARD_FAKE_GPUS=2 TRAINGUARD_FAKE_GPU_FAULT=remap_failed")
                   + f" > {out} 2>&1")
    job_id = hooks.submit("echo ran > started", name=f"tg-prolog-{uuid.uuid4().hex[:6]}")
    try:
        wait_until(lambda: "DRAIN" in hooks.node_info()["State"], 30, interval=0.5, what="the prolog to refuse the node")
        assert "GPU 1: row remapping failed" in out.read_text()
        info = hooks.job(job_id)
        assert info.get("JobState") in ("PENDING", "REQUEUED", "REQUEUE_HOLD"), info  # requeued, never started
        assert "rolog" in hooks.node_info()["Reason"]  # SLURM's own reason: "Prolog error"
    finally:
        sh("scancel", job_id, check=False)
