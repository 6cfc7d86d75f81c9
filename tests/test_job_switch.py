"""find_switch: the operator's per-job-name stop files, looked up from one listing of the stop dir per run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainguard.checks.job_switch import find_switch, listed
from trainguard.jobs.model import Job
from trainguard.node.access import AGENT, Identity


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
