"""Scenarios of a training job in trouble: hung, leaking, out of time, stopped by its operator, out of GPU memory."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

from tests.conftest import MemoryCgroup, free_port, require, wait_until
from tests.e2e.stack import FAST, Stack
from tests.slurm_cluster import JOB_USER, sh

MiB = 2**20


def text(path: str | Path) -> str:
    p = Path(path)
    return p.read_text(errors="replace") if p.exists() else ""


def test_a_hung_trainer_gets_a_stack_dump_a_save_request_and_an_alert_within_stale_after_plus_2s(stack: Stack) -> None:
    stale = 5.0
    # As in production, the period is well under stale_after (60s vs 30m by default): the check sees the job before
    # its deadline, and then the deadline itself wakes it.
    stack.start_agent(stack.config({"hang": {"stale_after": f"{stale}s", "interval": "2s",
                                             "actions": {"critical": ["save"]}}}))
    workdir = stack.slurm.workdir()
    job_id = stack.submit(stack.toy(workdir, "--fault", "hang", "--fault-at", "20"), workdir=workdir, name="e2e-hang")
    out = stack.slurm.wait_state(job_id, ("RUNNING",))["StdOut"]
    stack.wait_mark("trainer", "stuck in allreduce", lambda: "entering allreduce" in text(out), 30)
    heartbeat = workdir / ".trainguard" / "heartbeat.json"
    last_progress = max(Path(out).stat().st_mtime, heartbeat.stat().st_mtime)
    stack.timeline.mark("trainer", "last progress (log and heartbeat mtimes)", last_progress)

    save = workdir / ".trainguard" / "save"
    wait_until(save.exists, stale + 10, what="the save request")
    stack.timeline.mark("agent", f"save switch created: {save}", save.stat().st_mtime)
    [dump] = wait_until(lambda: list((stack.state_dir / "stacks").glob("*")), 5, what="a stack dump")  # type: ignore[misc]
    stack.timeline.mark("agent", f"stack dump written: {dump.name}", dump.stat().st_mtime)
    stack.wait_mark("slack", "hang alert received", lambda: stack.slack_posts("no progress for"), 10)
    stack.wait_mark("email", "hang alert received", lambda: stack.emails("no progress for"), 10)
    stack.wait_mark("alertmanager", "hang alert active", lambda: stack.alerts(f"slurm:{job_id}"), 10)

    assert "stuck_in_allreduce" in dump.read_text()
    [post] = stack.slack_posts("no progress for")
    assert "stuck_in_allreduce (train_toy.py:" in post["raw"].decode()
    for what, at in (("stack dump", dump.stat().st_mtime), ("save request", save.stat().st_mtime),
                     ("Slack alert", post["at"])):
        assert at - last_progress < stale + 2, f"{what} {at - last_progress:.2f}s after the last progress"
    assert stack.slurm.job(job_id)["JobState"] == "RUNNING"  # hung, not killed: saving is the trainer's call
    assert stack.query(f'trainguard_job_hung{{job_id="{job_id}"}} == 1')


def test_a_leaking_trainer_saves_and_exits_before_the_oom_killer(stack: Stack,
                                                                 memory_cgroup: Callable[[int], MemoryCgroup]) -> None:
    cgroup = memory_cgroup(400 * MiB)
    stack.start_agent(stack.config({"leak": {"type": "job_memory", "interval": "0.5s", "jitter": "0s", "min_span": "2s",
                                             "window": 20}}))  # the default response: signal (save and exit)
    workdir = stack.slurm.workdir()
    job_id = stack.submit(stack.toy(workdir, "--fault", "leak", "--fault-at", "30", "--leak-mb-per-step", "3"),
                          workdir=workdir, name="e2e-leak")
    out = stack.slurm.wait_state(job_id, ("RUNNING",))["StdOut"]
    wait_until(lambda: "training start" in text(out), 20, what="the trainer to start")
    pid = int(text(out).split("pid=", 1)[1].split()[0])
    cgroup.add(pid)
    stack.timeline.mark("test", f"trainer pid {pid} moved into a 400 MiB memory cgroup; it leaks 30 MB/s from step 30")

    final = stack.slurm.wait_state(job_id, ("COMPLETED", "FAILED", "OUT_OF_MEMORY", "CANCELLED"), timeout=60)
    stack.timeline.mark("slurm", f"job {job_id} {final['JobState']} exit {final['ExitCode']}")
    log = text(out)
    assert final["JobState"] == "COMPLETED" and final["ExitCode"] == "0:0", log
    assert "stop requested (SIGUSR1)" in log
    [ckpt] = (workdir / "ckpt").glob("ckpt-*.json")
    stack.timeline.mark("trainer", f"checkpoint {ckpt.name} saved", ckpt.stat().st_mtime)
    events = cgroup.path / ("memory.events" if (cgroup.path / "memory.events").exists() else "memory.oom_control")
    oom_kills = dict(line.split() for line in events.read_text().splitlines()).get("oom_kill", "0")
    assert oom_kills == "0", events.read_text()
    stack.wait_mark("slack", "leak alert received", lambda: stack.slack_posts("is reached in ~"), 10)


def test_the_trainer_exits_cleanly_with_a_checkpoint_before_its_time_limit(stack: Stack) -> None:
    margin = 110.0
    stack.start_agent(stack.config({"limit": {"type": "job_timelimit", "margin": f"{margin}s", **FAST,
                                              "actions": {"warning": ["signal"]}}}))
    workdir = stack.slurm.workdir()
    job_id = stack.submit(stack.toy(workdir), "--time=2", workdir=workdir, name="e2e-timelimit")
    info = stack.slurm.wait_state(job_id, ("RUNNING",))
    end_time = time.mktime(time.strptime(info["EndTime"], "%Y-%m-%dT%H:%M:%S"))
    stack.timeline.mark("slurm", f"EndTime {info['EndTime']}; the agent acts {margin:.0f}s before it", end_time - margin)
    final = stack.slurm.wait_state(job_id, ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED"), timeout=60)
    finished = stack.timeline.mark("slurm", f"job {job_id} {final['JobState']} exit {final['ExitCode']}")
    log = text(info["StdOut"])
    assert final["JobState"] == "COMPLETED" and "stop requested (SIGUSR1)" in log, log
    [ckpt] = (workdir / "ckpt").glob("ckpt-*.json")
    stack.timeline.mark("trainer", f"checkpoint {ckpt.name} saved", ckpt.stat().st_mtime)
    assert finished < end_time
    stack.wait_mark("slack", "time limit alert received", lambda: stack.slack_posts("limit"), 10)


def test_the_kill_switch_stops_the_job_with_a_checkpoint_and_holds_the_array(stack: Stack) -> None:
    # The trainer sees the switch itself and ends within a few tenths of a second, and SLURM may start the next task
    # half a second later: a check every second (this file's FAST) loses that race when the touch falls just after
    # one of its runs (11:48 on 2026-11-28: found 0.62 s after the touch, task 1 already started).
    stack.start_agent(stack.config({"stop": {"type": "job_switch", "switch": "stop", "interval": "0.2s",
                                             "jitter": "0s", "actions": {"warning": ["hold-array"]}}}))
    workdir = stack.slurm.workdir()
    array = stack.submit(stack.toy(workdir), "--array=0-3%1", workdir=workdir, name="e2e-switch")
    task0 = f"{array}_0"
    info = stack.slurm.wait_state(task0, ("RUNNING",))
    switch = workdir / ".trainguard" / "stop"
    wait_until(switch.with_name("heartbeat.json").exists, 20, what="the first heartbeat")
    sh("touch", str(switch), user=JOB_USER)
    stack.timeline.mark("operator", f"touch {switch} (as {JOB_USER})")
    final = stack.slurm.wait_state(task0, ("COMPLETED", "FAILED", "CANCELLED"))
    stack.timeline.mark("slurm", f"task {task0} {final['JobState']} exit {final['ExitCode']}")
    log = text(info["StdOut"])
    assert final["JobState"] == "COMPLETED" and "stop requested (switch)" in log, log
    [ckpt] = (workdir / "ckpt").glob("ckpt-*.json")
    stack.timeline.mark("trainer", f"checkpoint {ckpt.name} saved", ckpt.stat().st_mtime)

    def held() -> list[dict[str, str]]:
        pending = [j for j in stack.slurm.jobs_of(array) if j.get("JobState") == "PENDING"]
        return pending if pending and all(j.get("Reason") in ("JobHeldAdmin", "JobHeldUser") for j in pending) else []

    [pending] = stack.wait_mark("slurm", "pending array tasks held", held, 20) and held()
    assert pending["ArrayTaskId"].split("%")[0] == "1-3", pending  # held before the next task could start
    wait_until(lambda: stack.audit(check="stop", action="hold-array", outcome="ok"), 10, what="the hold-array audit line")
    stack.wait_mark("slack", "switch alert received", lambda: stack.slack_posts("stop"), 10)


def test_a_fragmentation_oom_is_one_alert_with_the_diagnosis_and_the_allocator_setting(stack: Stack) -> None:
    stack.start_agent(stack.config({"training_log": FAST}))
    workdir = stack.slurm.workdir()
    job_id = stack.submit(stack.toy(workdir, "--fault", "oom", "--fault-at", "15"), workdir=workdir, name="e2e-oom")
    info = stack.slurm.wait_state(job_id, ("RUNNING",))
    final = stack.slurm.wait_state(job_id, ("FAILED", "COMPLETED"), timeout=30)
    stack.timeline.mark("slurm", f"job {job_id} {final['JobState']} exit {final['ExitCode']}")
    assert "torch.OutOfMemoryError" in text(info["StdOut"])
    subject = f"slurm:{job_id}"
    stack.wait_mark("slack", "OOM alert received", lambda: stack.slack_posts("CUDA out of memory"), 15)
    stack.wait_mark("alertmanager", "OOM alert active", lambda: stack.alerts(subject), 10)
    time.sleep(3)  # past the group windows and a few check runs: a second alert would be here by now
    stack.mark_deliveries("CUDA out of memory")
    [post] = stack.slack_posts(subject)
    [mail] = stack.emails(subject)
    [alert] = stack.alerts(subject)
    for message in (post["raw"].decode(), mail.get_body(("plain",)).get_content(), alert["annotations"]["description"]):
        assert "CUDA out of memory (fragmentation)" in message, message
        assert "expandable_segments:True" in message, message
    assert "at step 14" in post["raw"].decode()  # the last step logged before the OOM


def test_the_rank_that_hung_a_two_task_slurm_job_is_named_in_every_channel(stack: Stack) -> None:
    """srun starts two ranks of examples/train_ddp.py as the job user (Gloo, the CPU build of PyTorch); rank 1 stops
    before an all_reduce. The agent reads both ranks' flight recorders through their worker sockets (owned by the job
    user, in its private directory) and names rank 1 in Slack, email and Alertmanager."""
    try:
        import torch
    except ImportError:
        require(False, "needs the CPU build of PyTorch (pip install torch==2.13.0: in the test extras)")
    site = Path(torch.__file__).resolve().parents[1]  # the job user runs the system Python on the test venv's packages
    stack.start_agent(stack.config({"hang": {"stale_after": "5s", "interval": "2s"}}))
    workdir = stack.slurm.workdir()
    logs = workdir / "logs"
    command = (f"export PYTHONPATH={site} MASTER_ADDR=127.0.0.1 MASTER_PORT={free_port()} PYTHONWARNINGS=ignore "
               f"TMPDIR={workdir}\n"
               f"exec srun --ntasks=2 {stack.slurm.python} {stack.slurm.lib}/examples/train_ddp.py --hang-rank 1 "
               f"--hang-at 3 --log-dir {logs}")
    job_id = stack.submit(command, "--ntasks=2", workdir=workdir, name="e2e-ddp-hang")
    stack.slurm.wait_state(job_id, ("RUNNING",))
    stack.wait_mark("trainer", "rank 1 stands before its all_reduce", lambda: "stops before" in text(logs / "rank1.log"),
                    90)
    pid = int(re.search(r"pid=(\d+)", text(logs / "rank1.log")).group(1))  # type: ignore[union-attr]
    named = (rf"rank 1 \(node {stack.slurm.node}, pid {pid}\) never entered all_reduce #(\d+) "
             rf"\(its last: all_reduce #\d+\); rank 0 waiting")
    stack.wait_mark("slack", "hang alert naming rank 1", lambda: stack.slack_posts("never entered all_reduce"), 30)
    stack.wait_mark("email", "hang alert naming rank 1", lambda: stack.emails("never entered all_reduce"), 10)
    stack.wait_mark("alertmanager", "hang alert active", lambda: stack.alerts(f"slurm:{job_id}"), 10)
    [post] = stack.slack_posts("never entered all_reduce")
    [mail] = stack.emails("never entered all_reduce")
    [alert] = stack.alerts(f"slurm:{job_id}")
    for message in (post["raw"].decode(), mail.get_body(("plain",)).get_content(), alert["annotations"]["description"]):
        assert re.search(named, message), message
    assert f"Next: rank 1 (node {stack.slurm.node}, pid {pid}) is stuck in stuck_before_all_reduce" in post["raw"].decode()
