"""`trainguard selftest`: a harmless test fault through each real path of the running agent, followed hop by hop.

POST /selftest on the control socket (root and the agent's group; one at a time) starts one. A transient check named
`selftest` is attached to the engine and run by this module through the engine's own run and ingest: its results
open incidents in the real tracker, their events go through the real outbox and dispatcher to every configured
channel, its series are on the real /metrics. The paths:

- disk: the disk check's own code on a scratch directory in the state directory, with a free-space floor of 100%
  (it fires at once), then with the floor lifted (it resolves).
- job: a test job's hang. The agent starts a harmless process job of its own (`/bin/sh` writing three steps to its
  log, then `sleep`: no GPU, no file outside the scratch directory), as its own user, found by its pidfile through the
  process job source, the source every node has: no `[jobs]` table, no SLURM partition, account or allocation, so it
  works alike on a SLURM node and elsewhere, and the node's real jobs and job checks never see it. The hang check's own
  code watches it with `stale_after` = HANG_AFTER_S (no stack dump, no flight recorder: nothing to read in `sleep`);
  once its log stops moving it is hung, and at the end it is killed, so its incident resolves as a job that ended.
- kernel: `trainguard selftest`, as root, writes one record to /dev/kmsg, `trainguard-selftest ID: ...`, and each
  configured check that follows the kernel log (xid) must read it through its own reader. Not an XID line: every
  reader of this node's kernel log (DCGM, a node health check, a log shipper, other agents) would take a `NVRM: Xid`
  record as a GPU fault and may drain the node. No XID parser matches it, so the XID ledger, the drain circuit and
  the actions never see it; the self-test check reports what the reader read.

Everything it sends is marked: each summary begins `[trainguard selftest] TEST`, each event's details hold
`test = true` (Alertmanager gets the label test="true"). The responder never runs an action for such an event
(Responder.handle). At the end the test job is killed, the incidents resolve (their resolved messages go out), the
check is detached, the scratch directory is removed, and what a failed channel still held of the test in the outbox is dropped.
"""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainguard.checks.base import Check, CheckContext, CheckSettings
from trainguard.checks.disk import DiskCheck, DiskSettings
from trainguard.checks.hang import HangCheck, HangSettings
from trainguard.core.events import Event, EventKind
from trainguard.core.logs import kv
from trainguard.core.model import Result, Status
from trainguard.core.settings import PLAIN
from trainguard.core.state import ScopedState
from trainguard.core.units import Limit
from trainguard.jobs.catalog import JobCatalog
from trainguard.jobs.settings import JobsSettings, ProcessJobSettings
from trainguard.node.kmsg import KernelRecord, KmsgFollower
from trainguard.node.proctable import ProcessSnapshots
from trainguard.pipeline.incidents import Operator

if TYPE_CHECKING:
    from trainguard.pipeline.engine import Engine

log = logging.getLogger("trainguard.selftest")

NAME = "selftest"  # the transient check's name, and its type in /metrics and /status
MARK = "[trainguard selftest]"
KMSG_TAG = "trainguard-selftest"
SCRATCH_PREFIX = "selftest-"
KERNEL_WAIT_S = 10.0  # the record, written by the command after the start's answer, read by each follower
DELIVERY_WAIT_S = 20.0  # each channel's answer after its group_window; a retrying channel has failed once by then
GIVE_UP_S = 300.0  # the command waits this long for the whole test (two group windows of a channel, and more)
JOB_NAME = "trainguard-selftest"  # the test job's name: its key, `process:trainguard-selftest`, is its subject
JOB_STEPS = 3  # the test job logs this many steps, STEP_S apart, then stops making progress
STEP_S = 0.2
HANG_AFTER_S = 3.0  # the test job is hung this long after its last step (the hang check's stale_after)
HANG_WAIT_S = 20.0  # ... and detected within this much more, or the hop fails
JOB_END_S = 5.0  # SIGTERM, then SIGKILL after this


def settings(cls: type[CheckSettings], **values: Any) -> CheckSettings:
    """Settings built at run time from values already valid (thresholds as Limits): the agent holds plain classes;
    a test's in-process engine holds pydantic models, built here without validation."""
    return cls(**values) if PLAIN else cls.model_construct(**values)  # type: ignore[attr-defined, no-any-return]


def kernel_record(test_id: str) -> str:
    """The record `trainguard selftest` writes to /dev/kmsg: tagged, and shaped like no fault any reader knows."""
    return f"{KMSG_TAG} {test_id}: a test record of trainguard selftest, not a fault"


def remove_leftovers(state_dir: Path) -> None:
    """At start: the scratch directories of a self-test cut short (a crash, a kill). Its incidents resolve as those
    of a check no longer configured (IncidentTracker.resolve_unconfigured)."""
    try:
        for path in state_dir.glob(SCRATCH_PREFIX + "*"):
            shutil.rmtree(path, ignore_errors=True)
    except OSError as exc:
        log.warning("self-test leftovers not removed", extra=kv(state_dir=state_dir, error=exc))


class SelfTestCheck(Check):
    """The disk check's code on the scratch directory (a floor that fires, then none), and what each kernel log
    reader read of the test record; every result marked as a test."""

    def __init__(self, context: CheckContext, scratch: Path, test_id: str, job: TestJob | None = None) -> None:
        super().__init__(NAME, settings(CheckSettings, interval=3600.0, jitter=0.0, timeout=10.0), context)
        self.test_id = test_id
        self.fault = True
        floors = {"paths": [str(scratch)], "free_critical": Limit(0.0, True), "inodes_free_warning": Limit(0.0, True),
                  "inodes_free_critical": Limit(0.0, True), "forecast_horizon": 0.0}
        self.faulty = DiskCheck(NAME, settings(DiskSettings, free_warning=Limit(100.0, True), **floors), context)
        self.healthy = DiskCheck(NAME, settings(DiskSettings, free_warning=Limit(0.0, True), **floors), context)
        self.kernel: dict[str, str] = {}  # reader check -> what it read of the record
        self.hang = None if job is None else HangCheck(NAME, settings(
            HangSettings, interval=3600.0, jitter=0.0, timeout=10.0, stale_after=HANG_AFTER_S, stacks=False,
            flight_recorder=False, flight_recorder_dumps="", heartbeat=""), replace(context, jobs=job.catalog,
                                                                                     processes=job.catalog.snapshots))

    def run(self) -> Sequence[Result]:
        results = list((self.faulty if self.fault else self.healthy).run())
        if self.hang is not None:  # the test job, hung or not yet; once it ended (the fault is over), said so
            subject = f"process:{JOB_NAME}"
            results += [r for r in self.hang.run() if r.subject == subject] or (
                [] if self.fault else [self.result(subject, Status.OK, f"process job {JOB_NAME}: ended")])
        for reader, read in sorted(self.kernel.items()):
            results.append(self.result(f"kernel-log/{reader}", Status.WARNING if self.fault else Status.OK,
                                       f"check {reader}'s kernel log reader read the test record ({read})"))
        return [self._marked(r) for r in results]

    def _marked(self, r: Result) -> Result:
        word = "TEST" if self.fault else "TEST over"
        return replace(r, summary=f"{MARK} {word}: {r.summary}", details={**r.details, "test": True,
                                                                            "selftest": self.test_id})

    def stop(self) -> None:
        self.faulty.stop()
        self.healthy.stop()
        if self.hang is not None:
            self.hang.stop()


class TestJob:
    """The self-test's job: a process of the agent's own user in its own session, declared to a job catalog of its
    own (the process job source, by pidfile). Its log moves JOB_STEPS times, then never again; `sleep` ends it by
    GIVE_UP_S should everything else fail."""

    def __init__(self, scratch: Path, node: str, proc: Any) -> None:
        self.log = scratch / "job.log"
        pidfile = scratch / "job.pid"
        user = pwd.getpwuid(os.getuid()).pw_name  # KeyError: a uid without a name, said as the hop
        script = (f'for i in {" ".join(str(i + 1) for i in range(JOB_STEPS))}; do echo "step $i of {JOB_NAME}" '
                  f'>> "$1"; sleep {STEP_S:g}; done; exec sleep {GIVE_UP_S:g}')
        self.process = subprocess.Popen(["/bin/sh", "-c", script, JOB_NAME, str(self.log)], cwd=scratch,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True,
                                        env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"})
        pidfile.write_text(f"{self.process.pid}\n")
        spec = settings(ProcessJobSettings, pidfile=pidfile, user=user, logs=[str(self.log)], cmdline=None,
                        switch_dir=None, job_id="")
        jobs = settings(JobsSettings, sources=[], processes={JOB_NAME: spec}, refresh=0.0)
        self.catalog = JobCatalog(jobs, node, processes=ProcessSnapshots(proc, max_age=0.0))
        self.user = user

    def end(self) -> str:
        """SIGTERM to its session, SIGKILL after JOB_END_S: how it ended."""
        if self.process.poll() is not None:
            return f"had ended already (exit {self.process.returncode})"
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.process.wait(JOB_END_S)
                return f"ended by {sig.name}"
            except subprocess.TimeoutExpired:
                continue
        return f"still running after SIGKILL and {JOB_END_S:g}s"

    def close(self) -> None:
        if self.process.poll() is None:
            self.end()
        self.catalog.close()


class SelfTest:
    """One run of `trainguard selftest` in the agent: `start()` answers at once; `document()` says each hop so far."""

    def __init__(self, engine: Engine, who: Operator, kmsg: bool, metrics: Callable[[], bytes]) -> None:
        self.engine = engine
        self.id = uuid.uuid4().hex[:10]
        self.by = who.by
        self.who = who
        self.kmsg = kmsg
        self.metrics = metrics
        self.started = time.monotonic()
        self.scratch = engine.config.agent.state_dir / f"{SCRATCH_PREFIX}{self.id}"
        self.record = kernel_record(self.id)
        self.done = False
        self.hops: list[dict[str, Any]] = []
        self.events: list[Event] = []
        # (channel, incident id, kind) -> the peer's answer, and when (since the start)
        self.delivered: dict[tuple[str, str, str], tuple[str, float]] = {}
        self.failed: dict[tuple[str, str], tuple[str, float]] = {}  # (channel, kind) -> its first error, and when
        self.ahead: dict[str, tuple[str, float]] = {}  # channel -> its error on an older message queued before ours
        self._changed = threading.Condition()
        self._readers: dict[str, KmsgFollower] = {}
        self._untap: list[Callable[[], None]] = []
        self.check: SelfTestCheck | None = None
        self.job: TestJob | None = None

    # what the command sees ---------------------------------------------------------------------------------------
    def document(self) -> dict[str, Any]:
        with self._changed:
            hops = [dict(h) for h in self.hops]
        return {"id": self.id, "by": self.by, "node": self.engine.node, "record": self.record,
                "kernel_readers": sorted(self._readers), "done": self.done,
                "ok": self.done and all(h["ok"] is not False for h in hops), "hops": hops}

    def _hop(self, path: str, hop: str, ok: bool | None, detail: str, at: float | None = None) -> None:
        """A hop; `at` is when it happened, seconds since the start, where that was before it is told (now)."""
        with self._changed:
            when = time.monotonic() - self.started if at is None else at
            self.hops.append({"at": round(when, 3), "path": path, "hop": hop, "ok": ok, "detail": detail})
        log.info("self-test hop", extra=kv(id=self.id, path=path, hop=hop, ok=ok, detail=detail))

    # start and end ----------------------------------------------------------------------------------------------
    def start(self) -> dict[str, Any]:
        """Attaches the check and the watchers, starts the test's thread: the document (with the record to write)."""
        try:
            self.scratch.mkdir(mode=0o700)
            context = replace(self.engine.shared, state=ScopedState(None, f"check/{NAME}"))
            self._start_job()
            self.check = SelfTestCheck(context, self.scratch, self.id, self.job)
            self.engine.attach(self.check, NAME)
        except Exception:  # refused (the command says why): nothing is left, and a next one may start
            if self.check is not None:
                self.check.stop()
            if self.job is not None:
                self.job.close()
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.done = True
            raise
        self._readers = {name: c.follower for name, c in self.engine.checks.items()
                         if isinstance(getattr(c, "follower", None), KmsgFollower)}
        if self.kmsg:
            self._untap = [f.tap(lambda r, name=name: self._read(name, r)) for name, f in self._readers.items()]
        self.engine.dispatcher.watch(self._answered)
        log.warning("self-test started", extra=kv(id=self.id, by=self.by, scratch=self.scratch))
        threading.Thread(target=self._run, name=f"selftest-{self.id}", daemon=True).start()
        return self.document()

    def _start_job(self) -> None:
        try:
            self.job = TestJob(self.scratch, self.engine.node, self.engine.shared.proc)
        except (OSError, KeyError, subprocess.SubprocessError) as exc:  # the other paths are still tested
            self._hop("job", "started", False, f"the test job could not start: {type(exc).__name__}: {exc}")
            return
        self._hop("job", "started", True, f"test job {JOB_NAME} pid {self.job.process.pid} as {self.job.user} (a "
                  f"process job, by pidfile): {JOB_STEPS} steps to {self.job.log}, then no progress; hung after "
                  f"{HANG_AFTER_S:g}s")

    def _run(self) -> None:
        try:
            self._fault()
            self._resolve()
        except Exception as exc:  # said as a failed hop; the cleanup runs whatever happened
            log.exception("self-test failed", extra=kv(id=self.id))
            self._hop("agent", "error", False, f"{type(exc).__name__}: {exc}")
        finally:
            self._cleanup()
            with self._changed:
                self.done = True
            log.warning("self-test done", extra=kv(id=self.id, ok=self.document()["ok"]))

    # the hops ---------------------------------------------------------------------------------------------------
    def _fault(self) -> None:
        self._kernel()
        report = self.engine.run_check(NAME)
        if report is None or report.outcome != "ok":
            self._hop("disk", "detected", False, f"the check's run: {report.outcome if report else 'did not run'}")
            return
        for r in report.results:
            if r.subject == str(self.scratch):
                self._hop("disk", "detected", r.status is not Status.OK, f"{r.status.name}: {r.summary}")
        self._incidents([r for r in report.results if _path(r.subject) != "job"])
        self._announced(EventKind.FIRED, "event", "delivered", ("disk", "kernel"))
        self._metric()
        self._hang()

    def _incidents(self, results: Sequence[Result]) -> None:
        firing = {i.subject: i for i in self.engine.tracker.incidents() if i.check == NAME and i.firing}
        for r in results:
            incident = firing.get(r.subject)
            self._hop(_path(r.subject), "incident", incident is not None,
                      f"incident {incident.id} firing: {NAME}/{r.subject}" if incident is not None
                      else f"no incident firing for {NAME}/{r.subject} (a silence of {NAME}?)")

    def _hang(self) -> None:
        """The test job's path: the hang check run (through the engine) until it finds the job hung, then the same
        hops as the others."""
        if self.job is None:
            return
        subject = f"process:{JOB_NAME}"
        deadline = time.monotonic() + HANG_AFTER_S + JOB_STEPS * STEP_S + HANG_WAIT_S
        found: Result | None = None
        while time.monotonic() < deadline and not self.engine.stop_event.is_set():
            report = self.engine.run_check(NAME)
            found = next((r for r in report.results if r.subject == subject), None) if report else None
            if found is not None and found.status is not Status.OK:
                break
            self.engine.stop_event.wait(0.5)
        if found is None or found.status is Status.OK:
            self._hop("job", "detected", False, f"the hang check did not find the test job hung in time "
                      f"({found.summary if found else 'it did not list the job'})")
            return
        self._hop("job", "detected", True, f"{found.status.name} by the hang check: {found.summary}")
        self._incidents([found])
        self._announced(EventKind.FIRED, "event", "delivered", ("job",))
        self._metric("job", "trainguard_job_hung{", f'name="{JOB_NAME}"')

    def _kernel(self) -> None:
        if not self._readers:
            self._hop("kernel", "detected", None, "no configured check follows the kernel log (xid): not tested")
            return
        if not self.kmsg:
            self._hop("kernel", "detected", None, "not tested: only root may write the test record to /dev/kmsg")
            return
        deadline = time.monotonic() + KERNEL_WAIT_S
        with self._changed:
            while len(self.check.kernel if self.check else {}) < len(self._readers) and time.monotonic() < deadline:
                self._changed.wait(deadline - time.monotonic())
            read = dict(self.check.kernel) if self.check else {}
        for name, follower in sorted(self._readers.items()):
            if name in read:
                self._hop("kernel", "detected", True, f"check {name}'s kernel log reader read the record ({read[name]})")
            else:
                self._hop("kernel", "detected", False, f"check {name}'s kernel log reader did not read the record in "
                          f"{KERNEL_WAIT_S:g}s (source {follower.source}, {follower.error or 'no error'})")

    def _read(self, reader: str, record: KernelRecord) -> None:
        """On the follower's thread: the test record, by its tag and id."""
        if self.record in record.message and self.check is not None:
            with self._changed:
                source = self._readers[reader].source
                self.check.kernel[reader] = f"{source} seq {record.seq}" if record.seq >= 0 else source
                self._changed.notify_all()

    def _resolve(self) -> None:
        if self.check is None:
            return
        if self.job is not None:  # a job that ended is no longer reported: its incident resolves
            running = self.job.process.poll() is None
            how = self.job.end()
            self._hop("job", "ended", running and self.job.process.poll() is not None,
                      f"test job pid {self.job.process.pid} {how}")
        self.check.fault = False
        before = {i.subject: i.id for i in self.engine.tracker.incidents() if i.check == NAME}
        self.engine.run_check(NAME)
        left = {i.subject for i in self.engine.tracker.incidents() if i.check == NAME}
        for subject, incident in sorted(before.items()):
            self._hop(_path(subject), "resolved", subject not in left,
                      f"incident {incident} resolved" if subject not in left else f"incident {incident} still open")
        self._announced(EventKind.RESOLVED, "resolved event", "resolved delivered")

    def _announced(self, kind: EventKind, event_hop: str, delivered_hop: str, paths: Sequence[str] = ()) -> None:
        """The events of `kind` queued for the channels (of `paths` only, when given), and each channel's answer."""
        with self._changed:
            events = [e for e in self.events if e.kind is kind and (not paths or _path(e.subject) in paths)]
        routed: dict[str, list[Event]] = {name: [] for name in self.engine.notifiers}
        for e in events:
            refused = {n: rule for n, notifier in self.engine.notifiers.items() if (rule := notifier.refusal(e))}
            for name, taken in routed.items():
                if name not in refused:
                    taken.append(e)
            self._hop(_path(e.subject), event_hop, True, f"{e.kind.value} event {e.incident_id} queued for "
                      + (", ".join(self._channel(n) for n in routed if n not in refused) or "no channel")
                      + "".join(f"; not routed to {n} ({rule})" for n, rule in refused.items()))
        if not self.engine.notifiers:
            self._hop("channels", delivered_hop, None, "no notification channel is configured")
            return
        now = time.monotonic()
        for channel, mine in routed.items():
            if not mine:
                continue
            # a channel that groups events (email: 30 s by default) sends once its window is over
            deadline = now + self.engine.notifiers[channel].settings.group_window + DELIVERY_WAIT_S
            keys = [(channel, e.incident_id, e.kind.value) for e in mine]
            with self._changed:
                before = self.failed.get((channel, EventKind.FIRED.value)) if kind is EventKind.RESOLVED else None
                while (before is None and (channel, kind.value) not in self.failed and channel not in self.ahead
                       and not all(k in self.delivered for k in keys) and time.monotonic() < deadline):
                    self._changed.wait(deadline - time.monotonic())
                answers = [self.delivered[k] for k in keys if k in self.delivered]
                error = self.failed.get((channel, kind.value))
                if error is None and channel in self.ahead and len(answers) < len(keys):
                    failing, when = self.ahead[channel]
                    error = (f"{failing} (on an older message queued ahead of the test's)", when)
            if before is not None:  # it waits behind the firing message, which the channel keeps refusing
                self._hop("channels", f"{channel} {delivered_hop}", False,
                          f"not sent: the channel failed the firing message ({before[0]})")
            elif error is not None:
                self._hop("channels", f"{channel} {delivered_hop}", False, error[0], error[1])
            elif len(answers) == len(keys):
                said = "; ".join(sorted({a or "accepted" for a, _ in answers}))
                self._hop("channels", f"{channel} {delivered_hop}", True, f"{len(keys)} event(s): {said}",
                          max(at for _, at in answers))
            else:
                self._hop("channels", f"{channel} {delivered_hop}", False, "no answer in time (the channel is slow, or "
                          "its queue holds older messages: `trainguard status`, trainguard_notifications_queued)")

    def on_event(self, event: Event) -> None:
        """From the engine: an event of a test incident was queued for the channels (its own or an earlier test's)."""
        if event.details.get("selftest") == self.id:
            with self._changed:
                self.events.append(event)

    def _answered(self, channel: str, events: list[Event], answer: str | None, error: str | None) -> None:
        """From a channel's delivery worker: how the delivery of events (ours among them, or not) went."""
        mine = [e for e in events if e.details.get("selftest") == self.id]
        at = time.monotonic() - self.started
        with self._changed:
            if not mine:  # an older message: the test's wait behind it, and a channel failing on it fails the test
                if error is not None:
                    self.ahead.setdefault(channel, (error, at))
                    self._changed.notify_all()
                return
            if error is not None:
                for e in mine:
                    self.failed.setdefault((channel, e.kind.value), (error, at))
            else:
                for e in mine:
                    self.delivered[(channel, e.incident_id, e.kind.value)] = (answer or "", at)
            self._changed.notify_all()

    def _channel(self, name: str) -> str:
        window = self.engine.notifiers[name].settings.group_window
        return f"{name} (sent after its {window:g}s group_window)" if window > 0 else name

    def _metric(self, path: str = "metrics", prefix: str = "trainguard_check_status{",
                label: str = f'check="{NAME}"') -> None:
        try:
            text = self.metrics().decode("utf-8", "replace")
        except Exception as exc:  # noqa: BLE001 - the hop fails, with why
            self._hop(path, "metric", False, f"/metrics failed: {type(exc).__name__}: {exc}")
            return
        series = [line for line in text.splitlines() if line.startswith(prefix) and label in line]
        self._hop(path, "metric", bool(series), "; ".join(series[:3]) if series
                  else f"no {prefix.rstrip('{')} series with {label} on /metrics")

    def _cleanup(self) -> None:
        for untap in self._untap:
            untap()
        engine = self.engine
        notes, ok = [], True
        try:
            # what a failed run left open resolves now (announced: it was announced as firing)
            left = engine.detach(NAME, replace(self.who, reason="the self-test is over"))
            if left:
                notes.append(f"{len(left)} incident(s) still open resolved at the end")
            engine.dispatcher.unwatch(self._answered)
            # a channel that failed still holds the test's messages: they would go out later, out of context
            dropped = engine.store.outbox_drop(NAME, "selftest", self.id)
            if dropped:
                notes.append(f"{dropped} undelivered test message(s) dropped from the outbox")
        except Exception as exc:  # noqa: BLE001 - said as a failed hop
            ok = False
            notes.append(f"FAILED: {type(exc).__name__}: {exc}")
        if self.job is not None:
            self.job.close()
            if self.job.process.poll() is None:
                ok = False
                notes.append(f"FAILED: test job pid {self.job.process.pid} still running")
        shutil.rmtree(self.scratch, ignore_errors=True)
        still = [f"{i.check}/{i.subject}" for i in engine.tracker.incidents() if i.check == NAME]
        ok = ok and not still and not self.scratch.exists() and NAME not in engine.checks
        self._hop("cleanup", "cleanup", ok, "; ".join([f"check {NAME} detached, {self.scratch} removed",
                                                        *(["test job ended"] if self.job is not None else []),
                                                        f"incidents left: {', '.join(still)}" if still
                                                        else "no incident left", *notes]))


def _path(subject: str) -> str:
    return "kernel" if subject.startswith("kernel-log/") else "job" if subject.startswith("process:") else "disk"
