"""`trainguard install` / `trainguard uninstall`: the systemd unit and its drop-ins, a commented config, the service
user.

Everything it writes ships inside the package (package data), so a wheel installed without the source tree is
enough: `trainguard/systemd` is the checkout's top-level `systemd/` folder (a link, so each file has one source),
`trainguard/default.toml` the config. Every step says what it did; a step already done is left alone (installing
twice changes nothing, and a config an operator edited is never overwritten). `root` stages everything under
another directory (packaging, tests); the user is then not created.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from trainguard.core.tools import run_tool
from trainguard.jobs.settings import STOP_DIR

PACKAGE = Path(__file__).resolve().parent
SYSTEMD = PACKAGE / "systemd"  # package data; in a checkout, a link to the top-level systemd/ folder
UNIT_SOURCE = SYSTEMD / "trainguard.service"
DEFAULT_CONFIG = PACKAGE / "default.toml"
UNIT_EXEC = "/usr/local/bin/trainguard"  # what the shipped unit names; replaced by the real path
UNIT = "trainguard.service"
PATH_LINK = Path("/usr/local/bin/trainguard")  # the link install.md and the next steps suggest; a purge removes it
CONFIG_DIR_MODE = 0o750  # the unit's ConfigurationDirectoryMode: systemd warns on every start when they differ


def dropins() -> dict[str, Path]:
    """The drop-ins that ship with trainguard, by name (`switch-files` for systemd/switch-files.conf)."""
    return {path.stem: path for path in sorted(SYSTEMD.glob("*.conf"))}


class InstallError(Exception):
    pass


@dataclass
class Installer:
    root: Path = Path("/")
    user: str = "trainguard"
    executable: str = ""
    with_dropins: tuple[str, ...] = ()
    done: list[str] = field(default_factory=list)

    @property
    def unit_path(self) -> Path:
        return self.root / "etc/systemd/system" / UNIT

    @property
    def dropin_dir(self) -> Path:
        return self.root / "etc/systemd/system" / f"{UNIT}.d"

    @property
    def config_path(self) -> Path:
        return self.root / "etc/trainguard/trainguard.toml"

    @property
    def staged(self) -> bool:
        return self.root.resolve() != Path("/")

    def install(self) -> list[str]:
        shipped = dropins()
        unknown = [name for name in self.with_dropins if name not in shipped]
        if unknown:  # before anything is written
            raise InstallError(f"no drop-in named {', '.join(unknown)} (shipped: {', '.join(shipped)})")
        if not SYSTEMD.is_dir():
            raise InstallError(f"{SYSTEMD} not found: this trainguard was installed without its package data; "
                               "reinstall it from a wheel or a source checkout")
        # The unit first: it is only a file to write, and with it in place `systemctl enable` works even when a later
        # step (useradd) fails; that failure then says what was done and what was not.
        self._steps([(str(self.unit_path), self._write_unit),
                     *((str(self.dropin_dir / f"{name}.conf"), partial(self._write_dropin, name, shipped[name]))
                       for name in self.with_dropins),
                     *(() if self.staged else ((f"user {self.user}", self.ensure_user),)),
                     (str(self.config_path), self._write_config),
                     ("systemctl daemon-reload", partial(self._systemctl, "daemon-reload"))])
        return self.done

    def _steps(self, steps: list[tuple[str, Callable[[], None]]]) -> None:
        """Each step in order; the first that fails stops the rest, in one line with what was and was not done."""
        for i, (what, step) in enumerate(steps):
            try:
                step()
            except (InstallError, OSError) as exc:
                raise InstallError(f"{what}: {exc}; done: {'; '.join(self.done) or 'nothing'}; "
                                   f"not done: {', '.join(name for name, _ in steps[i:])}") from None

    def uninstall(self, purge: bool = False) -> list[str]:
        removed = self.unit_path.exists()
        if removed:  # once uninstalled, systemctl would only fail on the missing unit
            self._systemctl("disable", "--now", UNIT)
            self.unit_path.unlink()
            self.done.append(f"removed {self.unit_path}")
        else:
            self.done.append(f"{self.unit_path} is not installed")
        for name in dropins():  # ours only: a site's own drop-ins stay
            path = self.dropin_dir / f"{name}.conf"
            if path.exists():
                path.unlink()
                removed = True
                self.done.append(f"removed {path}")
        if self.dropin_dir.is_dir():
            if any(self.dropin_dir.iterdir()):
                self.done.append(f"kept {self.dropin_dir} (drop-ins that are not trainguard's)")
            else:
                self.dropin_dir.rmdir()
        if removed:
            self._systemctl("daemon-reload")
        if purge:
            self._purge()
        else:
            self.done.append(f"kept {self.config_path.parent} and /var/lib/trainguard (--purge removes them)")
        return self.done

    def _purge(self) -> None:
        for path in (self.config_path.parent, self.root / "var/lib/trainguard"):
            if path.exists():
                shutil.rmtree(path)
                self.done.append(f"removed {path}")
        if not self.staged and _exists(pwd.getpwnam, self.user):
            run_tool(["userdel", self.user], 30, InstallError, label="userdel")
            self.done.append(f"removed user {self.user}")
        if not self.staged and _exists(grp.getgrnam, self.user):  # userdel keeps a group that has other members
            members = ", ".join(grp.getgrnam(self.user).gr_mem) or "none"
            self.done.append(f"kept group {self.user} (members: {members}; `groupdel {self.user}` removes it; a "
                             "new install uses it)")
        link = self.root / PATH_LINK.relative_to("/")
        if link.is_symlink():
            mine = executable_path()
            if str(script_path(link)) == mine:
                link.unlink()
                self.done.append(f"removed {link} (the link to {mine})")
            else:
                self.done.append(f"kept {link}: it links to {os.readlink(link)}, not to this trainguard ({mine})")
        if not self.staged and sys.prefix != sys.base_prefix:  # the running program: not removed under itself
            self.done.append(f"kept {sys.prefix}, the virtualenv trainguard runs from: `rm -rf {sys.prefix}` "
                             "removes it")

    def ensure_user(self) -> None:
        if _exists(pwd.getpwnam, self.user):
            self.done.append(f"user {self.user} exists")
            return
        nologin = shutil.which("nologin") or "/usr/sbin/nologin"
        # A purge keeps the group while operators are still in it (userdel removes only an empty one); --user-group
        # would then fail with "group exists".
        group = _exists(grp.getgrnam, self.user)
        run_tool(["useradd", "--system", "--no-create-home", "--home-dir", "/var/lib/trainguard", "--shell", nologin,
                  *(("--gid", self.user) if group else ("--user-group",)), self.user], 30, InstallError,
                 label="useradd")
        self.done.append(f"created system user {self.user}" + (f" in the existing group {self.user}" if group else ""))

    def _write_unit(self) -> None:
        exe = self.executable or executable_path()
        text = UNIT_SOURCE.read_text().replace(f"ExecStart={UNIT_EXEC} ", f"ExecStart={exe} ")
        if self.user != "trainguard":
            text = text.replace("User=trainguard", f"User={self.user}").replace("Group=trainguard", f"Group={self.user}")
        self._write_file(self.unit_path, text, f" (ExecStart={exe})")

    def _write_file(self, path: Path, text: str, note: str = "") -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() and path.read_text() == text:
            self.done.append(f"{path} up to date")
            return
        path.write_text(text)
        path.chmod(0o644)
        self.done.append(f"wrote {path}{note}")

    def _write_dropin(self, name: str, source: Path) -> None:
        """A drop-in is the operator's to adapt (switch-files lists where jobs run): one that differs from the
        shipped text is kept, and said so."""
        path = self.dropin_dir / f"{name}.conf"
        if path.exists() and path.read_text() != source.read_text():
            self.done.append(f"kept the existing {path} (it differs from the shipped {source})")
            return
        self._write_file(path, source.read_text())

    def _config_dir(self) -> None:
        """/etc/trainguard as the unit's ConfigurationDirectory= wants it: 0750, group trainguard (systemd does not
        chown a configuration directory), so the service reads its config without CAP_DAC_READ_SEARCH."""
        path = self.config_path.parent
        if not path.is_dir():
            path.mkdir(parents=True, mode=CONFIG_DIR_MODE)
            self.done.append(f"created {path} (mode 0750)")
        elif stat.S_IMODE(path.stat().st_mode) != CONFIG_DIR_MODE:
            self.done.append(f"set the mode of {path} to 0750 (was {stat.S_IMODE(path.stat().st_mode):04o})")
        os.chmod(path, CONFIG_DIR_MODE)  # mkdir's mode passes through the umask
        stop = self.root / STOP_DIR.relative_to("/")
        if not stop.is_dir():  # the operator's kill switches: root writes, the service reads
            stop.mkdir(mode=CONFIG_DIR_MODE)
            self.done.append(f"created {stop} (mode 0750: `touch {STOP_DIR}/<job name>` as root stops that job)")
        os.chmod(stop, CONFIG_DIR_MODE)
        if not self.staged and _exists(grp.getgrnam, self.user):
            for directory in (path, stop):
                os.chown(directory, 0, grp.getgrnam(self.user).gr_gid)

    def _write_config(self) -> None:
        path = self.config_path
        self._config_dir()
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


def executable_path() -> str:
    """This trainguard, for ExecStart: its script, else this interpreter with `-m trainguard` (absolute paths). Called
    through a link (/usr/local/bin/trainguard), the script the link names; the interpreter's links are kept: a
    virtualenv's python is a link that must stay one."""
    argv0 = Path(sys.argv[0])
    if argv0.name == "trainguard" and argv0.exists():
        return str(script_path(argv0.absolute()))
    return f"{Path(sys.executable).absolute()} -m trainguard"


def script_path(path: Path) -> Path:
    """`path` with the links of the file itself followed, not those of its directories: /usr/local/bin/trainguard
    gives /opt/trainguard/bin/trainguard, and an /opt/trainguard that links to a versioned directory stays named."""
    for _ in range(40):  # the kernel's own limit on a chain of links
        if not path.is_symlink():
            break
        path = Path(os.path.normpath(path.parent / os.readlink(path)))
    return path


def _exists(lookup: Callable[[str], object], name: str) -> bool:
    """Whether pwd.getpwnam / grp.getgrnam knows `name`."""
    try:
        lookup(name)
    except KeyError:
        return False
    return True


NEXT_STEPS = """
Next steps:
  (`trainguard` below is {trainguard}{link})
  1. Edit {config} (checks, Slack/email, jobs); check it: {trainguard} validate --config {config}
  2. SLURM drain/requeue as user {user}: sacctmgr -i add user {user} account=root adminlevel=Operator
     (or: {trainguard} install --dropin run-as-root)
  3. Optional features, each a drop-in: {trainguard} install --dropin NAME, for NAME in: {dropins}
  4. systemctl enable --now trainguard && systemctl status trainguard && journalctl -u trainguard -f
  5. curl -s localhost:9721/healthz; curl -s localhost:9721/metrics | head; point Prometheus at port 9721
See {docs}
"""


def path_link(exe: str) -> str:
    """How to put a script that is not on PATH (/opt/trainguard/bin/trainguard) there, for the next steps."""
    found = shutil.which("trainguard")
    if " " in exe or (found is not None and str(script_path(Path(found).absolute())) == exe):
        return ""
    return f"; `ln -s {exe} {PATH_LINK}` puts it on PATH"


def documentation() -> str:
    """Where the unit's Documentation= points (docs/install.md), for the next steps."""
    lines = UNIT_SOURCE.read_text().splitlines() if UNIT_SOURCE.exists() else []
    return next((line.split("=", 1)[1] for line in lines if line.startswith("Documentation=")), "docs/install.md")
