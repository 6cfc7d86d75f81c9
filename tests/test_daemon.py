"""The agent as users run it: a real `trainguard run` process."""

from __future__ import annotations

import ctypes
import json
import os
import pwd
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests

from tests.conftest import REPO, AgentProcess, control_status, free_port, wait_until
from trainguard.agent.systemd import SystemdNotifier, WatchdogPinger


def write_config(tmp_path: Path, port: int, critical: bool = True, interval: str = "1s") -> Path:
    path = tmp_path / "trainguard.toml"
    path.write_text(f"""
[agent]
node_name = "testnode"
state_dir = "{tmp_path}/state"
listen = "127.0.0.1:{port}"

[checks.scratch]
type = "disk"
paths = ["{tmp_path}"]
interval = "{interval}"
jitter = 0
free_critical = "{'100%' if critical else '0%'}"
free_warning = "0%"
inodes_free_warning = "0%"
inodes_free_critical = "0%"

[checks.memory]
interval = "{interval}"
available_warning = "0%"
available_critical = "0%"
swap_free_warning = "0%"
swap_free_critical = "0%"

[checks.ib]                 # no HCA under this root: idle
type = "infiniband"
sysfs_root = "{tmp_path}/no-infiniband"
interval = "{interval}"

[notifiers.console]
""")
    return path


def test_sigterm_shuts_down_cleanly(tmp_path: Path, agent_process: Callable[..., AgentProcess]) -> None:
    port = free_port()
    agent = agent_process(write_config(tmp_path, port))
    agent.wait_for("msg=ready")
    assert requests.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
    t0 = time.monotonic()
    agent.signal(signal.SIGTERM)
    assert agent.wait(timeout=5) == 0
    assert time.monotonic() - t0 < 5
    out = agent.output()
    assert "msg=stopped" in out and "signal=SIGTERM" in out
    assert (tmp_path / "state" / "state.db").exists()


def test_the_start_says_config_and_state_and_no_job_source_starts_for_checks_without_jobs(
        tmp_path: Path, agent_process: Callable[..., AgentProcess], caplog: pytest.LogCaptureFixture) -> None:
    """`make run` as root: the first lines say which config and state dir the agent uses; with no check that asks
    for jobs, no job source starts (no slurmd discovery, no `SLURM jobs of this node` line). The first use starts
    it."""
    from trainguard.jobs.catalog import JobCatalog
    from trainguard.jobs.settings import JobsSettings

    config = write_config(tmp_path, free_port())
    config.write_text(config.read_text() + '[jobs]\nsources = ["slurm"]\n')
    agent = agent_process(config)
    agent.wait_for("first round done")
    out = agent.output()
    assert "msg=starting version=" in out and f"config={config} state_dir={tmp_path}/state" in out, out
    assert "SLURM jobs of this node" not in out, out
    catalog = JobCatalog(JobsSettings(sources=["slurm"]), "testnode")
    with caplog.at_level("INFO", logger="trainguard.slurm"):
        assert catalog.sources == ["slurm"] and "SLURM jobs of this node" not in caplog.text
        catalog.listen(lambda: None)()
        assert "SLURM jobs of this node" in caplog.text
    catalog.close()


def test_after_the_first_round_the_main_thread_sleeps_until_a_signal(tmp_path: Path,
                                                                     agent_process: Callable[..., AgentProcess]) -> None:
    """The main thread watches the first round for `systemctl status`; after it, it only waits for SIGTERM: no
    wake-up a second (an idle agent's CPU is the sum of such wake-ups), and the signal still ends it at once."""
    agent = agent_process(write_config(tmp_path, free_port()))
    agent.wait_for("first round done")
    assert agent.proc is not None
    status = Path(f"/proc/{agent.proc.pid}/task/{agent.proc.pid}/status")  # the main thread's tid is the pid

    def switches() -> int:
        return int(next(line.split()[1] for line in status.read_text().splitlines()
                        if line.startswith("voluntary_ctxt_switches:")))

    before = switches()
    time.sleep(2.5)
    assert switches() == before  # with a 1 s wait it woke twice
    t0 = time.monotonic()
    agent.signal(signal.SIGTERM)
    assert agent.wait(timeout=5) == 0 and time.monotonic() - t0 < 5
    assert "msg=stopped" in agent.output()


def test_a_sigterm_the_kernel_hands_to_another_thread_still_stops_the_agent(
        tmp_path: Path, agent_process: Callable[..., AgentProcess]) -> None:
    """`kill` lets the kernel pick any thread of the agent; Python runs the handler in the main thread only. A main
    thread asleep in a lock never ran it (1 stop in 10 hung on a loaded machine): aimed at every other thread in turn
    (tgkill), SIGTERM stops the agent at once."""
    tgkill = ctypes.CDLL(None, use_errno=True).tgkill  # glibc 2.30+: a signal to one thread of another process
    for attempt in range(3):
        agent = agent_process(write_config(tmp_path, free_port()), log_name=f"agent{attempt}.log")
        agent.wait_for("first round done")
        assert agent.proc is not None
        pid = agent.proc.pid

        def threads() -> set[int]:
            return {int(t) for t in os.listdir(f"/proc/{pid}/task")} - {pid}  # noqa: B023 - called in this pass only

        first = threads()
        time.sleep(1.5)
        # Threads there 1.5 s apart are the long-lived ones (the checks', the servers'); a statvfs call's own thread
        # may end before the signal reaches it.
        lasting = sorted(first & threads())
        assert lasting, "the agent runs its checks and servers in threads of their own"
        tid = lasting[attempt * len(lasting) // 3]
        assert tgkill(pid, tid, signal.SIGTERM) == 0, os.strerror(ctypes.get_errno())
        assert agent.wait(timeout=10) == 0, agent.output()
        assert "signal=SIGTERM" in agent.output() and "msg=stopped" in agent.output()


class NotifySocket:
    """A NOTIFY_SOCKET as systemd listens on it: every datagram the agent sends, in order."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.messages: list[str] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(path))
        self._sock.settimeout(0.2)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._collect, daemon=True)
        self._thread.start()

    def _collect(self) -> None:
        while not self._done.is_set():
            try:
                self.messages.append(self._sock.recv(4096).decode())
            except TimeoutError:
                continue

    def has(self, text: str) -> bool:
        return any(text in m for m in self.messages)

    def close(self) -> None:
        self._done.set()
        self._thread.join(timeout=2)
        self._sock.close()


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[NotifySocket]:
    sock = NotifySocket(tmp_path / "notify.sock")
    yield sock
    sock.close()


def test_sd_notify_ready_watchdog_stopping(tmp_path: Path, agent_process: Callable[..., AgentProcess],
                                           notify_socket: NotifySocket) -> None:
    messages = notify_socket.messages
    agent = agent_process(write_config(tmp_path, free_port()),
                          env={"NOTIFY_SOCKET": str(notify_socket.path), "WATCHDOG_USEC": "1000000"})
    wait_until(lambda: notify_socket.has("READY=1"), 15, what="READY=1")
    wait_until(lambda: sum("WATCHDOG=1" in m for m in messages) >= 3, 10, what="watchdog pings")
    agent.signal(signal.SIGTERM)
    agent.wait(timeout=5)
    wait_until(lambda: notify_socket.has("STOPPING=1"), 2, what="STOPPING=1")
    ready_at = next(i for i, m in enumerate(messages) if "READY=1" in m)
    assert all("WATCHDOG=1" not in m for m in messages[:ready_at])


def test_a_slow_first_round_does_not_hold_ready_back(tmp_path: Path, agent_process: Callable[..., AgentProcess],
                                                     notify_socket: NotifySocket) -> None:
    """A controller that does not answer (squeue stands for one here: it sleeps until its timeout kills it) makes
    the first run of a job check last `slurm_timeout`; READY comes before, and /healthz names that check."""
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text("#!/bin/sh\nexec sleep 60\n")
    (bin_dir / "squeue").chmod(0o755)
    port = free_port()
    config = tmp_path / "trainguard.toml"
    config.write_text(f"""
[agent]
state_dir = "{tmp_path}/state"
listen = "127.0.0.1:{port}"
[jobs]
sources = ["slurm"]
slurm_bin_dir = "{bin_dir}"
slurm_timeout = "5s"
[checks.alive]
type = "job_liveness"
names = ["train"]
interval = "1h"
timeout = "10s"
[checks.memory]
[notifiers.console]
""")
    agent_process(config, env={"NOTIFY_SOCKET": str(notify_socket.path)})
    wait_until(lambda: notify_socket.has("READY=1"), 15, what="READY=1")
    healthz = requests.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
    assert healthz.status_code == 200 and healthz.text.startswith("ok; first run pending: alive")  # READY did not wait
    assert notify_socket.has("STATUS=watching 2 checks; first run pending: alive")
    wait_until(lambda: requests.get(f"http://127.0.0.1:{port}/healthz", timeout=5).text
               == "ok; first run pending: alive\n", 4, what="memory done, alive still on its first run")
    wait_until(lambda: requests.get(f"http://127.0.0.1:{port}/healthz", timeout=5).text == "ok\n", 15,
               what="the first round done")
    wait_until(lambda: any(m == "STATUS=watching 2 checks" for m in notify_socket.messages), 5,
               what="STATUS after the first round")
    [result] = control_status(tmp_path / "state")["checks"]["alive"]["results"]  # TCP's /status has no summaries
    assert result["status"] == "UNKNOWN" and "squeue" in result["summary"] and "timed out" in result["summary"]


def test_watchdog_withholds_pings_when_engine_is_wedged(tmp_path: Path) -> None:
    sock_path = tmp_path / "n.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(0.1)
    healthy = [True]
    notifier = SystemdNotifier({"NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "200000"})
    assert notifier.watchdog_s == 0.2
    pinger = WatchdogPinger(notifier, lambda: healthy[0])
    pinger.start()
    sock.settimeout(2.0)
    assert sock.recv(100) == b"WATCHDOG=1"
    sock.settimeout(0.15)
    healthy[0] = False
    time.sleep(0.15)
    while True:  # drain pings sent before the flip
        try:
            sock.recv(100)
        except TimeoutError:
            break
    with pytest.raises(TimeoutError):
        for _ in range(4):
            sock.recv(100)
    pinger.stop()
    sock.close()


def test_watchdog_pid_mismatch_disables_watchdog() -> None:
    assert SystemdNotifier({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"}).watchdog_s is None
    assert SystemdNotifier({}).notify("READY=1") is False


def test_sigkill_restart_keeps_incident_and_does_not_renotify(
        tmp_path: Path, agent_process: Callable[..., AgentProcess]) -> None:
    port = free_port()
    config = write_config(tmp_path, port)
    first = agent_process(config, log_name="first.log")
    first.wait_for("logger=trainguard.alert event=fired")  # the console's line: the engine logs its own one first
    [fired_line] = [line for line in first.output().splitlines() if "event=fired" in line and "trainguard.alert" in line]
    incident_id = re.search(r"incident=(\w+)", fired_line).group(1)  # type: ignore[union-attr]
    first.signal(signal.SIGKILL)
    first.wait()

    second = agent_process(config, log_name="second.log")
    second.wait_for("msg=ready")
    wait_until(lambda: requests.get(f"http://127.0.0.1:{port}/status", timeout=5).json()["checks"]["scratch"]["runs"] >= 3,
               10, what="three runs after restart")
    status = requests.get(f"http://127.0.0.1:{port}/status", timeout=5).json()
    [incident] = [i for i in status["incidents"] if i["check"] == "scratch"]
    assert incident["firing"] and incident["id"] == incident_id and incident["status"] == "CRITICAL"
    assert "event=fired" not in second.output()


def test_status_command_against_a_running_agent(tmp_path: Path, agent_process: Callable[..., AgentProcess]) -> None:
    port = free_port()
    config = write_config(tmp_path, port)
    agent = agent_process(config)
    agent.wait_for("event=fired")
    time.sleep(2.5)  # a few more runs of the idle check
    proc = subprocess.run([sys.executable, "-m", "trainguard", "status", "--config", str(config)],
                          capture_output=True, text=True, timeout=30, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "node testnode" in proc.stdout
    assert "incidents (1 firing, 0 pending)" in proc.stdout
    assert re.search(r"firing\s+CRITICAL\s+scratch", proc.stdout)
    assert re.search(r"^IDLE\s+ib\s+-\s+\d+s\s+no InfiniBand or RoCE device under .*/no-infiniband$", proc.stdout, re.M)
    agent.wait_for("check=ib", count=1)
    assert agent.output().count("check idle: what it watches is absent here") == 1  # once, not every second
    # over TCP (what any local user gets): the same table, the summaries left to the control socket
    tcp = subprocess.run([sys.executable, "-m", "trainguard", "status", "--url", f"http://127.0.0.1:{port}"],
                         capture_output=True, text=True, timeout=30, cwd=REPO)
    assert tcp.returncode == 0 and "no summaries, no job names; they are on the control socket" in tcp.stdout
    assert re.search(r"^firing\s+CRITICAL\s+scratch\s+\S+\s+-$", tcp.stdout, re.M), tcp.stdout
    assert "critical threshold" in proc.stdout and "critical threshold" not in tcp.stdout
    unreachable = subprocess.run([sys.executable, "-m", "trainguard", "status", "--url", f"http://127.0.0.1:{free_port()}"],
                                 capture_output=True, text=True, timeout=30, cwd=REPO)
    assert unreachable.returncode == 3 and "cannot reach the agent" in unreachable.stderr


def test_status_says_how_old_each_result_is_and_which_jobs_ended(tmp_path: Path,
                                                                   agent_process: Callable[..., AgentProcess]) -> None:
    """A result is its check's last run, up to an interval ago: `status` gives each its AGE, and a job check's result
    about a job that has ended since is marked "(job ended)" (the hang check runs once an hour here, so the result
    stays), not shown as the job's state now."""
    marker = f"tg-ending-job-{os.getpid()}"
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", marker])
    port = free_port()
    config = tmp_path / "agent.toml"
    config.write_text(f'[agent]\nstate_dir = "{tmp_path}/state"\nlisten = "127.0.0.1:{port}"\n'
                      f'control_socket = "{tmp_path}/state/control.sock"\n[jobs]\nsources = []\n'
                      f'[jobs.processes.ending]\ncmdline = "{marker}"\nuser = "{pwd.getpwuid(os.getuid()).pw_name}"\n'
                      '[checks.hang]\ninterval = "1h"\nstale_after = "1h"\nstacks = false\n')
    row = re.compile(r"^OK\s+hang\s+process:ending\s+(\d+)s\s+(.*)$", re.M)

    def status() -> str:
        proc = subprocess.run([sys.executable, "-m", "trainguard", "status", "--config", str(config)],
                              capture_output=True, text=True, timeout=30, cwd=REPO)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    try:
        agent_process(config).wait_for("msg=ready")
        found = wait_until(lambda: row.search(status()), 20, 0.3, what="the hang check's result for the job")
        assert isinstance(found, re.Match) and found[2].startswith("process job ending: progressing ("), found[0]
        before = requests.get(f"http://127.0.0.1:{port}/status", timeout=5).json()["checks"]["hang"]
        assert before["results"][0].get("job_ended") is None
    finally:
        job.kill()
        job.wait(timeout=10)
    time.sleep(2)
    found = row.search(status())
    assert found is not None and found[2].startswith("(job ended) process job ending: progressing ("), found
    assert int(found[1]) >= 2  # measured from the run, which came before the sleep
    after = requests.get(f"http://127.0.0.1:{port}/status", timeout=5).json()  # the TCP view says so too
    assert after["checks"]["hang"]["last_run"] == before["last_run"]  # the same run's result: no run since
    assert after["checks"]["hang"]["results"] == [{"check": "hang", "subject": "process:ending", "status": "OK",
                                                   "job_ended": True}]
    assert after["now"] - after["checks"]["hang"]["last_run"] >= 2


def _check_cmd(config: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainguard", "check", "--config", str(config), *extra],
                          capture_output=True, text=True, timeout=60, cwd=REPO)


def test_check_command_exit_codes_and_table(tmp_path: Path) -> None:
    crit = _check_cmd(write_config(tmp_path, 0, critical=True))
    assert crit.returncode == 2, crit.stderr
    lines = crit.stdout.splitlines()
    assert lines[0].split() == ["STATUS", "CHECK", "SUBJECT", "SUMMARY"]
    assert lines[1].startswith("CRITICAL") and "scratch" in lines[1] and "critical threshold" in lines[1]
    assert lines[-1] == "testnode: CRITICAL"

    ok = _check_cmd(write_config(tmp_path, 0, critical=False), "--json")
    assert ok.returncode == 0, ok.stderr
    data = json.loads(ok.stdout)
    assert data["status"] == "OK"
    assert {r["check"] for r in data["results"]} == {"scratch", "memory"}


def test_check_lists_idle_checks_without_changing_the_exit_code(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(f"[agent]\nstate_dir = '{tmp_path}'\n[checks.memory]\n[checks.gpu]\n")
    env = {**os.environ, "TRAINGUARD_FAKE_NVML": "missing"}
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.fake_gpu_agent", "check", "--config", str(config)],
                          capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^IDLE\s+gpu\s+-\s+NVML not available: NVML Shared Library Not Found$", proc.stdout, re.M)
    as_json = subprocess.run([sys.executable, "-m", "tests.helpers.fake_gpu_agent", "check", "--json", "--config",
                              str(config)], capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    data = json.loads(as_json.stdout)
    assert data["status"] == "OK" and data["idle"] == {"gpu": "NVML not available: NVML Shared Library Not Found"}


def test_check_unknown_when_path_missing(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(f"[agent]\nstate_dir = '{tmp_path}'\n[checks.d]\ntype = 'disk'\npaths = ['{tmp_path}/gone']\n")
    proc = _check_cmd(config)
    assert proc.returncode == 3
    assert "cannot stat" in proc.stdout


def test_default_config_runs_without_a_file(tmp_path: Path) -> None:
    env = {**os.environ, "STATE_DIRECTORY": str(tmp_path), "TRAINGUARD_CONFIG": ""}
    proc = subprocess.run([sys.executable, "-m", "trainguard", "check", "--json"], capture_output=True, text=True,
                          timeout=60, cwd=REPO, env=env)
    assert proc.returncode in (0, 1, 2), proc.stderr
    subjects = {(r["check"], r["subject"]) for r in json.loads(proc.stdout)["results"]}
    assert {("disk", "/"), ("disk", str(tmp_path)), ("memory", "host")} <= subjects


ARENA_PROBE = """
import ctypes, sys, threading
from trainguard.agent.daemon import fewer_malloc_arenas
if sys.argv[1] == "fewer":
    assert fewer_malloc_arenas()
gate = threading.Barrier(8)
kept = []
def allocate():
    gate.wait()  # all at once: each thread then takes an arena of its own unless capped
    kept.append([bytearray(4096) for _ in range(200)])
threads = [threading.Thread(target=allocate) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
out = libc.fopen(sys.argv[2].encode(), b"w")
libc.malloc_info(0, ctypes.c_void_p(out))
libc.fclose(ctypes.c_void_p(out))
"""


@pytest.mark.parametrize(("mode", "env", "most"), [("fewer", {}, 2), ("default", {}, None),
                                                   ("default", {"MALLOC_ARENA_MAX": "3"}, 3)])
def test_the_daemon_caps_glibcs_malloc_arenas(tmp_path: Path, mode: str, env: dict[str, str], most: int | None) -> None:
    """Counted by glibc itself (malloc_info's XML, one <heap> per arena) after 8 threads allocated at once."""
    info = tmp_path / "malloc.xml"
    environ = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"} | env
    subprocess.run([sys.executable, "-c", ARENA_PROBE, mode, str(info)], check=True, timeout=60, cwd=REPO, env=environ)
    arenas = info.read_text().count("<heap nr=")
    if most is None:
        assert arenas > 2  # uncapped, the threads spread over more arenas: the cap is what changes it
    else:
        assert 1 <= arenas <= most


def test_malloc_arena_max_in_the_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainguard.agent.daemon import fewer_malloc_arenas

    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert fewer_malloc_arenas() is False


def test_sighup_reloads_a_good_config_and_refuses_a_bad_one(
        tmp_path: Path, agent_process: Callable[..., AgentProcess]) -> None:
    """`systemctl reload` (SIGHUP): a broken config, or one whose engine cannot be built, is refused in one line and
    the running config keeps running; a good one applies in the same process (a check added, one removed, one
    changed) without losing the firing incident (not announced again), and the endpoint serves throughout.
    `trainguard validate` says the same of each beforehand."""
    port = free_port()
    config = write_config(tmp_path, port)
    agent = agent_process(config)
    agent.wait_for("logger=trainguard.alert event=fired")
    fired = agent.output().count("event=fired")
    pid = agent.proc.pid if agent.proc else 0
    good = config.read_text()

    config.write_text(good + '\n[checks.broken]\ntype = "disk"\nfree_warning = "10 parsecs"\n')
    agent.signal(signal.SIGHUP)
    agent.wait_for("msg=\"reload refused; the running config stays\"", timeout=70)
    [refused] = [line for line in agent.output().splitlines() if "reload refused" in line]
    assert "checks.broken.free_warning" in refused and "Traceback" not in agent.output()
    assert "broken" not in requests.get(f"http://127.0.0.1:{port}/status", timeout=5).json()["checks"]

    # one that parses, but whose engine cannot be built (its state database is a newer release's): refused before the
    # running engine stops, in one line; the incident, the endpoint and the process stay as they were
    newer = tmp_path / "newer"
    newer.mkdir()
    with sqlite3.connect(newer / "state.db") as db:
        db.execute("PRAGMA user_version = 99")
    config.write_text(good.replace(f'state_dir = "{tmp_path}/state"', f'state_dir = "{newer}"'))
    validate = subprocess.run([sys.executable, "-m", "trainguard", "validate", "--config", str(config)],
                              capture_output=True, text=True, timeout=60, cwd=REPO)
    assert validate.returncode == 2 and "a running agent would refuse it" in validate.stderr, validate.stderr
    assert "schema version 99" in validate.stderr
    mark = len(agent.output())
    agent.signal(signal.SIGHUP)
    wait_until(lambda: agent.output().count("reload refused") == 2, 70, what="the second refusal")
    after = agent.output()[mark:]
    [refused] = [line for line in after.splitlines() if "reload refused" in line]
    assert "schema version 99, newer than this trainguard's" in refused, refused
    assert "Traceback" not in after and "msg=reloading" not in after and "engine started" not in after, after
    assert "msg=stopped" not in after and [line for line in after.splitlines() if "logger=trainguard.daemon" in line] \
        == [refused], after  # its one line, nothing stopped
    [incident] = [i for i in requests.get(f"http://127.0.0.1:{port}/status", timeout=5).json()["incidents"]
                  if i["check"] == "scratch"]
    assert incident["firing"]
    assert (newer / "state.db").stat().st_size <= 8192  # neither migrated nor written

    # memory switched off, ib changed, a second disk check added
    changed = (good.replace("[checks.memory]", "[checks.memory]\nenabled = false")
               .replace(f'sysfs_root = "{tmp_path}/no-infiniband"', f'sysfs_root = "{tmp_path}/no-hca"')
               .replace("[notifiers.console]", f'[checks.tmp]\ntype = "disk"\npaths = ["{tmp_path}"]\n\n[notifiers.console]'))
    assert changed.count("no-hca") == 1 and changed.count("[checks.tmp]") == 1
    config.write_text(changed)
    agent.signal(signal.SIGHUP)
    agent.wait_for("msg=reloaded", timeout=70)
    [line] = [line for line in agent.output().splitlines() if "msg=reloading" in line]
    assert "checks_added=tmp" in line and "checks_changed=ib,memory" in line and "checks_removed=" not in line, line
    status = requests.get(f"http://127.0.0.1:{port}/status", timeout=5).json()
    assert status["pid"] == pid and "tmp" in status["checks"] and "memory" not in status["checks"]
    [incident] = [i for i in status["incidents"] if i["check"] == "scratch"]
    assert incident["firing"]
    wait_until(lambda: requests.get(f"http://127.0.0.1:{port}/status", timeout=5).json()["checks"]["scratch"]["runs"]
               >= 2, 10, what="the scratch check running after the reload")
    assert agent.output().count("event=fired") == fired  # the incident was kept, not fired again
    agent.signal(signal.SIGTERM)
    assert agent.wait() == 0


def test_a_paused_watchdog_neither_pings_nor_calls_the_engine_stuck(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A reload swaps the engine: meanwhile the pinger says nothing (the old engine, stopping, is not "not making
    progress"); it pings again once resumed."""
    sock_path = tmp_path / "n.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    notifier = SystemdNotifier({"NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "200000"})
    pinger = WatchdogPinger(notifier, lambda: False)
    pinger.pause(True)
    with caplog.at_level("ERROR"):
        pinger.start()
        sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            sock.recv(100)
        assert not [r for r in caplog.records if "not making progress" in r.getMessage()]
        pinger.pause(False)
        wait_until(lambda: [r for r in caplog.records if "not making progress" in r.getMessage()], 2,
                   what="the pinger judging the engine again")
    pinger.stop()
    sock.close()
