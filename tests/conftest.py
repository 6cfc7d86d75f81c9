"""Shared fixtures. Real components (tmpfs, FUSE, promtool, the agent as a process) are started here.

Under CI=true a test whose real component or privilege is missing fails; elsewhere it skips with the reason.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.packaging import Dists, build_dists
from tests.slurm_cluster import SlurmCluster, missing_components
from trainguard.node.stacks import find_py_spy

REPO = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(autouse=True)
def _root_logger() -> Iterator[None]:
    """A test that runs the CLI in-process points the root handler at the test's captured stderr, closed when the
    test ends; later tests' threads then log into a closed file. Each test gets the root logger back as it was."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def require(condition: bool, reason: str) -> None:
    if condition:
        return
    if IN_CI:
        pytest.fail(f"required for this test under CI=true: {reason}")
    pytest.skip(reason)


def require_root() -> None:
    require(os.geteuid() == 0, "needs root")


def require_tool(name: str) -> str:
    path = shutil.which(name)
    require(path is not None, f"needs {name} on PATH")
    assert path is not None
    return path


def wait_until(predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.05, what: str = "") -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mount_dev_id(mountpoint: Path) -> str | None:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == str(mountpoint):
            return fields[2]
    return None


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """Mount a size- and inode-limited tmpfs: `tmpfs(size="1m", inodes=100)`."""
    require_root()
    mounted: list[Path] = []

    def mount(size: str = "1m", inodes: int = 1000, parent: Path | None = None) -> Path:
        """`parent`: somewhere other users can reach (pytest's temp dirs are private to root)."""
        target = (parent or tmp_path) / f"tmpfs{len(mounted)}"
        target.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},nr_inodes={inodes}", "tmpfs", str(target)],
                       check=True, timeout=10)
        mounted.append(target)
        return target

    yield mount
    for target in mounted:
        subprocess.run(["umount", "-l", str(target)], check=False, timeout=10)


class HungMount:
    def __init__(self, mountpoint: Path, call_log: Path, proc: subprocess.Popen[bytes], server: str = "") -> None:
        self.mountpoint = mountpoint
        self.call_log = call_log
        self.proc = proc
        self.server = server  # the mount's source is `server:/export`, as an NFS mount's

    def statfs_calls(self) -> int:
        return self.call_log.read_text().count("statfs") if self.call_log.exists() else 0

    def abort(self) -> None:
        """Abort the FUSE connection: every request blocked on it returns ENOTCONN."""
        dev = mount_dev_id(self.mountpoint)
        if dev is None:
            return
        conns = Path("/sys/fs/fuse/connections")
        if not any(conns.iterdir()):
            subprocess.run(["mount", "-t", "fusectl", "fusectl", str(conns)], check=False, timeout=10)
        abort = conns / dev.split(":")[1] / "abort"
        if abort.exists():
            abort.write_text("1")


def start_fuse(mnt: Path, helper: str, *args: str) -> subprocess.Popen[bytes]:
    """A FUSE filesystem of tests/helpers (fusepy over libfuse2) mounted on `mnt`, made here."""
    require_root()
    require(Path("/dev/fuse").exists(), "needs /dev/fuse")
    try:
        import fuse  # noqa: F401
    except (ImportError, OSError) as exc:
        require(False, f"needs fusepy and libfuse2: {exc}")
    mnt.mkdir()
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "helpers" / helper), str(mnt), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_until(lambda: mount_dev_id(mnt) is not None or proc.poll() is not None, 10, what="FUSE mount")
    if proc.poll() is not None:
        raise AssertionError(f"{helper} failed: {proc.stderr.read().decode() if proc.stderr else ''}")
    return proc


@pytest.fixture
def hung_mount(tmp_path: Path) -> Iterator[HungMount]:
    """A FUSE mount whose statfs blocks forever, and a read of its file `data` (the reader waits in D state)."""
    mnt, log = tmp_path / "hung", tmp_path / "statfs-calls.log"
    server = f"tgnfs{random.randint(0, 1 << 30):x}"
    proc = start_fuse(mnt, "hangfs.py", str(log), f"{server}:/export")
    hung = HungMount(mnt, log, proc, server)
    yield hung
    hung.abort()
    subprocess.run(["umount", "-l", str(mnt)], check=False, timeout=10)
    proc.kill()
    proc.wait(timeout=10)


@pytest.fixture
def slurm(slurm_cluster: SlurmCluster, request: pytest.FixtureRequest) -> SlurmCluster:
    """The session's one-node SLURM cluster, as every test expects to find it: the node not drained and no job of
    an earlier test holding it (an earlier test's failure, or an agent acting on a kernel record another test wrote,
    must not fail the tests after it). What was tidied is printed, with the test before, to find who left it."""
    left = slurm_cluster.tidy()
    if left:  # a warning: listed in the run's summary (a print in a passing test's setup is never shown)
        warnings.warn(f"slurm: tidied before {request.node.nodeid}: {left}", stacklevel=1)
    return slurm_cluster


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A real one-node SLURM cluster, started once per session."""
    require(os.geteuid() == 0, "needs root to run slurmctld, slurmd and munged")
    missing = missing_components()
    require(not missing, f"needs SLURM and munge installed (missing: {', '.join(missing)})")
    for sbin in ("/usr/sbin", "/sbin"):  # the daemons live there; a non-login root PATH may lack it
        if sbin not in os.environ.get("PATH", "").split(":"):
            os.environ["PATH"] = os.environ.get("PATH", "") + ":" + sbin
    # Job users must reach the cluster's files: not under pytest's private (0700) temp root.
    base = Path(tempfile.mkdtemp(prefix="trainguard-slurm-", dir="/tmp"))
    cluster = SlurmCluster(base)
    try:
        cluster.start()
    except Exception:
        cluster.stop()
        raise
    yield cluster
    cluster.stop()
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def dists(tmp_path_factory: pytest.TempPathFactory) -> Dists:
    """The sdist and the wheel built from it, once per session (tests/packaging.py)."""
    import importlib.util

    require(importlib.util.find_spec("build") is not None, "needs the `build` package (pip install -e '.[test]')")
    return build_dists(tmp_path_factory.mktemp("dists"))


class AgentProcess:
    """`trainguard run` as a real subprocess, stderr captured to a file."""

    def __init__(self, config: Path, log: Path, env: dict[str, str] | None = None, wrapper: Sequence[str] = (),
                 module: str = "trainguard") -> None:
        self.config = config
        self.log = log
        self.env = {**os.environ, **(env or {})}
        self.wrapper = list(wrapper)  # e.g. setpriv with the service's user and capabilities
        self.module = module  # tests.helpers.fake_gpu_agent: the same command over a scripted NVML
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> AgentProcess:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen([*self.wrapper, sys.executable, "-m", self.module, "run", "--config",
                                          str(self.config)],
                                         stdout=out, stderr=out, env=self.env, cwd=REPO)
        return self

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_for(self, text: str, timeout: float = 15.0, count: int = 1) -> None:
        wait_until(lambda: self.output().count(text) >= count or (self.proc and self.proc.poll() is not None),
                   timeout, what=f"{text!r} in agent output")
        assert self.output().count(text) >= count, f"agent exited early:\n{self.output()}"

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 10.0) -> int:
        """The exit status; an agent still running after `timeout` fails with its threads' stacks and its log's
        tail, so a shutdown that hangs once in a CI run says where."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            py_spy = find_py_spy()
            try:
                dump = subprocess.run([py_spy, "dump", "--pid", str(self.proc.pid)], capture_output=True, text=True,
                                      timeout=30, check=False) if py_spy else None
                stacks = (dump.stdout + dump.stderr) if dump else "(no py-spy)"
            except subprocess.TimeoutExpired:
                stacks = "(py-spy dump timed out after 30s)"
            raise AssertionError(f"agent pid {self.proc.pid} still running {timeout:g}s on\n--- stacks ---\n"
                                 f"{stacks}\n--- log tail ---\n{self.output()[-6000:]}") from None

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def agent_process(tmp_path: Path) -> Iterator[Callable[..., AgentProcess]]:
    started: list[AgentProcess] = []

    def make(config: Path, env: dict[str, str] | None = None, log_name: str = "agent.log",
             wrapper: Sequence[str] = (), module: str = "trainguard") -> AgentProcess:
        agent = AgentProcess(config, tmp_path / log_name, env, wrapper, module)
        started.append(agent)
        return agent.start()

    yield make
    for agent in started:
        agent.stop()


def http_get(url: str, timeout: float = 5.0) -> requests.Response:
    return requests.get(url, timeout=timeout)


def control_get(sock: Path, path: str = "/status", timeout: float = 5.0) -> tuple[int, bytes]:
    """GET over the agent's control socket (root or its group): /status with summaries and details, which the TCP
    endpoint leaves out. The status code and the body."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(sock))
        s.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())
        reply = b"".join(iter(lambda: s.recv(1 << 16), b""))
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def control_status(state_dir: Path) -> dict[str, Any]:
    """The full /status of the agent whose state dir (and so control socket) is `state_dir`."""
    code, body = control_get(state_dir / "control.sock")
    assert code == 200, body[:500]
    return json.loads(body)  # type: ignore[no-any-return]


@pytest.fixture
def kmsg() -> Iterator[Any]:
    """Writes tagged records to the real /dev/kmsg, with userspace rate limiting lifted for the test."""
    require_root()
    require(os.access("/dev/kmsg", os.W_OK), "needs a writable /dev/kmsg")
    knob = Path("/proc/sys/kernel/printk_devkmsg")
    old = knob.read_text().strip() if knob.exists() else None
    if old is not None:
        knob.write_text("on\n")
    fd = os.open("/dev/kmsg", os.O_WRONLY)

    class Writer:
        def write(self, message: str, prio: int = 4) -> float:  # KERN_WARNING, as the driver logs XIDs
            os.write(fd, f"<{prio}>{message}\n".encode())
            return time.time()

    yield Writer()
    os.close(fd)
    if old is not None:
        knob.write_text(old + "\n")


def unique_bus() -> str:
    return f"00{random.randint(0x40, 0xff):02x}:{random.randint(0, 255):02x}:00"  # a domain no real GPU has


def xid79(bus: str) -> str:
    return f"NVRM: Xid (PCI:{bus}): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus. [trainguard-test]"


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    """Child processes a test starts; killed and reaped at teardown."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


class MemoryCgroup:
    """A memory-limited cgroup: call it on a command line to get one that enters the cgroup and then execs the
    command, or `add` a running process."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, argv: list[str]) -> list[str]:
        return ["/bin/sh", "-c", f'echo $$ > "{self.path / "cgroup.procs"}" && exec "$@"', "sh", *argv]

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))


@pytest.fixture
def memory_cgroup() -> Iterator[Callable[[int], MemoryCgroup]]:
    """Creates memory-limited cgroups (v2 where the node has it, else v1)."""
    require_root()
    v2 = Path("/sys/fs/cgroup/cgroup.controllers")
    v2_memory = v2.exists() and "memory" in v2.read_text().split()
    v1 = Path("/sys/fs/cgroup/memory")
    require(v2_memory or (v1 / "memory.limit_in_bytes").exists(), "needs the cgroup memory controller (v1 or v2)")
    made: list[Path] = []

    def make(limit_bytes: int) -> MemoryCgroup:
        path = (Path("/sys/fs/cgroup") if v2_memory else v1) / f"trainguard-test-{uuid.uuid4().hex[:8]}"
        path.mkdir()
        made.append(path)
        if v2_memory:
            (path / "memory.max").write_text(str(limit_bytes))
            if (path / "memory.swap.max").exists():
                (path / "memory.swap.max").write_text("0")
        else:
            (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
        return MemoryCgroup(path)

    yield make
    for path in made:
        for pid in (path / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), 9)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def hang_config(path: Path, state: Path, marker: str, user: str, extra: str = "") -> Path:
    """An agent config watching one process job (`marker` in its command line, of `user`) for hangs: stale after 2 s,
    checked every second, no flight recorder; `extra` is appended (more checks, channels)."""
    path.write_text(f"""
[agent]
state_dir = "{state}"
node_name = "node1"
listen = ""
[jobs]
sources = ["process"]
refresh = "0s"
[jobs.processes.trainer]
cmdline = "{marker}"
user = "{user}"
[checks.hang]
stale_after = "2s"
interval = "1s"
flight_recorder = false
{extra}""")
    return path
