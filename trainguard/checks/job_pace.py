"""JobPaceCheck: a job that runs slower than itself (fail-slow), and what on this node could make it so.

Each job's pace comes from what the agent already reads: the step lines the training_log check reads in its logs
(per log and rank, handed over through `CheckContext.paces`) and the trainer's heartbeat (its step and the time it
wrote it). `core/pace.py` keeps the job's own baseline (the step-weighted median of its steady step times) and says
when the pace falls below it by `slowdown` for `slow_for`: WARNING, with what this node shows that could cause it
(`gpu/slowdown.py`, `node/pressure.py`), or that it shows nothing (the cause is elsewhere: another node, the network,
the file system). It resolves when the pace comes back. A job with no step lines, no heartbeat and no flight recorder
has no pace: said once in the log and in its result, never guessed.

Each job's series (their baseline pools, recent intervals and slow-since times) are saved in the check's state and
restored by the next instance: a restart or a `systemctl reload` (a new engine) during a slowdown keeps the baseline
from before it and the time it began. Saved when a slowdown starts or ends and when jobs or series come or go, else
every SAVE_EVERY, and at stop; only for the jobs running here (the others are dropped at the next run).

Each node's agent reports its own evidence for its part of the job (scope "node"); Alertmanager groups a job's alerts
from all its nodes by job_id. Per rank, the flight recorder's collective wait ratio goes to Prometheus, whose rules
(deploy/prometheus) name the rank that waits least: the one that sets the pace.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from trainguard.checks.base import CheckContext, CheckSettings, JobCheck
from trainguard.core.budget import Deadline
from trainguard.core.logs import kv
from trainguard.core.model import Metric, Result, Sample, Status
from trainguard.core.pace import Pace, PaceSettings, Verdict
from trainguard.core.settings import Duration, Field
from trainguard.core.text import one_line
from trainguard.gpu.nvml import Clocks, GpuState, NvmlUnavailableError, PcieLink
from trainguard.gpu.slowdown import MAX_OTHERS, GpuEvidence, co_tenant, gpu_evidence
from trainguard.jobs.model import Job
from trainguard.jobs.tree import HEARTBEAT, flight_traces, heartbeat_path, job_pids, job_processes, read_beat
from trainguard.logscan.context import pick_gpu, visible_devices
from trainguard.node.pressure import HostSample, busy_on_job_cpus, cpu_use, host_evidence, host_sample, user_name
from trainguard.node.proctable import ProcessTable

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
                "(NVML clock-event reasons); absent otherwise.", ("job_id", "gpu", "reason"))
HOST = Metric("trainguard_job_host_pressure", "This node's pressure where a job runs: PSI some avg60 of cpu, io and "
              "memory, CPU steal and iowait shares (ratios), swap-ins a second.", ("job_id", "resource"))
RANK_STEP = Metric("trainguard_rank_step_seconds", "A rank's step time now, where its log lines name it "
                   "(`[rankN]:`, srun --label's `N: `): at most 16 ranks a job on this node.", ("job_id", "rank"))
RANK_SLOWDOWN = Metric("trainguard_rank_slowdown_ratio", "A rank's step time now over its own baseline.",
                       ("job_id", "rank"))
EVIDENCE = Metric("trainguard_job_node_evidence", "How many things this node shows that could slow a job (its GPUs', "
                  "links', CPUs' and host's; busy CPUs only while the job is slow): 0, the cause is elsewhere.",
                  ("job_id",))
MAX_SERIES_PER_JOB = 16  # also what bounds the ranks a job exports here
STATE_KEY = "job-paces"
STATE_VERSION = 1  # another version's saved paces are ignored (the baselines start over)
SAVE_EVERY = 300.0  # s: the pools grow a few intervals a run; losing minutes of them costs a baseline nothing
STOP_WAIT = 2.0  # s stop() waits for a run still under way to save what it holds (else the last save stands)
MAX_RANKS_NAMED = 3


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
class Node:
    """What this node shows in one run, for every job: the host's suspects in words and its gauges, the GPUs with
    their clocks and links, the process snapshot and the last run's."""

    said: list[str]
    host: dict[str, float]
    gpus: dict[int, tuple[GpuState, Clocks | None, PcieLink | None]]
    table: ProcessTable
    before: ProcessTable | None
    jobs: int  # running on this node

    @cached_property
    def cpu_use(self) -> dict[int, float]:
        """Each process's CPU use since the last run: one pass over the table, only in a run where a job is slow."""
        return cpu_use(self.before, self.table)

    def command(self, pid: int) -> str:
        info = self.table.procs.get(pid)
        return one_line(info.comm, 32) if info is not None else "?"


@dataclass
class JobPace:
    """One job's series (`path|rank` of its logs, `heartbeat`) and what was said of it."""

    series: dict[str, Pace]
    unknown_said: bool = False
    flight_at: float = float("-inf")
    waits: dict[str, float] | None = None
    trainer_step_time: float | None = None  # the trainer's own last measure (heartbeat `step_time`)


def lead(paces: dict[str, Pace], verdicts: dict[str, Verdict], settings: PaceSettings,
         now: float) -> tuple[str, Verdict] | None:
    """The series the job's pace is told from: the heartbeat when it has a baseline, else the series whose baseline
    covers the most steps; but a series slow for `slow_for` while that one is not (ranks that do not wait for each
    other: one of them is slow), the slowest such; None while none has a pace."""
    known = [n for n, v in verdicts.items() if v.baseline is not None]
    if not known:
        return next(((n, v) for n, v in verdicts.items() if v.pace is not None), None)
    name = BEAT if BEAT in known else max(known, key=lambda n: sum(w for _, w in paces[n].pool))
    slow = [n for n in known if verdicts[n].slow(now, settings)]
    if slow and not verdicts[name].slow(now, settings):
        name = max(slow, key=lambda n: verdicts[n].ratio or 0.0)
    return name, verdicts[name]


def rank_of(series: str) -> str | None:
    """The rank a log series (`path|rank`) is of; None for the heartbeat and lines that name no rank."""
    _, bar, rank = series.rpartition("|")
    return rank if bar and rank else None


def by_rank(verdicts: dict[str, Verdict]) -> dict[str, Verdict]:
    """Each rank's verdict (its series with a pace; where two logs carry one rank, the first by name)."""
    ranks: dict[str, Verdict] = {}
    for series in sorted(verdicts):
        rank = rank_of(series)
        if rank is not None and verdicts[series].pace is not None:
            ranks.setdefault(rank, verdicts[series])
    return ranks


def rank_note(ranks: dict[str, Verdict], settings: PaceSettings, now: float) -> str:
    """Which of the job's ranks here are slow when they are not all slow: the slow rank named; all slow alike (the
    synchronous case, each rank's steps wait for the slowest: Prometheus names it from the flight recorder)."""
    known = {r: v for r, v in ranks.items() if v.ratio is not None}
    slow = sorted((r for r, v in known.items() if v.slow(now, settings)), key=lambda r: -(known[r].ratio or 0.0))
    if not slow or len(known) < 2:
        return ""
    if len(slow) == len(known):
        return f"; its {len(known)} ranks here slow alike"
    named = ", ".join(f"{r} ({known[r].ratio or 0.0:.2f}x)" for r in slow[:MAX_RANKS_NAMED])
    others = len(known) - len(slow)
    return (f"; rank{'s' if len(slow) > 1 else ''} {named} slow, the other {others} rank{'s' if others > 1 else ''} "
            "here at their own pace")


def clock_time(when: float) -> str:
    return time.strftime("%H:%M", time.localtime(when))


def summarize(label: str, verdict: Verdict, settings: PaceSettings, now: float, evidence: Sequence[str],
              pinned: Status = Status.WARNING, ranks: str = "") -> tuple[Status, str]:
    """The job's status and summary from its verdict and this node's evidence (`pinned`: the status when the
    evidence is this node's GPUs', listed first; `ranks`: `rank_note`)."""
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
    return status, f"{label} runs {verdict.ratio:.2f}x slower than its own pace since {since} ({pace}){ranks}{where}"


def gauges(job_id: str, host: dict[str, float], waits: dict[str, float] | None,
           ranks: dict[str, Verdict]) -> list[Sample]:
    """A job's gauges but its own pace's: the host's pressure, each local rank's collective wait and pace."""
    samples = [HOST(v, {"job_id": job_id, "resource": r}) for r, v in sorted(host.items())]
    samples += [WAIT(w, {"job_id": job_id, "rank": r}) for r, w in sorted((waits or {}).items())]
    return samples + [m(x, {"job_id": job_id, "rank": r}) for r, v in sorted(ranks.items())
                      for m, x in ((RANK_STEP, v.pace), (RANK_SLOWDOWN, v.ratio)) if x is not None]


class JobPaceCheck(JobCheck):
    Settings = JobPaceSettings
    metrics = (STEP, BASELINE, SLOWDOWN, RANK_STEP, RANK_SLOWDOWN, WAIT, CLOCK, REASON, HOST, EVIDENCE)
    settings: JobPaceSettings

    def __init__(self, name: str, settings: CheckSettings, context: CheckContext) -> None:
        super().__init__(name, settings, context)
        s = self.settings
        self.pace = PaceSettings(s.slowdown, s.slow_for, s.window, s.warmup_steps, s.baseline_steps)
        self._lock = threading.Lock()  # a run's job paces and stop()'s save of them
        self._jobs: dict[str, JobPace] = self._restore()
        self._saved: tuple[dict[tuple[str, str], float | None], float] = (self._marks(), self.context.clock())
        self._host: HostSample | None = None
        self._table: ProcessTable | None = None  # the process snapshot of the last run: CPU use is between two
        self._replays: dict[int, int] = {}  # GPU index -> PCIe replay count at the last look

    def run(self) -> Sequence[Result]:
        view = self.view()
        results = self.source_errors(view)
        jobs = [job for job in view.jobs if job.on_this_node and job.running]
        with self._lock:
            self._jobs = {key: state for key, state in self._jobs.items() if key in {job.key for job in jobs}}
            now = self.context.clock()
            if jobs:
                results += self._runs(jobs, now)
            else:  # an idle node costs the view only
                self._host = self._table = None  # CPU shares are between two runs with a job, never across idleness
            self._save(now)
        return results

    def stop(self) -> None:
        """A reload or a shutdown: what the last runs added is saved, unless a run still holds it (the engine does not
        wait for one): then the last save stands."""
        if self._lock.acquire(timeout=STOP_WAIT):
            try:
                self._save(self.context.clock(), force=True)
            finally:
                self._lock.release()

    def _restore(self) -> dict[str, JobPace]:
        """The job paces this check saved in its last life (another process, or the engine before a reload); {} when
        none, or with one log line when they can't be read (damaged, another version's): the baselines start over."""
        raw = self.context.state.get(STATE_KEY)
        if not raw:
            return {}
        try:
            data = json.loads(raw)
            if data.get("v") != STATE_VERSION:
                raise ValueError(f"version {data.get('v')!r}, not {STATE_VERSION}")
            return {str(key): JobPace({str(name): Pace.from_json(saved)
                                       for name, saved in list(series.items())[:MAX_SERIES_PER_JOB]})
                    for key, series in data["jobs"].items()}
        except (ValueError, TypeError, KeyError, AttributeError, IndexError) as exc:
            log.warning("saved job paces ignored; their baselines start over",
                        extra=kv(check=self.name, error=one_line(str(exc), 200)))
            return {}

    def _marks(self) -> dict[tuple[str, str], float | None]:
        """Each series' slow-since time: a change of these (a slowdown begins or ends, a job or series comes or
        goes) is saved at once."""
        return {(key, name): p.slow_since for key, state in self._jobs.items() for name, p in state.series.items()}

    def _save(self, now: float, force: bool = False) -> None:
        marks = self._marks()
        if not force and marks == self._saved[0] and now - self._saved[1] < SAVE_EVERY:
            return
        data = {"v": STATE_VERSION, "jobs": {key: {name: p.to_json() for name, p in state.series.items()}
                                             for key, state in self._jobs.items()}}
        if self.save_state(STATE_KEY, data):  # a failed save is tried again at the next run
            self._saved = (marks, now)

    def _runs(self, jobs: list[Job], now: float) -> list[Result]:
        """The results of this node's running jobs."""
        before, host = self._host, host_sample(self.context.proc, now)
        self._host = host
        said, gauges = host_evidence(before, host)
        table = self.context.processes.get()
        node = Node(said, gauges, self._gpus(), table, self._table, len(jobs))
        self._table = table
        # a rank's flight recorder answers within its job's share
        return [self._job(job, now, node, deadline) for job, deadline in self.budgets(jobs)]

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

    def _job(self, job: Job, now: float, node: Node, deadline: Deadline) -> Result:
        state = self._jobs.setdefault(job.key, JobPace({}))
        self._feed(job, state)
        label, job_id = job.label(), job.job_id or job.name
        self._flight(job, state, now, deadline)
        verdicts = {name: p.evaluate(now, self.pace) for name, p in state.series.items()}
        found = lead(state.series, verdicts, self.pace, now)
        ranks = by_rank(verdicts)
        samples = gauges(job_id, node.host, state.waits, ranks)
        pids = job_pids(job, node.table)
        evidence = self._evidence(job_id, pids, node, samples)
        if found is not None and found[1].slow_since is not None:  # the CPUs are looked at only for a slow job
            evidence += busy_on_job_cpus(node.cpu_use, node.table, pids, self.context.proc,
                                         self.context.user_names)
        evidence += node.said
        samples.append(EVIDENCE(float(len(evidence)), {"job_id": job_id}))
        details: dict[str, Any] = {"job_key": job.key, "job_id": job.job_id, "name": job.name}
        if found is None:
            return self._unknown(job, state, details, samples)
        series, verdict = found
        pinned = Status.CRITICAL if self.settings.critical_when_pinned else Status.WARNING
        status, summary = summarize(label, verdict, self.pace, now, evidence, pinned, rank_note(ranks, self.pace, now))
        for metric, value in ((STEP, verdict.pace), (BASELINE, verdict.baseline), (SLOWDOWN, verdict.ratio)):
            if value is not None:
                samples.append(metric(value, {"job_id": job_id}))
        details.update(series=series, step_seconds=verdict.pace, baseline_seconds=verdict.baseline,
                       ratio=verdict.ratio, slow_since=verdict.slow_since, evidence=evidence,
                       rank_ratios={r: v.ratio for r, v in ranks.items() if v.ratio is not None},
                       restarts=state.series[series].restarts, collective_wait=state.waits,
                       trainer_step_time=state.trainer_step_time)
        return self.result(job.key, status, summary, details, samples)

    def _unknown(self, job: Job, state: JobPace, details: dict[str, Any], samples: list[Sample]) -> Result:
        """A job without a pace: said once in the log (when nothing at all gives one), and in its result."""
        if not state.unknown_said and not state.series:
            state.unknown_said = True
            log.info("a job's pace is unknown: no step lines, no heartbeat, no flight recorder",
                     extra=kv(check=self.name, job=job.key))
        details["pace"] = "unknown"
        what = "no step lines read yet" if state.series else "no step lines, no heartbeat"
        return self.result(job.key, Status.OK, f"{job.label()}: pace unknown ({what})", details, samples)

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

    def _evidence(self, job_id: str, job: Sequence[int], node: Node, samples: list[Sample]) -> list[str]:
        """What this node's GPUs of the job (its processes `job`) show (in words), their gauges added to `samples`."""
        pids, gpus = set(job), node.gpus
        said = []
        for index in self._job_gpus(pids, gpus, node.jobs == 1):
            gpu, clocks, link = gpus[index]
            replays = link.replays if link is not None else None
            grew = max(0, replays - self._replays.get(index, replays)) if replays is not None else 0
            if replays is not None:
                self._replays[index] = replays
            others = [p for p in gpu.processes or () if p.pid not in pids]
            named = [co_tenant(p.pid, node.command(p.pid), user_name(self.context.proc, p.pid, self.context.user_names),
                               p.used, gpu.memory_total) for p in others[:MAX_OTHERS]]
            found: GpuEvidence = gpu_evidence(index, clocks, link, gpu, grew, named, len(others))
            labels = {"job_id": job_id, "gpu": str(index)}
            if found.clock_ratio is not None:
                samples.append(CLOCK(found.clock_ratio, labels))
            # only the reasons active now: 5 zeros a GPU and job were most of a node's /metrics (docs/benchmarks.md)
            samples += [REASON(1.0, {**labels, "reason": r}) for r in found.reasons]
            if found.said:
                said.append(found.describe())
        return said

    def _job_gpus(self, pids: set[int], gpus: dict[int, tuple[GpuState, Clocks | None, PcieLink | None]],
                  alone: bool) -> list[int]:
        """The GPUs the job's processes hold, else those CUDA_VISIBLE_DEVICES names, else every GPU when the job is
        `alone` on this node (a node given to one job); else none (which of the node's jobs a GPU is can't be told)."""
        held = [i for i, (g, _, _) in gpus.items() if any(p.pid in pids for p in g.processes or ())]
        if held:
            return sorted(held)
        visible = visible_devices(sorted(pids), self.context.proc)
        states = [g for g, _, _ in gpus.values()]
        named = {g.index for o in range(len(visible or ())) if (g := pick_gpu(states, o, pids, visible)) is not None}
        return sorted(named) if named else sorted(gpus) if alone else []
