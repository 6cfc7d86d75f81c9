"""The responder: runs the named actions bound to a check when its incidents fire or escalate.

Each action runs in its own daemon thread with a timeout, logs an audit line, and its outcome is
recorded on the incident. An action runs at most once per incident unless it sets `repeat`.
Actions of one incident run in the order configured (save before drain before requeue).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from trainguard.actions.base import Action, ActionContext, ActionError, ActionRefusedError, Reports
from trainguard.checks.base import ActionBinding
from trainguard.core.events import Event, EventKind
from trainguard.core.logs import kv
from trainguard.core.model import Status
from trainguard.jobs.catalog import JobCatalog, JobView
from trainguard.jobs.model import Job
from trainguard.jobs.slurm import SlurmClient
from trainguard.pipeline.config import Config
from trainguard.pipeline.incidents import IncidentTracker
from trainguard.registry import Registry

log = logging.getLogger("trainguard.actions")


RECORD_WAIT_S = 5.0  # how long an action waits for a job's record from slurmctld (usually about a second)


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
                 forget: Callable[[str, str], None] | None = None) -> None:
        self.actions: dict[str, Action] = {
            name: registry.action_class(config.kind_of_action(name))(name, settings)
            for name, settings in config.actions.items()}
        self.catalog = catalog
        self.slurm = catalog.slurm if catalog else SlurmClient(config.jobs.slurm_timeout, config.jobs.slurm_bin_dir)
        self.node = catalog.node if catalog else (config.jobs.slurm_node or config.agent.node_name)
        self.slurmd = config.jobs.slurm_node
        self.forget = forget  # (check, subject): the check forgets the subject's history (the engine's, under its lock)
        self.reports = Reports()  # the ranks' reports asked for by a save signal, shared by the lists about a job
        self.tracker = tracker
        self.clock = clock
        self.threads: list[threading.Thread] = []
        self._threads_lock = threading.Lock()  # checks' threads start actions at once
        self._closing = False  # set by `finish`: an action starting after it would be cut short unseen
        # Actions that refused to act (the drain circuit breaker), by incident: an open fault nobody acted on.
        self._refused: dict[tuple[str, str], dict[str, Any]] = {}
        self._refused_lock = threading.Lock()

    def refused(self) -> list[dict[str, Any]]:
        """What actions refused to do and why, while the incidents they answered last."""
        with self._refused_lock:
            return [dict(r) for r in self._refused.values()]

    def handle(self, event: Event, binding: ActionBinding) -> threading.Thread | None:
        if event.kind.operator:  # an operator's ack or silence is news, never a reason to act
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
        a second before `systemctl stop` has its incident saved as fired, so the next start does not act again: an
        action cut short here (a drain, a requeue) would never happen. How many were running, and the threads
        (`actions-<incident>`) still running at the end."""
        deadline = time.monotonic() + timeout
        with self._threads_lock:
            self._closing = True
            alive = [t for t in self.threads if t.is_alive()]
        running = len(alive)
        for thread in alive:
            thread.join(max(0.0, deadline - time.monotonic()))
        return running, [t.name for t in alive if t.is_alive()]

    def jobs_for(self, event: Event, names: Sequence[str] = ()) -> tuple[Job, ...]:
        if self.catalog is None:
            return ()
        # only an action that needs the record waits for it (a restart, a switch): the others act on what is listed
        wait = any(self.actions[name].needs_record for name in names if name in self.actions)
        return event_jobs(self.catalog, event, RECORD_WAIT_S if wait else 0.0)

    def _run_all(self, event: Event, names: list[str]) -> None:
        try:
            jobs = self.jobs_for(event, names)
        except Exception as exc:  # noqa: BLE001 - still run node-level actions without jobs
            log.error("looking up jobs for actions failed", extra=kv(incident=event.incident_id, error=exc))
            jobs = ()
        others = tuple(f"{i.check}/{i.subject}" for i in self.tracker.incidents()
                       if i.firing and i.status is Status.CRITICAL and i.id != event.incident_id)
        ctx = ActionContext(event, jobs, self.node, self.slurm, self.clock, others, self.slurmd, self.reports)
        try:
            self._run_list(ctx, names)
        finally:
            ctx.done()

    def _run_list(self, ctx: ActionContext, names: list[str]) -> None:
        event = ctx.event
        for name in names:
            action = self.actions[name]
            record = self.run_one(action, ctx)
            try:
                self.tracker.record_action(event.check, event.subject, record, event.incident_id)
            except Exception as exc:  # noqa: BLE001 - the audit line said it; the next actions still run
                # (an action cut short at shutdown returns after the store closed)
                log.error("recording the action's outcome failed", extra=kv(
                    action=name, incident=event.incident_id, outcome=record["outcome"], error=exc))
            if action.fresh_start and record["outcome"] == "ok" and self.forget is not None:
                # The job started afresh: what the check learned about it (a NaN streak in the log it still writes,
                # samples of the processes gone) is the earlier start's, and must not hold the incident open.
                try:
                    self.forget(event.check, event.subject)
                except Exception as exc:  # noqa: BLE001 - the restart is done; an incident left open says the rest
                    log.error("forgetting the subject's history failed", extra=kv(
                        check=event.check, subject=event.subject, error=exc))

    def run_named(self, name: str, event: Event, jobs: tuple[Job, ...] = (),
                  others_critical: tuple[str, ...] = ()) -> dict[str, Any]:
        """Run one configured action for `event` now (the `check --drain` path, tests); its outcome record."""
        if name not in self.actions:
            return {"action": name, "at": self.clock(), "outcome": "failed", "detail": f"no `{name}` action configured"}
        ctx = ActionContext(event, jobs, self.node, self.slurm, self.clock, others_critical, self.slurmd, self.reports)
        try:
            return self.run_one(self.actions[name], ctx)
        finally:
            ctx.done()

    def run_one(self, action: Action, ctx: ActionContext) -> dict[str, Any]:
        started = self.clock()
        plan = action.plan(ctx)
        if action.settings.dry_run:
            outcome, detail = "dry_run", f"would {plan}"
        else:
            box: dict[str, str] = {}
            done = threading.Event()

            def target() -> None:
                try:
                    box["detail"] = action.run(ctx)
                    box["outcome"] = "ok"
                except ActionRefusedError as exc:
                    box["detail"], box["outcome"] = str(exc), "refused"
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
        level = logging.WARNING if outcome in ("ok", "dry_run") else logging.ERROR
        log.log(level, "action", extra=kv(action=action.name, outcome=outcome, incident=ctx.event.incident_id,
                                          check=ctx.event.check, subject=ctx.event.subject,
                                          jobs=",".join(j.job_id or j.key for j in ctx.jobs) or None, detail=detail))
        return {"action": action.name, "at": started, "outcome": outcome, "detail": detail}
