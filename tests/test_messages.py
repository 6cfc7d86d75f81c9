"""The diagnoses on real messages: every entry of tests/data/messages/corpus.toml (each one printed by PyTorch,
NCCL, Gloo or the driver, with its source), the OOM decision table, and the collective-failure story."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from tests.conftest import REPO, require
from trainguard.logscan.collectives import gather, observe, tell
from trainguard.logscan.diagnose import diagnose_nccl
from trainguard.logscan.oom import (
    FRAGMENTATION_ADVICE,
    NOT_WORKING_SET,
    TRUE_OOM,
    TRUE_OOM_ADVICE,
    CoTenant,
    GpuContext,
    OomReport,
    classify,
    diagnose_oom,
    explain,
    parse_oom,
)
from trainguard.logscan.signatures import BUILTIN, Scanner
from trainguard.node.flight import Collective, RankTrace, Stall

CORPUS: dict[str, dict[str, dict[str, Any]]] = tomllib.loads((REPO / "tests/data/messages/corpus.toml").read_text())
MiB, GiB = 2**20, 2**30


def text(section: str, name: str) -> str:
    entry = CORPUS[section][name]
    return "\n".join(entry["lines"]) if "lines" in entry else entry["text"]


def test_every_entry_says_where_it_came_from() -> None:
    for section, entries in CORPUS.items():
        for name, entry in entries.items():
            source = entry["source"]
            assert source.startswith(("https://github.com/", "captured: ", "a real H100 run")), (section, name)
            assert ("text" in entry) != ("lines" in entry), (section, name)


def signatures(section: str, name: str) -> list[str]:
    return [h.signature.name for h in Scanner(BUILTIN).scan((text(section, name) + "\n").encode())]


@pytest.mark.parametrize(("section", "expected"), [
    ("oom", {"cuda_oom"}), ("nccl", {"nccl_timeout", "nccl_progress"}), ("gloo", {"collective_failure"}),
    ("cuda", {"cuda_error", "device_assert"}), ("nan", {"nan_loss", "fp16_overflow", "loss_scale_min"}), ("not_oom", set()),
])
def test_the_scanner_finds_each_real_message_under_its_signature(section: str, expected: set[str]) -> None:
    for name in CORPUS[section]:
        found = set(signatures(section, name))
        assert found <= expected and (found or not expected), (name, found)


# CUDA out of memory -------------------------------------------------------------------------------------------------

# Every OOM of the corpus and its outcome. "not this job's working set" never gets the smaller-batch lever.
OUTCOMES = {
    "thc_0x": ("OOM", None), "thc_check_0x": ("OOM", None),
    "cached_larger_than_card": (TRUE_OOM, "larger than the GPU"),
    "cached_free_unusable": (NOT_WORKING_SET, "free memory unusable"),
    "cached_free_unusable_2": (NOT_WORKING_SET, "free memory unusable"),
    "cached_outside": (NOT_WORKING_SET, "outside PyTorch"),
    "reserved_outside": (NOT_WORKING_SET, "outside PyTorch"),
    "reserved_outside_2": (NOT_WORKING_SET, "outside PyTorch"),
    "reserved_fragmentation": ("fragmentation", None),
    "reserved_fragmentation_large": ("fragmentation", None),
    "reserved_free_unusable": (NOT_WORKING_SET, "free memory unusable"),
    "v20_true": (TRUE_OOM, None),
    "v20_outside": (NOT_WORKING_SET, "outside PyTorch"),
    "v20_overcommitted": (TRUE_OOM, "larger than the GPU"),
    "v20_small_card": ("fragmentation", None),
    "v21_introduced": ("fragmentation", None),
    "v21_self_listed": (TRUE_OOM, None),
    "v21_this_process": (TRUE_OOM, None),
    "v21_fragmentation": ("fragmentation", None),
    "v21_fragmentation_no_process": ("fragmentation", None),
    "v21_free_unusable": (NOT_WORKING_SET, "free memory unusable"),
    "v21_larger_than_card": (TRUE_OOM, "larger than the GPU"),
    "v22_true": (TRUE_OOM, None),
    "v22_true_2": (TRUE_OOM, None),
    "current_cotenants": (NOT_WORKING_SET, "co-tenant"),
    "current_fragmentation_h100": ("fragmentation", None),
    "current_cap_hip": (NOT_WORKING_SET, "cap"),
    "current_free_unusable_hip": (NOT_WORKING_SET, "free memory unusable"),
    "current_free_above_total_hip": ("OOM", "inconsistent numbers"),
    "own_ranks_returnn": (NOT_WORKING_SET, "the job's own ranks"),  # 15 alike, consecutive pids: told by their look
}


def test_the_outcomes_cover_the_whole_corpus() -> None:
    assert set(OUTCOMES) == set(CORPUS["oom"])


@pytest.mark.parametrize("name", sorted(OUTCOMES))
def test_oom_outcome_and_its_lever(name: str) -> None:
    d = diagnose_oom(text("oom", name))
    assert (d.kind, d.cause) == OUTCOMES[name], d.title
    assert d.fields["diagnosis"] == d.kind and d.fields["cause"] == d.cause
    if d.kind == "fragmentation":
        assert d.advice == FRAGMENTATION_ADVICE and "do not cut the batch size" in d.advice
    elif d.kind == NOT_WORKING_SET:
        assert "micro-batch" not in d.advice and "do not cut the batch size" in d.advice, d.advice
    elif d.kind == TRUE_OOM and d.cause is None:
        assert d.advice == TRUE_OOM_ADVICE
    assert d.title.startswith(f"{d.fields['device']} out of memory ({d.kind}")


@pytest.mark.parametrize(("name", "numbers"), [
    # <=1.4: `cached` is what the allocator holds but has not handed out (reserved - allocated)
    ("cached_free_unusable", {"form": "cached", "gpu": 0, "tried": int(12.5 * MiB), "total": int(10.92 * GiB),
                              "allocated": int(8.57 * MiB), "free": int(9.28 * GiB),
                              "reserved_unallocated": int(4.68 * MiB)}),
    ("reserved_outside", {"form": "reserved", "tried": 60 * MiB, "allocated": int(505.96 * MiB),
                          "reserved_unallocated": int(530 * MiB) - int(505.96 * MiB), "allowed": None}),
    ("v21_self_listed", {"form": "capacity", "tried": 496 * MiB, "total": int(14.75 * GiB), "this_process": None,
                         "processes": ((20398, int(14.52 * GiB)),)}),
    ("current_cotenants", {"form": "capacity", "device": "CUDA", "this_process": int(37.46 * GiB),
                           "processes": ((3721648, 414 * MiB), (1374765, 414 * MiB), (1374763, 414 * MiB),
                                         (1374764, 414 * MiB))}),
    ("current_cap_hip", {"device": "HIP", "allowed": int(1.05 * GiB), "private_pools": 17 * MiB,
                         "allocated": int(1017.01 * MiB), "reserved_unallocated": int(54.99 * MiB)}),
    ("thc_0x", {"form": "THC", "tried": None, "total": None}),
])
def test_each_form_is_parsed(name: str, numbers: dict[str, Any]) -> None:
    report = parse_oom(text("oom", name))
    for key, value in numbers.items():
        assert getattr(report, key) == value, (key, report)


def test_parsing_never_raises_on_garbage() -> None:
    # NVML version skew has printed "this process has 17179869184.00 GiB": an impossible size is left out
    skewed = parse_oom("CUDA out of memory. Tried to allocate 3.98 GiB. GPU 0 has a total capacity of 31.84 GiB of "
                       "which 16.30 GiB is free. Including non-PyTorch memory, this process has 17179869184.00 GiB "
                       "memory in use. 17.51 GiB allowed; Of the allocated memory")
    assert skewed.this_process is None and skewed.allowed == int(17.51 * GiB) and skewed.total == int(31.84 * GiB)
    for junk in ("", "CUDA out of memory", "CUDA out of memory. Tried to allocate 1e99 GiB (GPU x; ;;)",
                 "GPU 99999999999 has a total capacity of 1.00 GiB of which", "\x00\xff" * 5000):
        d = diagnose_oom(junk)
        assert d.kind in ("OOM", TRUE_OOM) and d.title


def test_a_message_that_names_a_co_tenant_holding_most_of_the_card() -> None:
    """The issue's case: 2.1 in a container (no "this process" line) lists one process with 9.52 GiB on a 14.75 GiB
    card while this job's PyTorch pool holds 4.98 GiB: that process can't be the job, it is a co-tenant."""
    report = OomReport("capacity", gpu=0, tried=496 * MiB, total=int(14.75 * GiB), free=int(235.06 * MiB),
                       allocated=int(4.65 * GiB), reserved_unallocated=int(0.33 * GiB),
                       processes=((20398, int(9.52 * GiB)),))
    rule, f = classify(report)
    assert (rule.kind, rule.cause) == (NOT_WORKING_SET, "co-tenant")
    d = explain(report, rule, f)
    assert "pid 20398 9.5 GiB" in d.title and "micro-batch" not in d.advice


def test_nvml_names_the_co_tenants_the_message_only_counts() -> None:
    """An old form lists no process: with NVML, the memory outside the job gets a pid, a user and a job."""
    ctx = GpuContext(2, (CoTenant(4242, int(10.4 * GiB), "python3", "alice", "job 77 (eval)"),), ())
    d = diagnose_oom(text("oom", "reserved_outside"), ctx)
    assert (d.kind, d.cause) == (NOT_WORKING_SET, "co-tenant")
    assert "pid 4242 (python3, user alice, job 77 (eval)) 10.4 GiB" in d.title


def test_free_memory_the_gpu_could_not_give_on_a_faulty_gpu_is_a_hardware_suspect() -> None:
    healthy = diagnose_oom(text("oom", "v21_free_unusable"))
    assert not healthy.hardware and "check its ECC and row-remap state" in healthy.advice
    faulty = diagnose_oom(text("oom", "v21_free_unusable"), GpuContext(0, (), ("row remapping pending",)))
    assert faulty.hardware and faulty.advice.startswith("hardware suspect") and "row remapping pending" in faulty.title


def test_a_mig_slice_is_the_cap_of_a_true_oom() -> None:
    d = diagnose_oom(text("oom", "v22_true"), GpuContext(mig=True))
    assert (d.kind, d.cause) == (NOT_WORKING_SET, "MIG slice") and "larger MIG profile" in d.advice


# Collective failures ------------------------------------------------------------------------------------------------

def story(section: str, name: str, stall: Stall | None = None) -> Any:
    record: dict[str, Any] = {}
    for line in text(section, name).splitlines():
        if (obs := observe(line)) is not None:
            gather(record, obs)
    return tell(record, stall)


def test_nccl_timeouts_from_several_ranks_name_the_collective() -> None:
    s = story("nccl", "v25_three_ranks")
    assert s.title.startswith("NCCL collective timeout: ALLREDUCE #808 timed out on ranks 0-2 (timeout 600s)")
    assert s.fields["timed_out"] == [0, 1, 2] and s.first == ()
    assert "the rank that stopped first reported nothing here" in s.title
    new = story("nccl", "v27_pg_status")  # 2.7's "failure detected by watchdog at work sequence id"
    assert new.fields["seq"] == 2847 and new.fields["seen"] == [0, 2]
    # rank 7 timed out 32,032 collectives behind rank 0 (pytorch/pytorch#118369): the first suspect, or a rank of
    # another process group; the story says both
    old = story("nccl", "old_one_rank")
    assert old.first == (7,) and old.fields["seq"] == 96120
    assert old.title.startswith("rank 7 timed out far behind, in ALLREDUCE #64088 (32032 collectives before #96120): "
                                "the first suspect (it stopped first), or a rank of a different process group")
    assert "; then NCCL collective timeout: ALLREDUCE #96120 timed out on rank 0" in old.title


def test_a_rank_whose_last_enqueued_collective_is_older_stopped_first() -> None:
    record: dict[str, Any] = {}
    for line in text("nccl", "v24_four_ranks").splitlines():
        gather(record, observe(line))  # type: ignore[arg-type]
    # rank 1's own watchdog line, as NCCL prints it when rank 1 never enqueued #1580 in process group 1
    gather(record, observe("[rank1]:[E321 02:07:08.465150152 ProcessGroupNCCL.cpp:1664] [PG 1 Rank 1] Exception "
                           "(either an error or timeout) detected by watchdog at work: 1579, last enqueued NCCL work: "
                           "1579, last completed NCCL work: 1578."))  # type: ignore[arg-type]
    s = tell(record)
    assert s.first == (1,)
    assert ("rank 1 never entered ALLREDUCE #1580 (last enqueued: #1579); ranks 0,3 completed #1579 and wait in #1580"
            in s.title), s.title


def test_the_flight_recorder_cross_checks_the_messages() -> None:
    c = Collective("1", 1580, "allreduce")
    waiting = tuple(RankTrace(r, (c,), (c,), pid=100 + r, node="gpu-01") for r in (0, 2, 3))
    lagging = RankTrace(1, (Collective("1", 1579, "allreduce"),), (), pid=101, node="gpu-01")
    s = story("nccl", "v24_four_ranks", Stall(c, waiting, (lagging,), (4, 5, 6, 7)))
    assert "flight recorder: rank 1 (node gpu-01, pid 101) never entered allreduce #1580 (process group 1)" in s.title
    assert s.first == (1,) and s.fields["flight_recorder"]["missing"][0]["rank"] == 1


def test_gloo_failures_from_the_cpu_build() -> None:
    assert story("gloo", "monitored_barrier").first == (1,)
    assert "rank 1 failed to pass a monitored barrier (rank 0 waited 2s)" in story("gloo", "monitored_barrier").title
    assert story("gloo", "peer_died").title.startswith("a peer rank died: the connection to 127.0.0.1:39594")
    assert story("gloo", "timeout").title == "a Gloo collective timed out after 2s on rank 0"


def test_the_captured_cpu_messages_are_what_this_pytorch_prints() -> None:
    """The `captured:` entries of one process are re-printed by the CPU build and must match the corpus verbatim."""
    try:
        import torch  # noqa: F401
    except ImportError:
        require(False, "needs the CPU build of PyTorch (pip install torch==2.13.0, in the test extras)")
    out = subprocess.run([sys.executable, str(REPO / "tests/data/messages/capture_cpu.py"), "single"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    got = dict(line.split("|", 1) for line in out.stdout.splitlines() if "|" in line)
    assert got["anomaly"] == text("nan", "anomaly")
    assert got["clip_grad"] == text("nan", "clip_grad")
    assert got["cpu_allocator"] == text("not_oom", "cpu_allocator")
    assert got["no_cuda"] == text("not_oom", "no_cuda")


def test_capture_scripts_are_in_the_repository() -> None:
    for script in ("tests/data/messages/capture_cpu.py", "tests/data/flight_recorder/capture.py"):
        assert Path(REPO / script).is_file()


@pytest.mark.parametrize(("section", "name", "line", "fields"), [
    ("nccl", "old_one_rank", 0, {"rank": 0, "seq": 96120, "op": "ALLREDUCE", "timeout_ms": 1800000}),
    ("nccl", "v24_four_ranks", 1, {"rank": 4, "seq": 1580, "op": "ALLREDUCE", "timeout_ms": 600000}),
    ("nccl", "v27_pg_status", 3, {"rank": 2, "seq": 2847, "op": "ALLREDUCE"}),
    ("nccl", "terminate", 1, {"rank": 5, "seq": 9141, "op": "_ALLGATHER_BASE"}),
])
def test_each_watchdog_timeout_line(section: str, name: str, line: int, fields: dict[str, Any]) -> None:
    d = diagnose_nccl(CORPUS[section][name]["lines"][line])
    for key, value in fields.items():
        assert d.fields[key] == value, (key, d.fields)
    assert d.title.startswith(f"NCCL collective timeout on rank {fields['rank']}: {fields['op']} #{fields['seq']}")


def test_the_jobs_own_ranks_are_not_co_tenants() -> None:
    """awslabs/keys_values#92: ranks 1-3 of the job each hold 414 MiB on GPU 0 (pids 1374763-5), beside one other
    process; known from the job's process tree they are its ranks, and the lever is the rank-to-device placement;
    unknown, three processes of one size are not enough to tell (not consecutive with the fourth): co-tenants."""
    message = text("oom", "current_cotenants")
    mine = diagnose_oom(message, GpuContext(own_pids=frozenset({1374763, 1374764, 1374765})))
    assert (mine.kind, mine.cause) == (NOT_WORKING_SET, "the job's own ranks"), mine.title
    assert "3 processes of the job itself (pids 1374763-1374765" in mine.title and "pid 3721648" in mine.title
    assert "torch.cuda.set_device" in mine.advice and "stop them" not in mine.advice
    unknown = diagnose_oom(message)
    assert (unknown.kind, unknown.cause) == (NOT_WORKING_SET, "co-tenant")
    # a process of the job's user in no other job is the job's; root's are not (services, other jobs' helpers)
    others = (CoTenant(1374763, 414 * MiB, "python", "alice"), CoTenant(1374764, 414 * MiB, "python", "alice"))
    assert diagnose_oom(message, GpuContext(others=others, user="alice")).cause == "the job's own ranks"
    assert diagnose_oom(message, GpuContext(others=others, user="root")).cause == "co-tenant"


def test_another_jobs_ranks_that_look_alike_are_co_tenants() -> None:
    """rwth-i6/returnn#1469's 15 processes of 1.19 GiB with consecutive pids look like the job's own ranks; named by
    the node as another job's, they are co-tenants."""
    message = text("oom", "own_ranks_returnn")
    assert diagnose_oom(message).cause == "the job's own ranks"
    pids = [int(p) for p in message.split("Process ")[1:] for p in [p.split()[0]]]
    theirs = tuple(CoTenant(pid, None, "python", "bob", "slurm job 77 (train)") for pid in pids)
    assert diagnose_oom(message, GpuContext(others=theirs)).cause == "co-tenant"
