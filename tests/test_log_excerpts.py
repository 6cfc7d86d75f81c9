"""Real training-log excerpts (tests/data/logs/excerpts.toml: each from a public thread, with what it concluded) read
by the training-log check as a job's log: the lead diagnosis of each, as the thread's conclusion has it; and the tags
launchers put in front of the lines (tests/data/logs/prefixes.toml): each names its rank."""

from __future__ import annotations

import os
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
from trainguard.logscan.collectives import observe
from trainguard.logscan.lines import MAX_LINE, Plain, plain, timestamp
from trainguard.logscan.signatures import last_exception
from trainguard.node.access import Identity

from .helpers.fake_nvml import FakeNvml, NVMLError

EXCERPTS: list[dict[str, Any]] = tomllib.loads(
    (Path(__file__).parent / "data" / "logs" / "excerpts.toml").read_text())["log"]
TAGGED: list[dict[str, Any]] = tomllib.loads(
    (Path(__file__).parent / "data" / "logs" / "prefixes.toml").read_text())["line"]


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


@pytest.mark.parametrize("entry", TAGGED, ids=[e["launcher"] for e in TAGGED])
def test_each_launchers_tag_names_its_rank(entry: dict[str, Any]) -> None:
    assert entry["source"].startswith("https://github.com/") and entry["line"].startswith(entry["tag"])
    p = plain(entry["line"])
    assert p.text == entry["line"][len(entry["tag"]):]
    assert p.rank == (entry["rank"] or None)


@pytest.mark.parametrize(("tag", "rank"), [
    ("[1,3][gpu-node-7:81234]<stderr>: ", "3"),  # --output tag-detailed
    ("[3]<stderr>: ", "3"),  # --output rank
    ("[Thu Jun 18 14:28:35 2020][1,3]<stderr>: ", "3"),  # --output tag,timestamp
    ("[Thu Jun 18 14:28:35 2020]<stderr>: ", None),  # --output timestamp: no rank
    ("Thu Jun 18 14:28:35 2020<stderr>:", None),  # Open MPI 4's --timestamp-output alone
])
def test_the_forms_no_capture_was_found_for(tag: str, rank: str | None) -> None:
    """Open MPI 5's other forms, as openpmix's src/common/pmix_iof.c writes them (and Open MPI 4's
    orte/mca/iof/base/iof_base_output.c its timestamp alone), in front of a real message."""
    message = excerpt("mpirun_tagged_device_assert_embedding")[0].removeprefix("[1,1]<stderr>:")
    assert plain(tag + message) == Plain(message, rank)


def test_hostile_tags_are_left_as_text() -> None:
    """A rank past 7 digits, a tag cut short or without its stream, a namespace past 100 characters: not a tag, the
    line kept whole (up to what a diagnosis reads of one), nothing raised; a flood of tag-like text is read in linear
    time (RE2)."""
    for line in ("[1,99999999999]<stderr>:x", "[1,13]<stder", "[1,13]", "[1,13]<stdout>", "[,]<stdout>x",
                 "[" + "n" * 101 + ",1]<stdout>:x", "Thu May  7 10:39:20 2020[1,", "[1,1]<stderr>" * 50_000):
        assert plain(line).rank is None and plain(line).text == line[:MAX_LINE]
    assert plain("[1,2]<stderr>:" * 20 + "x").rank == "2"  # a few stacked tags are read; the rest stays text
    assert timestamp("Thu May 77 10:39:20 2020[1,1]<stdout>:x") is None
    assert timestamp("Thu Mai  7 10:39:20 2020[1,1]<stdout>:x") is None


def test_the_launchers_timestamp_is_the_lines_time() -> None:
    """mpirun --timestamp-output's ctime (open-mpi/ompi#7710) reads as the same time as PyTorch's ISO form; a time in
    the message itself comes first."""
    [ompi] = [e["line"] for e in TAGGED if e["source"].endswith("/ompi/issues/7710")]
    assert timestamp(ompi) == timestamp("2020-05-07 10:39:20")
    assert timestamp(ompi + " 2020-05-07 10:39:25") == timestamp("2020-05-07 10:39:25")


def test_pytorchs_global_rank_comes_before_the_launchers(tmp_path: Path, job_marker: str) -> None:
    """mpirun or srun starting one torchrun per node: their tag names the node's task, PyTorch's `[rankN]:` the
    global rank (the ECC line of pytorch/pytorch#113128 as torchrun --tee printed it, behind each launcher's tag)."""
    ecc = excerpt("ecc_default_prefix")[0]
    for tag in ("[1,1]<stderr>:", "1: "):
        assert (plain(tag + ecc).rank, plain(tag + ecc).local_rank) == ("12", "0")
    result = read_logs(tmp_path, job_marker, {"rank.log": "[1,1]<stderr>:" + ecc + "\n"})
    assert "(rank 12): CUDA error: uncorrectable ECC error" in result.summary, result.summary


def test_a_timeout_behind_mpiruns_tags_is_its_ranks(tmp_path: Path, job_marker: str) -> None:
    """The watchdog lines of pytorch/pytorch#118369 (ranks 0 and 7, PyTorch 2.0-2.1: no `[rankN]:`) behind Open MPI
    4's tags, one a line and glued on one line as mpirun splits a write (jaeyun95/error_collections): found, each its
    tag's rank. The tag is the process's MPI rank, its global rank; the message's `[Rank N]` is its rank in the
    process group: the tag wins."""
    from .test_messages import CORPUS

    rank0, rank7 = CORPUS["nccl"]["old_one_rank"]["lines"]
    for where, text in (("lines", f"[1,0]<stderr>:{rank0}\n[1,7]<stderr>:{rank7}\n"),
                        ("glued", f"[1,0]<stderr>:{rank0}[1,7]<stderr>:{rank7}\n")):
        result = read_logs(tmp_path / where, job_marker, {"rank.log": text})
        assert result.status is Status.CRITICAL and "NCCL collective timeout" in result.summary, result.summary
        assert result.details["collectives"]["seen"] == [0, 7], where
        assert next(f["rank"] for f in result.details["findings"] if f["signature"] == "nccl_timeout") == "0"
    assert observe("[1,3]<stderr>:" + rank0).rank == 3


def test_the_last_exception_behind_a_tag_is_read(tmp_path: Path) -> None:
    """A job that exited without a traceback in what was scanned: its log's last exception line, behind mpirun's tag
    (horovod/horovod#3871's rank 1), is still the line that begins with the exception."""
    log = tmp_path / "rank.log"
    log.write_text("\n".join(excerpt("horovod_mpirun_broadcast_unhandled_cuda_wsl2")) + "\n")
    assert last_exception(str(log), Identity(os.getuid())) == "RuntimeError: ncclBroadcast failed: unhandled cuda error"
