"""Real training-log excerpts (tests/data/logs/excerpts.toml: each from a public thread, with what it concluded) read
by the training-log check as a job's log: the lead diagnosis of each, as the thread's conclusion has it."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tomllib

from trainguard.checks.base import CheckContext
from trainguard.checks.training_log import TrainingLogCheck, TrainingLogSettings
from trainguard.core.model import Result, Status
from trainguard.gpu.nvml import Nvml
from trainguard.jobs.catalog import JobCatalog
from trainguard.jobs.settings import JobsSettings, ProcessJobSettings

from .helpers.fake_nvml import FakeNvml, NVMLError

EXCERPTS: list[dict[str, Any]] = tomllib.loads(
    (Path(__file__).parent / "data" / "logs" / "excerpts.toml").read_text())["log"]


@pytest.fixture(scope="module")
def job_marker() -> Iterator[str]:
    """One process standing for the job: its logs are whatever each test writes."""
    marker = f"excerptjob-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", marker])
    yield marker
    proc.kill()
    proc.wait()


def read_logs(tmp_path: Path, marker: str, files: dict[str, str]) -> Result:
    """The check's result for a job whose logs (by file name) hold these texts."""
    logs = tmp_path / "logs"
    logs.mkdir()
    for name, text in files.items():
        (logs / name).write_text(text)
    jobs = JobCatalog(JobsSettings(sources=["process"], refresh=0, processes={
        "trainer": ProcessJobSettings(cmdline=marker, user="root", logs=[str(logs / "*.log")],
                                      switch_dir=str(tmp_path / "switch"))}), "node1")
    check = TrainingLogCheck("logs", TrainingLogSettings(), CheckContext(
        "node1", tmp_path, jobs=jobs, nvml=Nvml(FakeNvml(init_error=NVMLError))))
    [result] = check.run()
    return result


def test_the_corpus_is_large_and_cited() -> None:
    assert len(EXCERPTS) >= 40
    assert len({e["name"] for e in EXCERPTS}) == len(EXCERPTS)
    for entry in EXCERPTS:
        assert entry["source"].startswith("https://github.com/") and entry["concluded"], entry["name"]


@pytest.mark.parametrize("entry", EXCERPTS, ids=[e["name"] for e in EXCERPTS])
def test_each_excerpt_gets_its_lead_diagnosis(tmp_path: Path, job_marker: str, entry: dict[str, Any]) -> None:
    result = read_logs(tmp_path, job_marker, {"rank.log": entry["text"]})
    assert result.status is Status[entry["status"]], result.summary
    # the lead is the summary's first clause (the job's label, then what failed; after " — ": the lever)
    head = result.summary.split(" — ")[0]
    assert entry["lead"] in head, result.summary
