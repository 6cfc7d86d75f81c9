"""The goodput benchmark's harness (benchmarks/goodput.py) in a short version, so that it cannot rot: a 4-node SLURM
cluster, a 3-rank job, one agent per node; an XID 79, a NaN streak and the stop switch, with trainguard and without.
The figures of the full run are in docs/benchmarks.md; this test holds the harness and the promises that do not
depend on the machine's speed (what is detected, by whom, which nodes are drained)."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from benchmarks import goodput_fleet as fleet
from benchmarks.goodput import (
    EXTRA_KINDS,
    IB_TREE,
    KINDS,
    NFS_DOWN,
    NFS_MAJOR_TIMEOUT,
    NFS_OK,
    NIC_LINE,
    XID_FAULTS,
    Fault,
    Record,
    Run,
    Scale,
    Site,
    analyse,
    attempt_ends,
    benchmark,
    bus_of,
    data_mount,
    fault_free_table,
    fleet_schedule,
    kept_apart,
    lemon_figures,
    lemons,
    main,
    node_of_record,
    other_humans,
    paired,
    parser,
    replaced_on_repair,
    report,
    run_name,
    saved,
    schedule,
    seconds_text,
    seeds_table,
    site_of,
    step_cost,
    summarize,
    table,
    xid_line,
)
from benchmarks.goodput_trainer import resume_step
from tests.conftest import require, require_root, wait_until
from tests.slurm_cluster import REPO, missing_components
from trainguard.logscan.diagnose import diagnose_cuda
from trainguard.logscan.signatures import BUILTIN, Scanner
from trainguard.node.kernel_events import KernelEventParser
from trainguard.node.mounts import read_mounts


def test_the_schedule_is_the_seeds_each_kind_once_inside_the_run() -> None:
    a, b = schedule(24, 420), schedule(24, 420)
    assert a == b
    assert sorted(f.kind for f in a) == sorted(KINDS)
    assert all(0.12 * 420 <= f.at <= 0.9 * 420 for f in a)
    assert [f.at for f in a] == sorted(f.at for f in a)
    assert schedule(25, 420) != a
    assert schedule(24, 420, ()) == []  # --fault-free


def test_goodput_counts_steps_up_to_the_last_finite_checkpoint_and_charges_redone_steps_to_the_fault() -> None:
    rec = Record(trainguard=True, duration=20.0)
    # 0.5 s a step; a fault at 6 s; the job stopped at step 11 and came back at 9 s from the checkpoint of step 9.
    rec.steps = [(0.5 * i, i, True) for i in range(12)] + [(9.0 + 0.5 * i, 10 + i, True) for i in range(20)]
    rec.attempts = [(0.0, 0), (9.0, 10)]
    rec.checkpoints = [(5.0, 9, True), (18.0, 27, True), (19.0, 28, False)]  # a NaN checkpoint does not count
    rec.faults = [{"kind": "nan", "at": 6.0, "target": 0, "node": "n1", "injected": 6.0}]
    rec.alerts = [{"t": 7.25, "node": "n1", "check": "training_log", "subject": "slurm:1", "status": "CRITICAL",
                   "event": "escalated"}]
    out = analyse(rec, Scale(60), 0.5)
    assert out["pace_s"] == 0.5 and out["possible_steps"] == 40 and out["counted_steps"] == 28
    assert out["goodput"] == 0.7
    [fault] = out["faults"]
    assert fault["by"] == "trainguard" and fault["detect_s"] == 1.25 and fault["lost_steps"] == 2
    assert fault["resume_s"] == 3.0
    assert fault["stalled_s"] == 3.0  # no step from the fault (6 s) to the next attempt's first (9 s)


def test_a_slow_checks_alert_after_another_kind_of_fault_is_still_its_own_faults() -> None:
    """Seed 2 of the fleet's runs: the time limit's margin fired 50 s after its fault, 13 s after a disk fault."""
    rec = Record(trainguard=True, duration=100.0)
    rec.steps = [(0.5 * i, i, True) for i in range(200)]
    rec.faults = [{"kind": "time_limit", "at": 10.0, "target": 0, "node": "n1", "injected": 10.0, "limit_at": 70.0},
                  {"kind": "disk_full", "at": 40.0, "target": 0, "node": "n1", "injected": 40.0, "full_in": 60.0},
                  {"kind": "time_limit", "at": 80.0, "target": 0, "node": "n1", "injected": 80.0, "limit_at": 99.0}]
    alert = {"node": "n1", "subject": "slurm:1", "status": "WARNING", "event": "fired"}
    rec.alerts = [{**alert, "t": 50.0, "check": "disk"}, {**alert, "t": 58.0, "check": "job_timelimit"}]
    limit, disk, again = analyse(rec, Scale(60), 0.5)["faults"]
    assert limit["by"] == "trainguard" and limit["detect_s"] == 48.0, limit
    assert disk["by"] == "trainguard" and disk["detect_s"] == 10.0, disk
    assert again["by"] == "-" and again["detect_s"] is None  # its check's alert before it is not its own


def test_the_time_without_a_step_is_told_apart_from_the_time_to_the_next_attempt() -> None:
    rec = Record(trainguard=True, duration=30.0)
    # the time limit approaches at 6 s; the job trains on to step 27 (13.5 s) and saves it, the next life at 16 s
    rec.steps = [(0.5 * i, i, True) for i in range(28)] + [(16.5 + 0.5 * i, 28 + i, True) for i in range(20)]
    rec.attempts = [(0.0, 0), (16.0, 28)]
    rec.checkpoints = [(14.0, 27, True)]
    rec.faults = [{"kind": "time_limit", "at": 6.0, "target": 0, "node": "n1", "injected": 6.0}]
    [fault] = analyse(rec, Scale(60), 0.5)["faults"]
    assert fault["resume_s"] == 10.0 and fault["stalled_s"] == 3.0 and fault["lost_steps"] == 0


def test_runs_without_trainguard_against_other_humans_are_set_side_by_side() -> None:
    rec = Record(trainguard=True, duration=10.0)
    rec.steps, rec.attempts, rec.checkpoints = [(0.5 * i, i, True) for i in range(20)], [(0.0, 0)], [(9.5, 19, True)]
    rec.actions = [{"t": 3.0, "who": "human (page)", "what": "freed the checkpoint file system"}]
    base = analyse(rec, Scale(60), 0.5)
    assert base["human_looks_acted"] == 0  # a page is not a look
    rec.actions += [{"t": 4.0, "who": "human (look)", "what": "requeued the job"},
                    {"t": 5.0, "who": "human (look+page)", "what": "requeued the job"}]
    assert analyse(rec, Scale(60), 0.5)["human_looks_acted"] == 2  # what a look with a page did may be the look's

    def run(trainguard: bool, goodput: float, look: float, acted: int = 0) -> dict[str, object]:
        return {**base, "trainguard": trainguard, "goodput": goodput, "human_looks_acted": acted,
                "human": {"look_every_min": look, "page_response_min": 5.0}}

    out = table([run(True, 0.96, 30), run(False, 0.12, 240), run(False, 0.76, 30), run(False, 0.5, 45)], 24,
                Scale(60))
    # the main table pairs the runs of the same human, whatever the order; then one row per human, against the run
    # with trainguard, which stands for a human whose looks are among its own (its looks did nothing)
    assert "| goodput (counted / possible steps) | 0.96 | 0.76 |" in out, out
    assert "| 30 | 0.76 | 1.26x | yes |" in out and "| 240 | 0.12 | 8.00x | yes |" in out, out
    assert "| 45 | 0.5 | 1.92x | no |" in out, out
    assert out.index("| 30 |") < out.index("| 45 |") < out.index("| 240 |")
    assert "its human's looks did nothing" in out, out
    out = table([run(True, 0.96, 30, acted=2), run(False, 0.76, 30), run(False, 0.0, 240)], 24, Scale(60))
    assert "acted on 2 of their looks" in out and "| 240 | 0.0 | - | no |" in out, out
    assert "one run per human" not in table([run(True, 0.96, 30), run(False, 0.76, 30)], 24, Scale(60))


@pytest.mark.parametrize("bad", ["x", "0", "60,-1", "nan", "inf"])
def test_also_without_refuses_what_is_not_minutes(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--also-without", bad])
    assert exc.value.code == 2
    assert "--also-without" in capsys.readouterr().err


def test_also_without_runs_each_other_human_once() -> None:
    assert other_humans("240, 60,60.0,30,120", 30) == (60.0, 120.0, 240.0)  # 30 is --look-every's: run already
    assert other_humans("", 30) == ()


def test_a_restarted_rank_resumes_after_the_last_checkpoint_whose_loss_is_finite(tmp_path: Path) -> None:
    for step, loss in ((19, 3.9), (39, 3.8), (59, "nan")):
        (tmp_path / f"ckpt-{step:07d}.json").write_text(json.dumps({"step": step, "loss": loss}))
    (tmp_path / "ckpt-0000079.json").write_text("{torn")
    assert resume_step(tmp_path) == (40, 3.8)
    assert resume_step(tmp_path / "none") == (0, 4.0)


@pytest.mark.slow
def test_short_goodput_run_detects_each_fault_drains_only_the_faulty_node_and_restarts_in_place() -> None:
    """The harness end to end with trainguard (the run without it, the human's, is the benchmark's alone: the suite's
    minutes go to the product)."""
    require_root()
    missing = missing_components()
    require(not missing, f"needs SLURM and munge installed (missing: {', '.join(missing)})")
    require(os.access("/dev/kmsg", os.W_OK), "needs a writable /dev/kmsg")
    for sbin in ("/usr/sbin", "/sbin"):
        if sbin not in os.environ.get("PATH", "").split(":"):
            os.environ["PATH"] = os.environ.get("PATH", "") + ":" + sbin
    require(shutil.which("slurmd") is not None, "needs slurmd")
    kinds = ("xid79", "nan", "stop_switch")
    # seed 6: the NaN, then the XID, then the stop switch: both faults trainguard restarts in place come while the
    # job still holds the spare its first allocation got (after a requeue it may start on 3 nodes, without one)
    seed = 6
    [with_tg], [record] = benchmark(seed=seed, minutes=0.8, scale=Scale(60), kinds=kinds, without=False)
    assert with_tg["trainguard"]
    planned = [f.kind for f in schedule(seed, 48, kinds)]
    injected = [f["kind"] for f in with_tg["faults"]]  # a fault due while the job is down waits for it to run again
    assert injected == planned and set(injected) == set(kinds), with_tg["faults"]
    assert all(d["right"] for d in with_tg["drains"]), with_tg["drains"]  # no node drained that had no fault
    xid = next(f for f in with_tg["faults"] if f["kind"] == "xid79")
    assert xid["by"] == "trainguard" and xid["detect_s"] is not None and xid["detect_s"] <= xid["deadline_s"], xid
    assert [d["node"] for d in with_tg["drains"]] == [xid["node"]]
    # drain, restart without the node: the ranks go on on the allocation's spare (the lost GPU's step cancelled
    # after the restart's wait_exit, 5 s here), with no requeue
    assert xid["resume_s"] is not None and xid["resume_s"] < 15, xid
    nan = next(f for f in with_tg["faults"] if f["kind"] == "nan")
    assert nan["by"] == "trainguard" and nan["detect_s"] <= nan["deadline_s"], nan
    # the NaN streak restarts the ranks in place (training_log -> restart) and so does the lost node (on the spare):
    # the allocation kept, no requeue
    assert with_tg["in_place"] >= 2, with_tg["in_place"]
    assert nan["resume_s"] is not None and nan["resume_s"] < 10, nan
    assert 0 < with_tg["goodput"] <= 1.05 and record.steps
    # every attempt that ended before the run did says why (issue 24: early exits, cause unknown)
    assert len(with_tg["attempt_ends"]) >= with_tg["restarts"] and all(e["why"] for e in with_tg["attempt_ends"])


def _trainer(tmp_path: Path, ntasks: int, *args: str) -> subprocess.Popen[str]:
    (tmp_path / "run").mkdir(exist_ok=True)
    env = {**os.environ, "SLURM_PROCID": "0", "SLURM_NTASKS": str(ntasks), "SLURMD_NODENAME": "n1",
           "SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "2", "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "goodput_trainer.py"), "--run-dir",
                             str(tmp_path / "run"), "--ckpt-dir", str(tmp_path / "ckpt"), "--step-time", "0.05", *args],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _stops(tmp_path: Path) -> list[dict[str, object]]:
    path = tmp_path / "run" / "stops.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_trainer_records_why_each_attempt_stopped(tmp_path: Path) -> None:
    """Issue 24: early exits of the run with trainguard had no known cause. Each rank records how its attempt ended."""
    (tmp_path / "ckpt").mkdir()
    proc = _trainer(tmp_path, 1)
    wait_until(lambda: (tmp_path / "run" / "progress.log").exists()
               and "step 3 " in (tmp_path / "run" / "progress.log").read_text(), 20, what="a few steps")
    proc.send_signal(signal.SIGUSR1)  # what the `signal` action sends
    assert proc.wait(20) == 0
    [stop] = _stops(tmp_path)
    assert stop["attempt"] == "7.2.0" and stop["rank"] == 0 and stop["node"] == "n1"
    assert stop["why"] == "stop voted: rank 0: SIGUSR1" and isinstance(stop["step"], int)

    (tmp_path / ".trainguard").mkdir(exist_ok=True)
    (tmp_path / ".trainguard" / "stop").touch()  # the user's stop switch
    assert _trainer(tmp_path, 1).wait(20) == 0
    assert str(_stops(tmp_path)[-1]["why"]).startswith(f"stop voted: rank 0: stop switch (uid {os.getuid()}, written")
    (tmp_path / ".trainguard" / "stop").unlink()

    # two ranks expected, one runs: the collective times out
    proc = _trainer(tmp_path, 2, "--collective-timeout", "1")
    assert proc.wait(20) == 1
    assert _stops(tmp_path)[-1]["why"] == "collective timeout: 1 of 2 ranks missing after 1s"


def test_a_crash_fault_kills_its_rank_with_pytorchs_cuda_error(tmp_path: Path) -> None:
    """The fleet's software bugs' other shape: the rank dies of a CUDA error that training_log reads as one."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "run" / "faults").mkdir(parents=True)
    (tmp_path / "run" / "faults" / "crash").write_text("7.2.0 0")  # this attempt, rank 0
    proc = _trainer(tmp_path, 1)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 1
    assert _stops(tmp_path)[-1]["why"] == "crashed: CUDA error: an illegal memory access was encountered"
    assert "cuda_error" in {h.signature.name for h in Scanner(BUILTIN).scan(out.encode())}, out
    d = diagnose_cuda(out)
    assert d.fields["error"] == "illegal memory access" and not d.hardware, out  # the job's bug: no drain
    (tmp_path / "run" / "faults" / "crash").write_text("7.3.0 0")  # another attempt's: this one runs on
    proc = _trainer(tmp_path, 1)
    wait_until(lambda: "step 2 " in (tmp_path / "run" / "progress.log").read_text(), 20, what="steps past the crash")
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(20) == 0


def test_each_attempts_end_is_rank_0s_record_where_it_has_one() -> None:
    rec = Record(trainguard=True)
    rec.stops = [{"t": 5.0, "attempt": "1.0", "rank": 2, "node": "n3", "step": 9, "why": "stop voted: rank 1: SIGUSR1"},
                 {"t": 5.1, "attempt": "1.0", "rank": 0, "node": "n1", "step": 9, "why": "stop voted: rank 1: SIGUSR1"},
                 {"t": 9.0, "attempt": "1.1", "rank": 1, "node": "n2", "step": 20,
                  "why": "collective timeout: 1 of 3 ranks missing after 10s"}]
    assert [(e["attempt"], e["rank"]) for e in attempt_ends(rec)] == [("1.0", 0), ("1.1", 1)]


# the fleet schedule, several seeds, the fault-free pair -------------------------------------------------------------
def test_the_fleet_mix_is_llama_3s_table_mapped_to_harness_kinds() -> None:
    assert sum(c.count for c in fleet.CAUSES) == fleet.LLAMA3_INTERRUPTIONS == 419
    assert round(fleet.LLAMA3_MTBI_H, 2) == 3.09  # "one every 3.1 hours"
    known = set(KINDS) | set(EXTRA_KINDS)
    assert all(c.kind in known for c in fleet.CAUSES if c.kind) and all(c.how for c in fleet.CAUSES)
    w = fleet.weights()
    assert w["xid79"] == 148 and w["hbm"] == 72 and w["nan"] + w["cuda_error"] == 54 and w["ib_down"] == 35 and w["slow"] == 6
    assert w["maintenance"] == 32 and w["nic"] == 7 and sum(w.values()) == 397  # of the 419
    assert fleet.covered() == sum(w.values()) / 419
    assert max(w, key=w.__getitem__) == "xid79"


def test_the_fleet_schedule_is_the_seeds_at_the_fleets_rate_in_its_proportions() -> None:
    scale, duration = Scale(60), 200_000.0  # a long draw: the counts converge on the weights and the rate
    a = fleet_schedule(5, duration, scale)
    assert a == fleet_schedule(5, duration, scale) and a != fleet_schedule(6, duration, scale)
    drawn = [f for f in a if f.kind not in fleet.SITE_KINDS]
    assert sorted(f.kind for f in a if f.kind in fleet.SITE_KINDS) == sorted(fleet.SITE_KINDS)  # each site fault once
    gap = fleet.gap_s(60)
    assert gap == pytest.approx(fleet.LLAMA3_MTBI_H * 60)  # 3.09 hours at x60: 185 s here
    expected = 0.8 * duration / gap  # a Poisson process over the run's middle 0.8 (a minimum gap only delays some)
    assert 0.9 * expected < len(drawn) < 1.1 * expected, (len(drawn), expected)
    w = fleet.weights()
    for kind in ("xid79", "hbm", "nan"):
        share = sum(f.kind == kind for f in drawn) / len(drawn)
        assert abs(share - w[kind] / sum(w.values())) < 0.05, (kind, share)
    assert all(b.at - a.at >= 10 - 0.1 for a, b in itertools.pairwise(a))
    assert all(0.12 * duration <= f.at <= 0.92 * duration for f in a) and all(0 <= f.target < 3 for f in a)
    # --rate: 24 a day at x60 is one a minute here
    assert fleet.gap_s(60, 24 / 24) == pytest.approx(60)
    faster = [f for f in fleet_schedule(5, duration, scale, per_day=24) if f.kind not in fleet.SITE_KINDS]
    assert len(faster) > 2 * len(drawn)


def test_a_fault_that_waited_for_the_job_keeps_the_schedules_gap_to_the_next() -> None:
    """Seed 1 of the fleet: a hung_fs waited for a running attempt and came 1.1 s before an XID 79 on the same node; the
    XID's restart ended the hang before `hang` could fire, and the hang was counted undetected."""
    pending = [Fault(100.0, "xid79", 0), Fault(110.0, "nan", 1), Fault(150.0, "hbm", 2), Fault(420.0, "nic", 0)]
    later = kept_apart(pending, injected=99.0, gap=10.0, end=430.0)
    assert [(f.at, f.kind, f.target) for f in later] == [(109.0, "xid79", 0), (119.0, "nan", 1), (150.0, "hbm", 2),
                                                           (420.0, "nic", 0)]
    assert later[2] is pending[2]  # a fault far enough away keeps its drawn time
    assert [f.kind for f in kept_apart(pending, injected=415.0, gap=10.0, end=430.0)] == ["xid79"]  # rest past the end
    assert kept_apart(pending, injected=50.0, gap=10.0, end=430.0) == pending  # on time: the schedule as drawn
    # the fleet's runs keep the schedule's 10 scaled minutes; the default schedule and same-node reproductions as made
    assert site_of(parser().parse_args(["--schedule", "fleet"]), Scale(60), fleet_like=True).fault_gap == 10.0
    assert site_of(parser().parse_args(["--schedule", "fleet", "--repaired-same-node"]), Scale(60),
                   fleet_like=True).fault_gap == 0.0
    assert site_of(parser().parse_args([]), Scale(60), fleet_like=False).fault_gap == 0.0


def test_the_default_schedule_is_as_before() -> None:
    """The run of record depends on the seven kinds' seeded schedule: the fleet's kinds changed nothing there."""
    assert [(f.at, f.kind, f.target) for f in schedule(24, 900)] == [
        (113.8, "nan", 2), (228.8, "leak", 2), (331.4, "xid79", 0), (433.1, "hang", 1), (530.9, "stop_switch", 0),
        (622.7, "disk_full", 2), (739.4, "time_limit", 0)]


def _result(trainguard: bool, goodput: float, look: float = 30, faults: tuple[dict[str, object], ...] = (),
            drains: tuple[dict[str, object], ...] = ()) -> dict[str, object]:
    return {"trainguard": trainguard, "goodput": goodput, "possible_steps": 100, "pace_s": 0.5,
            "human": {"look_every_min": look, "page_response_min": 5.0}, "faults": list(faults), "drains": list(drains)}


def test_several_seeds_give_the_mean_its_spread_and_what_each_kind_cost() -> None:
    xid = {"kind": "xid79", "lost_steps": 10, "stalled_s": 5.0, "detect_s": 0.1, "deadline_s": 1.0}
    nan = {"kind": "nan", "lost_steps": 2, "stalled_s": 1.0, "detect_s": 5.0, "deadline_s": 3.5}  # late
    # a leak the next fault's restart ended before its forecast was due: no miss
    leak = {"kind": "leak", "lost_steps": 0, "stalled_s": None, "detect_s": None, "deadline_s": 40.0, "window_s": 10.0,
            "down_to_next_s": 1.0}  # its restart made no step before the next fault: down 1 s until then
    per_seed = {1: [_result(True, 0.9, faults=(xid,)), _result(False, 0.6), _result(False, 0.3, 240)],
                2: [_result(True, 0.96, faults=(nan,), drains=({"node": "n1", "right": False},)),
                    _result(False, 0.8), _result(False, 0.0, 240)],
                3: [_result(True, 0.94, faults=(leak,)), _result(False, 0.7), _result(False, 0.4, 240)]}
    s = summarize(per_seed)
    assert s["with"]["mean"] == round((0.9 + 0.96 + 0.94) / 3, 3) and s["with"]["min"] == 0.9 and s["with"]["n"] == 3
    assert s["nearest_mean"] == 3  # 0.94 against a mean of 0.933
    assert s["without"][30]["goodput"]["mean"] == 0.7 and s["without"][240]["ratio"]["n"] == 2  # 0.0: no ratio
    assert [k["kind"] for k in s["kinds"]] == ["xid79", "nan", "leak"]  # the costliest first
    assert s["kinds"][2]["missed"] == 0 and s["kinds"][2]["steps"] == 2.0
    assert s["kinds"][0]["steps"] == 20.0 and s["kinds"][0]["of_goodput"] == round(20 / 300, 4)
    assert s["kinds"][1]["missed"] == 1 and s["wrong_drains"] == 1
    out = seeds_table(s, Scale(60), "fleet")
    assert "over 3 seeds (1, 2, 3; schedule fleet" in out and "| xid79 | 1 | 20.0 | 6.67% | 0 |" in out, out


def test_the_fault_free_pair_compares_step_times_and_lists_every_alert() -> None:
    with_tg, without = Record(trainguard=True), Record(trainguard=False)
    with_tg.steps = [(0.505 * i, i, True) for i in range(101)]
    # a restart from the checkpoint of step 39: the gap before the redone step 40 is not a step interval
    without.steps = [(0.5 * i, i, True) for i in range(50)] + [(30 + 0.5 * i, 40 + i, True) for i in range(51)]
    cost = step_cost(with_tg, without)
    assert cost["steps"] == (100, 99) and cost["median"] == (0.505, 0.5, 0.01)
    out = fault_free_table([(1, cost, [])])
    assert "+1.00%" in out and "No alert fired" in out, out
    alert = {"t": 12.0, "node": "n2", "check": "job_pace", "subject": "slurm:7", "status": "WARNING", "event": "fired"}
    out = fault_free_table([(1, cost, []), (2, cost, [alert])])
    assert "run 2: fired job_pace WARNING slurm:7 on n2" in out and "No alert" not in out, out


def test_faults_of_two_runs_pair_by_kind_and_order_and_a_missing_one_is_said() -> None:
    def f(kind: str, at: float) -> dict[str, object]:
        return {"kind": kind, "at": at, "node": "n1", "by": "trainguard", "detect_s": 0.1, "deadline_s": 1.0,
                "resume_s": 5.0, "lost_steps": 0}
    none = {"by": "not injected", "detect_s": None, "deadline_s": None, "resume_s": None, "lost_steps": None}
    # without trainguard the second XID came later (the job was down when it was due) and the NaN never came
    pairs = paired([f("xid79", 10), f("xid79", 50), f("nan", 70)], [f("xid79", 11), f("xid79", 65)], none)
    assert [(a["kind"], a["at"], b.get("at")) for a, b in pairs] == [("xid79", 10, 11), ("xid79", 50, 65),
                                                                     ("nan", 70, None)]
    assert pairs[-1][1]["by"] == "not injected"


def test_the_lemon_node_is_held_after_its_second_fault_and_given_no_rank_after_it() -> None:
    rec = Record(trainguard=True, duration=100.0)
    rec.faults = [{"kind": "lemon", "at": 10.0, "target": 0, "node": "n1", "injected": 10.0},
                  {"kind": "lemon", "at": 50.0, "target": 0, "node": "n1", "injected": 52.0}]
    rec.alerts = [{"t": 52.3, "node": "n1", "check": "lemon", "subject": "gpu", "status": "CRITICAL", "event": "fired"}]
    rec.ranks = [(1.0, "1.0.0", "n1"), (45.0, "1.1.0", "n1"), (60.0, "1.2.0", "n2")]
    assert lemon_figures(rec) == {"faults": [10.0, 52.0], "held_at": 52.3, "replaced_at": None,
                                  "ranks_after_second_fault": []}
    rec.ranks.append((70.0, "1.3.0", "n1"))  # without the lemon rules: repaired, resumed, given the job again
    assert lemon_figures(rec)["ranks_after_second_fault"] == ["1.3.0"]
    base = {"trainguard": True, "goodput": 0.5, "lemon": lemon_figures(rec)}
    out = "\n".join(lemons([{**base, "lemon_policy": True}, {**base, "lemon_policy": False, "goodput": 0.4},
                            {"trainguard": False, "goodput": 0.2}]))
    assert "| installed | 0.5 | 10.0, 52.0 | 52.3 | - | 1 |" in out and "| none | 0.4 |" in out, out
    # over the seeds (`--report-from`): each seed's runs, and each policy's mean
    over = "\n".join(lemons([{**base, "lemon_policy": True}, {**base, "lemon_policy": False, "goodput": 0.4},
                              {**base, "lemon_policy": True, "goodput": 0.7}, {"trainguard": False, "goodput": 0.2}],
                             [1, 1, 2, 2]))
    assert "| 1 | installed | 0.5 |" in over and "| 1 | none | 0.4 |" in over and "| 2 | installed | 0.7 |" in over
    assert "mean over the seeds: lemon rules installed 0.600, lemon rules none 0.400." in over, over
    assert [run_name(r) for r in ({**base, "lemon_policy": False}, {**_result(False, 0.2)})] == [
        "with trainguard, its lemon rules none", "without trainguard (the human looks every 30 minutes)"]


def test_the_harness_faults_a_gpu_through_nvml_as_its_xid_says(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks.goodput_agent import FaultableNvml
    from tests.helpers.fake_nvml import FakeGpu

    state = tmp_path / "gpu-state.json"
    monkeypatch.setenv("TRAINGUARD_FAKE_GPU_STATE", str(state))
    nvml = FaultableNvml([FakeGpu("GPU-0"), FakeGpu("GPU-1")], tmp_path / "slow")
    assert nvml._gpu("nvmlDeviceGetMemoryInfo", 0).ecc_volatile == 0  # no file: healthy
    state.write_text(json.dumps(XID_FAULTS["hbm"][1]))
    gpu = nvml._gpu("nvmlDeviceGetMemoryInfo", 0)
    assert gpu.ecc_volatile == 2 and gpu.remap == (0, 1, 1, 0)
    state.write_text(json.dumps(XID_FAULTS["xid79"][1]))
    with pytest.raises(nvml.NVMLError):  # NVMLError_GpuIsLost
        nvml._gpu("nvmlDeviceGetMemoryInfo", 0)
    assert nvml._gpu("nvmlDeviceGetHandleByIndex", 0) and nvml._gpu("nvmlDeviceGetMemoryInfo", 1)  # GPU 1 is fine
    state.write_text("{torn")
    assert nvml._gpu("nvmlDeviceGetMemoryInfo", 0).ecc_volatile == 0  # a file that does not parse: healthy


def test_the_report_over_seeds_is_written_beside_the_runs(tmp_path: Path) -> None:
    rec = Record(trainguard=True)
    rec.steps = [(0.5 * i, i, True) for i in range(10)]
    per_seed = {1: ([_result(True, 0.9), _result(False, 0.6)], [rec, rec]),
                2: ([_result(True, 0.8), _result(False, 0.5)], [rec, rec])}
    report(per_seed, Scale(60), tmp_path, tmp_path / "plot.png", "fleet")
    assert "over 2 seeds (1, 2; schedule fleet" in (tmp_path / "report.md").read_text()
    assert json.loads((tmp_path / "summary.json").read_text())["with"]["mean"] == 0.85
    report({3: ([], [rec, rec])}, Scale(60), tmp_path, tmp_path / "plot.png", "fault-free")
    assert "| 3 | 9 / 9 | 0.5 / 0.5 | +0.00% |" in (tmp_path / "report.md").read_text()


def _save(out: Path, seed: int, results: list[dict[str, object]], minutes: float | None = 8) -> None:
    """Saved runs whose records make each result's goodput: a step every 0.5 s for 50 s (100 possible), the last
    finite checkpoint at the step that counts that share of them."""
    (out / f"seed-{seed}").mkdir(parents=True)
    records = [{"trainguard": r["trainguard"], "duration": 50.0, "steps": [[0.5 * i, i, True] for i in range(100)],
                "checkpoints": [[40.0, round(100 * float(r["goodput"])) - 1, True]]} for r in results]  # type: ignore[arg-type]
    (out / f"seed-{seed}" / "goodput.json").write_text(json.dumps({"minutes": minutes, "results": results,
                                                                   "records": records}))


def test_runs_saved_a_few_at_a_time_are_reported_together(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The runs of record take hours: made by several invocations (--without-only adds humans to saved seeds)."""
    first, later = tmp_path / "first", tmp_path / "later"
    for seed, w in ((1, 0.96), (2, 0.98)):
        _save(first, seed, [_result(True, w), _result(False, 0.7)])
    _save(later, 1, [_result(False, 0.75), _result(False, 0.5, 120), _result(True, 0.5)])  # a second 30 and "with"
    _save(later, 2, [_result(False, 0.4, 120)])
    per_seed = saved([first, later], Scale(60))
    assert [[(r["trainguard"], r["goodput"]) for r in rs] for rs, _ in per_seed.values()] == [
        [(True, 0.96), (False, 0.7), (False, 0.5)], [(True, 0.98), (False, 0.7), (False, 0.4)]]  # first ones kept
    assert per_seed[1][1][0].steps[-1] == [49.5, 99, True]  # the records, analysed again
    out = tmp_path / "report"
    assert main(["--report-from", str(first), str(later), "--schedule", "fleet", "--out", str(out),
                 "--plot", str(out / "p.png")]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["with"]["mean"] == 0.97 and summary["without"]["120"]["goodput"]["mean"] == 0.45
    assert "over 2 seeds (1, 2; schedule fleet" in (out / "report.md").read_text()
    _save(tmp_path / "none-with", 3, [_result(False, 0.4)])
    (tmp_path / "torn" / "seed-4").mkdir(parents=True)
    (tmp_path / "torn" / "seed-4" / "goodput.json").write_text("{")
    _save(tmp_path / "unsaid", 1, [_result(False, 0.4, 60)], minutes=None)  # saved before lengths were: joins
    assert [r["human"]["look_every_min"] for r in saved([first, tmp_path / "unsaid"], Scale(60))[1][0]] == [30, 30, 60]
    _save(tmp_path / "longer", 1, [_result(False, 0.4, 60)], minutes=15)
    for bad, says in (("none-with", "seeds [3]: no run with trainguard saved"),
                      ("torn", "seed-4/goodput.json: not a saved goodput run"),
                      ("longer", "15-minute runs, seed 1's first were 8-minute ones: another schedule")):
        with pytest.raises(SystemExit):
            main(["--report-from", str(first), str(tmp_path / bad), "--out", str(out)])
        assert says in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--with-only", "--without-only"])
    assert "--with-only and --without-only: one of them" in capsys.readouterr().err


# the hung file system -----------------------------------------------------------------------------------------------
def test_the_relay_hands_each_kernel_record_to_the_node_it_names() -> None:
    """The harness's one kernel for four nodes: a GPU's or HCA's record goes to the node of its PCI domain, an NFS
    server's to the node whose data mount it serves (fsN: nN), its OK line too; other records to none."""
    from tests.test_job_kernel_events import nfs_not_responding

    assert NFS_DOWN.format(server="fs3") == nfs_not_responding("fs3")  # the kernel's real line
    parser = KernelEventParser()
    [down] = parser.feed(NFS_DOWN.format(server="fs3"))
    [ok] = parser.feed(NFS_OK.format(server="fs3"))
    assert (down.klass, down.subject, ok.klass, ok.subject) == ("nfs_not_responding", "nfs:fs3", "nfs_ok", "nfs:fs3")
    for node in ("n1", "n2", "n3", "n4"):
        server = f"fs{node[1:]}"
        for line in (xid_line(bus_of(node)), NIC_LINE.format(domain=bus_of(node)[:4]), NFS_DOWN.format(server=server),
                     NFS_OK.format(server=server)):
            assert node_of_record(line.encode()) == node, line
    for other in ("nfs: server fs2.example.com not responding, still trying", "nfs: server 10.0.0.2 OK",
                  "NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
                  "EXT4-fs (sda1): mounted filesystem"):
        assert node_of_record(other.encode()) is None, other


def test_the_fleet_schedule_has_each_site_fault_once_and_the_runs_of_records_faults_before_the_hung_fs() -> None:
    """hung_fs came after the runs of record: drawn last, it leaves their seeded draws as they were; a fault after it
    may be pushed back by the minimum gap."""
    assert fleet.SITE_KINDS[-1] == "hung_fs" and "hung_fs" in EXTRA_KINDS
    # seed 1 of the runs of record, 8 minutes at x60, as the four site faults drew it (before hung_fs)
    of_record = [(66.2, "stop_switch", 2), (84.4, "maintenance", 0), (139.0, "hbm", 1), (159.9, "disk_full", 0),
                 (257.6, "hbm", 0), (275.9, "xid79", 1), (285.9, "leak", 0), (381.2, "ib_down", 0),
                 (403.7, "time_limit", 0)]
    assert fleet.draw(1, 480, 60, 3, site=fleet.SITE_KINDS[:4]) == of_record
    for seed in range(1, 6):
        now = fleet.draw(seed, 480, 60, 3)
        before = fleet.draw(seed, 480, 60, 3, site=fleet.SITE_KINDS[:4])
        assert sorted(k for _, k, _ in now if k in fleet.SITE_KINDS) == sorted(fleet.SITE_KINDS)
        hung = next(at for at, kind, _ in now if kind == "hung_fs")
        assert [f for f in now if f[0] < hung] == [f for f in before if f[0] < hung]
        assert [k for _, k, _ in now if k != "hung_fs"] == [k for _, k, _ in before], seed
    hung = next(f for f in fleet.draw(1, 480, 60, 3) if f[1] == "hung_fs")
    assert [f for f in of_record if f[0] < hung[0]] == of_record[:5]


class _Cluster:
    """What the human reads of SLURM and does to it, recorded: the job hung, every node up."""

    def __init__(self) -> None:
        self.nodes = ["n1", "n2", "n3", "n4"]
        self.commands: list[tuple[str, ...]] = []

    def job(self, job: str) -> dict[str, str]:
        return {"JobState": "RUNNING"}

    def node_states(self) -> dict[str, tuple[str, str]]:
        return dict.fromkeys(self.nodes, ("idle", ""))

    def run(self, *args: str, check: bool = True) -> None:
        self.commands.append(args)


def test_the_human_drains_the_node_whose_kernel_says_its_mount_is_dead_and_requeues(tmp_path: Path) -> None:
    """As for a lost GPU: at their look the job is hung (no step for 10 scaled minutes), the node's kernel log says
    its data mount's server is not responding: they drain that node, naming the dead mount, and requeue the job."""
    run = Run(tmp_path, False, [], 60.0, Scale(60), look_every=30.0, page_response=5.0, step_time=0.5, ckpt_every=20)
    run.cluster = cluster = _Cluster()  # type: ignore[assignment]
    run.run_dir, run.ckpt, run.job = tmp_path / "run", tmp_path / "ckpt", "7"
    run.run_dir.mkdir()
    run.out = run.run_dir / "progress.log"
    run.t0 = time.time() - 40
    run.out.write_text(f"step 0 loss=4.0 t={run.t0 + 5:.3f}\n")  # 35 s ago
    run.broken, run.hung_fs = {"n2", "n3"}, {"n2"}  # n3's GPU is gone, n2's mount hangs
    run.human(40.0, "look", set())
    assert cluster.commands == [
        ("scontrol", "update", "nodename=n2", "state=drain", "reason=operator: dead mount fs2:/export (server not "
         "responding)"),
        ("scontrol", "update", "nodename=n3", "state=drain", "reason=operator: hardware fault"),
        ("scontrol", "requeue", "7")]
    assert run.rec.actions[-1]["what"] == "drained n2; drained n3; requeued the job (running, stale log)"


class _BatchHostCluster(_Cluster):
    def __init__(self) -> None:
        super().__init__()
        self.restarts = "0"

    def job(self, job: str) -> dict[str, str]:
        return {"JobState": "RUNNING", "BatchHost": "n1", "Restarts": self.restarts}


def test_a_rebooted_batch_host_takes_the_job_down_and_slurmctld_requeues_it_unless_someone_did(tmp_path: Path) -> None:
    """A host's maintenance reboots the node: on the job's batch host its batch script (the relaunch loop) dies too,
    and slurmctld requeues the job once it finds the node gone (NODE_FAIL, its SlurmdTimeout of 5 scaled minutes);
    on another node only the rank there dies."""
    run = Run(tmp_path, True, [], 60.0, Scale(60), look_every=30.0, page_response=5.0, step_time=0.5, ckpt_every=20)
    run.cluster = cluster = _BatchHostCluster()  # type: ignore[assignment]
    run.run_dir, run.job = tmp_path / "run", "7"
    (run.run_dir / "pids").mkdir(parents=True)
    run.reboot("n2", 10.0)
    assert cluster.commands == [] and run.node_fail is None
    run.reboot("n1", 20.0)
    assert cluster.commands == [("scancel", "--batch", "--signal=KILL", "7")]
    run.requeue_after_node_fail(24.9)
    assert len(cluster.commands) == 1
    run.requeue_after_node_fail(25.0)
    assert cluster.commands[-1] == ("scontrol", "requeue", "7") and run.node_fail is None
    assert run.rec.actions[-1]["what"] == "slurmctld requeued the job (NODE_FAIL)"
    run.reboot("n1", 30.0)
    cluster.restarts = "1"  # trainguard's or the human's requeue came first: slurmctld has nothing to requeue
    run.requeue_after_node_fail(40.0)
    assert cluster.commands[-1] == ("scancel", "--batch", "--signal=KILL", "7")


def test_a_rank_reads_its_nodes_data_mount_every_step_and_blocks_while_it_hangs(tmp_path: Path) -> None:
    """The data mount the harness gives each node (`data_mount`: tests/helpers/hangfs.py with a control file), read
    every step; while it hangs the rank waits in the read in D state (every open reaches the mount: FUSE drops the
    file's cached pages), and steps on once it answers again; blocked, it dies of SIGKILL (the wait is killable: a
    restart that cancels its step ends it), and the harness's unmount ends the hang."""
    require_root()
    hung = tmp_path / "fs-hung-n1"
    (tmp_path / "ckpt").mkdir()
    progress = tmp_path / "run" / "progress.log"

    def steps() -> int:
        return progress.read_text().count("\nstep ") if progress.exists() else 0
    with contextlib.ExitStack() as stack:
        data_mount(stack, tmp_path / "data-n1", "fs1", hung)
        assert "fs1:/export" in {m.device for m in read_mounts() if m.mountpoint == str(tmp_path / "data-n1")}
        trainer = _trainer(tmp_path, 1, "--data", str(tmp_path / "data-{node}" / "data"))
        stack.callback(trainer.wait, 10)
        stack.callback(trainer.kill)
        wait_until(lambda: steps() >= 3, 20, what="steps reading the mount")
        hung.touch()
        wait_until(lambda: psutil.Process(trainer.pid).status() == psutil.STATUS_DISK_SLEEP, 10,
                   what="the rank blocked in D state")
        stopped = steps()
        time.sleep(0.5)  # ten steps' time
        assert steps() == stopped
        hung.unlink()
        wait_until(lambda: steps() >= stopped + 3, 20, what="steps again")
        hung.touch()
        wait_until(lambda: psutil.Process(trainer.pid).status() == psutil.STATUS_DISK_SLEEP, 10,
                   what="the rank blocked again")
    assert trainer.returncode == -signal.SIGKILL and not hung.exists()


# the repair: a replacement node ------------------------------------------------------------------------------------
def test_a_repaired_node_comes_back_as_a_replacement_but_the_lemon_scenarios_node_never() -> None:
    """Each node here takes ~680 fleet nodes' faults: kept through its repairs, unrelated faults make it a lemon. The
    fleet replaces a drained node; the lemon scenario's node is one machine put back again and again."""
    fleet_site = site_of(parser().parse_args(["--schedule", "fleet"]), Scale(60), fleet_like=True)
    assert fleet_site.repair_after == 30.0 and fleet_site.repair_model() == "replacement"
    assert [replaced_on_repair(n, fleet_site) for n in ("n1", "n2", "n3", "n4")] == [True] * 4
    lemon = site_of(parser().parse_args(["--scenario", "lemon"]), Scale(60), fleet_like=True)
    assert [replaced_on_repair(n, lemon) for n in ("n1", "n2", "n3", "n4")] == [False, True, True, True]
    same = site_of(parser().parse_args(["--schedule", "fleet", "--repaired-same-node"]), Scale(60), fleet_like=True)
    assert same.repair_model() == "same node" and not any(replaced_on_repair(n, same) for n in ("n1", "n2"))
    assert site_of(parser().parse_args([]), Scale(60), fleet_like=False).repair_model() is None  # no repair at all


class _Agent:
    """An agent's log and its stop, as the harness uses them (no process)."""

    def __init__(self, log: Path) -> None:
        self.config, self.log, self.stopped = log.with_suffix(".toml"), log, False

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def stop(self) -> None:
        self.stopped = True


def _repairable(tmp_path: Path, site: Site) -> Run:
    run = Run(tmp_path, True, [], 60.0, Scale(60), look_every=30.0, page_response=5.0, step_time=0.5, ckpt_every=20,
              site=site)
    run.cluster = _Cluster()  # type: ignore[assignment]
    run.run_dir = tmp_path / "run"
    (run.run_dir / "faults").mkdir(parents=True)
    run.t0 = time.time() - 40
    for node in ("n1", "n2"):
        shutil.copytree(IB_TREE, tmp_path / f"ib-{node}", symlinks=True)
        (tmp_path / f"state-{node}").mkdir()
        (tmp_path / f"agent-{node}.log").write_text("ts=x level=INFO msg=ready\n")
        run.agents[node] = _Agent(tmp_path / f"agent-{node}.log")  # type: ignore[assignment]
    run.fifos = {n: tmp_path / f"kmsg-{n}" for n in ("n1", "n2")}
    run.start_agent = lambda node, fifo: _Agent(tmp_path / f"agent-{node}.log")  # type: ignore[method-assign]
    return run


def test_a_replacement_gets_a_new_agent_with_an_empty_state_and_joins_once_it_is_ready(tmp_path: Path) -> None:
    run = _repairable(tmp_path, Site(repair_after=30.0, lemon_every=180.0))
    old = run.agents["n2"]
    (tmp_path / "gpu-state-n2.json").write_text('{"lost": true}')
    run.broken = {"n1", "n2"}
    with (tmp_path / "agent-n2.log").open("a") as log:
        log.write("ts=x level=INFO msg=incid")  # the old agent killed in the middle of a line
    run.repair("n2", 10.0)
    assert old.stopped and run.agents["n2"] is not old  # type: ignore[attr-defined]
    assert not (tmp_path / "state-n2").exists() and (tmp_path / "state-n2.1").is_dir()  # kept for the record
    assert not (tmp_path / "gpu-state-n2.json").exists() and "n2" not in run.broken
    assert run.cluster.commands == []  # type: ignore[attr-defined]  # not resumed before its agent is ready
    run.watch_drains(11.0)
    assert run.cluster.commands == []  # type: ignore[attr-defined]
    with (tmp_path / "agent-n2.log").open("a") as log:  # the new life logs to the same file
        log.write("ts=y level=INFO msg=ready\n")
    run.watch_drains(12.0)
    assert (tmp_path / "agent-n2.log").read_text().endswith("msg=incid\nts=y level=INFO msg=ready\n")
    assert run.cluster.commands == [("scontrol", "update", "nodename=n2", "state=resume")]  # type: ignore[attr-defined]
    assert run.rec.actions[-1]["what"] == "repaired n2 (as a replacement, fresh agent state), resumed"
    assert run.lives == {"n2": [10.0]}
    # the lemon scenario's node: the same machine, its agent and state kept
    lemon = run.agents["n1"]
    run.repair("n1", 13.0)
    assert not lemon.stopped and run.agents["n1"] is lemon and (tmp_path / "state-n1").is_dir()  # type: ignore[attr-defined]
    assert run.cluster.commands[-1] == ("scontrol", "update", "nodename=n1", "state=resume")  # type: ignore[attr-defined]
    assert run.rec.actions[-1]["what"] == "repaired n1 (the same node), resumed"


def test_a_held_lemon_is_sent_back_and_a_machine_of_the_pool_takes_its_place(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """As in a fleet: the node the lemon policy holds is not put back; another machine takes its slot, with a new agent
    and an empty state, and the lemon's GPU fails no more. Its ranks after that are the new machine's, not the
    lemon's. Where repaired nodes come back as the same node (the runs of record before replacements), a held node
    stays out."""
    run = _repairable(tmp_path, Site(repair_after=30.0, lemon_every=180.0))
    held = [{"t": 5.0, "node": "n1", "check": "lemon", "subject": "gpu", "status": "CRITICAL", "event": "fired"}]
    monkeypatch.setattr(run, "fired", lambda: held)
    lemon = run.agents["n1"]
    run.repair("n1", 10.0)
    assert lemon.stopped and run.agents["n1"] is not lemon and (tmp_path / "state-n1.1").is_dir()  # type: ignore[attr-defined]
    assert run.rec.lemon_replaced == 10.0 and run.lives == {"n1": [10.0]}
    assert any(a["what"] == "n1 held by the lemon policy: sent back, a machine of the pool in its place"
               for a in run.rec.actions)
    with (tmp_path / "agent-n1.log").open("a") as log:
        log.write("ts=y level=INFO msg=ready\n")
    run.watch_drains(11.0)
    assert run.cluster.commands == [("scontrol", "update", "nodename=n1", "state=resume")]  # type: ignore[attr-defined]
    # the machine in its place, drained later and repaired, is one of the pool's like the others: replaced again
    (tmp_path / "state-n1").mkdir()  # its agent's
    run.repair("n1", 20.0)
    assert (tmp_path / "state-n1.2").is_dir() and run.rec.lemon_replaced == 10.0
    run.rec.faults = [{"kind": "lemon", "injected": 2.0}, {"kind": "lemon", "injected": 4.9}]
    run.rec.alerts = held
    run.rec.ranks = [(1.0, "1.0.0", "n1"), (12.0, "1.1.0", "n1")]  # the second: the new machine's
    assert lemon_figures(run.rec) == {"faults": [2.0, 4.9], "held_at": 5.0, "replaced_at": 10.0,
                                      "ranks_after_second_fault": []}
    same = _repairable(tmp_path / "same", Site(repair_after=30.0, lemon_every=180.0, replace_repaired=False))
    monkeypatch.setattr(same, "fired", lambda: held)
    kept = same.agents["n1"]
    same.repair("n1", 10.0)
    assert not kept.stopped and same.agents["n1"] is kept and same.rec.lemon_replaced is None  # type: ignore[attr-defined]
    assert same.cluster.commands == [] and same.rec.actions[-1]["what"] == "n1 held by the lemon policy: not resumed"  # type: ignore[attr-defined]


def test_the_kernel_names_a_dead_nfs_server_after_its_major_timeout_and_never_one_back_sooner(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node's data mount stops answering: its kernel says `not responding` NFS_MAJOR_TIMEOUT (3 scaled minutes) later,
    as NFS over TCP does at its defaults, not at once; `OK` at the repair only after it; a mount repaired sooner is
    never named. `--fs-stale-after` sets the agents' `fs_stale_after`, scaled (0: unset, the installed default)."""
    said: list[str] = []
    monkeypatch.setattr("benchmarks.goodput.write_kmsg", lambda level, text: said.append(text))
    run = _repairable(tmp_path, Site(repair_after=30.0))
    clock = [100.0]
    monkeypatch.setattr(run, "now", lambda: clock[0])
    monkeypatch.setattr(run, "attempt_nodes", lambda: ("1", ["n1", "n2"]))
    run.inject(Fault(100.0, "hung_fs", 1))
    assert run.hung_mark("n2").exists() and said == []
    run.watch_drains(100.0 + NFS_MAJOR_TIMEOUT / 60 - 0.1)
    assert said == []
    run.watch_drains(100.0 + NFS_MAJOR_TIMEOUT / 60)
    assert said == [NFS_DOWN.format(server="fs2")]
    run.heal("n2")
    assert said[-1] == NFS_OK.format(server="fs2") and not run.hung_mark("n2").exists()
    run.inject(Fault(110.0, "hung_fs", 0))  # n1's, repaired within the major timeout
    run.heal("n1")
    run.watch_drains(200.0)
    assert said == [NFS_DOWN.format(server="fs2"), NFS_OK.format(server="fs2")]
    scale = Scale(60)
    assert site_of(parser().parse_args(["--fs-stale-after", "1"]), scale, True).fs_stale_after == 1.0
    assert site_of(parser().parse_args([]), scale, True).fs_stale_after is None


def test_the_report_says_which_repair_the_runs_had() -> None:
    rec = Record(trainguard=True, duration=10.0)
    rec.actions = [{"t": 1.0, "who": "site", "what": "n2 replaced: a new agent, an empty state"},
                   {"t": 2.0, "who": "site", "what": "repaired n2 (as a replacement, fresh agent state), resumed"}]
    figures = analyse(rec, Scale(60), 0.5)
    assert (figures["repairs"], figures["replaced"]) == (1, 1)
    w = {**_result(True, 0.9), **figures, "goodput": 0.9, "repair": "replacement"}
    wo = {**_result(False, 0.5), **analyse(Record(trainguard=False, duration=10.0), Scale(60), 0.5), "repair": None}
    assert "Repair: a replacement node (fresh agent state; the lemon scenario's node excepted); with trainguard 1 " \
           "repairs, 1 replacements." in table([w, wo], 1, Scale(60))
    older = {**w, "replaced": 0}
    del older["repair"]  # saved before the model was recorded: the same node came back
    summary = summarize({1: [w, _result(False, 0.5)], 2: [older, _result(False, 0.5)]})
    assert summary["repair"] == ["replacement", "same node"]
    text = seeds_table(summary, Scale(60), "fleet")
    assert "Repair: a replacement node" in text and "Repair: the same node (its agent's history kept" in text
    none = {**wo, "trainguard": True, "repair": None}
    assert "Repair" not in table([none, wo], 1, Scale(60))  # no repair, none said


def test_durations_given_the_agents_are_ones_their_config_reads() -> None:
    from trainguard.core.units import parse_duration

    for x, text in ((0.5, "0.5s"), (1e-05, "0.001s"), (1234567.0, "1234567s"), (300 / 60, "5s"), (2.0 / 3, "0.667s")):
        assert seconds_text(x) == text
        assert parse_duration(text) == pytest.approx(max(x, 0.001), abs=5e-4)
    assert Scale(60).dur(300, 2) == "5s" and Scale(60).dur(6, 2) == "2s"
