"""A real systemd, booted as PID 1 of a throwaway nspawn container over this machine's root (a volatile overlay:
nothing written inside reaches the host), so the unit is tested under the systemd that enforces it: Type=notify,
WatchdogSec, ProtectSystem, SystemCallFilter, DevicePolicy, capabilities, hidepid.

Made from the team's systemd-container recipe; what it took on the development VM (PID 1 there is not systemd, the
cgroup v1 memory controller is mounted):
- nspawn refuses `-D /`: / is bind-mounted to a scratch directory and booted with --volatile=overlay;
- --register=no needs --keep-unit when no system bus runs;
- --bind=/dev/kmsg gives the container the host's kernel log (an XID written inside reaches the agent);
- DevicePolicy= is only enforced with SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1 and --system-call-filter=bpf (otherwise
  nspawn answers bpf() with EPERM and systemd skips the device rules);
- --private-network keeps the container's ports (9721) off the host;
- the host's services (SLURM, munge, MariaDB, Prometheus, timers) are masked inside so they do not start twice.

Everything has a timeout, and `with SystemdContainer(...)` always powers it off and unmounts it, also when a test
fails; if the test run itself is killed, nspawn gets SIGTERM (setpriv --pdeathsig) and powers the container off, and the
next run unmounts what is left before it boots.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import psutil

STATE = Path("/run/trainguard-test-systemd")  # the nspawn pid and its log
ROOT = Path("/var/tmp/trainguard-test-systemd-root")  # where / is bind-mounted for nspawn
MASKED = [f"{u}.service" for u in ("mariadb", "munge", "postgresql", "prometheus", "prometheus-alertmanager",
                                   "prometheus-node-exporter", "slurmctld", "slurmd", "slurmdbd", "getty@tty1",
                                   "systemd-timesyncd")]
MASKED += [f"{t}.timer" for t in ("apt-daily", "apt-daily-upgrade", "man-db", "dpkg-db-backup", "e2scrub_all", "fstrim")]
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def missing_tools() -> list[str]:
    return [t for t in ("systemd-nspawn", "nsenter", "mountpoint", "setpriv") if shutil.which(t) is None]


class ContainerError(Exception):
    pass


class SystemdContainer:
    def __init__(self, bind_ro: Mapping[Path, str] | None = None, boot_timeout: float = 90.0) -> None:
        self.bind_ro = dict(bind_ro or {})  # host path -> path inside
        self.boot_timeout = boot_timeout
        self.pid1: int | None = None
        self._nspawn: subprocess.Popen[bytes] | None = None

    # lifecycle -----------------------------------------------------------------
    def __enter__(self) -> SystemdContainer:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.down()

    def up(self) -> None:
        teardown_stale()
        STATE.mkdir(parents=True, exist_ok=True)
        ROOT.mkdir(parents=True, exist_ok=True)
        _host(["mount", "--bind", "/", str(ROOT)])
        binds = [f"--bind-ro={host}:{inside}" for host, inside in self.bind_ro.items()]
        with (STATE / "nspawn.log").open("wb") as log:
            self._nspawn = subprocess.Popen(
                # setpriv --pdeathsig: SIGTERM to nspawn (which then powers the container off) when the test run
                # dies, even by SIGKILL, so no container outlives it; the next run unmounts what is left.
                ["setpriv", "--pdeathsig", "TERM", "systemd-nspawn", "-D", str(ROOT), "--volatile=overlay",
                 "--machine=trainguard-test", "--register=no", "--keep-unit", "--private-network", "--capability=all",
                 "--console=passive", "--system-call-filter=bpf", "--bind=/dev/kmsg", *binds, "-b",
                 *(f"systemd.mask={u}" for u in MASKED)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                env={**os.environ, "SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1"})
        (STATE / "nspawn.pid").write_text(str(self._nspawn.pid))
        deadline = time.monotonic() + self.boot_timeout
        while time.monotonic() < deadline:
            if self._nspawn.poll() is not None:
                raise ContainerError(f"systemd-nspawn exited {self._nspawn.returncode}: {self.boot_log()}")
            self.pid1 = self.pid1 or _child_named(self._nspawn.pid, "systemd")
            if self.pid1 is not None:
                state = self.run(["systemctl", "is-system-running", "--wait"], check=False,
                                 timeout=max(1.0, deadline - time.monotonic())).stdout.strip()
                if state == "running":
                    return
                if state == "degraded":
                    failed = self.run(["systemctl", "--failed", "--no-legend", "--plain"], check=False).stdout
                    raise ContainerError(f"the container booted degraded; failed units:\n{failed}")
            time.sleep(0.2)
        raise ContainerError(f"the container did not boot within {self.boot_timeout:g}s: {self.boot_log()}")

    def down(self) -> None:
        """Power off, wait for nspawn, kill it if it lingers, unmount: each step bounded, each attempted."""
        if self.pid1 is not None:
            with contextlib.suppress(subprocess.TimeoutExpired, ContainerError):
                self.run(["systemctl", "poweroff", "--no-block"], check=False, timeout=10)
        if self._nspawn is not None:
            try:
                self._nspawn.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._nspawn.pid, signal.SIGKILL)
                self._nspawn.wait(timeout=10)
        self.pid1 = None
        self._nspawn = None
        teardown_stale()

    def boot_log(self) -> str:
        log = STATE / "nspawn.log"
        return log.read_text(errors="replace")[-2000:] if log.exists() else ""

    # inside --------------------------------------------------------------------
    def run(self, argv: Sequence[str], *, check: bool = True, timeout: float = 60.0, input: str | None = None,  # noqa: A002
            user: str | None = None) -> subprocess.CompletedProcess[str]:
        """`argv` inside the container (all its namespaces), as root or `user`, with a clean environment."""
        if self.pid1 is None:
            raise ContainerError("the container is not up")
        inner = ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", *argv] if user else list(argv)
        cmd = ["nsenter", "-t", str(self.pid1), "-a", "--", "env", "-i", f"PATH={PATH}", "HOME=/root", "TERM=dumb",
               "SYSTEMD_PAGER=", "SYSTEMD_COLORS=0", "LANG=C.UTF-8", *inner]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, input=input,
                              stdin=None if input is not None else subprocess.DEVNULL, errors="replace")
        if check and proc.returncode != 0:
            raise ContainerError(f"{' '.join(argv)} exited {proc.returncode} in the container:\n"
                                 f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        return proc

    def sh(self, script: str, *, check: bool = True, timeout: float = 60.0) -> str:
        return self.run(["sh", "-ec", script], check=check, timeout=timeout).stdout

    def write(self, path: str, text: str, mode: str = "0644", owner: str = "root:root") -> None:
        self.run(["sh", "-ec", f'mkdir -p "$(dirname "$1")"; cat > "$1"; chmod {mode} "$1"; chown {owner} "$1"', "sh",
                  path], input=text)

    def read(self, path: str) -> str:
        return self.run(["cat", path]).stdout


def _host(argv: Sequence[str], timeout: float = 30.0) -> None:
    subprocess.run(list(argv), check=True, capture_output=True, timeout=timeout)


def _child_named(parent: int, name: str) -> int | None:
    try:
        return next((c.pid for c in psutil.Process(parent).children() if c.name() == name), None)
    except psutil.Error:
        return None


def teardown_stale() -> None:
    """Kill an nspawn a killed run left behind (its pid file), unmount the root bind, forget the state."""
    pidfile = STATE / "nspawn.pid"
    if pidfile.exists():
        with contextlib.suppress(ValueError, psutil.Error):
            proc = psutil.Process(int(pidfile.read_text()))
            if proc.name() == "systemd-nspawn":
                proc.send_signal(signal.SIGTERM)  # nspawn powers its container off on SIGTERM
                try:
                    proc.wait(timeout=20)
                except psutil.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
    for _ in range(3):  # a bind may be stacked by an earlier crash
        if subprocess.run(["mountpoint", "-q", str(ROOT)], timeout=10).returncode != 0:
            break
        if subprocess.run(["umount", str(ROOT)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(ROOT)], capture_output=True, timeout=30)
    shutil.rmtree(STATE, ignore_errors=True)
