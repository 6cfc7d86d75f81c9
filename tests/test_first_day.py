"""The first day on a real node (issue 23), with the config `trainguard install` writes: the kill switch stops an array
without burning through it, teammates may stop a run and nobody else may, a node without NVML fires nothing, and a
config that watches nothing says so."""

from __future__ import annotations

import grp
import json
import os
import pwd
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import requests

from tests import test_slurm_jobs
from tests.conftest import REPO, AgentProcess, free_port, require_root, wait_until
from tests.slurm_cluster import JOB_USER, OTHER_USER, TEAM_GROUP, TEAM_USER, SlurmCluster, ensure_member, ensure_user, sh
from tests.test_slurm_jobs import engine_for, toy
from trainguard.agent.configfile import load_config, parse_config
from trainguard.core.model import Status
from trainguard.core.state import scoped_key
from trainguard.install import DEFAULT_CONFIG
from trainguard.node.kmsg import CURSOR_KEY, cursor_at_end
from trainguard.pipeline.engine import Engine
from trainguard.pipeline.store import Store
from trainguard.trainer import Trainer

TOY = REPO / "examples" / "train_toy.py"
engines = test_slurm_jobs.engines  # the fixture: engines the test started, stopped after it


def installed_config(tmp_path: Path, slurm: SlurmCluster, port: int, node: str | None = None,
                     stop_dir: Path | None = None) -> Path:
    """The installed config as `trainguard install` writes it, with only what a test node needs changed: where the
    state goes, the port, and the state dir among the watched disks. The XID cursor starts at the end of the kernel
    log: other tests' injected XIDs are not this node's."""
    text = DEFAULT_CONFIG.read_text()
    state = tmp_path / "state"
    state.mkdir()
    for old, new in (("[agent]\n", f'[agent]\nstate_dir = "{state}"\nlisten = "127.0.0.1:{port}"\n'
                                    f'node_name = "{node or slurm.node}"\n'),
                     ('paths = ["/", "/var/lib/trainguard"]', f'paths = ["/", "{state}"]'),
                     ("[jobs]\n", f'[jobs]\nstop_dir = "{stop_dir}"\n' if stop_dir else "[jobs]\n")):
        assert old in text, old
        text = text.replace(old, new, 1)
    path = tmp_path / "trainguard.toml"
    path.write_text(text)
    store = Store(state)
    store.put(scoped_key("check/xid", CURSOR_KEY), cursor_at_end())
    store.close()
    return path


def checkpoints(workdir: Path) -> list[str]:
    return sorted(p.name for p in (workdir / "ckpt").glob("ckpt-*.json"))


# trainer helper ---------------------------------------------------------------------------------------------------------

def test_a_stopped_run_exits_before_its_first_step_without_a_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "ckpt-000041.json").write_text(json.dumps({"step": 41, "loss": 1.0, "time": 0}))
    (tmp_path / ".trainguard").mkdir()
    (tmp_path / ".trainguard" / "stop").touch()
    proc = subprocess.run([sys.executable, str(TOY), "--steps", "100", "--step-time", "0.01", "--ckpt-dir", str(ckpt)],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["stop requested (switch) before the first step: exiting without a checkpoint "
                                        "at step 42"]
    assert sorted(p.name for p in ckpt.iterdir()) == ["ckpt-000041.json"]  # nothing trained, nothing written
    assert not (tmp_path / ".trainguard" / "heartbeat.json").exists()


def test_a_stop_right_after_a_periodic_checkpoint_does_not_write_it_twice(tmp_path: Path) -> None:
    """--ckpt-every 1 saves every step; the stop request finds that step saved and exits without a second write."""
    (tmp_path / ".trainguard").mkdir()
    proc = subprocess.Popen([sys.executable, str(TOY), "--steps", "100000", "--step-time", "0.05", "--ckpt-every", "1",
                             "--ckpt-dir", str(tmp_path / "ckpt")], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        wait_until((tmp_path / ".trainguard" / "heartbeat.json").exists, 20, what="first heartbeat")
        (tmp_path / ".trainguard" / "stop").touch()
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    saved = re.findall(r"checkpoint saved step=(\d+)", out)
    assert proc.returncode == 0 and "stop requested (switch): exiting cleanly" in out, out
    assert len(saved) == len(set(saved)), out


def test_the_trainer_counts_a_teammates_switch_and_nobody_elses(tmp_path: Path) -> None:
    """Same rules as the agent: owner, root, or a member of the switch group by NSS; a symlink never; the file's group
    is no membership (an outsider's file in a setgid directory of the group gets it)."""
    require_root()
    ensure_member(TEAM_USER, TEAM_GROUP)
    ensure_user(OTHER_USER)
    team_gid = grp.getgrnam(TEAM_GROUP).gr_gid
    switch_dir = tmp_path / "sw"
    switch_dir.mkdir()
    stop = switch_dir / "stop"
    alone, team = Trainer(switch_dir=switch_dir), Trainer(switch_dir=switch_dir, switch_group=TEAM_GROUP)

    stop.touch()
    os.chown(stop, pwd.getpwnam(OTHER_USER).pw_uid, team_gid)  # an outsider's file with the team's group
    assert not alone.should_stop() and not team.should_stop()
    os.chown(stop, pwd.getpwnam(TEAM_USER).pw_uid, pwd.getpwnam(TEAM_USER).pw_gid)  # a teammate's, own group
    assert team.should_stop() and team.should_save() and not alone.should_stop()
    stop.unlink()
    stop.symlink_to(tmp_path / "elsewhere")  # a teammate's symlink: never a switch
    (tmp_path / "elsewhere").touch()
    os.lchown(stop, pwd.getpwnam(TEAM_USER).pw_uid, -1)
    assert not team.should_stop()
    os.environ["TRAINGUARD_SWITCH_GROUP"] = TEAM_GROUP  # the job's environment names the group as well
    try:
        stop.unlink()
        stop.touch()
        os.chown(stop, pwd.getpwnam(TEAM_USER).pw_uid, -1)
        assert Trainer(switch_dir=switch_dir).should_stop()
    finally:
        del os.environ["TRAINGUARD_SWITCH_GROUP"]
    assert not Trainer(switch_dir=switch_dir, switch_group="tg-no-such-group").should_stop()


# a config that watches nothing ---------------------------------------------------------------------------------------------

def test_a_config_that_enables_no_check_is_a_warning_in_validate_and_at_start(tmp_path: Path) -> None:
    config = tmp_path / "trainguard.toml"
    config.write_text(f'[agent]\nstate_dir = "{tmp_path}/state"\nlisten = ""\n')
    proc = subprocess.run([sys.executable, "-m", "trainguard", "validate", "--config", str(config)],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        f"trainguard: warning: {config}: no check is enabled: the agent watches nothing; add [checks.NAME] tables "
        "(docs/configuration.md)", f"config OK: {config} (with warnings); a running agent takes it at `systemctl "
        "reload trainguard` (a config it refuses, it says why in the journal and keeps its own)"]

    disabled = parse_config({"agent": {"state_dir": str(tmp_path / "s2"), "listen": ""},
                             "checks": {"memory": {"enabled": False}}}, "t.toml")
    assert disabled.warnings() == ["no check is enabled: the agent watches nothing (memory disabled); add "
                                   "[checks.NAME] tables (docs/configuration.md)"]
    engine = Engine(load_config(str(config)), self_check=True)  # as the daemon builds it
    try:
        [report] = engine.run_round()
        by_subject = {r.subject: r for r in report.results}
        assert by_subject["config"].status is Status.WARNING and "watches nothing" in by_subject["config"].summary
        assert by_subject["state"].status is Status.OK
        [incident] = engine.tracker.incidents()
        assert (incident.check, incident.subject, incident.firing) == ("agent", "config", True)
    finally:
        engine.stop()
    assert parse_config({"checks": {"memory": {}}}, "t.toml").warnings() == []


# on the test SLURM cluster, as the unprivileged job user --------------------------------------------------------------------

def test_installed_config_stops_an_array_and_holds_the_rest(
        slurm: SlurmCluster, tmp_path: Path, agent_process: Callable[..., AgentProcess]) -> None:
    """`touch stop` on a --array=0-2%1 run: task 0 saves and exits, tasks 1-2 are held (the job's owner may release
    them, as the agent says), and they wrote no checkpoint. The toy's checkpoint takes 15 s, as a large model's takes
    minutes: the agent relays the switch meanwhile."""
    port = free_port()
    agent = agent_process(installed_config(tmp_path, slurm, port))
    agent.wait_for("msg=ready", timeout=30)
    workdir = slurm.workdir()
    array = slurm.submit(toy(slurm, workdir, "--save-time", "15"), "--array=0-2%1", workdir=workdir,
                         name="tg-firstday")
    try:
        slurm.wait_state(f"{array}_0", ("RUNNING",))
        wait_until((workdir / ".trainguard" / "heartbeat.json").exists, 20, what="first heartbeat")
        sh("touch", str(workdir / ".trainguard" / "stop"), user=JOB_USER)

        def held() -> dict[int, str]:
            """Pending task -> reason; the pending rest of an array may be one record (ArrayTaskId=1-2%1)."""
            out = {}
            for t in slurm.jobs_of(array):
                if t.get("JobState") == "PENDING":
                    for part in t.get("ArrayTaskId", "").split("%")[0].split(","):
                        first, _, last = part.partition("-")
                        out.update(dict.fromkeys(range(int(first), int(last or first) + 1), t.get("Reason", "")))
            return out

        wait_until(lambda: held() == {1: "JobHeldUser", 2: "JobHeldUser"}, 30, what=f"tasks 1-2 held: {held()}")
        final = slurm.wait_state(f"{array}_0", ("COMPLETED", "FAILED", "CANCELLED"), timeout=60)
        assert final["JobState"] == "COMPLETED", final
        out = Path(final["StdOut"]).read_text()
        # the trainer saw the file, or the agent's SIGUSR1 (bound after the hold) landed during the 15 s save
        assert re.search(r"stop requested \((switch|SIGUSR1)\): exiting cleanly", out), out
        saved = checkpoints(workdir)
        assert len(saved) == 1, saved
        time.sleep(3)  # task 0 is gone: nothing may start now
        assert held() == {1: "JobHeldUser", 2: "JobHeldUser"}
        assert checkpoints(workdir) == saved
        agent.wait_for("action=hold-array")
        [audit] = [line for line in agent.output().splitlines() if "action=hold-array" in line]
        assert "outcome=ok" in audit and f"held {array}_[1-2]" in audit, audit
        stop = workdir / ".trainguard" / "stop"
        assert f"to go on: rm {stop}, then scontrol release {array}_[1-2]" in audit, audit

        # What the agent said works for the job's owner: a user hold, not an administrator's.
        sh("rm", str(stop), user=JOB_USER)
        sh("scontrol", "release", f"{array}_[1-2]", user=JOB_USER)
        task1 = slurm.wait_state(f"{array}_1", ("RUNNING",), timeout=30)
        step = int(saved[0].removeprefix("ckpt-").removesuffix(".json")) + 1
        out1 = Path(task1["StdOut"])  # RUNNING may come before slurmstepd opened the file
        wait_until(lambda: out1.exists() and f"training start step={step}" in out1.read_text(errors="replace"), 20,
                   what="task 1 resuming from task 0's checkpoint")
    finally:
        sh("scancel", array, check=False)


def test_a_trainer_that_exits_at_once_still_gets_its_array_held(
        slurm: SlurmCluster, tmp_path: Path, agent_process: Callable[..., AgentProcess]) -> None:
    """The trainer saves nothing and exits within ~50 ms of `touch stop` (0.05 s steps): polled every 2 s, the hold
    came after the task ended and the next task started in one of two runs. Even relayed at once (inotify), SLURM
    starts the next task as this one ends, before the agent's hold: the trainer helper holds its own array's pending
    tasks as it sees the switch, before it exits; twice."""
    port = free_port()
    agent = agent_process(installed_config(tmp_path, slurm, port))
    agent.wait_for("msg=ready", timeout=30)
    for attempt in range(2):
        workdir = slurm.workdir()
        array = slurm.submit(toy(slurm, workdir, "--step-time", "0.05"), "--array=0-2%1", workdir=workdir,
                             name=f"tg-fast-{attempt}")
        try:
            task0 = slurm.wait_state(f"{array}_0", ("RUNNING",), timeout=60)
            out0 = Path(task0["StdOut"])
            wait_until(lambda out0=out0: out0.exists() and "step 3 " in out0.read_text(errors="replace"), 30,
                       what="task 0 training")
            sh("touch", str(workdir / ".trainguard" / "stop"), user=JOB_USER)
            final = slurm.wait_state(f"{array}_0", ("COMPLETED", "FAILED", "CANCELLED"), timeout=60)
            assert final["JobState"] == "COMPLETED", (final, out0.read_text(errors="replace")[-2000:])
            time.sleep(3)  # what the controller would start next has had its chance
            states = {t.get("ArrayTaskId"): (t.get("JobState"), t.get("Reason")) for t in slurm.jobs_of(array)}
            assert states.get("1-2%1", states.get("1")) == ("PENDING", "JobHeldUser"), (attempt, states)
            assert not any(state in ("RUNNING", "COMPLETED") for task, (state, _) in states.items() if task != "0"), \
                (attempt, states)
        finally:
            sh("scancel", array, check=False)


def test_roots_stop_file_stops_a_running_job_with_the_installed_config(
        slurm: SlurmCluster, tmp_path: Path, agent_process: Callable[..., AgentProcess]) -> None:
    """`touch /etc/trainguard/stop/<job name>` as root, as `trainguard install` prints: only the agent sees that file,
    so the installed config binds `signal` (after `hold-array`, which has nothing to hold here and says so, skipped):
    the job saves and exits; before, it trained on and the alert said the array was held."""
    port = free_port()
    stop_dir = tmp_path / "stop"
    stop_dir.mkdir(mode=0o750)
    agent = agent_process(installed_config(tmp_path, slurm, port, stop_dir=stop_dir))
    agent.wait_for("msg=ready", timeout=30)
    workdir = slurm.workdir()
    job_id = slurm.submit(toy(slurm, workdir, "--save-time", "2"), workdir=workdir, name="tg-opstop")
    try:
        slurm.wait_state(job_id, ("RUNNING",))
        wait_until((workdir / ".trainguard" / "heartbeat.json").exists, 20, what="first heartbeat")
        (stop_dir / "tg-opstop").touch()
        final = slurm.wait_state(job_id, ("COMPLETED", "FAILED", "CANCELLED"), timeout=60)
        out = Path(final["StdOut"]).read_text()
        assert final["JobState"] == "COMPLETED" and "stop requested (SIGUSR1): exiting cleanly" in out, out
        assert len(checkpoints(workdir)) == 1
        agent.wait_for("action=signal")
        audit = {line.split("action=")[1].split()[0]: line for line in agent.output().splitlines()
                 if "msg=action " in line}
        assert "outcome=ok" in audit["signal"] and f"scancel --signal=USR1 --full {job_id}" in audit["signal"], audit
        assert "outcome=skipped" in audit["hold-array"] and "not an array job" in audit["hold-array"], audit
        assert "array held" not in agent.output()  # the alert says only what happened
    finally:
        sh("scancel", job_id, check=False)


def test_burn_through_configured_each_task_exits_without_a_checkpoint(
        slurm: SlurmCluster, tmp_path: Path, engines: list[Engine]) -> None:
    engine = engine_for(slurm, tmp_path, {"job_switch": {"actions": {}}})  # the installed check, hold unbound
    engines.append(engine)
    engine.start()
    workdir = slurm.workdir()
    array = slurm.submit(toy(slurm, workdir), "--array=0-2%1", "--export=ALL,TRAINGUARD_HOLD_ARRAY=0", workdir=workdir,
                         name="tg-burn")  # and the trainer helper's own hold turned off, as the job's user may
    try:
        slurm.wait_state(f"{array}_0", ("RUNNING",))
        wait_until((workdir / ".trainguard" / "heartbeat.json").exists, 20, what="first heartbeat")
        sh("touch", str(workdir / ".trainguard" / "stop"), user=JOB_USER)
        for task in range(3):
            final = slurm.wait_state(f"{array}_{task}", ("COMPLETED", "FAILED", "CANCELLED"), timeout=60)
            assert final["JobState"] == "COMPLETED", final
        outputs = {t: Path(slurm.job(f"{array}_{t}")["StdOut"]).read_text() for t in range(3)}
        assert "stop requested (switch): exiting cleanly" in outputs[0], outputs[0]
        for task in (1, 2):
            assert "stop requested (switch) before the first step: exiting without a checkpoint" in outputs[task]
            assert "checkpoint saved" not in outputs[task] and "training start" not in outputs[task]
        assert len(checkpoints(workdir)) == 1  # task 0's only
        assert not any(i.actions for i in engine.tracker.incidents())
    finally:
        sh("scancel", array, check=False)


def test_a_teammate_stops_the_run_and_an_outsider_is_ignored(
        slurm: SlurmCluster, tmp_path: Path, engines: list[Engine]) -> None:
    engine = engine_for(slurm, tmp_path, {"job_switch": {"switch_group": TEAM_GROUP}})
    engines.append(engine)
    workdir = slurm.workdir()
    job_id = slurm.submit(toy(slurm, workdir, "--save-time", "5"), f"--export=ALL,TRAINGUARD_SWITCH_GROUP={TEAM_GROUP}",
                          workdir=workdir, name="tg-team")
    try:
        info = slurm.wait_state(job_id, ("RUNNING",))
        switch_dir = workdir / ".trainguard"
        wait_until((switch_dir / "heartbeat.json").exists, 20, what="first heartbeat")
        sh("chgrp", TEAM_GROUP, str(switch_dir))
        switch_dir.chmod(0o2777)  # the team's dir, carelessly open to all: an outsider's file gets the team's group

        sh("touch", str(switch_dir / "stop"), user=OTHER_USER)
        [report] = engine.run_round(ingest=True)
        [result] = report.results
        assert result.status is Status.UNKNOWN
        assert (f"created by {OTHER_USER}, not by the job's owner {JOB_USER}, root or a member of {TEAM_GROUP}"
                in result.summary), result.summary
        time.sleep(2)
        assert slurm.job(job_id)["JobState"] == "RUNNING"  # neither the agent nor the trainer honoured it
        assert "stop requested" not in Path(info["StdOut"]).read_text()
        (switch_dir / "stop").unlink()

        sh("touch", str(switch_dir / "stop"), user=TEAM_USER)
        [report] = engine.run_round(ingest=True)  # the trainer is writing its 5 s checkpoint meanwhile
        [result] = report.results
        assert result.status is Status.WARNING and result.summary.endswith(f"by {TEAM_USER}"), result.summary
        final = slurm.wait_state(job_id, ("COMPLETED", "FAILED", "CANCELLED"), timeout=60)
        out = Path(final["StdOut"]).read_text()
        assert final["JobState"] == "COMPLETED" and "stop requested (switch): exiting cleanly" in out, out
        assert len(checkpoints(workdir)) == 1
    finally:
        sh("scancel", job_id, check=False)


IDLE_ON_A_CPU_NODE = ("gpu", "nvlink", "pcie", "gpu_config", "fabric", "infiniband")


def test_installed_config_on_a_node_without_nvml_fires_nothing(
        slurm: SlurmCluster, tmp_path: Path, agent_process: Callable[..., AgentProcess]) -> None:
    """A login or head node: SLURM configured (the controller answers), no NVIDIA driver, no HCA. Every check runs; the
    hardware checks are idle (one log line each, a metric), and no incident opens."""
    port = free_port()
    # The login node is not one of the cluster's compute nodes: the jobs that earlier tests ran on the test node are
    # not its jobs (each would be this node's own news: a cancelled job's training_log finding, a passed time limit).
    agent = agent_process(installed_config(tmp_path, slurm, port, node="tg-login"),
                          env={"TRAINGUARD_FAKE_NVML": "missing"}, module="tests.helpers.fake_gpu_agent")
    agent.wait_for("msg=ready", timeout=30)
    wait_until(lambda: requests.get(f"http://127.0.0.1:{port}/healthz", timeout=5).text.strip() == "ok", 60,
               what="every check run once")
    time.sleep(3)  # a few more rounds of the fast checks
    status = requests.get(f"http://127.0.0.1:{port}/status", timeout=5).json()
    assert status["incidents"] == [], status["incidents"]
    metrics = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    for check in IDLE_ON_A_CPU_NODE:
        assert f'trainguard_check_idle{{check="{check}"}} 1.0' in metrics, check
    assert 'trainguard_check_idle{check="xid"} 0.0' in metrics
    assert "trainguard_incident_firing{" not in metrics or not re.search(r"trainguard_incident_firing\{.*\} 1\.0",
                                                                         metrics)
    output = agent.output()
    for check in IDLE_ON_A_CPU_NODE:
        assert len(re.findall(rf"check idle: what it watches is absent here\b.*check={check}\b", output)) == 1, output
    assert "event=fired" not in output
