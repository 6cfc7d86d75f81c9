"""Fail-slow: a job's pace against its own baseline (core/pace.py) on the shapes real training logs have, the
job_pace check's finding and resolution on a fake clock, and this node's evidence from scripted NVML and /proc."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require, require_root, wait_until
from tests.helpers.fake_nvml import FakeGpu, FakeNvml
from tests.slurm_cluster import OTHER_USER, ensure_user
from tests.test_gpu import Clock
from tests.test_log_excerpts import EXCERPTS
from trainguard.checks.base import CheckContext
from trainguard.checks.job_pace import STATE_KEY, JobPaceCheck, JobPaceSettings, clock_time
from trainguard.core.model import Result, Status
from trainguard.core.pace import Pace, PaceLedger, PaceSettings, weighted_median
from trainguard.core.state import ScopedState, scoped_key
from trainguard.gpu.nvml import Clocks, Nvml, PcieLink
from trainguard.gpu.slowdown import co_tenant, gpu_evidence
from trainguard.jobs.catalog import JobCatalog
from trainguard.jobs.settings import JobsSettings, ProcessJobSettings
from trainguard.logscan.context import step_marks
from trainguard.node.flight import parse_dump
from trainguard.node.pressure import CO_TENANT, host_evidence, host_sample
from trainguard.node.procfs import ProcFS
from trainguard.node.proctable import ProcessSnapshots
from trainguard.pipeline.store import Store

SETTINGS = PaceSettings()


def step_times(n: int, seconds: float = 2.0, *, warmup: int = 20, ckpt_every: int = 0, ckpt_s: float = 60.0,
               eval_every: int = 0, eval_s: float = 90.0, slow_from: int | None = None, slow: float = 1.0,
               slow_to: int | None = None, seed: int = 1) -> list[float]:
    """When each step ends, modelled on real runs: the first `warmup` steps 3x slower (compilation, cache warm-up),
    +-5% jitter, a checkpoint save every `ckpt_every` steps and an evaluation pass every `eval_every` steps (pauses
    of their own), and steps `slow_from`..`slow_to` `slow` times longer (a throttled GPU)."""
    rng, now, out = random.Random(seed), 0.0, []
    for step in range(n):
        took = seconds * rng.uniform(0.95, 1.05) * (3 if step < warmup else 1)
        if slow_from is not None and step >= slow_from and (slow_to is None or step < slow_to):
            took *= slow
        if ckpt_every and step and step % ckpt_every == 0:
            took += ckpt_s
        if eval_every and step and step % eval_every == 0:
            took += eval_s
        now += took
        out.append(now)
    return out


def read_every(ends: list[float], every: float = 15.0, first_step: int = 0) -> list[tuple[int, float]]:
    """What the log reader sees: the last step line each read finds, stamped when read (every `every` s)."""
    samples, i, t = [], 0, every
    while i < len(ends):
        while i < len(ends) and ends[i] <= t:
            i += 1
        if i:
            samples.append((first_step + i - 1, t))
        t += every
    return samples


def replay(samples: list[tuple[int, float]], settings: PaceSettings = SETTINGS, pace: Pace | None = None,
           every: float = 30.0) -> tuple[Pace, list[tuple[float, bool, float | None]]]:
    """Feed the samples and evaluate every `every` s as the check does: (time, slow finding, ratio) at each run."""
    pace = pace or Pace()
    runs, next_run = [], samples[0][1]
    for step, when in samples:
        pace.add(step, when, settings)
        if when >= next_run:
            v = pace.evaluate(when, settings)
            runs.append((when, v.slow(when, settings), v.ratio))
            next_run += every
    return pace, runs


def test_weighted_median_counts_each_value_its_steps() -> None:
    assert weighted_median([(2.0, 10), (60.0, 1), (2.2, 10)]) == 2.2
    assert weighted_median([]) is None


@pytest.mark.parametrize("shape", ["steady", "checkpoints", "eval", "both"])
def test_a_healthy_run_never_fires_and_its_baseline_is_its_steady_step(shape: str) -> None:
    kw = {"steady": {}, "checkpoints": {"ckpt_every": 100}, "eval": {"eval_every": 250},
          "both": {"ckpt_every": 100, "eval_every": 250}}[shape]
    for seed in (1, 2, 3):
        pace, runs = replay(read_every(step_times(3000, seed=seed, **kw)))
        assert not any(slow for _, slow, _ in runs), (shape, seed)
        base = pace.baseline(SETTINGS)
        # stamped when read, 7 or 8 steps a read: each interval's step time is 1.88 or 2.14 s, never 2.0 (the same
        # quantisation in the recent pace: their ratio stays near 1)
        assert base is not None and 1.8 < base < 2.2, (shape, base)


def test_warmup_is_not_the_baseline() -> None:
    """The first steps run 3x slower (compilation); with no warm-up skip they would set a baseline the steady run
    beats, and a later slowdown would hide under it."""
    pace, _ = replay(read_every(step_times(200)))
    assert 1.8 < (pace.baseline(SETTINGS) or 0) < 2.2
    cold, _ = replay(read_every(step_times(200)), PaceSettings(warmup_steps=0, baseline_steps=1))
    assert cold.pool[0][0] > 4  # what the skip leaves out


def test_a_slowdown_fires_after_slow_for_and_resolves_when_the_pace_comes_back() -> None:
    ends = step_times(2400, ckpt_every=100, slow_from=1000, slow=1.4, slow_to=1700)
    slow_start = ends[1000]  # step 1000 saves a checkpoint first: its steps run slow from there
    pace, runs = replay(read_every(ends))
    fired = [t for t, slow, _ in runs if slow]
    assert fired, "a 1.4x slowdown for 700 steps is found"
    # counted from the slowdown's start (not from when it tipped the window's median): within a read or two of it
    assert slow_start + SETTINGS.slow_for - 30 <= fired[0] <= slow_start + SETTINGS.slow_for + 60
    ratio = next(r for t, _, r in runs if t == fired[0])
    assert ratio is not None and 1.3 < ratio < 1.5
    back = ends[1699]
    assert all(t < back + SETTINGS.window + 30 for t in fired), "resolved once the window is past the slow steps"
    assert not runs[-1][1] and 1.8 < (pace.baseline(SETTINGS) or 0) < 2.2  # the slow stretch never became its pace


def test_a_slowdown_under_the_threshold_or_shorter_than_slow_for_is_no_finding() -> None:
    _, mild = replay(read_every(step_times(2000, slow_from=800, slow=1.10)))
    _, short = replay(read_every(step_times(2000, slow_from=800, slow=2.0, slow_to=900)))  # ~200 s at 2x
    assert not any(s for _, s, _ in mild) and not any(s for _, s, _ in short)


def test_a_restart_goes_through_warm_up_again_and_keeps_the_baseline() -> None:
    first = read_every(step_times(800))
    again = read_every(step_times(600), first_step=700)  # requeued: resumed from the checkpoint at step 700
    end = first[-1][1] + 120  # the relaunch took 2 minutes
    pace, runs = replay(first + [(s, t + end) for s, t in again])
    assert pace.restarts == 1
    assert not any(s for _, s, _ in runs)
    assert 1.8 < (pace.baseline(SETTINGS) or 0) < 2.2


def test_a_series_saved_mid_slowdown_restores_its_pool_clock_and_last_step() -> None:
    """What the check saves of a series (as JSON) is what it needs to go on: the pool from before the slowdown, the
    slow-since time, the last sample; a damaged or foreign one is refused, never half taken."""
    pace, _ = replay(read_every(step_times(1300, slow_from=1000, slow=1.5)))
    assert pace.slow_since is not None
    back = Pace.from_json(json.loads(json.dumps(pace.to_json())))
    assert (back.last, back.warm_from, back.slow_since, back.restarts) == (pace.last, pace.warm_from,
                                                                            pace.slow_since, pace.restarts)
    assert back.baseline(SETTINGS) == pytest.approx(pace.baseline(SETTINGS) or 0, rel=1e-5)
    assert back.current() == pytest.approx(pace.current() or 0, rel=1e-5) and len(back.pool) == len(pace.pool)
    for bad in ({}, {**pace.to_json(), "pool": [[2.0, 0]]}, {**pace.to_json(), "last": [1]},
                {**pace.to_json(), "recent": [["x", 1.0, 1]]}, {**pace.to_json(), "slow_since": float("nan")}):
        with pytest.raises((ValueError, TypeError, KeyError, IndexError)):
            Pace.from_json(bad)


def test_step_marks_per_rank_with_the_lines_own_time() -> None:
    """Lines as torchrun --tee and Megatron print them, and the toy trainer's."""
    data = (b"[default0]:[rank0]: 2025-05-21 14:05:01,120 iteration      100/  500000 | elapsed time per iteration "
            b"(ms): 2201.3\n[default1]:[rank1]: 2025-05-21 14:05:01,180 iteration      100/  500000 |\n"
            b"[default0]:[rank0]: 2025-05-21 14:05:03,330 iteration      101/  500000 |\nstep 7 loss=3.9\n")
    marks = step_marks(data)
    assert marks["0"][0] == 101 and marks["1"][0] == 100 and marks[None] == (7, None)
    assert marks["0"][1] is not None and marks["1"][1] is not None
    assert round(marks["0"][1] - marks["1"][1], 2) == 2.15


def test_the_ledger_is_bounded_and_forgets_gone_jobs() -> None:
    ledger = PaceLedger()
    for i in range(100):
        ledger.record("a", f"log|{i}", i, float(i))
        ledger.record("b", "log|", i, float(i))
    assert len(ledger.take("a")) == 16 and len(ledger.take("b")["log|"]) == 64 and ledger.take("a") == {}
    ledger.record("c", "x", 1, 1.0)
    ledger.forget({"a"})
    assert ledger.take("c") == {}


def test_the_trainer_reports_its_step_time_and_the_agent_reads_it_bounded(tmp_path: Path) -> None:
    from trainguard.jobs.tree import read_beat
    from trainguard.node.access import AGENT
    from trainguard.trainer import Trainer

    trainer = Trainer(switch_dir=tmp_path)
    path = str(tmp_path / "heartbeat.json")
    trainer.heartbeat(10, loss=2.0)
    first = read_beat(path, AGENT)
    assert first is not None and first.step == 10 and first.step_time is None  # nothing to measure it against yet
    time.sleep(0.05)
    trainer.heartbeat(12, loss=1.9)
    second = read_beat(path, AGENT)
    assert second is not None and second.step == 12 and second.step_time is not None
    assert second.step_time == pytest.approx((second.time - first.time) / 2)
    for hostile in ({"step": 5, "time": "soon"}, {"step": "5", "time": 1.0}, {"step": -1, "time": 1.0}, [1, 2]):
        Path(path).write_text(json.dumps(hostile))
        assert read_beat(path, AGENT) is None, hostile
    Path(path).write_text('{"step": 5, "time": 1e3, "pid": 1, "step_time": NaN}')  # an older or odd trainer
    assert read_beat(path, AGENT) == type(second)(5, 1000.0, 1, None)


# Node evidence --------------------------------------------------------------------------------------------------
def clocks(**kw: object) -> Clocks:
    base: dict[str, object] = {"sm_mhz": 1980, "sm_max_mhz": 1980, "reasons": 0, "power_w": 350.0,
                               "power_limit_w": 700.0, "temperature_c": 50, "slowdown_c": 90}
    return Clocks(**{**base, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize(("kw", "said"), [
    ({"reasons": 0x8, "sm_mhz": 1200}, "GPU 3: HW slowdown (SM clock 1200 of 1980 MHz)"),
    ({"reasons": 0x40 | 0x20}, "GPU 3: thermal slowdown and HW thermal slowdown (SM clock 1980 of 1980 MHz)"),
    ({"reasons": 0x80}, "GPU 3: power brake (SM clock 1980 of 1980 MHz)"),
    ({"reasons": 0x4, "power_w": 699.0}, "GPU 3: software power cap (SM clock 1980 of 1980 MHz), power at its limit "
                                         "(699 of 700 W)"),
    ({"temperature_c": 87}, "GPU 3: temperature 87 C (slows itself at 90 C)"),
    ({"reasons": 0x1 | 0x2}, None),  # idle, application clocks: not a slowdown
])
def test_throttle_reasons_in_words(kw: dict[str, object], said: str | None) -> None:
    found = gpu_evidence(3, clocks(**kw))
    assert (found.describe() if found.said else None) == said


def test_pcie_ecc_and_co_tenants_in_words() -> None:
    from trainguard.gpu.nvml import GpuState

    link = PcieLink(generation=4, generation_max=5, width=8, width_max=16, replays=120, utilization=95)
    gpu = GpuState(0, "GPU-a", "H100", "0000:18:00", remap_pending=True)
    found = gpu_evidence(0, clocks(), link, gpu, replays=20, others=[co_tenant(4242, "python", "tgother", 8 << 30,
                                                                               80 << 30)])
    assert found.said == ("PCIe link x8 of x16", "PCIe gen 4 of 5", "20 PCIe replays", "row remapping pending",
                          "another process on it: pid 4242 (python, user tgother) 8.0 GiB, 10% of its memory")
    many = gpu_evidence(0, None, others=[co_tenant(p, "x", "root", None, None) for p in (1, 2, 3)], count=5)
    assert many.said == ("5 other processes on it: pid 1 (x, user root); pid 2 (x, user root); pid 3 (x, user root)",)
    idle = PcieLink(generation=1, generation_max=5, width=16, width_max=16, replays=0, utilization=0)
    assert gpu_evidence(0, clocks(), idle).said == ()  # an idle GPU lowers its link generation to save power


def fake_proc(root: Path, *, steal: int = 0, iowait: int = 0, cpu_psi: float = 0.0, swap_in: int = 0) -> ProcFS:
    (root / "pressure").mkdir(parents=True, exist_ok=True)
    (root / "stat").write_text(f"cpu  1000 0 500 {8000 - steal - iowait} {iowait} 0 0 {steal} 0 0\ncpu0 1 2 3\n")
    (root / "vmstat").write_text(f"nr_free_pages 1\npswpin {swap_in}\npswpout 0\n")
    for r in ("cpu", "io", "memory"):
        some = cpu_psi if r == "cpu" else 0.0
        (root / "pressure" / r).write_text(f"some avg10=0.00 avg60={some:.2f} avg300=0.00 total=1\n"
                                           "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    return ProcFS(root)


def test_host_steal_pressure_and_swap(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path)
    before = host_sample(proc, 0.0)
    # 10,000 jiffies later: 1,500 stolen, 300 in iowait; CPU pressure 40%; 6,000 pages swapped in over 30 s
    fake_proc(tmp_path, cpu_psi=40.0, swap_in=6000)
    (tmp_path / "stat").write_text("cpu  5500 0 2500 9700 300 0 0 1500 0 0\n")
    said, gauges = host_evidence(before, host_sample(proc, 30.0))
    assert said == ["cpu pressure 40%", "CPU steal 15%", "swapping in 200 pages/s"]
    assert gauges["iowait"] == pytest.approx(0.03) and gauges["cpu"] == pytest.approx(0.4)
    quiet, _ = host_evidence(host_sample(proc, 30.0), host_sample(proc, 60.0))
    assert quiet == ["cpu pressure 40%"]


def test_collective_wait_ratio_from_flight_recorder_entries() -> None:
    """NCCL entries as PyTorch 2.x records them: the rank that arrives last spends least time inside each
    all-reduce (its peers already wait there); Gloo's carry no times."""
    def dump(inside_ms: float) -> dict[str, object]:
        entries = []
        for i in range(10):
            start = 1_700_000_000_000_000_000 + i * 1_000_000_000
            entries.append({"collective_seq_id": i + 1, "pg_id": 0, "process_group": ["0", "default_pg"],
                            "profiling_name": "nccl:all_reduce", "state": "completed", "is_p2p": False,
                            "time_created_ns": start - 1000, "time_discovered_started_ns": start,
                            "time_discovered_completed_ns": start + int(inside_ms * 1e6)})
        return {"entries": entries}
    straggler, peer = parse_dump(dump(20), 17), parse_dump(dump(310), 3)
    assert straggler is not None and peer is not None  # 20 ms and 310 ms inside each, one a second
    assert straggler.wait_ratio == pytest.approx(0.02, abs=0.01) and peer.wait_ratio == pytest.approx(0.33, abs=0.01)
    gloo = json.loads((Path(__file__).parent / "data/flight_recorder/hang/rank0.json").read_text())
    trace = parse_dump(gloo, 0)
    assert trace is not None and trace.wait_ratio is None


# The check ------------------------------------------------------------------------------------------------------
@pytest.fixture
def trainer(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    marker = f"pace-trainer-{uuid.uuid4().hex}"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", marker])
    switch = tmp_path / "switch"
    switch.mkdir()
    yield proc, marker, switch
    proc.kill()
    proc.wait()


def pace_check(tmp_path: Path, marker: str, switch: Path, fake: FakeNvml, clock: Clock,
               proc: ProcFS, snapshots: ProcessSnapshots | None = None, store: Store | None = None,
               **extra: object) -> JobPaceCheck:
    jobs = JobCatalog(JobsSettings(sources=["process"], refresh=0, processes={"trainer": ProcessJobSettings(
        cmdline=marker, user="root", switch_dir=str(switch), job_id="7001")}), "node1", clock)
    ctx = CheckContext("node1", tmp_path, clock, nvml=Nvml(fake), jobs=jobs, proc=proc,
                       state=ScopedState(store, "check/pace"),
                       **({"processes": snapshots} if snapshots is not None else {}))
    settings = JobPaceSettings.model_validate({"flight_recorder": False, **extra})
    return JobPaceCheck("pace", settings, ctx)


def beat(switch: Path, step: int, when: float) -> None:
    (switch / "heartbeat.json").write_text(json.dumps({"step": step, "time": when, "pid": 1, "metrics": {}}))


def run_for(check: JobPaceCheck, clock: Clock, switch: Path, state: dict[str, float], seconds: float,
            step_s: float) -> Result:
    """The trainer beats every step of `step_s`; the check runs every 30 s of the fake clock."""
    result = None
    end = clock.now + seconds
    while clock.now < end:
        clock.now += 30
        while state["t"] + step_s <= clock.now:
            state["t"] += step_s
            state["step"] += 1
        beat(switch, int(state["step"]), state["t"])
        [result] = check.run()
    assert result is not None
    return result


@pytest.mark.parametrize("pinned", [False, True])
def test_the_finding_names_the_throttled_gpu_and_resolves(tmp_path: Path, pinned: bool,
                                                          trainer: tuple[subprocess.Popen[bytes], str, Path]) -> None:
    """`critical_when_pinned`: the node whose GPU explains the slowdown says so as CRITICAL (its bound actions run
    there only)."""
    proc, marker, switch = trainer
    fake = FakeNvml([FakeGpu("GPU-a", processes=[(proc.pid, 1 << 30)]),
                     FakeGpu("GPU-b", bus_id=b"00000000:19:00.0", processes=[(proc.pid, 1 << 30)])])
    clock = Clock()
    clock.now = time.time()
    check = pace_check(tmp_path, marker, switch, fake, clock, fake_proc(tmp_path / "proc"),
                       critical_when_pinned=pinned)
    state = {"t": clock.now, "step": 0.0}
    healthy = run_for(check, clock, switch, state, 900, 2.2)
    assert healthy.status is Status.OK and "at its own pace, 2.2 s/step against 2.2" in healthy.summary
    # GPU 1 goes into HW slowdown: the job's steps take 3.1 s
    fake.gpus[1].clock_events, fake.gpus[1].sm_clock = 0x8, 1200
    early = run_for(check, clock, switch, state, 300, 3.1)
    assert early.status is Status.OK and "slower since" in early.summary  # not yet for slow_for
    slow = run_for(check, clock, switch, state, 420, 3.1)
    assert slow.status is (Status.CRITICAL if pinned else Status.WARNING)
    assert slow.summary.startswith("process job trainer runs 1.41x slower than its own pace since ")
    assert "(3.1 s/step against 2.2); on this node: GPU 1: HW slowdown (SM clock 1200 of 1980 MHz)" in slow.summary
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in slow.samples}
    assert values[("trainguard_job_slowdown_ratio", (("job_id", "7001"),))] == pytest.approx(1.41, abs=0.01)
    assert values[("trainguard_job_gpu_slowdown", (("gpu", "1"), ("job_id", "7001"), ("reason", "hw_slowdown")))] == 1
    assert values[("trainguard_job_gpu_clock_ratio", (("gpu", "1"), ("job_id", "7001")))] == pytest.approx(0.606,
                                                                                                            abs=0.01)
    fake.gpus[1].clock_events, fake.gpus[1].sm_clock = 0, 1980
    back = run_for(check, clock, switch, state, 180, 2.2)
    assert back.status is Status.OK and "at its own pace" in back.summary


def test_a_slowdown_this_node_does_not_explain_says_the_cause_is_elsewhere(
        tmp_path: Path, trainer: tuple[subprocess.Popen[bytes], str, Path]) -> None:
    proc, marker, switch = trainer
    fake, clock = FakeNvml([FakeGpu("GPU-a", processes=[(proc.pid, 1 << 30)])]), Clock()
    clock.now = time.time()
    check = pace_check(tmp_path, marker, switch, fake, clock, fake_proc(tmp_path / "proc"), critical_when_pinned=True)
    state = {"t": clock.now, "step": 0.0}
    run_for(check, clock, switch, state, 900, 1.0)
    slow = run_for(check, clock, switch, state, 900, 1.5)  # a slow shared file system: nothing here
    assert slow.status is Status.WARNING  # critical_when_pinned or not: nothing here is pinned
    assert slow.summary.endswith("this node shows nothing that would slow it: the cause is elsewhere (another node, "
                                 "the network, storage)")


@pytest.mark.parametrize("stopped", [True, False])
def test_a_slowdown_across_a_restart_keeps_the_baseline_from_before_it_and_its_start(
        tmp_path: Path, trainer: tuple[subprocess.Popen[bytes], str, Path], stopped: bool) -> None:
    """A new check over the same state in the middle of a slowdown (`stopped`: the old one stopped, as at a reload;
    else killed: what the run that saw the slowdown begin saved): its baseline is still the pace from before the
    slowdown, and the finding comes at `slow_for` from the slowdown's start, which it names. Once the job is gone, so
    is what was saved of it."""
    proc, marker, switch = trainer
    clock = Clock()
    clock.now = time.time()
    store = Store(tmp_path / "state")
    check = pace_check(tmp_path, marker, switch, FakeNvml([]), clock, fake_proc(tmp_path / "proc"), store=store)
    state = {"t": clock.now, "step": 0.0}
    run_for(check, clock, switch, state, 900, 2.0)
    early = run_for(check, clock, switch, state, 300, 3.0)
    since = early.details["slow_since"]
    assert early.status is Status.OK and since is not None and "slower since" in early.summary
    if stopped:
        check.stop()
        store.close()
        store = Store(tmp_path / "state")
    again = pace_check(tmp_path, marker, switch, FakeNvml([]), clock, fake_proc(tmp_path / "proc"), store=store)
    slow = run_for(again, clock, switch, state, 420, 3.0)
    assert slow.status is Status.WARNING and slow.details["slow_since"] == since
    assert slow.details["baseline_seconds"] == pytest.approx(2.0)
    assert f"runs 1.50x slower than its own pace since {clock_time(since)} (3 s/step against 2)" in slow.summary
    proc.kill()
    proc.wait()
    clock.now += 30
    assert again.run() == []
    assert json.loads(store.get(scoped_key("check/pace", STATE_KEY)) or "") == {"v": 1, "jobs": {}}


@pytest.mark.parametrize("saved", ['{"v": 1, "jobs": {"k": {"log|0": {"pool": [[2.0, "x"]]}}}}', '{"jobs": {}}',
                                   '{"v": 1, "jobs": [', "[1, 2]"])
def test_damaged_or_foreign_saved_paces_are_ignored_in_one_line(
        tmp_path: Path, trainer: tuple[subprocess.Popen[bytes], str, Path], saved: str,
        caplog: pytest.LogCaptureFixture) -> None:
    _, marker, switch = trainer
    store, clock = Store(None), Clock()
    store.put(scoped_key("check/pace", STATE_KEY), saved)
    with caplog.at_level("WARNING", logger="trainguard.checks.job_pace"):
        check = pace_check(tmp_path, marker, switch, FakeNvml([]), clock, fake_proc(tmp_path / "proc"), store=store)
        [result] = check.run()
    assert result.status is Status.OK
    assert [r.getMessage() for r in caplog.records] == ["saved job paces ignored; their baselines start over"]


def test_a_job_without_steps_has_its_pace_said_unknown_once(
        tmp_path: Path, trainer: tuple[subprocess.Popen[bytes], str, Path], caplog: pytest.LogCaptureFixture) -> None:
    _, marker, switch = trainer
    clock = Clock()
    clock.now = time.time()
    check = pace_check(tmp_path, marker, switch, FakeNvml([]), clock, fake_proc(tmp_path / "proc"))
    with caplog.at_level("INFO", logger="trainguard.checks.job_pace"):
        results = [check.run() for _ in range(3)]
    assert all(r[0].status is Status.OK and r[0].summary == "process job trainer: pace unknown (no step lines, no "
               "heartbeat)" and r[0].details["pace"] == "unknown" for r in results)
    assert [r.getMessage() for r in caplog.records].count(
        "a job's pace is unknown: no step lines, no heartbeat, no flight recorder") == 1


def test_gpu_gauges_name_only_a_jobs_own_gpus_and_the_reasons_active_now(
        tmp_path: Path, trainer: tuple[subprocess.Popen[bytes], str, Path]) -> None:
    """A job that holds no GPU is given every GPU only when it is alone on the node; with another job there, which
    GPU is whose can't be told: no per-GPU gauges for either (10 jobs x 8 GPUs of them were half of /metrics)."""
    _, marker, switch = trainer
    fake = FakeNvml([FakeGpu("GPU-a"), FakeGpu("GPU-b", bus_id=b"00000000:19:00.0", clock_events=0x8)])
    clock = Clock()
    clock.now = time.time()
    alone = pace_check(tmp_path, marker, switch, fake, clock, fake_proc(tmp_path / "proc")).run()
    gauges = sorted((s.name, s.labels["gpu"], s.labels.get("reason", "")) for r in alone for s in r.samples
                    if s.name.startswith("trainguard_job_gpu"))
    assert gauges == [("trainguard_job_gpu_clock_ratio", "0", ""), ("trainguard_job_gpu_clock_ratio", "1", ""),
                      ("trainguard_job_gpu_slowdown", "1", "hw_slowdown")]
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", marker + "-b"])
    try:
        jobs = JobCatalog(JobsSettings(sources=["process"], refresh=0, processes={
            name: ProcessJobSettings(cmdline=cmd, user="root", switch_dir=str(switch), job_id=name)
            for name, cmd in (("a", f"{marker}$"), ("b", f"{marker}-b"))}), "node1", clock)
        ctx = CheckContext("node1", tmp_path, clock, nvml=Nvml(fake), jobs=jobs, proc=fake_proc(tmp_path / "proc"))
        two = JobPaceCheck("pace", JobPaceSettings.model_validate({"flight_recorder": False}), ctx).run()
        assert len(two) == 2
        assert not [s for r in two for s in r.samples if s.name.startswith("trainguard_job_gpu")]
    finally:
        other.kill()
        other.wait()

# Per rank ---------------------------------------------------------------------------------------------------------
def excerpt(name: str) -> list[str]:
    """The non-empty lines of one real excerpt of tests/data/logs/excerpts.toml (each names its public thread)."""
    return [line for line in next(e for e in EXCERPTS if e["name"] == name)["text"].splitlines() if line.strip()]


def test_step_marks_per_rank_under_srun_label_and_pytorchs_rank_prefix() -> None:
    """Real step lines as the launchers carry them: Megatron-DeepSpeed's iteration lines (its issue 396) under srun
    --label (`N: ` before each task's line), and a trainer's `[01:53:32] step 1980/2000` lines (the UNO report) under
    PyTorch 2.2+'s `[rankN]:`. Each rank's last step is its own."""
    megatron = excerpt("megatron_grad_norm_nan")
    srun = "".join(f"{rank}: {line}\n" for i, line in enumerate(megatron) for rank in (0, 1) if rank == 0 or i < 2)
    marks = step_marks(srun.encode())
    assert marks["0"][0] == 5428 and marks["1"][0] == 5427 and None not in marks
    uno = [line for line in excerpt("system_error_async_mid_run") if " step " in line]
    torch = "".join(f"[rank{rank}]: {line}\n" for line in uno for rank in (3, 7))
    marks = step_marks(torch.encode())
    assert marks["3"][0] == 2000 and marks["7"][0] == 2000


def run_ranks(check: JobPaceCheck, clock: Clock, key: str, state: dict[str, tuple[float, int]], seconds: float,
              step_s: dict[str, float]) -> Result:
    """Each rank's log line read every 30 s of the fake clock (its last step, stamped when it ended), then a run."""
    result = None
    end = clock.now + seconds
    while clock.now < end:
        clock.now += 30
        for rank, took in step_s.items():
            t, step = state[rank]
            n = int((clock.now - t) // took)
            state[rank] = (t + n * took, step + n)
            check.context.paces.record(key, f"/scratch/train.log|{rank}", step + n, t + n * took)
        [result] = check.run()
    assert result is not None
    return result


def test_the_slow_rank_is_named_and_ranks_slow_alike_are_said_so(
        tmp_path: Path, trainer: tuple[subprocess.Popen[bytes], str, Path]) -> None:
    """Ranks whose steps do not wait for each other (here rank 3 slows 1.5x alone) name the slow one; ranks of a
    synchronous job slow alike, and the pace alone can't name which one sets it (the flight recorder can)."""
    _, marker, switch = trainer
    clock = Clock()
    clock.now = time.time()
    check = pace_check(tmp_path, marker, switch, FakeNvml([]), clock, fake_proc(tmp_path / "proc"), heartbeat="")
    [first] = check.run()
    key = first.details["job_key"]
    state = {r: (clock.now, 0) for r in "0123"}
    healthy = run_ranks(check, clock, key, state, 900, dict.fromkeys("0123", 2.0))
    assert healthy.status is Status.OK and "at its own pace, 2 s/step against 2" in healthy.summary
    one = run_ranks(check, clock, key, state, 720, {**dict.fromkeys("012", 2.0), "3": 3.0})
    assert one.status is Status.WARNING
    assert "runs 1.50x slower than its own pace since" in one.summary
    assert "(3 s/step against 2); rank 3 (1.50x) slow, the other 3 ranks here at their own pace; this node shows " \
           "nothing" in one.summary
    values = {(s.name, s.labels.get("rank")): s.value for s in one.samples}
    assert values[("trainguard_rank_step_seconds", "3")] == pytest.approx(3.0)
    assert values[("trainguard_rank_slowdown_ratio", "3")] == pytest.approx(1.5)
    assert values[("trainguard_rank_slowdown_ratio", "0")] == pytest.approx(1.0)
    alike = run_ranks(check, clock, key, state, 720, dict.fromkeys("0123", 3.0))
    assert alike.status is Status.WARNING and "(3 s/step against 2); its 4 ranks here slow alike;" in alike.summary


# CPU co-tenants ----------------------------------------------------------------------------------------------------
def busy_loop(user: str | None = None, cpus: set[int] | None = None, **kw: Any) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(["sh", "-c", "while :; do :; done"], user=user, **kw)
    if cpus is not None:
        os.sched_setaffinity(proc.pid, cpus)
    return proc


def slow_job(tmp_path: Path, marker: str, switch: Path, clock: Clock,
             fake: FakeNvml | None = None) -> tuple[JobPaceCheck, dict[str, float]]:
    """A job found slow by its heartbeat (15 minutes at 2 s/step, 12 at 3), with a fresh process table each run
    (the real /proc: this VM's own pressure may be named too)."""
    check = pace_check(tmp_path, marker, switch, fake or FakeNvml([]), clock, ProcFS(), ProcessSnapshots(max_age=0))
    state = {"t": clock.now, "step": 0.0}
    run_for(check, clock, switch, state, 900, 2.0)
    assert run_for(check, clock, switch, state, 720, 3.0).status is Status.WARNING
    return check, state


def test_another_users_busy_process_on_the_jobs_cpus_is_named_and_one_pinned_elsewhere_is_not(
        tmp_path: Path, trainer: tuple[subprocess.Popen[bytes], str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A real busy loop of the other test user on the job's CPU (0) is named with its share; its twin pinned to
    CPU 1 competes with nobody of the job's and is not. The first also holds 8 GiB on the job's GPU (scripted NVML):
    named there too, with who it is."""
    require_root()
    require(len(os.sched_getaffinity(0)) >= 2, "needs two CPUs")
    ensure_user(OTHER_USER)
    monkeypatch.setitem(CO_TENANT, "cpus", 0.2)  # a loaded 2-CPU VM may give the busy loop less than half a CPU
    proc, marker, switch = trainer
    os.sched_setaffinity(proc.pid, {0})
    clock = Clock()
    clock.now = time.time()
    fake = FakeNvml([FakeGpu("GPU-a", processes=[(proc.pid, 1 << 30)])])
    check, state = slow_job(tmp_path, marker, switch, clock, fake)
    here, elsewhere = busy_loop(OTHER_USER, {0}), busy_loop(OTHER_USER, {1})
    fake.gpus[0].processes.append((here.pid, 8 << 30))
    try:
        def named() -> str | None:
            time.sleep(1.2)  # CPU time is compared between two runs at least a second apart
            summary = run_for(check, clock, switch, state, 30, 3.0).summary
            return summary if f"pid {here.pid} (sh, user {OTHER_USER})" in summary else None
        summary = str(wait_until(named, 30, what="the busy loop named"))
        found = re.search(rf"busy on the job's CPUs: pid {here.pid} \(sh, user {OTHER_USER}\) (\S+) CPUs, (\d+)% of "
                          r"the job's", summary)
        assert found, summary
        # of its 1 CPU; ticks counted over ~1.2 s, the table read between two clock readings: a little over 1 is 1
        assert 0.2 <= float(found.group(1)) <= 1.3 and 20 <= int(found.group(2)) <= 130, summary
        assert f"pid {elsewhere.pid}" not in summary
        assert f"; on this node: GPU 0: another process on it: pid {here.pid} (sh, user {OTHER_USER}) 8.0 GiB, 10% of " \
               "its memory; busy on the job's CPUs: " in summary
    finally:
        for p in (here, elsewhere):
            p.kill()
            p.wait()


def test_the_jobs_own_processes_using_all_its_cpus_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job pinned to CPU 0 whose child (a runaway data loader) spins: the job's own processes use its one CPU."""
    marker = f"pace-loader-{uuid.uuid4().hex}"
    job = subprocess.Popen([sys.executable, "-c", "import os, subprocess, time; os.sched_setaffinity(0, {0}); "
                            "subprocess.Popen(['sh', '-c', 'while :; do :; done']); time.sleep(120)", marker],
                           start_new_session=True)
    monkeypatch.setitem(CO_TENANT, "own", 0.3)  # a loaded 2-CPU VM may give the spinning child less than 0.9 CPU
    try:
        switch = tmp_path / "switch"
        switch.mkdir()
        clock = Clock()
        clock.now = time.time()
        check, state = slow_job(tmp_path, marker, switch, clock)

        def named() -> str | None:
            time.sleep(1.2)
            summary = run_for(check, clock, switch, state, 30, 3.0).summary
            return summary if "the job's own processes use" in summary else None
        summary = str(wait_until(named, 30, what="the job's own CPU use"))
        found = re.search(r"the job's own processes use (\S+) of its 1 CPUs \(busiest: pid (\d+) \(sh, user root\) ",
                          summary)
        assert found, summary
        assert 0.3 <= float(found.group(1)) <= 1.3 and int(found.group(2)) != job.pid, summary
    finally:
        os.killpg(job.pid, 9)
        job.wait()

# End to end -------------------------------------------------------------------------------------------------------
TOY = Path(__file__).resolve().parent.parent / "examples" / "train_toy.py"


def last_step(log: Path) -> int:
    """The last step the toy trainer's log says it ran (0 before its first)."""
    text = log.read_text() if log.exists() else ""
    return max(map(int, re.findall(r"^step (\d+) ", text, re.M)), default=0)


def test_a_real_job_that_slows_down_is_found_by_the_real_agent_and_resolves(tmp_path: Path,
                                                                            agent_process: Any) -> None:
    """The toy trainer's step lines, read by training_log and handed to job_pace in a real agent (windows of seconds):
    steps 2x longer from step 120 to 270 (6 s) fire the finding, the pace coming back resolves it. A reload (SIGHUP: a
    new engine) as the slowdown begins keeps the job's baseline from before it: without it, the new check would learn
    the slow steps as the job's own pace and never fire."""
    log = tmp_path / f"pace-{uuid.uuid4().hex}.log"
    job = subprocess.Popen([sys.executable, str(TOY), "--steps", "100000", "--step-time", "0.05", "--fault", "slow",
                            "--fault-at", "120", "--fault-until", "270", "--slow-factor", "2.0", "--log", str(log),
                            "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "50"],
                           cwd=tmp_path, env={**os.environ, "TRAINGUARD_SWITCH_DIR": str(tmp_path / "switch")})
    try:
        config = tmp_path / "trainguard.toml"
        config.write_text(f"""
[agent]
state_dir = "{tmp_path / 'state'}"
node_name = "node1"
listen = ""
[jobs]
sources = ["process"]
refresh = "0s"
[jobs.processes.trainer]
cmdline = "{log.name}"
user = "root"
logs = ["{log}"]
job_id = "7001"
[checks.training_log]
interval = "1s"
jitter = "0s"
[checks.pace]
type = "job_pace"
interval = "1s"
jitter = "0s"
heartbeat = ""
window = "3s"
slow_for = "5s"
warmup_steps = 5
baseline_steps = 20
flight_recorder = false
[notifiers.console]
""")
        config.chmod(0o600)
        agent = agent_process(config)
        wait_until(lambda: last_step(log) >= 125, 30, what="the slowdown's first steps")
        agent.signal(signal.SIGHUP)
        agent.wait_for("msg=reloaded", timeout=60)
        # the console's line carries the summary; the engine's own line of the event may come before it
        wait_until(lambda: any("event=fired" in x and "summary=" in x for x in agent.output().splitlines()), 60,
                   what="the console's fired line")
        [line] = [x for x in agent.output().splitlines() if "event=fired" in x and "summary=" in x]
        found = re.search(r'summary="process job trainer runs (\d+\.\d\d)x slower than its own pace since \d\d:\d\d '
                          r'\((\S+) s/step against ([0-9.]+)\); (.*)"', line)
        assert found, line
        assert 1.6 <= float(found.group(1)) <= 2.4, line  # steps 2x longer; stamped when read, once a second
        assert float(found.group(3)) < 0.075, line  # 0.05 s/step: the pace from before the slowdown, kept
        # no GPU here; this shared VM's own pressure, steal or I/O wait may be named (it is real)
        assert found.group(4).startswith(("this node shows nothing", "on this node: ")), line
        assert "GPU" not in found.group(4), line
        agent.wait_for("event=resolved", timeout=60)
        # the console's line carries the summary; the engine's own line of the event may come after it
        wait_until(lambda: any("event=resolved" in x and "summary=" in x for x in agent.output().splitlines()), 10,
                   what="the console's resolved line")
        resolved = next(x for x in agent.output().splitlines() if "event=resolved" in x and "summary=" in x)
        assert "at its own pace" in resolved, resolved
    finally:
        job.kill()
        job.wait()


RANK_SERVER = r'''
import json, os, socket, sys
entries = [{"collective_seq_id": i + 1, "pg_id": 0, "process_group": ["0", "default_pg"], "is_p2p": False,
            "profiling_name": "nccl:all_reduce", "state": "completed", "time_created_ns": 10**18 + i * 10**9,
            "time_discovered_started_ns": 10**18 + i * 10**9, "time_discovered_completed_ns": 10**18 + i * 10**9 + 2 * 10**7}
           for i in range(10)]
body = json.dumps({"entries": entries}).encode()
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(os.environ["TORCH_WORKER_SERVER_SOCKET"])
srv.listen(4)
print("serving", flush=True)
while True:
    conn, _ = srv.accept()
    with conn:
        request = conn.recv(4096)
        if b"dump_nccl_trace_json" in request:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        else:  # the CPU recorder of a NCCL job: nothing
            conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
'''


def test_each_local_ranks_collective_wait_ratio_from_its_worker_socket(tmp_path: Path) -> None:
    """A rank serving PyTorch's debug handlers (its worker socket, RANK=17): its NCCL recorder's times give the
    share of its time inside collectives (20 ms a second: it arrives last, the others wait for it)."""
    marker = f"pace-rank-{uuid.uuid4().hex}"
    sock = tmp_path / "worker.sock"
    rank = subprocess.Popen([sys.executable, "-c", RANK_SERVER, marker], stdout=subprocess.PIPE,
                            env={**os.environ, "TORCH_WORKER_SERVER_SOCKET": str(sock), "RANK": "17"})
    try:
        assert rank.stdout is not None and rank.stdout.readline() == b"serving\n"
        clock = Clock()
        clock.now = time.time()
        switch = tmp_path / "switch"
        check = pace_check(tmp_path, marker, switch, FakeNvml([]), clock, ProcFS(), flight_recorder=True)
        [result] = check.run()
        waits = {s.labels["rank"]: s.value for s in result.samples if s.name == "trainguard_rank_collective_wait_ratio"}
        assert waits == {"17": pytest.approx(0.2 / 9.02, abs=0.001)}
        assert result.summary.endswith("pace unknown (no step lines, no heartbeat)")  # the recorder gives no pace
    finally:
        rank.kill()
        rank.wait()
