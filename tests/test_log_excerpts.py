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
    logs.mkdir(parents=True)
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
    if "advice" in entry:
        assert entry["advice"] in result.summary.split(" — ", 1)[1], result.summary


def excerpt(name: str) -> list[str]:
    return next(e for e in EXCERPTS if e["name"] == name)["text"].splitlines()


def test_a_late_ecc_error_leads_over_25_timeouts(tmp_path: Path, job_marker: str) -> None:
    """Findings are not capped first-come: 25 ranks' timeouts (the real line of pytorch/pytorch#118369, once per
    rank) come first in the log, the uncorrectable ECC error of pytorch/pytorch#113128 last; the hardware leads."""
    timeout = excerpt("timeout_broadcast_deepspeed")[2]
    lines = [timeout.replace("[Rank 2]", f"[Rank {r}]") for r in range(25)] + excerpt("ecc_default_prefix")[:1]
    result = read_logs(tmp_path, job_marker, {"rank.log": "\n".join(lines) + "\n"})
    assert "(rank 12): CUDA error: uncorrectable ECC error" in result.summary, result.summary
    assert "hardware: the GPU's memory failed" in result.summary
    kept = [f for f in result.details["findings"] if f["signature"] == "nccl_timeout"]
    assert 0 < len(kept) <= 8  # bounded per signature, the ECC line kept whatever came before


def test_an_oom_after_a_timeout_is_its_knock_on(tmp_path: Path, job_marker: str) -> None:
    """By the lines' timestamps the OOM came after the collective timed out (the pattern of NVIDIA/nccl#1284): the
    timeout leads, not the OOM; the same OOM before the timeout is the cause."""
    timeout = excerpt("timeout_behind_physicsnemo")[0]
    oom = "[rank1]:[E1016 03:40:01.000000000 train.py:1] " + next(
        e for e in EXCERPTS if e["name"] == "oom_cached_form_true")["text"].splitlines()[1]
    after = read_logs(tmp_path / "after", job_marker, {"rank3.log": timeout + "\n", "rank1.log": oom + "\n"})
    assert ": NCCL collective timeout: ALLREDUCE #50" in after.summary, after.summary
    before = read_logs(tmp_path / "before", job_marker, {
        "rank3.log": timeout + "\n", "rank1.log": oom.replace("03:40:01", "03:20:01") + "\n"})
    assert "(rank 1): CUDA out of memory (true OOM)" in before.summary, before.summary
    assert "then ALLREDUCE #50 timed out on rank 3" in before.summary


def test_the_rank_that_stopped_first_is_found_across_the_nodes_logs(tmp_path: Path, job_marker: str) -> None:
    """Two nodes' logs of one job (hiyouga/LlamaFactory#7396's ranks 0,3,4 on one, rank 1's own watchdog line on the
    other): rank 1 never entered #1580, the others completed #1579 and wait in #1580."""
    from .test_messages import CORPUS

    node1 = "\n".join(CORPUS["nccl"]["v24_four_ranks"]["lines"]) + "\n"
    node2 = ("[rank1]:[E321 02:07:08.465150152 ProcessGroupNCCL.cpp:1664] [PG 1 Rank 1] Exception (either an error or "
             "timeout) detected by watchdog at work: 1579, last enqueued NCCL work: 1579, last completed NCCL work: "
             "1578.\n")
    result = read_logs(tmp_path, job_marker, {"node1.log": node1, "node2.log": node2})
    assert ("rank 1 never entered ALLREDUCE #1580 (last enqueued: #1579); ranks 0,3 completed #1579 and wait in "
            "#1580") in result.summary, result.summary
    assert result.details["collectives"]["first"] == [1]


def test_a_watchdog_abort_is_the_timeouts_effect_whatever_the_order(tmp_path: Path, job_marker: str) -> None:
    """huggingface/picotron_tutorial#6: the watchdog's timeout took the ranks down (exit code -6, SIGABRT). torchrun's
    summary read first (its own file, or before the ranks' lines in one) does not make the abort the cause."""
    lines = excerpt("timeout_then_watchdog_abort_picotron")
    ranks, launcher = "\n".join(lines[:7]) + "\n", "\n".join(lines[7:]) + "\n"
    for where, files in (("two_files", {"launcher.log": launcher, "rank.log": ranks}),
                         ("launcher_first", {"rank.log": launcher + ranks})):
        result = read_logs(tmp_path / where, job_marker, files)
        head = result.summary.split(" — ")[0]
        assert ": NCCL collective timeout: ALLREDUCE #1 timed out on ranks 2-3" in head, result.summary
        assert head.endswith("; then the watchdog's abort: torchrun: rank 0 failed first: killed by signal 6 (SIGABRT) "
                             "(on 472a4389fceb)"), result.summary


def test_two_watchdog_lines_glued_on_one_terminal_line_are_two_ranks(tmp_path: Path, job_marker: str) -> None:
    """A terminal that lost a newline glues two ranks' watchdog messages (hiyouga/LlamaFactory#7396's rank 0 and rank
    4 lines, and rank 0's and rank 3's progress lines): each is its rank's, and both count in the story."""
    from .test_messages import CORPUS

    timeout0, timeout4, progress0, progress3 = CORPUS["nccl"]["v24_four_ranks"]["lines"]
    result = read_logs(tmp_path, job_marker, {"rank.log": timeout0 + timeout4 + "\n" + progress0 + progress3 + "\n"})
    assert "ALLREDUCE #1580 timed out on ranks 0,3-4" in result.summary, result.summary
    assert result.details["collectives"]["seen"] == [0, 3, 4]


def test_the_step_of_a_timeout_is_named(tmp_path: Path, job_marker: str) -> None:
    """pytorch/pytorch#118369: Lightning's bar, glued to the first watchdog line, says global_step=3.2e+4."""
    result = read_logs(tmp_path, job_marker, {"rank.log": "\n".join(excerpt("timeout_far_behind_nemo")) + "\n"})
    assert "; at step 32000 — " in result.summary, result.summary
    assert result.details["collectives"]["first"] == [7]
