"""A hung job's user tries to make the hang check spend the agent's processes and descriptors, or fail for everyone:
1,500 children that all look like Python, and a flight-recorder dump whose sequence id has 5,000 digits. Through the
real agent process: the attacker's hang is reported within its budget, the agent's descriptors and children are back
to where they were once the attacker is gone, and another user's hang is reported meanwhile and afterwards."""

from __future__ import annotations

import os
import pickle
import pwd
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from tests.conftest import AgentProcess, require_root, wait_until
from tests.slurm_cluster import JOB_USER, OTHER_USER, ensure_user
from trainguard.node.stacks import find_py_spy

# Forks `n` children, Python interpreters whose argv[0] is "python3", that sleep: each one py-spy can dump. Forked,
# not started: they share the parent's pages, so 1,500 of them fit in little memory.
STORM = """
import os, sys, time
for _ in range(int(sys.argv[2])):
    if os.fork() == 0:
        time.sleep(600)
        os._exit(0)
print("forked", flush=True)
time.sleep(600)
"""
SLEEPER = "import sys, time\nwhile True:\n    time.sleep(1)\n"
WRITER = "import sys, time\nwhile True:\n    print('step', flush=True)\n    time.sleep(0.2)\n"
FORK_STORM = 1500


@pytest.fixture
def workdirs() -> Iterator[tuple[Path, str, list[subprocess.Popen[bytes]]]]:
    """A base dir with a directory per user, a marker for command lines, and the users' processes (killed after)."""
    require_root()
    ensure_user(JOB_USER)
    ensure_user(OTHER_USER)
    base = Path(tempfile.mkdtemp(prefix="trainguard-hang-budget-", dir="/tmp"))
    base.chmod(0o755)
    for user in (JOB_USER, OTHER_USER):
        (base / user / "switch" / "flight-recorder").mkdir(parents=True)
        for d in (base / user, base / user / "switch", base / user / "switch" / "flight-recorder"):
            shutil.chown(d, user, user)
    procs: list[subprocess.Popen[bytes]] = []
    yield base, uuid.uuid4().hex[:8], procs
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    shutil.rmtree(base, ignore_errors=True)


def run_as(user: str, code: str, *args: str, log: Path | None = None) -> subprocess.Popen[bytes]:
    """A Python program as `user` (in a session of its own: killed as a group), its stdout into `log`."""
    pw = pwd.getpwnam(user)
    out = log.open("ab") if log is not None else subprocess.DEVNULL
    try:
        return subprocess.Popen(["python3", "-c", code, *args], user=pw.pw_uid, group=pw.pw_gid, extra_groups=[],
                                cwd="/", stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        if log is not None and not isinstance(out, int):
            out.close()


def config(tmp_path: Path, base: Path, marker: str, stale_after: str) -> Path:
    path = tmp_path / "trainguard.toml"
    path.write_text(f"""
[agent]
node_name = "budget"
state_dir = "{tmp_path / 'state'}"
listen = ""
[jobs]
sources = ["process"]
refresh = "0s"
[jobs.processes.hostile]
cmdline = "{marker}-hostile"
user = "{JOB_USER}"
logs = ["{base / JOB_USER / 'train.log'}"]
switch_dir = "{base / JOB_USER / 'switch'}"
[jobs.processes.honest]
cmdline = "{marker}-honest"
user = "{OTHER_USER}"
logs = ["{base / OTHER_USER / 'train.log'}"]
switch_dir = "{base / OTHER_USER / 'switch'}"
[checks.hang]
interval = "1s"
stale_after = "{stale_after}"
[notifiers.console]
""")
    return path


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def direct_children(pid: int) -> list[int]:
    pids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            pids += [int(p) for p in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except OSError:
            continue
    return pids


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def agent_children(pid: int) -> list[psutil.Process]:
    """The agent's children, zombies included."""
    return psutil.Process(pid).children(recursive=True)


def test_a_fork_storm_of_python_lookalikes_costs_the_agent_nothing_it_keeps(
        tmp_path: Path, workdirs: tuple[Path, str, list[subprocess.Popen[bytes]]],
        agent_process: Callable[..., AgentProcess]) -> None:
    require_root()
    assert find_py_spy() is not None, "py-spy is installed with trainguard"
    base, marker, procs = workdirs
    honest_log = base / OTHER_USER / "train.log"
    honest = run_as(OTHER_USER, WRITER, f"{marker}-honest", log=honest_log)
    procs.append(honest)
    agent = agent_process(config(tmp_path, base, marker, "4s"))
    agent.wait_for("msg=ready")
    assert agent.proc is not None
    time.sleep(2)  # a few runs of every check: what the agent holds when nothing is wrong
    fds_before, children_before = fds(agent.proc.pid), len(agent_children(agent.proc.pid))

    most, done = 0, threading.Event()

    def count_py_spy() -> None:
        nonlocal most
        while not done.is_set():  # /proc's children lists: psutil's walk of 3,000 processes would miss short runs
            most = max(most, [comm(pid) for pid in direct_children(agent.proc.pid)].count("py-spy"))  # type: ignore[union-attr]
            time.sleep(0.005)

    sampler = threading.Thread(target=count_py_spy, daemon=True)
    sampler.start()
    started = time.monotonic()
    storm = run_as(JOB_USER, STORM, f"{marker}-hostile", str(FORK_STORM), log=base / JOB_USER / "train.log")
    procs.append(storm)
    wait_until(lambda: "forked" in (base / JOB_USER / "train.log").read_text(), 60, what="the fork storm")
    forked = time.monotonic() - started
    assert len(psutil.Process(storm.pid).children()) == FORK_STORM
    try:
        agent.wait_for("event=fired check=hang subject=process:hostile", timeout=40)
    finally:
        done.set()
        sampler.join()
    fired = time.monotonic() - started
    out = agent.output()
    assert 0 < most <= 4, f"{most} py-spy at once"
    assert "more processes not dumped (at most 256 inspected and 32 dumped per hang, one per rank)" in out
    assert out.count('msg="hung job stacks" job=process:hostile') == 1

    os.killpg(storm.pid, signal.SIGKILL)  # the attacker is gone
    storm.wait()
    wait_until(lambda: fds(agent.proc.pid) <= fds_before  # type: ignore[union-attr]
               and len(agent_children(agent.proc.pid)) == children_before, 10,  # type: ignore[union-attr]
               what=f"the agent's fds ({fds_before}) and children ({children_before}) back to where they were")
    # the other user's job stops logging only now: its hang is still reported
    os.killpg(honest.pid, signal.SIGSTOP)
    agent.wait_for("event=fired check=hang subject=process:honest", timeout=30)
    assert "check failed" not in agent.output() and "Traceback" not in agent.output()
    print(f"{FORK_STORM} children forked in {forked:.1f}s, the hang fired {fired:.1f}s after the storm began; "
          f"at most {most} py-spy at once; fds {fds_before}, children {children_before} before and after")
    os.killpg(honest.pid, signal.SIGCONT)


def test_a_5000_digit_sequence_id_blinds_nothing(
        tmp_path: Path, workdirs: tuple[Path, str, list[subprocess.Popen[bytes]]],
        agent_process: Callable[..., AgentProcess]) -> None:
    base, marker, procs = workdirs
    recorder = base / JOB_USER / "switch" / "flight-recorder"
    entry = {"pg_id": 0, "process_group": ("0", "default_pg"), "profiling_name": "nccl:all_reduce",
             "state": "started", "retired": False}
    dump = {"entries": [{**entry, "collective_seq_id": 3}, {**entry, "collective_seq_id": 10**5000}],
            "pg_status": {"0": {"last_enqueued_collective": 10**5000}}, "pg_config": {"0": {"ranks": "[0, 1]"}}}
    for rank in (0, 1):  # what the NCCL watchdog would write on its timeout (TORCH_FR_DUMP_TEMP_FILE + rank)
        (recorder / f"rank_{rank}").write_bytes(pickle.dumps(dump))
        shutil.chown(recorder / f"rank_{rank}", JOB_USER, JOB_USER)
    hostile = run_as(JOB_USER, SLEEPER, f"{marker}-hostile")
    honest = run_as(OTHER_USER, WRITER, f"{marker}-honest", log=base / OTHER_USER / "train.log")
    procs.extend([hostile, honest])
    agent = agent_process(config(tmp_path, base, marker, "3s"))
    agent.wait_for('msg="hung job stacks" job=process:hostile', timeout=30)  # the dump is being read
    os.killpg(honest.pid, signal.SIGSTOP)  # only now another user's job stops: no more log lines
    agent.wait_for("event=fired check=hang subject=process:honest", timeout=30)
    agent.wait_for("event=fired check=hang subject=process:hostile", timeout=5)
    time.sleep(4)  # four more runs of the check with both jobs still hung
    out = agent.output()
    assert "check failed" not in out and "Traceback" not in out
    assert "flight recorder entries skipped" in out
    hostile_stacks = [p for p in (tmp_path / "state" / "stacks").iterdir() if "hostile" in p.name]
    assert len(hostile_stacks) == 1, "py-spy ran once for the hang, not at every run"
    assert out.count('msg="hung job stacks" job=process:hostile') == 1
    os.killpg(honest.pid, signal.SIGCONT)
