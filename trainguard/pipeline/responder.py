"""The responder: runs the named actions bound to a check when its incidents fire or escalate.

Each action runs in its own daemon thread with a timeout, logs an audit line, and its outcome is
recorded on the incident. An action runs at most once per incident unless it sets `repeat`.
Actions of one incident run in the order configured (save before drain before requeue).

A list under way is kept in the state database until it is done. A stop (`systemctl restart`, an upgrade) or a crash
in the middle of one (a `requeue` waits minutes for the ranks to save) would otherwise leave undone what the fault
called for: the ranks save and exit, and a job nobody requeues leaves the queue. At the next start, the rest of each
such list is taken up (within RESUME_WITHIN_S, for incidents still firing, as still bound) from the action that was
under way if it is safe to repeat (`Action.resumes`: `drain`, `requeue`, which reads the job's record first), on the
jobs it was about; an action under way that is not safe to repeat is recorded on the incident as interrupted, and the
list ends there.

A stop or a reload lets each list finish the action under way (a thread cannot be stopped) and begin no other. At a
reload the process goes on, and so does that action: its list is marked live in this process, the old responder's
outcomes go to a handover key instead of its closed incidents, and the new responder follows the list (it neither
runs the action again nor calls it cut short) until the old thread has handed it over, then records what ran and
takes up the rest as at a start.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from trainguard.actions.base import (
    Action,
    ActionAnsweredError,
    ActionContext,
    ActionError,
    ActionRefusedError,
    ActionSkippedError,
    Claims,
    Reports,
    ResumeGate,
)
from trainguard.actions.diag import DiagReport
from trainguard.actions.savereport import SaveReport
from trainguard.checks.base import ActionBinding
from trainguard.core.events import Event, EventKind
from trainguard.core.logs import kv
from trainguard.core.model import Status
from trainguard.core.state import KeyValueStore
from trainguard.jobs.catalog import JobCatalog, JobView
from trainguard.jobs.model import Job
from trainguard.jobs.slurm import SlurmClient
from trainguard.pipeline.config import Config
from trainguard.pipeline.incidents import IncidentTracker
from trainguard.pipeline.ledger import Ledger
from trainguard.registry import Registry

log = logging.getLogger("trainguard.actions")


RECORD_WAIT_S = 5.0  # how long an action waits for a job's record from slurmctld (usually about a second)
LISTS_KEY = "responder.lists"  # the action lists under way: what a stop or a crash cut short is taken up at start
# A list cut longer ago than this is not taken up: the agent was down for maintenance, not restarted, and what its
# jobs did meanwhile (finished, cancelled) is better judged by a person. slurmctld forgets a finished job after
# MinJobAge (300 s by default) anyway, and a requeue after that fails.
RESUME_WITHIN_S = 600.0
HANDOVER_KEY = "responder.handover/"  # + a list id: what a list left running by a reload did after it (`_end`)
PROCESS = uuid.uuid4().hex  # this process: a list marked live by it still runs here (a reload), it was not cut short
FOLLOW_MARGIN_S = 5.0  # past its action's timeout, a list followed after a reload is given up (its outcome unknown)
# How a list came to be taken up (`_take_up`). Only one cut short by a stop or a crash may be stale: a reload's (handed
# over, or stopped between two actions, in this same process) is taken up at once, however long its action ran.
CUT = "cut short by the agent's stop or crash"
HANDED = "handed over after a reload"
STOPPED = "stopped between two actions by a reload"


def _fresh(action: Action, record: Mapping[str, Any]) -> bool:
    """The action left the job starting afresh: done, or done by another list's action (answered)."""
    return action.fresh_start and (record["outcome"] == "ok" or bool(record.get("answered")))


def _brief(job: Job) -> dict[str, Any]:
    """What a list taken up after a restart needs of a job that may have ended meanwhile (its ranks saved and exited
    while the agent was down): the `requeue` reads the job's record by id, with its owner's uid, and skips a job whose
    life moved on."""
    return {"key": job.key, "source": job.source, "name": job.name, "job_id": job.job_id, "uid": job.uid,
            "user": job.user, "restarts": job.restarts, "requeue": job.requeue}


def _same_lives(earlier: tuple[Job, ...], listed: tuple[Job, ...]) -> tuple[Job, ...]:
    """The jobs a list cut short was about: only those (a job that started here since is none of its business), as
    listed now where the same life still runs here (its processes to wait for), else as they were: ended while the
    agent was down, or in a later life (the requeue reads the record and leaves a job whose life moved on alone)."""
    now = {j.key: j for j in listed}
    out = []
    for job in earlier:
        here = now.get(job.key)
        if here is not None and (job.restarts is None or here.restarts in (None, job.restarts)):
            out.append(replace(here, restarts=job.restarts if job.restarts is not None else here.restarts))
        else:
            out.append(job)
    return tuple(out)


def _kept_report(job_id: str, kept: object) -> dict[str, Any]:
    """A report as a list kept it (SaveReport.kept), checked to be job `job_id`'s; ValueError else."""
    if not isinstance(kept, dict) or str(kept.get("job_id")) != job_id:
        raise ValueError(f"not a report of job {job_id}")
    return kept


def _withdraw(event: Event, reports: Mapping[str, Any]) -> None:
    """A list cut short that is not taken up, or its jobs no longer here: the requests for the ranks' reports its
    signal wrote are removed (if they are still those files), as the agent that wrote them would have once the list
    was done."""
    for job_id, kept in reports.items():
        try:
            SaveReport.resumed(_kept_report(job_id, kept), watch=False)
        except Exception as exc:  # noqa: BLE001 - a request left behind costs nothing but a file
            log.error("a report's request left by the stop could not be removed", extra=kv(
                incident=event.incident_id, job=job_id, error=exc))


def _from_brief(data: Any) -> Job | None:
    try:
        return Job(key=str(data["key"]), source=str(data["source"]), name=str(data["name"]), state="UNKNOWN",
                   job_id=str(data["job_id"]) if data.get("job_id") is not None else None,
                   uid=int(data["uid"]) if data.get("uid") is not None else None,
                   user=str(data["user"]) if data.get("user") is not None else None,
                   restarts=int(data["restarts"]) if data.get("restarts") is not None else None,
                   requeue=bool(data.get("requeue", True)))
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def event_jobs(catalog: JobCatalog, event: Event, record_wait: float = RECORD_WAIT_S) -> tuple[Job, ...]:
    """The incident's own job when it names one, else every job running on this node. Listed afresh (the node only:
    no controller RPC): a job that started a second before the fault is still the one to act on. A SLURM job listed
    before its record came (just started, or requeued onto this node) lacks what only the controller knows (its
    switch dir, its life): a restart would not know where to ask the job's relaunch loop. Its record is waited for,
    `record_wait` at most (a controller that fails ends the wait; 0: no wait)."""
    def pick(view: JobView) -> tuple[Job, ...]:
        key = event.details.get("job_key")
        if key:
            job = view.by_key(str(key))
            return (job,) if job else ()
        return tuple(view.on_node())

    jobs = pick(catalog.view(fresh=True))
    if record_wait > 0 and any(job.source == "slurm" and "incomplete" in job.extra for job in jobs):
        catalog.settle(record_wait, listed=True)  # the listing above asked for the records
        jobs = pick(catalog.view(fresh=True))
    return jobs


class Responder:
    def __init__(self, config: Config, registry: Registry, catalog: JobCatalog | None, tracker: IncidentTracker,
                 clock: Callable[[], float] = time.time,
                 forget: Callable[[str, str], None] | None = None, state: KeyValueStore | None = None,
                 ledger: Ledger | None = None, resume_gates: Sequence[ResumeGate] = ()) -> None:
        self.actions: dict[str, Action] = {
            name: registry.action_class(config.kind_of_action(name))(name, settings)
            for name, settings in config.actions.items()}
        self.catalog = catalog
        self.slurm = catalog.slurm if catalog else SlurmClient(config.jobs.slurm_timeout, config.jobs.slurm_bin_dir)
        self.node = catalog.node if catalog else (config.jobs.slurm_node or config.agent.node_name)
        self.slurmd = config.jobs.slurm_node
        self.forget = forget  # (check, subject): the check forgets the subject's history (the engine's, between runs)
        self.reports = Reports()  # the ranks' reports asked for by a save signal, shared by the lists about a job
        self.claims = Claims()  # what the lists do to a job or the node now: one fault's incidents run at once
        self.tracker = tracker
        self.clock = clock
        self.threads: list[threading.Thread] = []
        self._threads_lock = threading.Lock()  # checks' threads start actions at once
        self._closing = False  # set by `finish`: an action starting after it would be cut short unseen
        # Actions that refused to act (the drain circuit breaker), by incident: an open fault nobody acted on.
        self._refused: dict[tuple[str, str], dict[str, Any]] = {}
        self._refused_lock = threading.Lock()
        self.state = state  # where the lists under way are kept (None: not kept, as in tests of one action)
        self.ledger = ledger  # where drains and resumes done are recorded (None: not recorded)
        self.resume_gates = tuple(resume_gates)  # what `resume` asks first (ActionContext.resume_gates)
        self._lists: dict[str, dict[str, Any]] = {}  # list id -> its event, actions, jobs and the next action's index
        self._lists_lock = threading.Lock()
        self.process = PROCESS  # who marks a list live at `finish` (a test's second engine plays another process)
        self._running: dict[str, threading.Thread] = {}  # list id -> the thread running it
        # After `finish`: the lists still running, each with what it did since (the records its closed store and
        # tracker no longer take), handed over at its end; and the store's close, deferred until the last one ends.
        self._handed: dict[str, dict[str, Any]] = {}
        self._sealed = False  # set by `finish`: the lists under way are the next engine's to save
        self._close_last: Callable[[], None] | None = None
        self._stop = threading.Event()

    def refused(self) -> list[dict[str, Any]]:
        """What actions refused to do and why, while the incidents they answered last."""
        with self._refused_lock:
            return [dict(r) for r in self._refused.values()]

    def handle(self, event: Event, binding: ActionBinding) -> threading.Thread | None:
        if event.kind.operator:  # an operator's ack or silence is news, never a reason to act
            return None
        if event.details.get("test") is True:  # `trainguard selftest`'s fault: announced, never acted on
            log.info("test event: no action runs", extra=kv(incident=event.incident_id, check=event.check,
                                                            subject=event.subject))
            return None
        if event.kind is EventKind.RESOLVED:
            with self._refused_lock:  # the fault is gone: nothing is left undone
                for key in [k for k in self._refused if k[0] == event.incident_id]:
                    del self._refused[key]
            names = [n for n in binding.resolved if n in self.actions]
        else:
            done = self.tracker.actions_done(event.check, event.subject)
            names = [n for n in binding.for_status(event.status)
                     if n in self.actions and (self.actions[n].settings.repeat or n not in done)]
        if event.kind is EventKind.REMINDER:
            names = [n for n in names if self.actions[n].settings.repeat]
        if not names:
            return None
        thread = threading.Thread(target=self._run_all, args=(event, names), name=f"actions-{event.incident_id}",
                                  daemon=True)
        with self._threads_lock:  # started under the lock: `finish` never takes a listed thread for one done
            if self._closing:
                log.error("action not started: the agent is stopping", extra=kv(
                    incident=event.incident_id, check=event.check, subject=event.subject, actions=",".join(names)))
                return None
            self.threads = [t for t in self.threads if t.is_alive()] + [thread]
            thread.start()
        return thread

    def finish(self, timeout: float) -> tuple[int, list[str]]:
        """At shutdown: wait up to `timeout` s for the actions still running, and start no more. A fault that fired
        a second before `systemctl stop` has its incident saved as fired, so the next start does not fire it again;
        a list cut short here stays kept, and `resume()` takes it up there. How many were running, and the threads
        (`actions-<incident>`) still running at the end."""
        deadline = time.monotonic() + timeout
        with self._threads_lock:
            self._closing = True
            alive = [t for t in self.threads if t.is_alive()]
        self._stop.set()
        running = len(alive)
        for thread in alive:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._hand_over()
        return running, [t.name for t in alive if t.is_alive()]

    def _hand_over(self) -> None:
        """The lists still running after `finish`'s wait end their action under way and hand over what it did: each
        is marked live in this process (until its action's timeout) for the responder a reload builds next."""
        with self._lists_lock:
            self._sealed = True
            for list_id, thread in self._running.items():
                entry = self._lists.get(list_id)
                if not thread.is_alive() or entry is None:
                    continue
                self._handed[list_id] = {"records": [], "forget": False}
                names = entry["names"]
                now = names[entry["next"]] if entry["next"] < len(names) else None  # under way, or the first
                bound = (self.actions[now].settings.timeout if now in self.actions else 0.0) + RECORD_WAIT_S
                entry["live"] = {"process": self.process, "until": time.monotonic() + bound + FOLLOW_MARGIN_S}
            if self._handed and self.state is not None:
                try:
                    self.state.put(LISTS_KEY, json.dumps(self._lists))
                except Exception as exc:  # noqa: BLE001 - taken up at the next start as cut short, as before
                    log.warning("saving the action lists under way failed", extra=kv(error=exc))

    def release(self, close: Callable[[], None]) -> None:
        """Call `close` (the state store's) now, or, where lists were handed over, once the last one has written
        what it did."""
        with self._lists_lock:
            if self._handed:
                self._close_last = close
                return
        close()

    def jobs_for(self, event: Event, names: Sequence[str] = ()) -> tuple[Job, ...]:
        if self.catalog is None:
            return ()
        # only an action that needs the record waits for it (a restart, a switch): the others act on what is listed
        wait = any(self.actions[name].needs_record for name in names if name in self.actions)
        return event_jobs(self.catalog, event, RECORD_WAIT_S if wait else 0.0)

    def _run_all(self, event: Event, names: list[str], earlier: tuple[Job, ...] | None = None,
                 reports: Mapping[str, Any] | None = None) -> None:
        """Run `names` for `event`. `earlier`: the jobs a list cut short by a stop was about (taken up at start);
        `reports`: the ranks' reports its save signal asked for, by job id, watched again (SaveReport.kept)."""
        list_id = f"{event.incident_id}-{uuid.uuid4().hex[:8]}"
        # Kept before its jobs are listed (a restart's record wait takes up to RECORD_WAIT_S): a crash meanwhile
        # leaves the list with no jobs named, and the next start lists them itself.
        entry = {"event": event.to_dict(), "names": names, "next": 0, "started": False,
                 "kinds": {n: type(self.actions[n]).__name__ for n in names}, "at": self.clock(),
                 "jobs": [_brief(j) for j in earlier] if earlier is not None else None, "reports": dict(reports or {})}
        with self._lists_lock:
            self._running[list_id] = threading.current_thread()
        self._keep(list_id, entry)
        ctx = None
        whole = False
        try:
            try:
                jobs = self.jobs_for(event, names)
            except Exception as exc:  # noqa: BLE001 - still run node-level actions without jobs
                log.error("looking up jobs for actions failed", extra=kv(incident=event.incident_id, error=exc))
                jobs = ()
            if earlier is not None:
                jobs = _same_lives(earlier, jobs)
            others = tuple(f"{i.check}/{i.subject}" for i in self.tracker.incidents()
                           if i.firing and i.status is Status.CRITICAL and i.id != event.incident_id)
            ctx = ActionContext(event, jobs, self.node, self.slurm, self.clock, others, self.slurmd, self.reports,
                                claims=self.claims, resume_gates=self.resume_gates, held_reason=self._held_reason(),
                                on_diag=self._diag_to_ledger)
            self._watch_again(ctx, reports or {})
            self._keep(list_id, {**entry, "jobs": [_brief(j) for j in jobs], "reports": self._reports_asked(ctx)})
            whole = self._run_list(ctx, names, list_id)
        finally:
            if ctx is not None:
                ctx.done()
            self._end(list_id, whole)

    def _end(self, list_id: str, whole: bool) -> None:
        """A list ended: done (`whole`), or stopped between actions by a stop (kept: the next start takes up the
        rest), or handed over after a reload (what it did since, for the next responder: `_follow`)."""
        with self._lists_lock:
            self._running.pop(list_id, None)
            handover = self._handed.pop(list_id, None)
            entry = self._lists.pop(list_id, None) if handover is not None else None
            close, self._close_last = (self._close_last, None) if not self._handed else (None, self._close_last)
        if handover is not None and self.state is not None:
            try:
                self.state.put(HANDOVER_KEY + list_id, json.dumps({**handover, "next": (entry or {}).get("next", 0)}))
            except Exception as exc:  # noqa: BLE001 - the next responder gives the list up, said as unknown
                log.error("handing over an action list failed", extra=kv(list=list_id, error=exc))
        elif whole or not self._closing:
            self._keep(list_id, None)
        elif (kept := self._lists.get(list_id)) is not None:  # stopped between two actions: by a reload if the
            self._keep(list_id, {**kept, "stopped": self.process})  # responder that takes it up is in this process
        if close is not None:
            close()

    def _keep(self, list_id: str, entry: dict[str, Any] | None) -> None:
        """Save the lists under way with `list_id`'s entry set (None: the list is done). Never raises: a state
        database that cannot be written costs the taking up after a stop, not the actions."""
        if self.state is None:
            return
        with self._lists_lock:
            if entry is None:
                self._lists.pop(list_id, None)
            else:
                self._lists[list_id] = entry
            if self._sealed:  # after `finish`: what is under way is saved by the next responder, or handed to it
                return
            try:
                self.state.put(LISTS_KEY, json.dumps(self._lists))
            except Exception as exc:  # noqa: BLE001 - the store may be closing (a list cut short at shutdown)
                log.warning("saving the action lists under way failed", extra=kv(list=list_id, error=exc))

    def _progress(self, list_id: str, index: int, started: bool, reports: dict[str, Any] | None = None) -> None:
        """The list is at `names[index]`: `started` (under way), or not yet begun; `reports`: the ranks' reports it
        holds now (_reports_asked)."""
        with self._lists_lock:
            entry = self._lists.get(list_id)
        if entry is not None:
            more = {"reports": reports} if reports is not None else {}
            self._keep(list_id, {**entry, "next": index, "started": started, "at": self.clock(), **more})

    @staticmethod
    def _reports_asked(ctx: ActionContext) -> dict[str, Any]:
        """What a list taken up after a stop needs to watch the ranks' reports this list holds (its save signal
        asked for them, or joined another list's), by job id. Before and after each action: a request written slowly
        (NSS, NFS) after its signal returned is kept before the requeue's wait."""
        out = {}
        for job_id, report in ctx.reports.held_by(ctx.actions).items():
            kept = report.kept() if isinstance(report, SaveReport) else None
            if kept is not None:
                out[job_id] = kept
        return out

    @staticmethod
    def _watch_again(ctx: ActionContext, reports: Mapping[str, Any]) -> None:
        """A list taken up after a stop: the reports it held are watched again for its jobs whose same life still
        runs here (the requeue it takes up then gives the ranks `after_save` from rank 0's report, not its whole
        `wait_exit` for a rank that never exits). For the others (ended meanwhile, or in a later life) the dead agent's
        request is only removed."""
        here = {j.job_id for j in ctx.jobs if j.job_id and j.processes}
        _withdraw(ctx.event, {job_id: kept for job_id, kept in reports.items() if job_id not in here})
        for job_id, kept in reports.items():
            if job_id not in here:
                continue
            try:
                report = _kept_report(job_id, kept)
                ctx.reports.join(job_id, ctx.actions, lambda report=report: SaveReport.resumed(report))
            except Exception as exc:  # noqa: BLE001 - the list goes on: its requeue waits wait_exit, as before
                log.error("a report asked for before the stop could not be watched again", extra=kv(
                    incident=ctx.event.incident_id, job=job_id, error=exc))

    def resume(self, bindings: Callable[[Event], ActionBinding | None]) -> list[threading.Thread]:
        """At start: take up the lists a stop or a crash cut short within RESUME_WITHIN_S, for incidents still firing
        (as saved: the checks have not run yet), with the actions their check is still bound to, as the same kind. The
        action cut short runs again if it is safe to repeat (`Action.resumes`), and the list goes on after it (those
        never began); one that is not safe to repeat is recorded on the incident as interrupted, and the list ends
        there (a requeue after a signal that may never have been sent would end the job unsaved). A list still
        running in this process (a reload) is followed instead (`_follow`). `bindings`: the actions an event's
        check binds to it now (`Check.actions_for`: the saved event's details choose, as they chose at its
        start); None when its check is no longer configured."""
        if self.state is None:
            return []
        try:
            saved = json.loads(self.state.get(LISTS_KEY) or "{}")
            self.state.put(LISTS_KEY, "{}")
        except Exception as exc:  # noqa: BLE001 - unreadable state: nothing to take up, the agent starts anyway
            log.error("reading the action lists cut short failed", extra=kv(error=exc))
            return []
        threads = []
        for list_id, entry in saved.items() if isinstance(saved, dict) else ():
            live = entry.get("live") if isinstance(entry, dict) else None
            if isinstance(live, dict) and live.get("process") == self.process:
                threading.Thread(target=self._follow, args=(str(list_id), entry, bindings),
                                 name=f"follow-{list_id}", daemon=True).start()
                continue
            stopped = isinstance(entry, dict) and entry.get("stopped") == self.process
            thread = self._take_up(str(list_id), entry, bindings, STOPPED if stopped else CUT)
            if thread is not None:
                threads.append(thread)
            if self._closing:
                break
        return threads

    def _follow(self, list_id: str, entry: dict[str, Any], bindings: Callable[[Event], ActionBinding | None]) -> None:
        """A list a reload left running in this process: kept as it is (a crash meanwhile leaves it cut short, for the
        next start), waited for until the old responder hands it over (its action's timeout at most), then taken up
        after what it did. A stop meanwhile leaves it marked for the responder after this one."""
        state = self.state
        if state is None:
            return
        self._keep(list_id, entry)
        until = float(entry["live"]["until"])
        while not state.get(HANDOVER_KEY + list_id) and time.monotonic() < until:
            if self._stop.wait(0.2):
                return
        if not state.get(HANDOVER_KEY + list_id):
            self._keep(list_id, None)
            event, names = Event.from_dict(entry["event"]), entry["names"]
            self._interrupted(event, names[min(int(entry["next"]), len(names) - 1)], "left running by a reload and "
                              "not handed over within its timeout: its outcome is unknown; not run again, nor the "
                              "actions after it")
            return
        self._keep(list_id, None)
        self._take_up(list_id, entry, bindings, HANDED)

    def _handed_in(self, list_id: str, entry: dict[str, Any]) -> dict[str, Any]:
        """`entry` after what its old responder handed over (`_end`), that recorded here: its outcomes on the incident
        and the ledger, the subject forgotten after a fresh start; the list then goes on at the action after."""
        state = self.state
        raw = state.get(HANDOVER_KEY + list_id) if state is not None else None
        if state is None or not raw:
            return entry
        state.delete(HANDOVER_KEY + list_id)  # read once: a crash while recording records nothing twice
        data = json.loads(raw)
        event = Event.from_dict(entry["event"])
        for record in data["records"]:
            kind = record.pop("kind", "")
            try:
                self.tracker.record_action(event.check, event.subject, record, event.incident_id)
                if self.ledger is not None:
                    self.ledger.on_action(event, kind, record)
            except Exception as exc:  # noqa: BLE001 - the audit line said it
                log.error("recording a handed-over action's outcome failed", extra=kv(
                    action=record.get("action"), incident=event.incident_id, error=exc))
        if data.get("forget") and self.forget is not None:
            try:
                self.forget(event.check, event.subject)
            except Exception as exc:  # noqa: BLE001 - an incident left open says the rest
                log.error("forgetting the subject's history failed", extra=kv(
                    check=event.check, subject=event.subject, error=exc))
        return {**entry, "next": int(data["next"]), "started": False}

    def _take_up(self, list_id: str, entry: Any, bindings: Callable[[Event], ActionBinding | None],
                 how: str = CUT) -> threading.Thread | None:
        """One list cut short (`resume`), or left by a reload (`how`): its rest started, or said why not."""
        try:
            entry = self._handed_in(list_id, entry)
            event = Event.from_dict(entry["event"])
            names = [str(n) for n in entry["names"]]
            at, index, started = float(entry["at"]), int(entry["next"]), bool(entry["started"])
            kinds = {str(k): str(v) for k, v in dict(entry["kinds"]).items()}
            briefs = entry.get("jobs")  # None: cut before its jobs were listed; they are listed now
            jobs = None if briefs is None else tuple(j for j in map(_from_brief, briefs) if j is not None)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            log.error("an action list cut short could not be read; not taken up", extra=kv(error=exc))
            return None
        left = names[index:]
        if not left:  # every action had returned: only the list's removal was cut
            return None
        where = kv(incident=event.incident_id, check=event.check, subject=event.subject, actions=",".join(left))
        reports = entry.get("reports")  # none before this version, or nothing asked
        reports = reports if isinstance(reports, dict) else {}
        if not any(i.firing and i.id == event.incident_id for i in self.tracker.incidents()):
            log.info("action list cut short; its incident is over, not taken up", extra=where)
            _withdraw(event, reports)
            return None
        binding = bindings(event)
        bound = set(binding.for_status(event.status)) if binding is not None else set()
        again = [n for n in left if n in bound and n in self.actions and kinds.get(n) == type(self.actions[n]).__name__]
        why = ("no longer bound as it was" if again[:1] != left[:1] else
               f"cut more than {RESUME_WITHIN_S:g}s ago" if how == CUT and self.clock() - at > RESUME_WITHIN_S else "")
        if why:
            log.error(f"action list {how}; not taken up: {why}", extra=where)
            what = f"not begun: the list was {how}"  # the action a reload left ran to its end
            if how == CUT:
                what = ("cut short" if started else "not begun") + " at the agent's stop or crash"
            self._interrupted(event, left[0], f"{what}; not taken up ({why})")
            _withdraw(event, reports)
            return None
        if started and not self.actions[again[0]].resumes:
            self._interrupted(event, again[0], "cut short by the agent's stop or crash; not run again at start "
                              "(not safe to repeat), nor the actions after it")
            _withdraw(event, reports)
            return None
        log.warning(f"action list {how}; taken up", extra=kv(
            incident=event.incident_id, check=event.check, subject=event.subject, actions=",".join(again),
            jobs=",".join(j.job_id or j.key for j in jobs or ()) or None))
        thread = threading.Thread(target=self._run_all, args=(event, again, jobs, reports),
                                  name=f"actions-{event.incident_id}", daemon=True)
        with self._threads_lock:
            if self._closing:
                return None
            self.threads = [t for t in self.threads if t.is_alive()] + [thread]
            thread.start()
        return thread

    def _interrupted(self, event: Event, name: str, detail: str) -> None:
        log.error("action", extra=kv(action=name, outcome="interrupted", incident=event.incident_id,
                                     check=event.check, subject=event.subject, detail=detail))
        try:
            self.tracker.record_action(event.check, event.subject, {
                "action": name, "at": self.clock(), "outcome": "interrupted", "detail": detail}, event.incident_id)
        except Exception as exc:  # noqa: BLE001 - the audit line said it
            log.error("recording the action's outcome failed", extra=kv(action=name, error=exc))

    def _run_list(self, ctx: ActionContext, names: list[str], list_id: str = "") -> bool:
        """Run `names` in order; False when a stop or a reload stopped it between two actions (the rest is the next
        start's, or the next engine's)."""
        event = ctx.event
        for index, name in enumerate(names):
            if index and self._closing:  # the first runs: a fault that fired a second before the stop is acted on
                log.warning("action list stopped: the agent is stopping or reloading; the rest is taken up after it",
                            extra=kv(incident=event.incident_id, actions=",".join(names[index:])))
                return False
            action = self.actions[name]
            self._progress(list_id, index, True, self._reports_asked(ctx))
            record = self.run_one(action, ctx)
            self._progress(list_id, index + 1, False, self._reports_asked(ctx))
            with self._lists_lock:
                handover = self._handed.get(list_id)
                if handover is not None:  # the tracker's store is closed: the next responder records it
                    handover["records"].append({**record, "kind": type(action).__name__})
                    handover["forget"] = handover["forget"] or _fresh(action, record)
            if handover is not None:
                continue
            try:
                self.tracker.record_action(event.check, event.subject, record, event.incident_id)
            except Exception as exc:  # noqa: BLE001 - the audit line said it; the next actions still run
                # (an action cut short at shutdown returns after the store closed)
                log.error("recording the action's outcome failed", extra=kv(
                    action=name, incident=event.incident_id, outcome=record["outcome"], error=exc))
            self._to_ledger(event, action, record)
            if _fresh(action, record) and self.forget is not None:
                # The job started afresh: what the check learned about it (a NaN streak in the log it still writes,
                # samples of the processes gone) is the earlier start's, and must not hold the incident open.
                try:
                    self.forget(event.check, event.subject)
                except Exception as exc:  # noqa: BLE001 - the restart is done; an incident left open says the rest
                    log.error("forgetting the subject's history failed", extra=kv(
                        check=event.check, subject=event.subject, error=exc))
        return True

    def _held_reason(self) -> str:
        try:
            return self.ledger.held_reason() if self.ledger is not None else ""
        except Exception as exc:  # noqa: BLE001 - the drain goes on with the incident's own reason
            log.error("reading the lemon holds failed", extra=kv(error=exc))
            return ""

    def _to_ledger(self, event: Event, action: Action, record: dict[str, Any]) -> None:
        if self.ledger is None:
            return
        try:
            self.ledger.on_action(event, type(action).__name__, record)
        except Exception as exc:  # noqa: BLE001 - the ledger is history: the next actions still run
            log.error("recording the action in the ledger failed", extra=kv(action=action.name, error=exc))

    def _diag_to_ledger(self, report: DiagReport, source: str) -> None:
        if self.ledger is None:
            return
        try:
            self.ledger.on_diag(report, source)
        except Exception as exc:  # noqa: BLE001 - the ledger is history: the action's verdict stands
            log.error("recording the diagnostics in the ledger failed", extra=kv(level=report.level, error=exc))

    def run_named(self, name: str, event: Event, jobs: tuple[Job, ...] = (),
                  others_critical: tuple[str, ...] = ()) -> dict[str, Any]:
        """Run one configured action for `event` now (the `check --drain` path, tests); its outcome record."""
        if name not in self.actions:
            return {"action": name, "at": self.clock(), "outcome": "failed", "detail": f"no `{name}` action configured"}
        ctx = ActionContext(event, jobs, self.node, self.slurm, self.clock, others_critical, self.slurmd, self.reports,
                            claims=self.claims, resume_gates=self.resume_gates, held_reason=self._held_reason(),
                            on_diag=self._diag_to_ledger)
        try:
            return self.run_one(self.actions[name], ctx)
        finally:
            ctx.done()

    def run_one(self, action: Action, ctx: ActionContext) -> dict[str, Any]:
        started = self.clock()
        plan = action.plan(ctx)
        box: dict[str, str] = {}
        if action.settings.dry_run:
            outcome, detail = "dry_run", f"would {plan}"
        else:
            done = threading.Event()

            def target() -> None:
                try:
                    box["detail"] = action.run(ctx)
                    box["outcome"] = "ok"
                except ActionRefusedError as exc:
                    box["detail"], box["outcome"] = str(exc), "refused"
                except ActionSkippedError as exc:  # nothing to act on: said as such, never as done or failed
                    box["detail"], box["outcome"] = str(exc), "skipped"
                    if isinstance(exc, ActionAnsweredError):
                        box["answered"] = "yes"
                except ActionError as exc:
                    box["detail"], box["outcome"] = str(exc), "failed"
                except Exception as exc:  # noqa: BLE001 - a buggy action must not take others down
                    box["detail"], box["outcome"] = f"{type(exc).__name__}: {exc}", "failed"
                finally:
                    done.set()

            threading.Thread(target=target, name=f"action-{action.name}", daemon=True).start()
            if done.wait(action.settings.timeout):
                outcome, detail = box["outcome"], box["detail"]
            else:
                outcome, detail = "timeout", f"still running after {action.settings.timeout:g}s: {plan}"
        key = (ctx.event.incident_id, action.name)
        with self._refused_lock:
            if outcome == "refused":
                self._refused[key] = {"action": action.name, "check": ctx.event.check, "subject": ctx.event.subject,
                                      "incident": ctx.event.incident_id, "detail": detail, "at": started}
            elif outcome == "ok":
                self._refused.pop(key, None)
        level = {"ok": logging.WARNING, "dry_run": logging.WARNING, "skipped": logging.INFO}.get(outcome, logging.ERROR)
        log.log(level, "action", extra=kv(action=action.name, outcome=outcome, incident=ctx.event.incident_id,
                                          check=ctx.event.check, subject=ctx.event.subject,
                                          jobs=",".join(j.job_id or j.key for j in ctx.jobs) or None, detail=detail))
        record: dict[str, Any] = {"action": action.name, "at": started, "outcome": outcome, "detail": detail}
        if outcome == "skipped" and box.get("answered"):
            record["answered"] = True  # another list's action did it: a fresh start all the same (`_fresh`)
        return record
