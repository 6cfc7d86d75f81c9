"""JobPaceCheck: a job that runs slower than itself (fail-slow), and what on this node could make it so.

Each job's pace comes from what the agent already reads: the step lines the training_log check reads in its logs
(per log and rank, handed over through `CheckContext.paces`) and the trainer's heartbeat (its step and the time it
wrote it). `core/pace.py` keeps the job's own baseline (the step-weighted median of its steady step times) and says
when the pace falls below it by `slowdown` for `slow_for`: WARNING, with what this node shows that could cause it
(`gpu/slowdown.py`, `node/pressure.py`), or that it shows nothing (the cause is elsewhere: another node, the network,
the file system). It resolves when the pace comes back. A job with no step lines, no heartbeat and no flight recorder
has no pace: said once in the log and in its result, never guessed.

Each node's agent reports its own evidence for its part of the job (scope "node"); Alertmanager groups a job's alerts
from all its nodes by job_id. Per rank, the flight recorder's collective wait ratio goes to Prometheus, whose rules
(deploy/prometheus) name the rank that waits least: the one that sets the pace.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trainguard.checks.base import CheckContext, CheckSettings, JobCheck
from trainguard.core.budget import Deadline
from trainguard.core.logs import kv
from trainguard.core.model import Metric, Result, Sample, Status
from trainguard.core.pace import Pace, PaceSettings, Verdict
from trainguard.core.settings import Duration, Field
from trainguard.gpu.nvml import SLOWDOWN_REASONS, Clocks, GpuState, NvmlUnavailableError, PcieLink
from trainguard.gpu.slowdown import GpuEvidence, gpu_evidence
from trainguard.jobs.model import Job
from trainguard.jobs.tree import HEARTBEAT, flight_traces, heartbeat_path, job_pids, job_processes, read_beat
from trainguard.logscan.context import pick_gpu, visible_devices
from trainguard.node.pressure import HostSample, host_evidence, host_sample

log = logging.getLogger("trainguard.checks.job_pace")

BEAT = "heartbeat"
STEP = Metric("trainguard_job_step_seconds", "A job's step time now (step-weighted median over the recent window).",
              ("job_id",))
BASELINE = Metric("trainguard_job_step_baseline_seconds", "A job's own steady step time (its baseline).", ("job_id",))
SLOWDOWN = Metric("trainguard_job_slowdown_ratio", "A job's step time now over its baseline (1: its own pace).",
                  ("job_id",))
WAIT = Metric("trainguard_rank_collective_wait_ratio", "The share of a rank's recent time inside collectives, from "
              "its flight recorder: the rank that sets a job's pace waits least.", ("job_id", "rank"))
CLOCK = Metric("trainguard_job_gpu_clock_ratio", "SM clock over its maximum of each GPU of a job on this node.",
               ("job_id", "gpu"))
REASON = Metric("trainguard_job_gpu_slowdown", "1 while a GPU of a job on this node is held back for this reason "
                "(NVML clock-event reasons).", ("job_id", "gpu", "reason"))
HOST = Metric("trainguard_job_host_pressure", "This node's pressure where a job runs: PSI some avg60 of cpu, io and "
              "memory, CPU steal and iowait shares (ratios), swap-ins a second.", ("job_id", "resource"))
MAX_SERIES_PER_JOB = 16


class JobPaceSettings(CheckSettings):
    interval: Duration = Field(30.0, gt=0)
    slowdown: float = Field(0.15, gt=0, lt=1, description="The job is slow when its pace (steps a second) falls "
                            "below its own baseline by this fraction: 0.15 is a step time 1.18x the baseline's.")
    slow_for: Duration = Field(600.0, gt=0, description="How long it must stay slow before the finding (WARNING).")
    window: Duration = Field(120.0, gt=0, description="The recent pace is the median step time over this window.")
    warmup_steps: int = Field(20, ge=0, description="Steps of each start (and restart) left out of the baseline.")
    baseline_steps: int = Field(30, ge=1, description="Steps the baseline needs before a finding can be made.")
    heartbeat: str = Field(HEARTBEAT, description="The trainer's heartbeat file (templates as hang); empty: none.")
    flight_recorder: bool = Field(True, description="Read the ranks' flight recorders (worker sockets) for each "
                                                    "rank's collective wait ratio.")
    flight_recorder_interval: Duration = Field(300.0, gt=0, description="At most one flight-recorder read per job "
                                               "in this time (a read costs the ranks a dump).")
    critical_when_pinned: bool = Field(False, description="A slowdown this node's GPUs explain (a clock-event reason, "
                                       "a degraded link, ECC, a co-tenant) is CRITICAL here, so that `critical` "
                                       "actions (drain, restart with leave_node) run only on the node at fault; "
                                       "every node of a slow job sees the slowdown (docs/slow-jobs.md).")


@dataclass
class JobPace:
    """One job's series (`path|rank` of its logs, `heartbeat`) and what was said of it."""

    series: dict[str, Pace]
    unknown_said: bool = False
    flight_at: float = float("-inf")
    waits: dict[str, float] | None = None
    trainer_step_time: float | None = None  # the trainer's own last measure (heartbeat `step_time`)


def lead(paces: dict[str, Pace], settings: PaceSettings, now: float) -> tuple[str, Verdict] | None:
    """The series the job's pace is told from: the heartbeat when it has a baseline, else the series whose baseline
    covers the most steps; None while none has a pace."""
    verdicts = {name: p.evaluate(now, settings) for name, p in paces.items()}
    known = [n for n, v in verdicts.items() if v.baseline is not None]
    if not known:
        return next(((n, v) for n, v in verdicts.items() if v.pace is not None), None)
    name = BEAT if BEAT in known else max(known, key=lambda n: sum(w for _, w in paces[n].pool))
    return name, verdicts[name]


def clock_time(when: float) -> str:
    return time.strftime("%H:%M", time.localtime(when))


def summarize(label: str, verdict: Verdict, settings: PaceSettings, now: float, evidence: Sequence[str],
              pinned: Status = Status.WARNING) -> tuple[Status, str]:
    """The job's status and summary from its verdict and this node's evidence (`pinned`: the status when the
    evidence is this node's GPUs', listed first)."""
    if verdict.pace is None:
        return Status.OK, f"{label}: no steady steps yet"
    if verdict.baseline is None or verdict.ratio is None:
        return Status.OK, f"{label}: {verdict.pace:.3g} s/step; its baseline is not known yet"
    pace = f"{verdict.pace:.3g} s/step against {verdict.baseline:.3g}"
    if not verdict.slow(now, settings):
        note = " (slower since " + clock_time(verdict.slow_since) + ")" if verdict.slow_since is not None else ""
        return Status.OK, f"{label}: at its own pace, {pace}{note}"
    where = ("; on this node: " + "; ".join(evidence)) if evidence else \
        "; this node shows nothing that would slow it: the cause is elsewhere (another node, the network, storage)"
    status = pinned if evidence and evidence[0].startswith("GPU ") else Status.WARNING
    since = clock_time(verdict.slow_since if verdict.slow_since is not None else now)
    return status, f"{label} runs {verdict.ratio:.2f}x slower than its own pace since {since} ({pace}){where}"


class JobPaceCheck(JobCheck):
    Settings = JobPaceSettings
    metrics = (STEP, BASELINE, SLOWDOWN, WAIT, CLOCK, REASON, HOST)
    settings: JobPaceSettings

    def __init__(self, name: str, settings: CheckSettings, context: CheckContext) -> None:
        super().__init__(name, settings, context)
        s = self.settings
        self.pace = PaceSettings(s.slowdown, s.slow_for, s.window, s.warmup_steps, s.baseline_steps)
        self._jobs: dict[str, JobPace] = {}
        self._host: HostSample | None = None
        self._replays: dict[int, int] = {}  # GPU index -> PCIe replay count at the last look

    def run(self) -> Sequence[Result]:
        view = self.view()
        results = self.source_errors(view)
        jobs = [job for job in view.jobs if job.on_this_node and job.running]
        self._jobs = {key: state for key, state in self._jobs.items() if key in {job.key for job in jobs}}
        if not jobs:  # an idle node costs the view only
            self._host = None  # the CPU shares are taken between two runs with a job, never across an idle stretch
            return results
        now = self.context.clock()
        before, host = self._host, host_sample(self.context.proc, now)
        self._host = host
        said, gauges = host_evidence(before, host)
        gpus = self._gpus()
        for job, deadline in self.budgets(jobs):  # a rank's flight recorder answers within its job's share
            results.append(self._job(job, now, said, gauges, gpus, deadline))
        return results

    def _gpus(self) -> dict[int, tuple[GpuState, Clocks | None, PcieLink | None]]:
        """The node's GPUs with their clocks and PCIe links; {} without NVML (a CPU-only node: host evidence only)."""
        nvml = self.context.nvml
        try:
            states = nvml.gpus()
            clocks = {r.gpu.index: r.value for r in nvml.clocks()}
            links = {r.gpu.index: r.value for r in nvml.pcie()}
        except NvmlUnavailableError:
            return {}
        return {g.index: (g, clocks.get(g.index), links.get(g.index)) for g in states if not g.lost}

    def _job(self, job: Job, now: float, host_said: list[str], host: dict[str, float],
             gpus: dict[int, tuple[GpuState, Clocks | None, PcieLink | None]], deadline: Deadline) -> Result:
        state = self._jobs.setdefault(job.key, JobPace({}))
        self._feed(job, state)
        label, job_id = job.label(), job.job_id or job.name
        self._flight(job, state, now, deadline)
        found = lead(state.series, self.pace, now)
        samples: list[Sample] = [HOST(v, {"job_id": job_id, "resource": r}) for r, v in sorted(host.items())]
        samples += [WAIT(w, {"job_id": job_id, "rank": r}) for r, w in sorted((state.waits or {}).items())]
        evidence = self._evidence(job, job_id, gpus, samples)
        details: dict[str, Any] = {"job_key": job.key, "job_id": job.job_id, "name": job.name}
        if found is None:
            if not state.unknown_said and not state.series:
                state.unknown_said = True
                log.info("a job's pace is unknown: no step lines, no heartbeat, no flight recorder",
                         extra=kv(check=self.name, job=job.key))
            details["pace"] = "unknown"
            what = "no step lines read yet" if state.series else "no step lines, no heartbeat"
            return self.result(job.key, Status.OK, f"{label}: pace unknown ({what})", details, samples)
        series, verdict = found
        pinned = Status.CRITICAL if self.settings.critical_when_pinned else Status.WARNING
        status, summary = summarize(label, verdict, self.pace, now, [*evidence, *host_said], pinned)
        for metric, value in ((STEP, verdict.pace), (BASELINE, verdict.baseline), (SLOWDOWN, verdict.ratio)):
            if value is not None:
                samples.append(metric(value, {"job_id": job_id}))
        details.update(series=series, step_seconds=verdict.pace, baseline_seconds=verdict.baseline,
                       ratio=verdict.ratio, slow_since=verdict.slow_since, evidence=[*evidence, *host_said],
                       restarts=state.series[series].restarts, collective_wait=state.waits,
                       trainer_step_time=state.trainer_step_time)
        return self.result(job.key, status, summary, details, samples)

    def _feed(self, job: Job, state: JobPace) -> None:
        """The job's new samples: its log lines' (from training_log) and its heartbeat."""
        for series, marks in self.context.paces.take(job.key).items():
            self._add(state, series, marks)
        beat_path = heartbeat_path(job, self.settings.heartbeat)
        beat = read_beat(beat_path, self.identity(job)) if beat_path else None
        if beat is not None and (not job.start_time or beat.time >= job.start_time - 2.0):  # not an earlier life's
            self._add(state, BEAT, [(beat.step, beat.time)])
            state.trainer_step_time = beat.step_time

    def _add(self, state: JobPace, series: str, marks: list[tuple[int, float]]) -> None:
        pace = state.series.get(series)
        if pace is None:
            if len(state.series) >= MAX_SERIES_PER_JOB:
                return
            pace = state.series[series] = Pace()
        for step, when in marks:
            pace.add(step, when, self.pace)

    def _flight(self, job: Job, state: JobPace, now: float, deadline: Deadline) -> None:
        """Each local rank's collective wait ratio, read at most every `flight_recorder_interval`, within the job's
        share of the run (5 s at most)."""
        if not self.settings.flight_recorder or now - state.flight_at < self.settings.flight_recorder_interval:
            return
        state.flight_at = now
        timeout = min(5.0, deadline.left())
        if timeout <= 0:
            return
        traces = flight_traces(job, job_processes(job, self.context.processes.get()), "", self.context.node, timeout,
                               self.context.proc)
        state.waits = {str(t.rank): t.wait_ratio for t in traces if t.wait_ratio is not None}

    def _evidence(self, job: Job, job_id: str, gpus: dict[int, tuple[GpuState, Clocks | None, PcieLink | None]],
                  samples: list[Sample]) -> list[str]:
        """What this node's GPUs of the job show (in words), their gauges added to `samples`."""
        pids = set(job_pids(job, self.context.processes.get()))
        mine = self._job_gpus(pids, gpus)
        said = []
        for index in mine:
            gpu, clocks, link = gpus[index]
            replays = link.replays if link is not None else None
            grew = max(0, replays - self._replays.get(index, replays)) if replays is not None else 0
            if replays is not None:
                self._replays[index] = replays
            others = [p.pid for p in gpu.processes or () if p.pid not in pids]
            found: GpuEvidence = gpu_evidence(index, clocks, link, gpu, grew, others)
            labels = {"job_id": job_id, "gpu": str(index)}
            if found.clock_ratio is not None:
                samples.append(CLOCK(found.clock_ratio, labels))
            if clocks is not None and clocks.reasons is not None:
                samples += [REASON(float(r in found.reasons), {**labels, "reason": r})
                            for r in SLOWDOWN_REASONS.values()]
            if found.said:
                said.append(found.describe())
        return said

    def _job_gpus(self, pids: set[int], gpus: dict[int, tuple[GpuState, Clocks | None, PcieLink | None]]) -> list[int]:
        """The GPUs the job's processes hold, else those CUDA_VISIBLE_DEVICES names, else every GPU (a node given to
        one job)."""
        held = [i for i, (g, _, _) in gpus.items() if any(p.pid in pids for p in g.processes or ())]
        if held:
            return sorted(held)
        visible = visible_devices(sorted(pids), self.context.proc)
        states = [g for g, _, _ in gpus.values()]
        named = {g.index for o in range(len(visible or ())) if (g := pick_gpu(states, o, pids, visible)) is not None}
        return sorted(named) if named else sorted(gpus)
