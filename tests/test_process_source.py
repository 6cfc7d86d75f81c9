"""The process job source over a /proc tree the test writes (pids, stat lines, command lines, uids): which listings
read every process again and which reuse the last one.

The stat lines have the kernel's shape (`pid (comm) state ppid ...`, start time the 22nd field, rss the 24th, as
proc(5) numbers them and as tests/test_leaks.py reads from the real /proc); only the fields the agent reads carry
values."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from trainguard.jobs import process as process_module
from trainguard.jobs.process import EXEC_WINDOW_S, REUSE_MAX_S, ProcessSource
from trainguard.jobs.settings import JobsSettings, ProcessJobSettings
from trainguard.node.procfs import ProcFS
from trainguard.node.proctable import ProcessSnapshots

BOOT = 1_700_000_000
TICKS = os.sysconf("SC_CLK_TCK")
ME = os.getuid()


@dataclass(frozen=True)
class CountingProcFS(ProcFS):
    stat_reads: list[int] = field(default_factory=list)

    def read_text(self, *parts: str | int) -> str | None:
        if len(parts) == 2 and parts[1] == "stat":
            self.stat_reads.append(int(parts[0]))
        return super().read_text(*parts)


class Node:
    """A /proc tree and the two clocks the source reads (wall for start times, monotonic for the snapshot)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.wall = BOOT + 10_000.0
        self.mono = 1_000.0
        (root / "stat").write_text(f"cpu  1 2 3\nbtime {BOOT}\n")

    def spawn(self, pid: int, cmdline: str, started_ago: float = 3600.0, ppid: int = 1, uid: int = ME) -> None:
        d = self.root / str(pid)
        d.mkdir(exist_ok=True)
        start = round((self.wall - started_ago - BOOT) * TICKS)
        (d / "stat").write_text(f"{pid} (python3) S {ppid} " + " ".join(["0"] * 17) + f" {start} 0 100\n")
        (d / "cmdline").write_text("\0".join(cmdline.split()) + "\0")
        (d / "status").write_text(f"Name:\tpython3\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")

    def exec(self, pid: int, cmdline: str) -> None:
        (self.root / str(pid) / "cmdline").write_text("\0".join(cmdline.split()) + "\0")

    def exit(self, pid: int) -> None:
        for f in (self.root / str(pid)).iterdir():
            f.unlink()
        (self.root / str(pid)).rmdir()

    def later(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Node:
    n = Node(tmp_path)
    monkeypatch.setattr(process_module, "time", types.SimpleNamespace(time=lambda: n.wall))
    return n


def source(node: Node, **jobs: ProcessJobSettings) -> tuple[ProcessSource, ProcessSnapshots, CountingProcFS]:
    proc = CountingProcFS(node.root)
    snapshots = ProcessSnapshots(proc, max_age=0.0, clock=lambda: node.mono)  # every get() would read /proc again
    settings = JobsSettings(sources=["process"], processes=jobs)
    return ProcessSource(settings, "node1", None, snapshots), snapshots, proc  # type: ignore[arg-type]


def user() -> str:
    import pwd

    return pwd.getpwuid(ME).pw_name


def pids(src: ProcessSource) -> dict[str, list[int]]:
    return {j.name: sorted(p.pid for p in j.processes) for j in src.jobs()}


def test_a_quiet_node_is_listed_once_then_the_listing_is_reused(node: Node) -> None:
    node.spawn(100, "python train.py --run a")
    node.spawn(101, "sshd: idle")
    src, _, proc = source(node, train=ProcessJobSettings(cmdline="train.py", user=user()))
    assert pids(src) == {"train": [100]}
    read = len(proc.stat_reads)
    assert read >= 2
    node.later(2.0)
    assert pids(src) == {"train": [100]}
    assert len(proc.stat_reads) == read  # nothing started or ended: not one stat file read again
    node.later(REUSE_MAX_S)
    assert pids(src) == {"train": [100]}
    assert len(proc.stat_reads) > read  # reused for REUSE_MAX_S at most


def test_no_declared_process_lists_nothing_and_reads_nothing(node: Node) -> None:
    node.spawn(100, "python train.py --run a")
    src, _, proc = source(node)
    assert src.jobs() == [] and proc.stat_reads == []


def test_a_process_that_starts_or_ends_anywhere_means_a_full_listing(node: Node) -> None:
    node.spawn(100, "python train.py")
    src, _, proc = source(node, train=ProcessJobSettings(cmdline="train.py", user=user()))
    assert pids(src) == {"train": [100]}
    node.later(10)
    node.spawn(200, "python train.py --second")  # a rank of its own started: the pid set changed
    node.later(EXEC_WINDOW_S + 1)
    assert pids(src) == {"train": [100, 200]}
    node.later(1)
    node.exit(100)
    assert pids(src) == {"train": [200]}
    reads = len(proc.stat_reads)
    node.later(1)
    assert pids(src) == {"train": [200]} and len(proc.stat_reads) == reads


def test_a_young_process_that_execs_is_seen_although_no_pid_changed(node: Node) -> None:
    """A fork's child takes its own command line when it execs, after the listing that saw it: while any process is
    young enough for that, listings are not reused."""
    node.spawn(300, "bash launch.sh", started_ago=1.0)
    src, _, _ = source(node, train=ProcessJobSettings(cmdline="train.py", user=user()))
    assert pids(src) == {"train": []}
    node.exec(300, "python train.py")
    node.later(1.0)
    assert pids(src) == {"train": [300]}


def test_a_pidfile_rewritten_to_another_live_process_is_followed(node: Node, tmp_path: Path) -> None:
    # a pidfile's pid must also live on the real node (the source asks psutil): two real processes, mirrored
    old, new = (subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2))
    try:
        node.spawn(old.pid, "python old.py")
        node.spawn(new.pid, "python new.py")
        pidfile = tmp_path / "train.pid"
        pidfile.write_text(f"{old.pid}\n")
        src, _, _ = source(node, train=ProcessJobSettings(pidfile=pidfile, user=user()))
        assert pids(src) == {"train": [old.pid]}
        node.later(1.0)
        pidfile.write_text(f"{new.pid}\n")  # the trainer restarted as a process that already ran: no pid changed
        assert pids(src) == {"train": [new.pid]}
    finally:
        for p in (old, new):
            p.kill()
            p.wait()


def test_a_newer_snapshot_read_by_another_check_is_used(node: Node) -> None:
    node.spawn(100, "python train.py")
    src, snapshots, _ = source(node, train=ProcessJobSettings(cmdline="train.py", user=user()))
    assert pids(src) == {"train": [100]}
    node.later(1.0)
    (node.root / "100" / "status").write_text(f"Name:\tpython3\nUid:\t{ME + 1}\t{ME + 1}\t{ME + 1}\t{ME + 1}\n")
    assert pids(src) == {"train": [100]}  # reused: same pids, no newer table
    snapshots.get()  # job_memory's round read /proc: the next listing is made from that table
    assert pids(src) == {"train": []}  # the process now runs as another user: not the job's
