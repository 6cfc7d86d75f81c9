"""`trainguard install` / `trainguard uninstall`: the systemd unit, a commented config, the service user.

Every step says what it did; a step already done is left alone (installing twice changes nothing, and a
config an operator edited is never overwritten). `root` stages everything under another directory
(packaging, tests); the user is then not created.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from trainguard.core.tools import run_tool

PACKAGE = Path(__file__).resolve().parent
UNIT_SOURCE = PACKAGE.parent / "systemd" / "trainguard.service"
DEFAULT_CONFIG = PACKAGE / "default.toml"
UNIT_EXEC = "/usr/local/bin/trainguard"  # what the shipped unit names; replaced by the real path


class InstallError(Exception):
    pass


@dataclass
class Installer:
    root: Path = Path("/")
    user: str = "trainguard"
    executable: str = ""
    done: list[str] = field(default_factory=list)

    @property
    def unit_path(self) -> Path:
        return self.root / "etc/systemd/system/trainguard.service"

    @property
    def config_path(self) -> Path:
        return self.root / "etc/trainguard/trainguard.toml"

    @property
    def staged(self) -> bool:
        return self.root.resolve() != Path("/")

    def install(self) -> list[str]:
        if not self.staged:
            self.ensure_user()
        self._write_unit()
        self._write_config()
        self._systemctl("daemon-reload")
        return self.done

    def uninstall(self, purge: bool = False) -> list[str]:
        self._systemctl("disable", "--now", "trainguard.service")
        if self.unit_path.exists():
            self.unit_path.unlink()
            self.done.append(f"removed {self.unit_path}")
        self._systemctl("daemon-reload")
        if purge:
            for path in (self.config_path.parent, self.root / "var/lib/trainguard"):
                if path.exists():
                    shutil.rmtree(path)
                    self.done.append(f"removed {path}")
            if not self.staged and _exists(pwd.getpwnam, self.user):
                run_tool(["userdel", self.user], 30, InstallError, label="userdel")
                self.done.append(f"removed user {self.user}")
        else:
            self.done.append(f"kept {self.config_path.parent} and /var/lib/trainguard (--purge removes them)")
        return self.done

    def ensure_user(self) -> None:
        if _exists(pwd.getpwnam, self.user):
            self.done.append(f"user {self.user} exists")
            return
        nologin = shutil.which("nologin") or "/usr/sbin/nologin"
        run_tool(["useradd", "--system", "--no-create-home", "--home-dir", "/var/lib/trainguard", "--shell", nologin,
                  "--user-group", self.user], 30, InstallError, label="useradd")
        self.done.append(f"created system user {self.user}")

    def _write_unit(self) -> None:
        if not UNIT_SOURCE.exists():
            raise InstallError(f"unit file {UNIT_SOURCE} not found: install trainguard from a source checkout "
                               "(pip install /path/to/trainguard)")
        exe = self.executable or _executable()
        text = UNIT_SOURCE.read_text().replace(f"ExecStart={UNIT_EXEC} ", f"ExecStart={exe} ")
        if self.user != "trainguard":
            text = text.replace("User=trainguard", f"User={self.user}").replace("Group=trainguard", f"Group={self.user}")
        self.unit_path.parent.mkdir(parents=True, exist_ok=True)
        if self.unit_path.exists() and self.unit_path.read_text() == text:
            self.done.append(f"{self.unit_path} up to date")
            return
        self.unit_path.write_text(text)
        self.unit_path.chmod(0o644)
        self.done.append(f"wrote {self.unit_path} (ExecStart={exe})")

    def _write_config(self) -> None:
        path = self.config_path
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            self.done.append(f"kept the existing {path}")
            return
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)  # never world-readable, not even briefly
        with os.fdopen(fd, "w") as f:
            f.write(DEFAULT_CONFIG.read_text())
        os.chmod(path, 0o640)
        if not self.staged and _exists(grp.getgrnam, self.user):
            os.chown(path, 0, grp.getgrnam(self.user).gr_gid)  # secrets inside stay readable by the service only
        self.done.append(f"wrote {path} (mode 0640)")

    def _systemctl(self, *args: str) -> None:
        if self.staged or not Path("/run/systemd/system").is_dir():  # systemd is not PID 1 here
            return
        proc = subprocess.run(["systemctl", *args], capture_output=True, text=True, timeout=60)
        self.done.append(f"systemctl {' '.join(args)}" + ("" if proc.returncode == 0 else f": {proc.stderr.strip()}"))


def _executable() -> str:
    """This trainguard, for ExecStart: its script, else this interpreter with `-m trainguard` (absolute paths, links
    kept: a virtualenv's python is a link that must stay one)."""
    argv0 = Path(sys.argv[0])
    if argv0.name == "trainguard" and argv0.exists():
        return str(argv0.absolute())
    return f"{Path(sys.executable).absolute()} -m trainguard"


def _exists(lookup: Callable[[str], object], name: str) -> bool:
    """Whether pwd.getpwnam / grp.getgrnam knows `name`."""
    try:
        lookup(name)
    except KeyError:
        return False
    return True


NEXT_STEPS = """
Next steps:
  1. Edit {config} (checks, Slack/email, jobs); check it: trainguard validate --config {config}
  2. SLURM drain/requeue as user {user}: sacctmgr -i add user {user} account=root adminlevel=Operator
  3. systemctl enable --now trainguard && journalctl -u trainguard -f
  4. curl -s localhost:9721/metrics | head; point Prometheus at port 9721 (deploy/prometheus/)
See docs/install.md.
"""
