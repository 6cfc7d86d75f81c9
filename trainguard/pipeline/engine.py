"""The engine: schedules every check, feeds results to incidents, and keeps the snapshot that
/metrics and /status read (they never do I/O themselves)."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from trainguard.actions.base import ResumeGate
from trainguard.checks.base import ActionBinding, Check, CheckContext, CheckSettings
from trainguard.core.events import Event, EventKind
from trainguard.core.logs import kv
from trainguard.core.model import Result, Status
from trainguard.core.pace import PaceLedger
from trainguard.core.state import ScopedState
from trainguard.core.worker import Worker
from trainguard.gpu.faults import XidLedger
from trainguard.gpu.nvml import Nvml
from trainguard.jobs.catalog import JobCatalog
from trainguard.node.kmsg import KernelLog
from trainguard.node.procfs import ProcFS, own_usage
from trainguard.node.proctable import ProcessSnapshots
from trainguard.notifiers.base import Notifier
from trainguard.pipeline.config import Config
from trainguard.pipeline.dispatch import Dispatcher
from trainguard.pipeline.incidents import Incident, IncidentPolicy, IncidentTracker, Operator, Silence
from trainguard.pipeline.ledger import Ledger
from trainguard.pipeline.lemon import NAME as LEMON_NAME
from trainguard.pipeline.lemon import HoldGate, LemonCheck
from trainguard.pipeline.responder import Responder
from trainguard.pipeline.runner import CheckRunner, RunReport
from trainguard.pipeline.schedule import LATE_EVERY_S, TICK_S, Schedule
from trainguard.pipeline.selfcheck import NAME as SELF_NAME
from trainguard.pipeline.selfcheck import AgentCheck
from trainguard.pipeline.selftest import SelfTest, remove_leftovers
from trainguard.pipeline.store import Store
from trainguard.registry import DEFAULT_REGISTRY, Registry

log = logging.getLogger("trainguard.engine")

# The queue lengths and the agent's own usage the tick also reads are shown on a 15 s scrape: read every 5 s, not at
# the ticks that come sooner for a run's deadline (trainguard.pipeline.schedule). The ticks are TICK_S apart, give
# or take a scheduling delay: half a second of slack keeps a tick from missing its turn by a microsecond.
USAGE_EVERY_S = 5.0
USAGE_SLACK_S = 0.5
# The unit's TimeoutStopSec is 15 s: the daemon's servers and the actions under way share 10 of them; the rest of
# shutdown (the kernel log reader's stop and the channels' last deliveries, 2 s at most each; the store's
# checkpoint) has the remainder before systemd's SIGKILL.
ACTIONS_GRACE_S = 10.0


class OperatorError(Exception):
    """An operator command that can't be done as asked; the message says why."""


class BrokenCheck(Check):
    """Stands in for a check whose constructor failed, so the failure shows up as data."""

    def __init__(self, name: str, settings: CheckSettings, context: CheckContext, error: str) -> None:
        super().__init__(name, settings, context)
        self.error = error

    def run(self) -> Sequence[Result]:
        return [self.result(self.name, Status.UNKNOWN, f"check could not start: {self.error}")]


@dataclass
class CheckState:
    kind: str
    interval: float
    last: RunReport | None = None
    runs: int = 0
    timeouts: int = 0
    errors: int = 0
    skipped: int = 0
    idle: int = 0
    seq: int = 0  # the runner's number of the latest run ingested (RunReport.seq)


@dataclass(frozen=True)
class Snapshot:
    node: str
    started: float
    checks: Mapping[str, CheckState]
    firing: Mapping[Status, int]
    outbox: Mapping[str, tuple[int, float | None]]
    delivery: Mapping[str, tuple[int, int, int]]  # sent, failed, dropped
    agent: Mapping[str, float] = field(default_factory=dict)
    incidents: tuple[Incident, ...] = ()
    silences: tuple[Silence, ...] = ()
    not_routed: Mapping[str, Mapping[str, int]] = field(default_factory=dict)  # channel -> routing rule -> events


class Engine:
    def __init__(
        self,
        config: Config,
        registry: Registry = DEFAULT_REGISTRY,
        *,
        store: Store | None = None,
        notifiers: Mapping[str, Notifier] | None = None,
        clock: Callable[[], float] = time.time,
        nvml: Nvml | None = None,
        self_check: bool = False,
        kernel_since_usec: int | None = None,
        ledger: bool = False,
        resume_gates: Sequence[ResumeGate] = (),
    ) -> None:
        """`ledger`: keep the node ledger and apply the lemon policy (the daemon); `resume_gates`: what the `resume`
        action asks after the lemon hold (a repair's validation)."""
        self.config = config
        self.clock = clock
        self.node = config.agent.node_name
        jobs = config.jobs
        proc = ProcFS()
        processes = ProcessSnapshots(proc)
        self.catalog = JobCatalog(jobs, self.node, clock, processes) if jobs.sources or jobs.processes else None
        self.store = store if store is not None else Store(config.agent.state_dir)
        # One of each per agent, shared by every check: one NVML session, one ledger of this boot's XIDs, one /proc
        # snapshot per round, one ledger of the jobs' step samples.
        shared = CheckContext(config.agent.node_name, config.agent.state_dir, clock, self.catalog,
                              nvml if nvml is not None else Nvml(), proc, xid_history=XidLedger(self.store, clock, proc=proc),
                              processes=processes, kernel_since_usec=kernel_since_usec, kernel_log=KernelLog(proc),
                              paces=PaceLedger())
        self.shared = shared  # what a transient check (`trainguard selftest`'s) is built with
        self.checks: dict[str, Check] = {}
        for name, settings in config.checks.items():
            if settings.enabled:
                context = replace(shared, state=ScopedState(self.store, f"check/{name}", legacy=self.store))
                self.checks[name] = self._build_check(registry, config.kind_of_check(name), name, settings, context)
        if self_check:  # the daemon watches its own health: its state on disk, that its config watches something,
            # and actions that refused to act (the responder is built below, with the checks)
            refused = lambda: self.responder.refused()  # noqa: E731, PLW0108
            self.checks[SELF_NAME] = AgentCheck(shared, self.store, config.warnings(), refused=refused,
                                                usage=self.own_usage)
        self.ledger = self._with_ledger(shared) if ledger else None
        gates = ([HoldGate(self.ledger)] if self.ledger else []) + list(resume_gates)
        self.runners = {name: CheckRunner(check, clock, self._wake_at) for name, check in self.checks.items()}
        self._states = {name: CheckState(config.kind_of_check(name) if name in config.checks else name,
                                         c.settings.interval) for name, c in self.checks.items()}
        if notifiers is None:
            notifiers = {name: registry.notifier_class(config.kind_of_notifier(name))(name, s)
                         for name, s in config.notifiers.items() if s.enabled}
        self.notifiers = dict(notifiers)
        self.tracker = IncidentTracker(self.store, self.node, clock)
        self.dispatcher = Dispatcher(self.store, self.notifiers, clock, annotator=self._actions_taken)
        self.responder = Responder(config, registry, self.catalog, self.tracker, clock, forget=self._forget,
                                   state=self.store, ledger=self.ledger, resume_gates=gates)
        self.stop_event = threading.Event()
        self._lock = threading.Lock()
        self._started = clock()
        self._last_tick = time.monotonic()
        self._outbox: dict[str, tuple[int, float | None]] = {}
        self._agent: dict[str, float] = {}
        self._usage_at = -math.inf  # when the tick last read them (never yet)
        self._schedule: Schedule | None = None
        self._run_locks = {name: threading.Lock() for name in self.checks}  # one run of a check at a time
        # One ingest of a check's report at a time, in the order of the runs: a run's own, or one the tick reports
        # for a run blocked past its timeout (on the check's `late-NAME` worker, as its lane is still blocked)
        self._ingest_locks = {name: threading.Lock() for name in self.checks}
        self._late = {name: Worker(f"late-{name}") for name in self.checks}  # a thread only while it has work
        self._late_pending: set[str] = set()  # checks with a late report waiting for `_late`
        # subjects whose history a check forgets before its next run (asked while a run was blocked past its timeout)
        self._forgotten: dict[str, list[tuple[str, float]]] = {name: [] for name in self.checks}
        self._selftest: SelfTest | None = None  # the latest `trainguard selftest`, under way or done

    def _with_ledger(self, context: CheckContext) -> Ledger:
        """The node ledger, and the check of the agent's own that holds a lemon (trainguard.pipeline.lemon)."""
        ledger = Ledger(self.store, self.node, self.config.ledger, self.clock, on_hold=lambda: self.trigger(LEMON_NAME))
        self.checks[LEMON_NAME] = LemonCheck(context, ledger, self.config.ledger)
        return ledger

    @staticmethod
    def _build_check(registry: Registry, kind: str, name: str, settings: CheckSettings,
                     context: CheckContext) -> Check:
        try:
            return registry.check_class(kind)(name, settings, context)
        except Exception as exc:  # noqa: BLE001 - one broken check must not stop the others
            log.error("check could not start", extra=kv(check=name, error=f"{type(exc).__name__}: {exc}"))
            return BrokenCheck(name, settings, context, f"{type(exc).__name__}: {exc}")

    # running -------------------------------------------------------------------
    def run_round(self, ingest: bool = True) -> list[RunReport]:
        """Run every check once, concurrently; each bounded by its own timeout. A one-shot round (`trainguard
        check`) first waits, `slurm_timeout` at most, for what slurmctld knows of this node's jobs; the daemon's
        scheduled runs never wait for it."""
        if self.catalog is not None:
            self.catalog.settle(self.config.jobs.slurm_timeout)
        reports: dict[str, RunReport] = {}

        def one(name: str) -> None:
            # The check's run lock, as run_check takes: a run an event triggers meanwhile (an XID during the first
            # round) waits, so an older report is never ingested after a newer one (it would resolve what the newer
            # one found, as "no longer reported").
            with self._run_locks[name]:
                reports[name] = self.runners[name].run_once(self.stop_event)
                if ingest:
                    self._ingest_in_order(reports[name])

        threads = [threading.Thread(target=one, args=(n,), daemon=True) for n in self.runners]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [reports[n] for n in self.runners if n in reports]

    def firing_events(self) -> list[Event]:
        """Every firing incident as a reminder-kind event, for channels that restate the current state."""
        return [Event(EventKind.REMINDER, i.id, i.check, i.subject, i.status, i.summary, self.node, self.clock(),
                      i.since, details={**i.details, "actions_taken": list(i.actions)})
                for i in self.tracker.incidents() if i.firing]

    def _actions_taken(self, event: Event) -> dict[str, Any]:
        """For notifications: the actions run on the incident so far, with their outcomes."""
        actions = self.tracker.actions_of(event.incident_id)
        return {"actions_taken": actions} if actions else {}

    def run_check(self, name: str) -> RunReport | None:
        """Run a check once and ingest what it found, on a thread of the check's own and within its timeout (the
        caller waits at most that long): the run's report (None when it could not run); never raises, whatever the
        check or the store does."""
        if self.stop_event.is_set():
            return None
        with self._run_locks[name]:  # runs of one check never overlap
            try:
                report = self.runners[name].run_once(self.stop_event)
            except Exception:  # no thread to be had for the run (a pids limit)
                if not self.stop_event.is_set():
                    log.exception("check run failed", extra=kv(check=name))
                return None
            self._ingest_in_order(report)
            return report

    def _run_scheduled(self, name: str) -> None:
        """A scheduled or triggered run, on the check's lane: the check runs on this thread, and a run past its
        timeout is reported by the tick (`_supervise`), what it returns late dropped. Never raises."""
        if self.stop_event.is_set():
            return
        with self._run_locks[name]:
            self._forget_deferred(name)
            report = self.runners[name].run_here()
            if report is not None:
                self._ingest_in_order(report)

    def _ingest_in_order(self, report: RunReport, late: bool = False) -> None:
        """Ingest under the check's ingest lock, so a check's reports go in one at a time; never raises. A `late`
        report (the tick's, for a blocked lane) older than the latest one ingested is counted only: the blocked run
        returned and a later run was ingested first, and its UNKNOWN must not follow what that run found."""
        name = report.check
        try:
            with self._ingest_locks[name]:
                if late:
                    with self._lock:
                        if report.seq < self._states[name].seq:
                            self._count(report)
                            return
                self.ingest(report)
        except Exception:
            if not self.stop_event.is_set():  # during shutdown the store may already be closed
                log.exception("ingesting check results failed", extra=kv(check=name))

    def _supervise(self) -> float:
        """Each tick: the timeout report of each lane's run past its deadline (once per run). Returns the soonest
        deadline of the runs still going (monotonic; infinity for none), or a second from now after a timeout (the
        blocked lane's skipped runs are told from then on): the tick comes again by then."""
        now = time.monotonic()
        soonest = math.inf
        for runner in self.runners.values():
            report = runner.overdue(now)
            if report is not None:
                self._report_late(report)
                soonest = min(soonest, now + LATE_EVERY_S)
            soonest = min(soonest, runner.deadline())
        return soonest

    def _wake_at(self, deadline: float) -> None:
        """A scheduled run started: the tick comes by its deadline."""
        if self._schedule is not None:
            self._schedule.wake_at(deadline)

    def _skipped(self, name: str) -> None:
        """A run came due while the check's lane was still in its previous run: reported when that run is blocked
        past its timeout (a run merely still going is not)."""
        report = self.runners[name].blocked()
        if report is not None:
            self._report_late(report)

    def _report_late(self, report: RunReport) -> None:
        """Ingest a timeout or skipped report of a blocked lane on the check's own `late-NAME` worker (the lane
        is blocked; the tick must not wait on the store)."""
        name = report.check
        with self._lock:
            # One report per check waits at most: an ingest stalled (a stalled state file) piles nothing up behind
            # it. What comes meanwhile is counted (a timeout stays a timeout in the metrics), not ingested: the one
            # waiting says the same, that the check's runs do not come back.
            if name in self._late_pending:
                self._count(report)
                log.debug("late check report counted only: one is still waiting",
                          extra=kv(check=name, outcome=report.outcome))
                return
            self._late_pending.add(name)

        def ingest() -> None:
            try:
                self._ingest_in_order(report, late=True)
            finally:
                with self._lock:
                    self._late_pending.discard(name)

        try:
            self._late[name].submit(ingest)
        except RuntimeError as exc:  # no thread to be had (a pids limit): counted; the next report is tried
            with self._lock:
                self._late_pending.discard(name)
                self._count(report)
            log.error("late check report not ingested", extra=kv(check=name, outcome=report.outcome, error=exc))

    def _on_tick(self) -> float:
        try:
            self.tick()
        except Exception:  # a failed tick still looks for runs past their timeout
            log.exception("tick failed")
        return self._supervise()

    def trigger(self, name: str) -> None:
        """Run a check now, from an event-driven check's watcher."""
        if self._schedule is not None:
            self._schedule.trigger(name)

    def ingest(self, report: RunReport) -> None:
        if self.stop_event.is_set():  # state was flushed at shutdown; late results are dropped
            return
        check = self.checks[report.check]
        with self._lock:
            state = self._count(report)
            state.last = report
            state.seq = max(state.seq, report.seq)
        s = check.settings
        policy = IncidentPolicy(s.fire_after, s.fire_after_runs, s.repeat_interval, s.alert_on_unknown)
        if self.ledger is not None and check.layer == "hardware":
            self.ledger.learn(report.results)  # which serial each GPU is, which sits where
        results, withheld = self._spoken(check, self._placed(report))
        self._emit(self.tracker.observe(report.check, results, policy, report.complete, self.dispatcher.route,
                                        withheld))

    def _count(self, report: RunReport) -> CheckState:
        """Count a run in its check's state (called with the lock held)."""
        state = self._states[report.check]
        state.runs += 1
        state.timeouts += report.outcome == "timeout"
        state.errors += report.outcome == "error"
        state.skipped += report.outcome == "skipped"
        state.idle += report.outcome == "idle"
        return state

    def _placed(self, report: RunReport) -> tuple[Result, ...]:
        """The results with where they belong in the fleet, for grouping and inhibition across nodes: the check's
        type and layer (hardware, job, node), the cluster, and for a fault of the node's hardware the jobs running
        here when it was seen (kept for the incident's life: the requeue it triggers takes the job away)."""
        check = self.checks[report.check]
        kind = self._states[report.check].kind
        place = {"type": kind, "layer": check.layer, "cluster": self.config.agent.cluster}
        here: list[str] | None = None
        out = []
        for r in report.results:
            details = {**place, **r.details}
            if check.layer == "hardware" and r.status is not Status.OK and not r.details.get("job_id"):
                if here is None:
                    here = self._job_ids_here()
                before = self.tracker.details_of(r.check, r.subject).get("jobs_here") or ()
                details["jobs_here"] = sorted({*before, *here})
            out.append(replace(r, details=details))
        return tuple(out)

    def _spoken(self, check: Check, results: tuple[Result, ...]) -> tuple[tuple[Result, ...], frozenset[str]]:
        """A job-scoped check's results about a multi-node job count on the job's owner node only: every node of the
        job sees the same log, time limit and switch, and each alerting and requeueing it made duplicates (issue 24:
        12 of 22 alerts; the extra requeues failed). A result about what only this node sees (details scope "node":
        the operator's stop file in this node's /etc) counts here. The report itself (metrics, status) keeps them
        all.

        Also the subjects withheld this run: a SLURM job whose record was asked and not answered yet (a second,
        usually: the agent just started, or the job was requeued onto this node and seen by its prolog) has no known
        owner, and every node would speak with what it holds, such as the NaN streak of an earlier start that the
        owner's restart dealt with (the goodput benchmark: a false restart, then a requeue of the healthy job). Its
        incident, if open, is neither stepped nor resolved until the record says who owns the job; a record that
        failed or came back empty leaves every node speaking, as before."""
        if check.scope != "job" or self.catalog is None:
            return results, frozenset()
        try:
            view = self.catalog.view()
        except Exception as exc:  # noqa: BLE001 - without the view every node speaks, as before
            log.warning("job owners unknown; every result kept", extra=kv(check=check.name, error=exc))
            return results, frozenset()
        out, withheld = [], set()
        for r in results:
            key = r.details.get("job_key")
            job = view.by_key(key) if isinstance(key, str) else None
            if job is not None and r.details.get("scope") != "node":
                if not job.spoken_for_by(self.catalog.node):
                    continue
                if job.extra.get("record_pending"):
                    withheld.add(r.subject)
                    continue
            out.append(r)
        return tuple(out), frozenset(withheld)

    def _job_ids_here(self) -> list[str]:
        if self.catalog is None:
            return []
        try:
            return sorted({j.job_id or j.key for j in self.catalog.view().on_node()})
        except Exception as exc:  # noqa: BLE001 - a failing job source must not lose the hardware alert
            log.warning("jobs on this node unknown for a hardware incident", extra=kv(error=exc))
            return []

    def _emit(self, events: list[Event]) -> None:
        """Events already queued for the channels: log them, run the actions bound to them (never a self-test's: the
        responder refuses them), wake the channels."""
        for event in events:
            log.info("incident event", extra=kv(event=event.kind.value, check=event.check, subject=event.subject,
                                                status=event.status.name, incident=event.incident_id))
            check = self.checks.get(event.check)
            if check is not None:
                self._to_ledger(event, check)
                self.responder.handle(event, check.actions_for(event))
            selftest = self._selftest
            if selftest is not None and event.details.get("test") is True:
                selftest.on_event(event)
        if events:
            self.dispatcher.wake()

    def _binding(self, event: Event) -> ActionBinding | None:
        """The actions bound to `event` by its check as configured now (`Check.actions_for`); None: no such check."""
        check = self.checks.get(event.check)
        return check.actions_for(event) if check is not None else None

    def _to_ledger(self, event: Event, check: Check) -> None:
        """A hardware check's incident fired, escalated or resolved: into the node ledger, before its actions run
        (a lemon rule it completes holds the node before a `resume` asks). A result of one that says it is no fault of
        the hardware (`hardware: false`: the kernel check's segfaults, OOM kills, file systems) is not recorded."""
        if self.ledger is None or check.layer != "hardware" or event.details.get("hardware") is False:
            return
        try:
            self.ledger.on_event(event, self._states[event.check].kind)
        except Exception as exc:  # noqa: BLE001 - the ledger is history: the alert and its actions go on
            log.error("recording the incident in the ledger failed", extra=kv(check=event.check, error=exc))
            return
        self.trigger(LEMON_NAME)  # its gauges count the fault now, not at its next run a minute on

    # operators -------------------------------------------------------------------
    def attach(self, check: Check, kind: str) -> None:
        """A transient check (`trainguard selftest`'s), run by its owner through `run_check`, never scheduled. Each
        table is replaced, never changed in place: the tick and the read side may be iterating the old one."""
        name = check.name
        if name in self.checks:
            raise OperatorError(f"a check named {name!r} exists already")
        self.runners = {**self.runners, name: CheckRunner(check, self.clock, self._wake_at)}
        self._run_locks = {**self._run_locks, name: threading.Lock()}
        self._ingest_locks = {**self._ingest_locks, name: threading.Lock()}
        self._late = {**self._late, name: Worker(f"late-{name}")}
        with self._lock:
            self._forgotten = {**self._forgotten, name: []}
            self._states = {**self._states, name: CheckState(kind, check.settings.interval)}
        self.checks = {**self.checks, name: check}

    def detach(self, name: str, who: Operator) -> list[Event]:
        """The transient check `name` is gone: no table keeps it, its watcher and threads end, and what is still open
        of its incidents resolves (cleared by `who`): those events."""
        check = self.checks.get(name)
        self.checks = {n: c for n, c in self.checks.items() if n != name}
        with self._lock:
            self._states = {n: s for n, s in self._states.items() if n != name}
            self._forgotten = {n: f for n, f in self._forgotten.items() if n != name}
        runner, late = self.runners.get(name), self._late.get(name)
        self.runners = {n: r for n, r in self.runners.items() if n != name}
        self._late = {n: w for n, w in self._late.items() if n != name}
        self._run_locks = {n: lk for n, lk in self._run_locks.items() if n != name}
        self._ingest_locks = {n: lk for n, lk in self._ingest_locks.items() if n != name}
        try:
            for stop in (runner.close if runner else None, late.close if late else None, check.stop if check else None):
                if stop is not None:
                    stop()
        except Exception as exc:  # noqa: BLE001 - what is gone from the tables is gone; say it
            log.warning("transient check did not stop cleanly", extra=kv(check=name, error=exc))
        events = [e for i in self.tracker.incidents() if i.check == name
                  for e in self.tracker.clear(name, i.subject, who, self.dispatcher.route)]
        self._emit(events)
        return events

    def selftest(self, who: Operator, kmsg: bool, metrics: Callable[[], bytes]) -> dict[str, Any]:
        """Starts `trainguard selftest` (pipeline/selftest.py): its document, which `selftest_status` follows."""
        self._refuse_if_stopping()
        with self._lock:
            running = self._selftest
            if running is not None and not running.done:
                raise OperatorError(f"a self-test is under way already (id {running.id}, by {running.by})")
            self._selftest = SelfTest(self, who, kmsg, metrics)
            test = self._selftest
        return test.start()

    def selftest_status(self) -> dict[str, Any] | None:
        test = self._selftest
        return None if test is None else test.document()

    def _refuse_if_stopping(self) -> None:
        if self.stop_event.is_set():  # the store and the channels are closing: the command would be half done
            raise OperatorError("the agent is stopping: run it again once it is back")

    def _target(self, target: str, need_subject: bool = False) -> tuple[str, str | None]:
        """`CHECK` or `CHECK/SUBJECT` (a subject may itself hold slashes: `disk//scratch`)."""
        self._refuse_if_stopping()
        check, sep, subject = target.partition("/")
        if check not in self.checks:
            raise OperatorError(f"no check named {check!r} (configured: {', '.join(self.configured) or 'none'})")
        if need_subject and not subject:
            raise OperatorError(f"{target!r}: name the subject too, as CHECK/SUBJECT (see trainguard status)")
        return check, self.tracker.subject_named(check, subject) if sep else None

    def acknowledge(self, target: str, who: Operator) -> list[Event]:
        check, subject = self._target(target)
        events = self.tracker.acknowledge(check, subject, who, self.dispatcher.route)
        if not events and not any(i.check == check and subject in (None, i.subject) for i in self.tracker.incidents()):
            raise OperatorError(f"no incident of {target} to acknowledge")
        self._emit(events)
        return events

    def silence(self, target: str, duration: float, who: Operator) -> Silence:
        check, subject = self._target(target)
        silence, events = self.tracker.silence(check, subject, duration, who, self.dispatcher.route)
        self._emit(events)
        return silence

    def clear(self, target: str, who: Operator) -> list[Event]:
        """The cause is fixed: the check forgets the history behind the subject, the incident resolves, and the check
        runs again at once (what is still wrong fires as a new incident)."""
        check, subject = self._target(target, need_subject=True)
        assert subject is not None
        # Never while the check runs (it would change the history under the run); and the resolution's actions
        # start under the ingest lock, where a stop waits for them.
        with self._between_runs(check) as between, self._ingest_locks[check]:
            self._refuse_if_stopping()  # again: a stop may have begun while it waited for the run
            if self.ledger is not None:  # before the history goes: a lemon's hold names the component repaired
                self.ledger.on_clear(check, subject, who.by, who.uid, who.reason)
            self._clear_history(check, subject, between)
            events = self.tracker.clear(check, subject, who, self.dispatcher.route)
            self._emit(events)
        self.trigger(check)
        return events

    @contextlib.contextmanager
    def _between_runs(self, check: str) -> Iterator[bool]:
        """The check's run lock, waited for as long as a run may take (its timeout, and a second for the run to
        return): True once held. A run blocked in the kernel holds its lane for ever, and an operator's clear (the
        client waits 30 s) or an action's forget must not wait for it: False then."""
        lock = self._run_locks[check]
        got = lock.acquire(timeout=self.checks[check].settings.timeout + 1.0)
        try:
            yield got
        finally:
            if got:
                lock.release()

    def _clear_history(self, check: str, subject: str, between: bool) -> None:
        """The check forgets the subject's history: now, between its runs; or, while its run is blocked past its
        timeout, before its next run. That blocked run is then reported timed out (if the tick has not yet), so what
        it returns, history the clear was to end, is dropped."""
        if between:
            self.checks[check].clear(subject, self.clock())
            return
        report = self.runners[check].overdue()
        if report is not None:
            self._report_late(report)
        with self._lock:
            self._forgotten[check].append((subject, self.clock()))
        log.warning("check run still going past its timeout; the subject's history is forgotten before its next run",
                    extra=kv(check=check, subject=subject))

    def _forget_deferred(self, check: str) -> None:
        """Before a run (with its run lock): what a clear or a forget asked while the previous run was blocked."""
        with self._lock:
            pending, self._forgotten[check] = self._forgotten[check], []
        for subject, when in pending:
            try:
                self.checks[check].clear(subject, when)
            except Exception as exc:  # noqa: BLE001 - one subject's failure leaves the others forgotten, the run goes on
                log.error("check could not forget a subject", extra=kv(check=check, subject=subject, error=exc))

    def _forget(self, check: str, subject: str) -> None:
        """An action restarted the job in place: the check forgets the subject's history (as an operator's clear
        does), and the incident stays until the check's next results say it is over."""
        if check in self.checks:
            with self._between_runs(check) as between:
                self._clear_history(check, subject, between)

    def tick(self) -> None:
        """Liveness of the scheduler (its tick thread), plus the slow-changing parts of the snapshot."""
        self._last_tick = now = time.monotonic()
        if now - self._usage_at >= USAGE_EVERY_S - USAGE_SLACK_S:
            self._usage_at = now
            try:
                outbox = self.store.outbox_stats()
            except Exception as exc:  # noqa: BLE001 - the tick is the liveness signal: it must not die
                log.warning("reading outbox stats failed", extra=kv(error=exc))
                outbox = self._outbox
            agent = own_usage()
            with self._lock:
                self._outbox = outbox
                self._agent = agent
        try:
            self._emit(self.tracker.expire_silences(self.dispatcher.route))
        except Exception as exc:  # noqa: BLE001 - the tick is the liveness signal: it must not die
            log.warning("ending silences failed", extra=kv(error=exc))

    def healthy(self, max_age_s: float = 3 * TICK_S) -> bool:
        """False when the scheduler's tick stopped making progress: the systemd watchdog then restarts us. Three
        ticks' time: the tick comes every TICK_S, and a loaded node may delay one by seconds."""
        return not self.stop_event.is_set() and time.monotonic() - self._last_tick < max_age_s

    @property
    def configured(self) -> list[str]:
        """The checks the config asked for (the agent's own health and lemon checks, and a self-test's, aside)."""
        return [name for name in self.checks if name in self.config.checks]

    def pending(self) -> list[str]:
        """The configured checks whose first run has not finished yet (the agent is up; they have nothing to say
        so far)."""
        with self._lock:
            return [name for name, state in self._states.items() if state.runs == 0 and name in self.config.checks]

    # lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        """Starts the scheduler and returns: each check's first run is its first scheduled run, due at once, so a
        slow one (squeue timing out) delays nobody, READY included (`pending()` names those not done yet)."""
        if self.ledger is not None:
            try:
                self.ledger.note_boot()
            except Exception as exc:  # noqa: BLE001 - a reboot unrecorded costs history, not the agent
                log.error("recording the boot in the ledger failed", extra=kv(error=exc))
        remove_leftovers(self.config.agent.state_dir)  # what a self-test cut short by a crash left
        self.dispatcher.start()
        for notifier in self.notifiers.values():
            notifier.start(self.firing_events)
        try:  # a check taken out of the config no longer keeps its incidents firing
            self._emit(self.tracker.resolve_unconfigured(self.checks, self.dispatcher.route))
        except Exception:
            log.exception("resolving incidents of checks no longer configured failed")
        # what a stop or a crash cut short (a requeue waiting for the ranks)
        self.responder.resume(self._binding)
        self.tick()
        self._schedule = Schedule({n: (c.settings.interval, c.settings.jitter) for n, c in self.checks.items()},
                                  self._run_scheduled, self._on_tick, self._skipped)
        for name, check in self.checks.items():
            try:
                check.start(lambda name=name: self.trigger(name))
            except Exception as exc:  # noqa: BLE001 - its runs will show the failure
                log.error("check watcher could not start", extra=kv(check=name, error=exc))
        self._schedule.start()
        log.info("engine started", extra=kv(checks=",".join(self.checks) or "-",
                                             notifiers=",".join(self.notifiers) or "-"))

    def stop(self, grace: float = ACTIONS_GRACE_S) -> None:
        """Stop; actions under way get `grace` seconds to finish. A list cut short is taken up at the next start
        where its actions are safe to repeat (trainguard.pipeline.responder)."""
        if self.stop_event.is_set():
            return
        self.stop_event.set()
        if self._schedule is not None:
            self._schedule.stop()
        for runner in self.runners.values():
            runner.close()
        for worker in self._late.values():
            worker.close()
        t0 = time.monotonic()
        deadline = t0 + grace
        # An ingest past its stop test still starts the actions of what it fires: wait for it (each ingest lock, once
        # free, says so), so that `finish` sees them. A check still in its run is not waited for: what it returns
        # is dropped. An ingest blocked past the deadline is left; its actions with it.
        for name, lock in self._ingest_locks.items():
            if lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                lock.release()
            else:
                log.warning("check results or an operator's clear still under way at shutdown; actions they start "
                            "are not waited for", extra=kv(check=name))
        running, cut = self.responder.finish(max(0.0, deadline - time.monotonic()))
        waited = round(time.monotonic() - t0, 3)
        if cut:
            log.error("actions still running at shutdown; cut short", extra=kv(threads=",".join(cut), waited_s=waited))
        elif running:
            log.info("actions finished before shutdown", extra=kv(actions=running, waited_s=waited))
        for check in self.checks.values():
            try:
                check.stop()
            except Exception as exc:  # noqa: BLE001 - shutdown goes on regardless
                log.warning("check watcher did not stop cleanly", extra=kv(check=check.name, error=exc))
        self.dispatcher.stop()
        for notifier in self.notifiers.values():
            notifier.stop()
        if self.catalog is not None:
            self.catalog.close()
        # once the lists a reload leaves running have handed over what they did (trainguard.pipeline.responder)
        self.responder.release(self.store.close)

    # read side -----------------------------------------------------------------
    def own_usage(self) -> dict[str, float]:
        """The agent's own usage as the tick last read it (trainguard.node.procfs.own_usage)."""
        with self._lock:
            return dict(self._agent)

    def snapshot(self) -> Snapshot:
        with self._lock:
            checks = {n: replace(s) for n, s in self._states.items()}
            outbox = dict(self._outbox)
            agent = dict(self._agent, start_time=self._started, now=self.clock())
        delivery = {n: (s.sent, s.failed, s.dropped) for n, s in self.dispatcher.stats.items()}
        now = agent["now"]
        return Snapshot(self.node, self._started, checks, self.tracker.firing_by_status(), outbox, delivery, agent,
                        tuple(self.tracker.incidents()), tuple(s for s in self.tracker.silences() if s.until > now),
                        {n: dict(s.not_routed) for n, s in self.dispatcher.stats.items()})
