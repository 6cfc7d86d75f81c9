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


@pytest.fixture
def epilog_gate(hooks: SlurmCluster, tmp_path: Path) -> Iterator[Path]:
    """`slurm-epilog --check` as the cluster's Epilog (docs/slurm.md): one script, the record first, the gate's exit
    code last. Yields the file its output goes to (what slurmd would log)."""
    out = tmp_path / "epilog.out"
    hooks.set_hook("epilog", trainguard(hooks, "trainguard", "slurm-epilog", "--check", "--dir", str(tmp_path / "jobs"),
                                        "--gate-dir", str(tmp_path / "gates"), "--grace", "1s", "--tmp",
                                        str(tmp_path)) + f" > {out} 2>&1")
    hooks.use_epilog(True)
    try:
        yield out
    finally:
        hooks.set_hook("epilog", "exit 0")
        hooks.use_epilog(False)


def test_a_job_that_leaves_a_process_drains_the_node_in_its_epilog_before_the_next_job(
        hooks: SlurmCluster, epilog_gate: Path) -> None:
    """The issue's goal: a job's task escapes the step (setsid -f: reparented to init, proctrack/linuxproc loses it)
    and keeps running after the job; the epilog gate names it and fails, slurmd drains the node ("Epilog error"), and
    the next job, queued behind the first, does not start there."""
    tag = uuid.uuid4().hex[:6]
    workdir = hooks.workdir()
    first = hooks.submit("setsid -f sleep 300 < /dev/null > /dev/null 2>&1\necho ran > first", workdir=workdir,
                         name=f"tg-leftover-{tag}")
    second = hooks.submit("echo ran > second", f"--dependency=afterany:{first}", workdir=workdir,
                          name=f"tg-next-{tag}")
    leftover: list[int] = []
    try:
        wait_until(lambda: "DRAIN" in hooks.node_info()["State"], 60, interval=0.5, what="the epilog to drain the node")
        assert "pilog" in hooks.node_info()["Reason"]  # SLURM's own: "Epilog error"
        text = epilog_gate.read_text()
        leftover = [int(p) for p in sh("pgrep", "-u", "tgjob", "-f", "^sleep 300$", check=False).split()]
        assert f"trainguard epilog gate: FAIL: job {first}: 1 process(es) of the job left: pid {leftover[0]} 'sleep'" \
            in text, text
        assert (workdir / "first").exists() and not (workdir / "second").exists()
        time.sleep(2)  # the dependency is satisfied: only the drain keeps the next job off the node
        assert hooks.job(second).get("JobState") == "PENDING" and not (workdir / "second").exists()
    finally:
        sh("scancel", second, check=False)
        for pid in leftover or sh("pgrep", "-u", "tgjob", "-f", "^sleep 300$", check=False).split():
            sh("kill", "-9", str(pid), check=False)


def test_the_prolog_gate_refuses_a_node_with_a_critical_gpu_after_writing_the_record(hooks: SlurmCluster,
                                                                                     tmp_path: Path) -> None:
    """`slurm-prolog --check` as the Prolog (docs/slurm.md): the job's record first, then the gate; its exit 2 makes
    slurmd drain the node ("Prolog error") and requeue the job, which never starts here."""
    config = tmp_path / "prolog.toml"
    config.write_text(f'[agent]\nstate_dir = "{tmp_path}"\nlisten = ""\n')
    out, records = tmp_path / "prolog.out", tmp_path / "jobs"
    hooks.set_hook("prolog", trainguard(hooks, "tests.helpers.fake_gpu_agent", "slurm-prolog", "--check", "--config",
                                        str(config), "--checks", "gpu", "--dir", str(records), "--gate-dir",
                                        str(tmp_path / "gates"),
                                        env="TRAINGUARD_FAKE_GPUS=2 TRAINGUARD_FAKE_GPU_FAULT=remap_failed")
                   + f" > {out} 2>&1")
    workdir = hooks.workdir()
    job_id = hooks.submit("echo ran > started", workdir=workdir, name=f"tg-gate-{uuid.uuid4().hex[:6]}")
    try:
        wait_until(lambda: "DRAIN" in hooks.node_info()["State"], 30, interval=0.5, what="the prolog gate to refuse")
        text = out.read_text()
        assert "trainguard prolog gate: FAIL: gpu: GPU 1: row remapping failed: hardware fault, RMA the GPU" in text
        assert (records / f"{job_id}.json").exists()  # the record was written before the gate ran
        assert "rolog" in hooks.node_info()["Reason"]
        assert hooks.job(job_id).get("JobState") in ("PENDING", "REQUEUED", "REQUEUE_HOLD")
        assert not (workdir / "started").exists()
    finally:
        sh("scancel", job_id, check=False)
