"""ProcFS: the one place that names /proc. Its root is a parameter (node_exporter's --path.procfs), so a test or a
container can point the agent at another tree. Every read returns None on any OSError: a process that exited
between listing and reading is the normal case, not an error."""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

CAP_SYS_PTRACE = 19  # linux/capability.h


@dataclass(frozen=True)
class ProcFS:
    root: Path = Path("/proc")

    def path(self, *parts: str | int) -> Path:
        return self.root.joinpath(*(str(p) for p in parts))

    def read_text(self, *parts: str | int) -> str | None:
        # One unbuffered read and a decode: the /proc walks read thousands of these a minute, and pathlib's text
        # layer cost more than the kernel's part.
        try:
            with open(os.path.join(self.root, *(str(p) for p in parts)), "rb", buffering=0) as f:
                return f.read().decode("utf-8", errors="replace")
        except OSError:
            return None

    def pids(self) -> list[int]:
        """The pids of every process now (a snapshot: some may be gone by the time they are read)."""
        try:
            return [int(name) for name in os.listdir(self.root) if name.isdigit()]
        except OSError:
            return []

    def boot_time(self) -> float:
        """When the kernel booted (Unix time), from /proc/stat: process start times count from it."""
        for line in (self.read_text("stat") or "").splitlines():
            if line.startswith("btime "):
                try:
                    return float(line.split()[1])
                except (IndexError, ValueError):
                    break
        return 0.0

    def boot_id(self) -> str:
        """This boot's id: persisted cursors and ledgers from another boot describe hardware that was reset."""
        return (self.read_text("sys", "kernel", "random", "boot_id") or "").strip()

    def mountinfo(self) -> str:
        return self.read_text("self", "mountinfo") or ""

    def hidden_processes(self) -> str | None:
        """Why other users' processes are out of this process's sight, or None when it sees them all.

        A /proc mounted with hidepid (systemd's ProtectProc=invisible, noaccess or ptraceable) shows another user's
        /proc/PID only to a process that may ptrace it, i.e. holds CAP_SYS_PTRACE, or to the mount's gid= group.
        """
        hidepid = gid = None
        for line in self.mountinfo().splitlines():
            fields = line.split(" - ", 1)
            if len(fields) != 2 or len(fields[0].split()) < 5 or fields[0].split()[4] != str(self.root):
                continue
            after = fields[1].split()
            if not after or after[0] != "proc":
                continue
            options = dict(o.split("=", 1) for o in (after[2] if len(after) > 2 else "").split(",") if "=" in o)
            hidepid, gid = options.get("hidepid"), options.get("gid")  # the last mount over the path wins
        if hidepid in (None, "0", "off"):
            return None
        status = self.read_text("self", "status") or ""
        cap_eff = next((line.split()[1] for line in status.splitlines() if line.startswith("CapEff:")), "0")
        if int(cap_eff, 16) >> CAP_SYS_PTRACE & 1:
            return None
        if gid is not None and gid.isdigit() and int(gid) in (os.getegid(), *os.getgroups()):
            return None
        return f"{self.root} is mounted hidepid={hidepid} and this process lacks CAP_SYS_PTRACE"

    def real_uid(self, pid: int) -> int | None:
        """A process's real uid (the first figure of the `Uid:` line of its status); None when it is gone."""
        for line in (self.read_text(pid, "status") or "").splitlines():
            if line.startswith("Uid:"):
                fields = line.split()
                return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None
        return None

    def wchan(self, pid: int) -> str | None:
        """The kernel function a process sleeps in; None when running or hidden from us ("0")."""
        text = (self.read_text(pid, "wchan") or "").strip()
        return text if text not in ("", "0") else None

    def environ_var(self, pid: int, name: str) -> str | None:
        """One variable of a process's environment (needs the right to ptrace-read it: same user or CAP_SYS_PTRACE)."""
        return self.environ_vars(pid, (name,)).get(name)

    def environ_vars(self, pid: int, names: tuple[str, ...]) -> dict[str, str]:
        """Those of `names` the process's environment sets (one read of it; empty when it can't be read)."""
        try:
            environ = self.path(pid, "environ").read_bytes()
        except OSError:
            return {}
        wanted = {name.encode() for name in names}
        found: dict[str, str] = {}
        for entry in environ.split(b"\0"):
            key, eq, value = entry.partition(b"=")
            if eq and key in wanted and key.decode() not in found:  # the first wins, as getenv's
                found[key.decode()] = value.decode(errors="replace")
        return found

    def fd_mtime(self, pid: int, fd: int) -> float | None:
        """mtime of the file behind an open descriptor: a log renamed by rotation or deleted is still this file."""
        try:
            return os.stat(self.path(pid, "fd", fd)).st_mtime
        except OSError:
            return None

    def cgroup(self, pid: int) -> str | None:
        return self.read_text(pid, "cgroup")

    def pids_named(self, name: str) -> list[int]:
        """Processes whose command name (`comm`, which the kernel cuts to 15 characters) is `name`'s."""
        comm = name[:15]
        try:
            entries = [e.name for e in os.scandir(self.root) if e.name.isdigit()]
        except OSError:
            return []
        return sorted(int(pid) for pid in entries if (self.read_text(pid, "comm") or "").rstrip("\n") == comm)

    def open_paths(self, pid: int, limit: int | None = None) -> set[str]:
        """What each open descriptor of the process names (its /proc/PID/fd link, read, never followed: a stat through
        it would block on a hung mount), of its first `limit` descriptors when given; empty when it can't be read."""
        out = set()
        try:
            with os.scandir(self.path(pid, "fd")) as fds:
                for n, fd in enumerate(fds):
                    if limit is not None and n >= limit:
                        break
                    try:
                        out.add(os.readlink(fd.path))
                    except OSError:
                        continue
        except OSError:
            pass
        return out

    def group(self, pgid: int) -> list[int]:
        """The processes of process group `pgid` now."""
        out = []
        for pid in self.pids():
            text = self.read_text(pid, "stat") or ""
            fields = text[text.rfind(")") + 2:].split()  # after the command name, which may hold anything
            if len(fields) > 2 and fields[2] == str(pgid):
                out.append(pid)
        return out

    def listening(self, pid: int) -> bool:
        """Whether the process holds a TCP socket (IPv4 or IPv6) in the LISTEN state, per its network namespace's
        tables."""
        sockets = {p for p in self.open_paths(pid) if p.startswith("socket:[")}
        for table in ("tcp", "tcp6") if sockets else ():
            for line in (self.read_text(pid, "net", table) or "").splitlines()[1:]:
                fields = line.split()
                if len(fields) > 9 and fields[3] == "0A" and f"socket:[{fields[9]}]" in sockets:  # 0A: TCP_LISTEN
                    return True
        return False

    def mapped_files(self, pid: int) -> set[tuple[int, int]]:
        """(device, inode) of each file mapped into the process, per /proc/PID/maps (a mapping outlives its
        descriptor: a shared-memory segment is usually mapped and closed)."""
        out = set()
        for line in (self.read_text(pid, "maps") or "").splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) < 5 or fields[4] == "0":
                continue
            major, _, minor = fields[3].partition(":")
            try:
                out.add((os.makedev(int(major, 16), int(minor, 16)), int(fields[4])))
            except ValueError:
                continue
        return out


PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def own_usage() -> dict[str, float]:
    """This process's resident memory, CPU seconds, threads, open descriptors and their limit (RLIMIT_NOFILE), and its
    service's task limit where a cgroup sets one, for the agent's self metrics; {} if unreadable. One read of
    /proc/self/stat: psutil's four reads and its objects took half a millisecond, most of the tick's work."""
    proc = ProcFS()
    text = proc.read_text("self", "stat")
    try:
        fields = (text or "").rsplit(")", 1)[1].split()  # after the command name, which may hold anything
        times = os.times()
        usage = {"rss": float(int(fields[21]) * PAGE_SIZE), "cpu": times.user + times.system,
                 "threads": float(fields[17])}
    except (IndexError, ValueError):
        return {}
    try:
        usage["fds"] = float(len(os.listdir(proc.path("self", "fd"))) - 1)  # less the listing's own
    except OSError:
        pass
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY:
        usage["max_fds"] = float(soft)
    tasks = own_task_limit(proc)
    if tasks is not None:
        usage["max_tasks"] = float(tasks)
    return usage


def own_task_limit(proc: ProcFS, cgroups: Path = Path("/sys/fs/cgroup")) -> int | None:
    """pids.max of this process's cgroup (v2; the unit's TasksMax): threads and children count against it. None
    where no limit is set or the hierarchy is not v2."""
    for line in (proc.read_text("self", "cgroup") or "").splitlines():
        if line.startswith("0::"):
            try:
                limit = (cgroups / line[3:].lstrip("/") / "pids.max").read_text().strip()
            except OSError:
                return None
            return int(limit) if limit.isdigit() else None
    return None
