"""find_switch: the operator's per-job-name stop files, looked up from one listing of the stop dir per run."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import require_root, wait_until
from trainguard.agent.configfile import parse_config
from trainguard.checks.job_switch import find_switch, listed
from trainguard.jobs.model import Job
from trainguard.node.access import AGENT, Identity
from trainguard.node.inotify import DirWatcher
from trainguard.pipeline.engine import Engine


def _job(name: str) -> Job:
    return Job(key=f"process:{name}", source="process", name=name, state="RUNNING", on_this_node=True)


def _agent(job: Job) -> Identity:
    return AGENT


def test_the_operators_stop_file_is_found_through_one_listing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stop_dir = tmp_path / "stop"
    stop_dir.mkdir()
    (stop_dir / "train-a").touch()
    os.mkfifo(stop_dir / "train-b")  # as the trainer helper counts them: a FIFO is no switch
    names = listed(stop_dir)
    assert names == {"train-a", "train-b"}
    looked: list[str] = []
    real_lstat = os.lstat

    def lstat(path: str) -> os.stat_result:
        looked.append(path)
        return real_lstat(path)

    monkeypatch.setattr(os, "lstat", lstat)
    found = {job: find_switch(_job(job), "stop", stop_dir, _agent, names) for job in ("train-a", "train-b", "train-c")}
    assert [(f.path, f.uid) for f in found["train-a"]] == [(stop_dir / "train-a", os.getuid())]
    assert found["train-b"] == [] and found["train-c"] == []
    # a job whose name the listing does not hold costs no system call of its own
    assert looked == [str(stop_dir / "train-a"), str(stop_dir / "train-b")]
    # without a listing each job is looked for (and the save switch never in the operator's dir)
    assert [f.path for f in find_switch(_job("train-a"), "stop", stop_dir, _agent)] == [stop_dir / "train-a"]
    assert find_switch(_job("train-a"), "save", stop_dir, _agent, names) == []


def test_an_absent_stop_dir_lists_nothing(tmp_path: Path) -> None:
    assert listed(tmp_path / "absent") == frozenset()
    (tmp_path / "file").touch()
    assert listed(tmp_path / "file") == frozenset()


def test_the_watcher_wakes_on_the_switch_name_alone_and_at_most_once_a_gap(tmp_path: Path) -> None:
    """inotify on the switch dirs: a `stop` created, renamed in or touched wakes the check at once; other names in the
    job's dir do not; any name in the operator's stop dir does (its files are named after jobs); a user's loop of
    touches wakes it at most once per gap; a dir removed and made again is watched again."""
    wakes: list[float] = []
    switch, operator = tmp_path / "run" / ".trainguard", tmp_path / "stop"
    switch.mkdir(parents=True)
    operator.mkdir()
    watcher = DirWatcher(["stop"], lambda: wakes.append(time.monotonic()), min_gap=0.2)
    try:
        watcher.watch([str(switch), str(tmp_path / "absent")], [str(operator)])
        assert watcher.watching == {str(switch), str(operator)}
        (switch / "heartbeat.json").write_text("{}")
        time.sleep(0.3)
        assert wakes == []
        t0 = time.monotonic()
        (switch / "stop").touch()
        wait_until(lambda: wakes, 2, 0.005, what="a wake")
        assert wakes[0] - t0 < 0.1, wakes[0] - t0
        (operator / "pretrain-70b").touch()
        wait_until(lambda: len(wakes) == 2, 2, 0.005, what="the operator's file")
        before = len(wakes)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.0:  # a flood of touches
            os.utime(switch / "stop")
        time.sleep(0.3)
        assert len(wakes) - before <= 7  # one per 0.2 s gap at most, not one per touch
        for child in switch.iterdir():
            child.unlink()
        switch.rmdir()
        wait_until(lambda: str(switch) not in watcher.watching, 2, 0.01, what="the dropped watch forgotten")
        switch.mkdir()
        watcher.watch([str(switch)], [str(operator)])
        count = len(wakes)
        (switch / "stop").touch()
        wait_until(lambda: len(wakes) > count, 2, 0.005, what="a wake in the dir made again")
        watcher.watch([], [])
        assert watcher.watching == frozenset()
    finally:
        watcher.close()
    fds = len(os.listdir("/proc/self/fd"))
    watcher.close()  # a second close touches no descriptor (its numbers may be another file's by now)
    assert len(os.listdir("/proc/self/fd")) == fds


def test_the_watcher_works_past_fd_setsize_and_follows_no_symlink(tmp_path: Path) -> None:
    """An agent holding a thousand connections gets descriptors past 1024, where select() fails (the watch thread
    died and switch files waited for the poll); and a job's switch dir that is a symlink is not followed as root."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 1200
    if soft < need:
        require_root()  # raising the hard limit needs root; CI runs as root
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, max(hard, need)))
    held = []
    try:
        while not held or held[-1] < 1030:
            held.append(os.open("/dev/null", os.O_RDONLY))
        wakes: list[float] = []
        switch, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
        switch.mkdir()
        elsewhere.mkdir()
        (tmp_path / "link").symlink_to(elsewhere)
        watcher = DirWatcher(["stop"], lambda: wakes.append(time.monotonic()))
        try:
            watcher.watch([str(switch), str(tmp_path / "link")])
            assert watcher.watching == {str(switch)}
            (elsewhere / "stop").touch()
            (switch / "stop").touch()
            wait_until(lambda: wakes, 2, 0.005, what="a wake from a watcher whose descriptors are past 1024")
        finally:
            watcher.close()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_switch_touched_between_polls_fires_at_once(tmp_path: Path) -> None:
    """The switch check with a one-minute interval: a `stop` touched after its first run fires within a second (was:
    at the next poll, after the trainer had saved and exited and the array's next task had started)."""
    run = tmp_path / "run"
    (run / ".trainguard").mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "tg-switch-watch"])
    raw = {"agent": {"state_dir": str(tmp_path / "state"), "listen": "", "node_name": "n1"},
           "jobs": {"sources": ["process"], "refresh": 0, "processes": {"train": {
               "cmdline": "tg-switch-watch", "user": pwd.getpwuid(os.getuid()).pw_name,
               "switch_dir": str(run / ".trainguard")}}},
           "checks": {"job_switch": {"interval": "60s", "jitter": 0}}, "notifiers": {}}
    engine = Engine(parse_config(raw, "t.toml"))
    try:
        engine.start()
        wait_until(lambda: (engine.snapshot().checks["job_switch"].runs or 0) >= 1, 10, what="the first run")
        wait_until(lambda: str(run / ".trainguard") in engine.checks["job_switch"]._watcher.watching, 10,  # type: ignore[attr-defined]
                   what="the switch dir watched")
        t0 = time.monotonic()
        (run / ".trainguard" / "stop").touch()
        wait_until(lambda: any(i.check == "job_switch" and i.firing for i in engine.tracker.incidents()), 5, 0.01,
                   what="the stop switch incident")
        assert time.monotonic() - t0 < 1.0
    finally:
        engine.stop()
        proc.kill()
        proc.wait()
