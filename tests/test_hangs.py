"""Hangs: real processes that stop making progress, caught at their deadline, with their stacks."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import REPO, HungMount, require, wait_until
from trainguard.agent.configfile import parse_config
from trainguard.core.model import Status
from trainguard.node.stacks import DumpLimits, StackDumper, find_py_spy, innermost
from trainguard.pipeline.engine import Engine
from trainguard.pipeline.incidents import Incident


def hang_engine(tmp_path: Path, marker: str, job: dict[str, Any], **check: Any) -> Engine:
    raw = {"agent": {"state_dir": str(tmp_path / "state"), "node_name": "node1", "listen": ""},
           "jobs": {"sources": ["process"], "refresh": 0, "processes": {"trainer": {"cmdline": marker, "user": "root", **job}}},
           "checks": {"hang": {"stale_after": "2s", "interval": "30s", **check}},
           "notifiers": {"console": {}}}
    return Engine(parse_config(raw, "test.toml"))


def toy(tmp_path: Path, marker: str, *args: str) -> list[str]:
    return [sys.executable, str(REPO / "examples/train_toy.py"), "--steps", "100000", "--step-time", "0.1",
            "--ckpt-dir", str(tmp_path / marker), *args]


def hung(engine: Engine) -> Incident | None:
    return next((i for i in engine.tracker.incidents() if i.check == "hang" and i.firing), None)


def test_innermost_frame_of_a_py_spy_dump() -> None:
    dump = """Process 4242: python train.py
Python v3.11.2 (/usr/bin/python3.11)

Thread 4250 (idle): "pin_memory"
    select (selectors.py:415)
Thread 4242 (idle): "MainThread"
    wait (torch/distributed/distributed_c10d.py:3120)
    all_reduce (torch/distributed/distributed_c10d.py:2050)
    main (train.py:88)
"""
    assert innermost(dump) == "wait (torch/distributed/distributed_c10d.py:3120)"
    assert innermost('Thread 7 (active): "worker"\n    run (w.py:3)\n') == "run (w.py:3)"
    assert innermost("Error: Failed to find python version") is None


def test_hung_trainer_fires_at_its_deadline_with_its_stack(tmp_path: Path, children: list[subprocess.Popen[str]]) -> None:
    require(find_py_spy() is not None, "needs py-spy (pip install py-spy)")
    marker = f"hang-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "train.log"
    engine = hang_engine(tmp_path, marker, {"logs": [str(log)]})
    proc = subprocess.Popen(toy(tmp_path, marker, "--fault", "hang", "--fault-at", "10", "--log", str(log)), text=True)
    children.append(proc)
    engine.start()
    try:
        wait_until(lambda: "entering allreduce" in (log.read_text() if log.exists() else ""), 20, what="the hang")
        incident = wait_until(lambda: hung(engine), 15, what="hang incident")
        assert isinstance(incident, Incident) and incident.status is Status.CRITICAL
        deadline = log.stat().st_mtime + 2.0
        # the run that found it started at the deadline (its timer), not at the next 30 s interval; the stack dump
        # after the decision (py-spy, about a second on a busy 2-core machine) is not part of "on time"
        firing = engine.snapshot().checks["hang"].last
        assert firing is not None and 0.0 <= firing.started - deadline < 1.0, (firing, deadline)
        assert firing.results and firing.results[0].status is Status.CRITICAL
        assert incident.fired_at is not None and incident.fired_at - deadline < 10.0  # the dump's own timeout bounds it
        assert "process job trainer: no progress for" in incident.summary
        assert f"last: log {log}" in incident.summary
        assert f"pid {proc.pid}: stuck_in_allreduce (train_toy.py:" in incident.summary, incident.summary
        path = Path(incident.summary.rsplit("stacks in ", 1)[1])
        assert path.is_file() and "stuck_in_allreduce" in path.read_text()
        assert path.parent == tmp_path / "state" / "stacks"
    finally:
        engine.stop()
    written = path.stat().st_mtime_ns
    again = hang_engine(tmp_path, marker, {"logs": [str(log)]})  # the agent restarted; the job is still hung
    again.start()
    try:
        report = wait_until(lambda: again.snapshot().checks["hang"].last, 15, what="the first run after the restart")
        [result] = report.results  # type: ignore[attr-defined]
        assert result.status is Status.CRITICAL and result.details["stacks_path"] == str(path)
        assert f"pid {proc.pid}: stuck_in_allreduce (train_toy.py:" in result.summary, result.summary
        assert list(path.parent.iterdir()) == [path] and path.stat().st_mtime_ns == written  # one dump per hang
    finally:
        again.stop()


def test_log_rotation_is_no_hang(tmp_path: Path, children: list[subprocess.Popen[str]]) -> None:
    marker = f"rotate-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "train.log"
    engine = hang_engine(tmp_path, marker, {"logs": [str(log)]}, stacks=False)
    children.append(subprocess.Popen(toy(tmp_path, marker, "--log", str(log)), text=True))
    engine.start()
    try:
        wait_until(lambda: log.exists() and "step 3" in log.read_text(), 20, what="training steps")
        log.rename(tmp_path / "train.log.1")  # rotated by rename: the trainer keeps writing the old file
        log.write_text("")
        time.sleep(5)  # more than twice stale_after
        assert hung(engine) is None
        assert "step" in (tmp_path / "train.log.1").read_text().splitlines()[-1]
        with log.open("w"):
            pass  # and truncation of the new one changes nothing either
        time.sleep(1)
        assert hung(engine) is None
    finally:
        engine.stop()


def test_heartbeat_rewritten_with_a_stuck_step_is_a_hang(tmp_path: Path, children: list[subprocess.Popen[str]]) -> None:
    marker = f"beat-{uuid.uuid4().hex[:8]}"
    switch_dir = tmp_path / "switch"
    beating = ("import sys, time\nsys.path.insert(0, sys.argv[1])\nfrom trainguard.trainer import Trainer\n"
               "t = Trainer(sys.argv[2])\nfor step in range(5):\n    t.heartbeat(step); time.sleep(0.2)\n"
               "while True:\n    t.heartbeat(5); time.sleep(0.2)  # a heartbeat thread outliving the training loop\n")
    engine = hang_engine(tmp_path, marker, {"switch_dir": str(switch_dir)}, stacks=False)
    children.append(subprocess.Popen([sys.executable, "-c", beating, str(REPO), str(switch_dir), marker], text=True))
    engine.start()
    try:
        incident = wait_until(lambda: hung(engine), 15, what="hang incident")
        assert isinstance(incident, Incident)
        assert "last: heartbeat step 5" in incident.summary, incident.summary
        beat = switch_dir / "heartbeat.json"
        assert time.time() - beat.stat().st_mtime < 1  # the file kept moving; the step did not
    finally:
        engine.stop()


def test_job_blocked_on_a_dead_filesystem_shows_the_kernel_wait(
        tmp_path: Path, children: list[subprocess.Popen[str]], hung_mount: HungMount) -> None:
    # hung_mount after children: its teardown aborts the mount first, or the blocked child could not even be killed
    marker = f"dstate-{uuid.uuid4().hex[:8]}"
    engine = hang_engine(tmp_path, marker, {})
    blocked = subprocess.Popen([sys.executable, "-c", "import os, sys; os.statvfs(sys.argv[1])", str(hung_mount.mountpoint),
                                marker], text=True)
    children.append(blocked)
    engine.start()
    try:
        incident = wait_until(lambda: hung(engine), 15, what="hang incident")
        assert isinstance(incident, Incident)
        # FUSE waits interruptibly first: the stack is read without stopping the process, and the wait shows
        assert f"pid {blocked.pid}: <module> (<string>:1), kernel wait request_wait_answer" in incident.summary, \
            incident.summary
        assert "last: write I/O" in incident.summary or "last: job start" in incident.summary
    finally:
        engine.stop()


def test_heartbeat_deadline_counts_from_the_write_not_from_when_it_was_seen(
        tmp_path: Path, children: list[subprocess.Popen[str]]) -> None:
    marker = f"beat-{uuid.uuid4().hex[:8]}"
    switch_dir = tmp_path / "switch"
    stepping = ("import sys, time\nsys.path.insert(0, sys.argv[1])\nfrom trainguard.trainer import Trainer\n"
                "t = Trainer(sys.argv[2])\nfor step in range(8):\n    t.heartbeat(step); time.sleep(0.15)\n"
                "time.sleep(600)\n")
    engine = hang_engine(tmp_path, marker, {"switch_dir": str(switch_dir)}, stacks=False)
    children.append(subprocess.Popen([sys.executable, "-c", stepping, str(REPO), str(switch_dir), marker], text=True))
    wait_until((switch_dir / "heartbeat.json").exists, 10, what="first heartbeat")
    engine.start()  # sees an early step; at its deadline it finds the last step, written ~2s before it looked
    try:
        incident = wait_until(lambda: hung(engine), 20, what="hang incident")
        assert isinstance(incident, Incident) and "last: heartbeat step 7" in incident.summary, incident.summary
        deadline = (switch_dir / "heartbeat.json").stat().st_mtime + 2.0
        assert incident.fired_at is not None and incident.fired_at - deadline < 1.0, incident.fired_at - deadline
    finally:
        engine.stop()


FAKE_PY_SPY = """#!/bin/sh
# py-spy as the dumper calls it (dump --pid N ...): prints a big dump, or hangs past its timeout
if [ "$FAKE_PY_SPY" = print ]; then
  printf 'Thread %s (idle): "MainThread"\\n    wait (fake.py:%s)\\n' "$3" "$3"
  head -c 1300000 /dev/zero | tr '\\0' x
  exit 0
fi
exec sleep 60
"""


@pytest.fixture
def python_procs(tmp_path: Path, children: list[subprocess.Popen[str]]) -> tuple[Path, list[psutil.Process]]:
    """A fake py-spy, and ten Python processes: ranks 0-3 (rank 0 twice: a data-loader worker inherits its RANK),
    and four that name no rank."""
    fake = tmp_path / "py-spy"
    fake.write_text(FAKE_PY_SPY)
    fake.chmod(0o755)
    for rank in ("0", "0", "1", "2", "3", None, None, None, None, None):
        env = {**os.environ, "RANK": rank} if rank is not None else {k: v for k, v in os.environ.items() if k != "RANK"}
        children.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env, text=True))
    procs = [psutil.Process(c.pid) for c in children]
    wait_until(lambda: all(p.exe().startswith(sys.executable[:-1]) or "python" in p.name() for p in procs), 10)
    return fake, procs


def _spies(procs: list[psutil.Process]) -> list[psutil.Process]:
    """This process's children started since the dumped `procs`, other than them: the py-spy runs (`exec sleep` once
    hung), zombies too; not what an earlier test's fixture left running under this process (a SLURM cluster)."""
    since = min(p.create_time() for p in procs)
    mine = []
    for c in psutil.Process().children(recursive=True):
        try:
            if c.pid not in {p.pid for p in procs} and c.create_time() >= since:
                mine.append(c)
        except psutil.NoSuchProcess:
            continue
    return mine


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_py_spy_runs_at_most_n_at_a_time_one_per_rank_and_every_child_is_reaped(
        python_procs: tuple[Path, list[psutil.Process]]) -> None:
    fake, procs = python_procs
    dumper = StackDumper(str(fake), timeout=20, limits=DumpLimits(inspected=9, dumps=6, parallel=2, each=0.5))
    fds = _fds()
    most, done = 0, threading.Event()

    def sample() -> None:
        nonlocal most
        while not done.is_set():
            most = max(most, len([c for c in _spies(procs) if c.status() != psutil.STATUS_ZOMBIE]))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        capture = dumper.dump(procs)
    finally:
        done.set()
        sampler.join()
    assert most == 2  # six dumps of 0.5 s each, two at a time
    # ranks 0-3 once each (the first process of rank 0, not its worker), then the first two that name no rank
    assert [(s.pid, s.rank) for s in capture.stacks] == [(procs[0].pid, "0"), (procs[2].pid, "1"), (procs[3].pid, "2"),
                                                        (procs[4].pid, "3"), (procs[5].pid, None), (procs[6].pid, None)]
    assert all(s.where.startswith("no stack: py-spy timed out after 0.") for s in capture.stacks)
    assert capture.note == "4 more processes not dumped (at most 9 inspected and 6 dumped per hang, one per rank)"
    assert _spies(procs) == [] and _fds() == fds  # killed, reaped (no zombie), pipes closed


def test_a_big_dump_is_read_while_it_is_printed(python_procs: tuple[Path, list[psutil.Process]],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    fake, procs = python_procs
    monkeypatch.setenv("FAKE_PY_SPY", "print")
    capture = StackDumper(str(fake), timeout=20, limits=DumpLimits(parallel=3)).dump(procs[:4])
    assert [s.where for s in capture.stacks] == [f"wait (fake.py:{p.pid})" for p in procs[:1] + procs[2:4]]
    # read while printed (a full pipe would have stalled it), kept up to 1 MiB
    assert all(len(s.text) < 1.1e6 and s.text.endswith(" more bytes not kept]\n") for s in capture.stacks)
    assert capture.note == "1 more processes not dumped (at most 256 inspected and 32 dumped per hang, one per rank)"
    assert _spies(procs) == []


def test_py_spy_that_cannot_start_is_one_line_per_process_and_leaks_nothing(
        python_procs: tuple[Path, list[psutil.Process]]) -> None:
    fake, procs = python_procs
    fds = _fds()
    missing = StackDumper(str(fake.parent / "gone"), timeout=5).dump(procs[:3])
    assert {s.where for s in missing.stacks} == {"no stack: py-spy could not start: No such file or directory"}
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (fds + 2, hard))  # room for the selector, not for a child's pipes
    try:
        starved = StackDumper(str(fake), timeout=5).dump(procs)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(starved.stacks) == 9
    assert {s.where for s in starved.stacks} == {"no stack: py-spy could not start: Too many open files"}
    assert _spies(procs) == [] and _fds() == fds


def test_an_exception_midway_kills_and_reaps_the_running_children(
        python_procs: tuple[Path, list[psutil.Process]]) -> None:
    fake, procs = python_procs
    fds = _fds()

    class Interrupted(StackDumper):
        def _start(self, pid: int, until: float) -> Any:
            if len(_spies(procs)) == 3:
                raise KeyboardInterrupt  # what a signal or a bug raises while children run
            return super()._start(pid, until)

    with pytest.raises(KeyboardInterrupt):
        Interrupted(str(fake), timeout=20, limits=DumpLimits(parallel=4)).dump(procs)
    assert _spies(procs) == [] and _fds() == fds


def test_a_capture_that_raises_makes_only_that_job_unknown_and_is_not_run_again(
        tmp_path: Path, children: list[subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def explode(self: StackDumper, procs: list[psutil.Process]) -> Any:
        calls.append(len(procs))
        raise ValueError("Exceeds the limit (4300 digits) for integer string conversion")

    monkeypatch.setattr(StackDumper, "dump", explode)
    marker = f"boom-{uuid.uuid4().hex[:8]}"
    for name in ("bad", "good"):
        children.append(subprocess.Popen([sys.executable, "-c", SLEEP, f"{marker}-{name}"], text=True))
    raw = {"agent": {"state_dir": str(tmp_path / "state"), "node_name": "node1", "listen": ""},
           "jobs": {"sources": ["process"], "refresh": 0, "processes": {
               name: {"cmdline": f"{marker}-{name}", "user": "root"} for name in ("bad", "good")}},
           "checks": {"hang": {"stale_after": "2s", "stale_after_by_name": {"good": "1h"}, "interval": "0.5s"}},
           "notifiers": {"console": {}}}
    engine = Engine(parse_config(raw, "test.toml"))
    engine.start()
    try:
        first = wait_until(lambda: hung(engine), 20, what="the bad job's hang")
        assert isinstance(first, Incident) and first.subject == "process:bad" and first.status is Status.UNKNOWN
        assert "hang check failed: ValueError: Exceeds the limit" in first.summary
        incident = wait_until(lambda: (i := hung(engine)) and i.status is Status.CRITICAL and i, 10, what="CRITICAL")
        assert isinstance(incident, Incident) and incident.subject == "process:bad"
        assert "capturing the stacks failed: see the agent's log" in incident.summary, incident.summary
        time.sleep(1.5)  # three more runs, the job still hung
        report = engine.snapshot().checks["hang"].last
        assert report is not None and {r.subject: r.status for r in report.results} == {
            "process:bad": Status.CRITICAL, "process:good": Status.OK}
    finally:
        engine.stop()
    assert calls == [1]  # the first run that found the hang was UNKNOWN for that job alone; no run dumped again


SLEEP = "import time\nwhile True:\n    time.sleep(1)\n"
