"""The SLURM job source: the jobs running on this node, found on this node, at a cost that follows this node.

Which jobs run here comes from the node (`slurmnode`: the SLURM cgroup tree where there is one, else the slurmd
spool dir, whose mtime says when a step started or ended, and `scontrol listpids`), and from the Prolog/Epilog hook
when it is installed (`prolog`). Nothing of this asks slurmctld. What only the controller knows (name, array ids,
StdOut/StdErr, WorkDir, EndTime, requeue) is fetched once per job by id (`scontrol show job ID`, one
REQUEST_JOB_INFO_SINGLE), in a background thread so that a slow or dead controller never holds up a check, and kept
for the job's life; it is fetched again only when asked (`refresh`: the time-limit check, on the job's owner node,
every `recheck` and near EndTime; never more often than `slurm_refetch_min` after the last try, and never over a
retry's backoff while the controller is down) and once when the job ends, for its final state and exit code.

A job is known as soon as its first process runs (or its prolog ran). Between two listings a watcher thread looks at
the node's job directories every WATCH_S (a stat, or a directory listing: no process read, no RPC), so that a job
living less than a listing period (an array task that honours the stop switch before its first step) is still known
and its record fetched. One whose steps are gone is no longer running at once, and is forgotten `LINGER_S` later
(its final state stays visible that long, for the checks that report how a job ended). While the controller does not
answer, the jobs stay known from the node and `stale()` says so.

Whoever must look at a job as soon as it starts (the log check notes where a job's logs end before it writes)
`listen`s: it is told when the watcher finds a job new to this node, when a prolog record is written, and when a job's
first record comes back.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from trainguard.core.listeners import Listeners
from trainguard.core.logs import kv
from trainguard.jobs.model import Job, ProcessRef
from trainguard.jobs.prolog import PrologRecord, RecordReader
from trainguard.jobs.settings import JobsSettings
from trainguard.jobs.slurm import JobRecord, SlurmClient, SlurmError, expand_output_path, parse_job_record
from trainguard.jobs.slurmnode import (
    CgroupRoot,
    cgroup_job_ids,
    cgroup_job_owners,
    cgroup_jobs,
    cgroup_roots,
    conf_text,
    spool_dir,
    spool_listing,
)
from trainguard.node.proctable import ProcessSnapshots, ProcessTable

log = logging.getLogger("trainguard.slurm")

LINGER_S = 600.0  # an ended job stays in the view this long, with its final state
PROLOG_GRACE_S = 120.0  # a prolog's record alone (no step seen yet) makes a job running for this long
RETRY_S = (5.0, 30.0, 60.0, 300.0)  # after a failed fetch (controller down), then every 5 minutes
FINAL_TRIES = 5  # an ended job's final state: the controller may still say COMPLETING for a moment
REDISCOVER_S = 60.0  # where no cgroup or spool dir was found, look again this often (slurmd may start later)
WATCH_S = 0.25  # the watcher's period: jobs that live longer than this are seen even between two listings
STARTING_S = 60.0  # a job directory with no process in it is a job starting for this long; after, a leftover
GOING_S = 5.0  # a job the controller says ended while its steps are still here is asked about again after this, then
# after as long as it has been going, up to the settings' slurm_refetch_min
# What the controller says of a job whose steps run here and that is not going away. Anything else (COMPLETING, an
# ended state, PENDING/REQUEUED after a requeue) while steps are still here: the job is COMPLETING, its steps being
# killed or finishing, and no check judges it (a finished job's EndTime is its end: "time limit in 0s").
LIVE_STATES = frozenset({"RUNNING", "CONFIGURING", "SUSPENDED", "STOPPED", "RESIZING", "SIGNALING"})


def going_wait(going_for: float, cap: float) -> float:
    """How long after a fetch that said a job is going (its steps still here) to ask again: GOING_S at first, then
    as long as it has been going, up to `cap` (the refetch minimum: 5, 5, 10, 20, 40, 60, 60 s ... for 60 s)."""
    return min(cap, max(GOING_S, going_for))


@dataclass
class _Local:
    """What this node knows of one job."""

    job_id: str
    seen: float  # first seen here
    refs: tuple[ProcessRef, ...] = ()
    uid: int | None = None  # from the node: the cgroup path, the prolog's environment, its processes
    stepped: bool = False  # a step or process of it was seen (a prolog record alone is not that)
    prolog: PrologRecord | None = None
    raw: str | None = None  # the controller's record as printed, parsed again once the uid is known
    record: JobRecord | None = None
    fetched: float | None = None
    failures: int = 0
    ended: float | None = None
    final_tries: int = 0
    array_pending: bool | None = None
    glimpsed: bool = False  # found by the watcher, between listings
    placed: tuple[str | None, str | None] = (None, None)  # (BatchHost, NodeList) of this life, as last said
    life: JobRecord | None = None  # the controller's record of the life running here, while it ran
    going_since: float | None = None  # when the controller first said it is going while its steps are still here
    attempted: float | None = None  # the last fetch's start, answered or not
    fetching: bool = False  # a fetch of it is under way


@dataclass
class _Due:
    job_id: str
    kind: str  # "first", "refresh" or "final"
    at: float


@dataclass
class _Discovery:
    """How this node's jobs are found, decided at start and again every REDISCOVER_S while nothing better exists."""

    roots: list[CgroupRoot] = field(default_factory=list)
    spool: Path | None = None
    decided: float = 0.0

    @property
    def method(self) -> str:
        return "cgroup" if self.roots else "spool" if self.spool else "listpids"


class SlurmSource:
    """The SLURM jobs on this node (JOB_SOURCES["slurm"])."""

    def __init__(self, settings: JobsSettings, node: str, client: SlurmClient,
                 processes: ProcessSnapshots | None = None, clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.node = node
        self.client = client
        self.processes = processes or ProcessSnapshots()
        self.clock = clock
        self.switch_template = settings.switch_dir
        # slurm_node set: this host may run several slurmd (a test fleet); name ours to scontrol and in the spool
        self._named = settings.slurm_node
        self.records = RecordReader(settings.prolog_dir, self._named) if settings.prolog_dir else None
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._fetched = threading.Condition(self._lock)
        self._jobs: dict[str, _Local] = {}
        self._due: dict[str, _Due] = {}
        self._worker: threading.Thread | None = None
        self._watcher: threading.Thread | None = None
        self._stop = threading.Event()
        self._leftovers: set[str] = set()  # job directories that never held a process: not taken in again
        self._closed = False
        self._dirty = True  # something arrived since the last listing (a fetched record)
        self._built: object = None  # the node's signature at the last listing
        self._pids: dict[str, list[int]] = {}  # the last listpids, reused while the spool dir is unchanged
        self._spool_seen: int | None = None
        self._stale: str | None = None
        self._discovery = _Discovery()
        self._listeners = Listeners()
        self._discover(force=True)

    # discovery ------------------------------------------------------------------------------------------------
    def _discover(self, force: bool = False) -> None:
        now = self.clock()
        if not force and (self._discovery.method != "listpids" or now - self._discovery.decided < REDISCOVER_S):
            return
        roots = cgroup_roots(self.processes.proc.mountinfo(), self._named or self.node)
        spool = spool_dir(self._named or self.node, socket.gethostname().split(".")[0], conf_text(os.environ),
                          self.settings.slurmd_spool_dir)
        before = self._discovery.method
        self._discovery = _Discovery(roots, spool, now)
        if force or self._discovery.method != before:
            log.info("SLURM jobs of this node", extra=kv(method=self._discovery.method, cgroup=",".join(
                str(r.path) for r in roots) or None, spool=spool, prolog_dir=self.settings.prolog_dir or None))

    def _signature(self) -> object:
        """Cheap: what changes when a job starts or ends here (directory listings and mtimes, no process read)."""
        d = self._discovery
        node: object = None
        if d.roots:
            node = tuple(cgroup_job_ids(r) for r in d.roots)
        elif d.spool is not None:
            node = _mtime(d.spool)
        return (node, self.records.signature() if self.records else None)

    def changed(self) -> bool:
        """Whether a listing now would differ from the last one (a step started or ended, a hook wrote, a fetch
        came back); where only `scontrol listpids` can tell, the catalog's refresh period decides instead."""
        with self._lock:
            if self._dirty:
                return True
        return self._discovery.method != "listpids" and self._signature() != self._built

    def _evidence(self, table: ProcessTable) -> dict[str, tuple[list[int], int | None]]:
        """job id -> (pids, uid as the node knows it) of the jobs with a step here now."""
        d = self._discovery
        if d.roots:
            found: dict[str, tuple[list[int], int | None]] = {}
            for root in d.roots:
                for job in cgroup_jobs(root).values():
                    if job.pids and job.job_id not in found:
                        found[job.job_id] = (list(job.pids), job.uid)
            return found
        if d.spool is not None:
            stamp = _mtime(d.spool)
            if stamp != self._spool_seen:  # a step started or ended: ask the stepds for pids again
                self._pids = self.client.local_pids(self._named)
                self._spool_seen = stamp
            here = spool_listing(d.spool, self._named)
            if here - set(self._pids):  # a step's socket came before its first process: ask again next time
                self._spool_seen = None
                self._dirty = True
            # a job whose socket is gone has ended even if listpids ran before it did
            return {job: (pids, None) for job, pids in self._pids.items() if job in here}
        return {job: (pids, None) for job, pids in self.client.local_pids(self._named).items()}

    def _glimpse(self) -> dict[str, int | None]:
        """job id -> uid (None where the node does not say) of the jobs with a step here now: listings only."""
        d = self._discovery
        if d.roots:
            return {job: uid for root in d.roots for job, uid in cgroup_job_owners(root).items()}
        if d.spool is not None:
            return dict.fromkeys(spool_listing(d.spool, self._named))
        return {}

    def _watch(self) -> None:
        """Between listings: a job not known yet is taken in at once and its record asked for, so that it is known
        (name, array, workdir) even if it has ended by the next listing. The spool dir is listed only when its
        mtime changed; a cgroup tree has no such stamp and is listed each time (one directory per user on v1)."""
        stamp: object = None
        hooks: object = self.records.signature() if self.records else None
        while not self._stop.wait(WATCH_S):
            if self.records and self._listeners:  # a prolog wrote (a job about to start here): one stat
                now_hooks = self.records.signature()
                if now_hooks != hooks:
                    hooks = now_hooks
                    self._announce("prolog record")
            d = self._discovery
            if d.spool is not None and not d.roots:
                now_stamp = _mtime(d.spool)
                if now_stamp == stamp:
                    continue
                stamp = now_stamp
            try:
                found = self._glimpse()
            except OSError as exc:  # the listings handle their own errors; this is belt and braces for a thread
                log.warning("job directory watch failed", extra=kv(error=exc))
                continue
            now = self.clock()
            new = False
            with self._lock:
                self._leftovers.intersection_update(found)  # gone and back (a requeue): a job again
                for job_id, uid in found.items():
                    if job_id in self._jobs or job_id in self._leftovers or self._closed:
                        continue
                    self._jobs[job_id] = _Local(job_id, now, uid=uid, stepped=True, glimpsed=True)
                    self._schedule(job_id, "first", now)
                    self._dirty = True
                    new = True
            if new:
                self._announce("job found")

    def listen(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` (from this source's threads: it must return at once) when there is news of a job starting
        here: found between listings, its prolog record written, its first record back. Returns what stops it."""
        return self._listeners.add(callback)

    def _announce(self, what: str) -> None:
        self._listeners.tell(what)  # a listener's failure never stops the watcher or the fetches

    # the listing -----------------------------------------------------------------------------------------------
    def jobs(self) -> Sequence[Job]:
        self._discover()
        if self._watcher is None and self._discovery.method != "listpids" and not self._closed:
            self._watcher = threading.Thread(target=self._watch, name="slurm-watch", daemon=True)
            self._watcher.start()
        looked = self.clock()
        signature = self._signature()
        table = self.processes.get()
        evidence = self._evidence(table)  # raises SlurmError when listpids fails: nothing is known then
        with self._lock:
            glimpsed = any(local.glimpsed for local in self._jobs.values())
        # a job the watcher saw whose step has no process yet (a socket or cgroup before its first task) is starting,
        # not ended: only one gone from the directories too has ended (listed only while such a job exists)
        present = self._glimpse() if glimpsed else {}
        records = self.records.read() if self.records else {}
        if self.records and self.records.problem:
            log.warning("prolog records ignored", extra=kv(reason=self.records.problem))
        now = self.clock()
        with self._lock:
            self._dirty = False
            self._built = signature
            live = set(evidence) | {j for j, r in records.items() if self._prolog_live(r, now, j)}
            for job_id in live:
                self._update(job_id, evidence.get(job_id), records.get(job_id), table, now)
                local = self._jobs[job_id]
                if local.record is not None and local.record.state not in LIVE_STATES and local.fetched is not None:
                    # the controller said it is going while steps remain: ask again soon, so that a job requeued
                    # back onto this node between two listings is not taken as going for a whole minute; backing off
                    # to that rate, since a step stuck in D state keeps a job COMPLETING for days
                    local.going_since = local.fetched if local.going_since is None else local.going_since
                    self._schedule(job_id, "refresh", local.fetched + going_wait(local.fetched - local.going_since,
                                                                                 self.settings.slurm_refetch_min))
                elif local.record is not None:
                    local.going_since = None
            for job_id, record in records.items():  # ran and ended between two listings: the hooks saw it
                if job_id not in self._jobs and record.ended is not None and now - record.ended < LINGER_S:
                    self._jobs[job_id] = _Local(job_id, record.started, uid=record.uid, prolog=record,
                                                ended=record.ended)
                    self._schedule(job_id, "final", now)
            for job_id, local in list(self._jobs.items()):
                if job_id in live:
                    continue
                if local.glimpsed and local.ended is None:
                    if local.seen >= looked or (job_id in present and now - local.seen < STARTING_S):
                        continue  # starting; or seen by the watcher after this listing looked
                    if job_id in present:  # a socket or cgroup left behind (a crashed slurmstepd), never a process
                        log.warning("SLURM job directory without processes ignored", extra=kv(job=job_id))
                        self._leftovers.add(job_id)
                if local.ended is None:
                    local.ended = now
                    if records.get(job_id) is not None:
                        local.prolog = records[job_id]
                    self._schedule(job_id, "final", now)  # at once: a stop switch may wait on it
                elif now - local.ended > LINGER_S:
                    del self._jobs[job_id]
                    self._due.pop(job_id, None)
            return [self._job(local) for local in self._jobs.values()]

    def _prolog_live(self, record: PrologRecord, now: float, job_id: str) -> bool:
        """A prolog ran and no epilog yet: running, until steps have come and gone or the grace passed without any."""
        if record.ended is not None:
            return False
        local = self._jobs.get(job_id)
        if local is not None and local.stepped:
            return False  # its steps were seen and are gone: ended, whatever the hook (no epilog installed)
        return now - record.started < PROLOG_GRACE_S

    def _update(self, job_id: str, found: tuple[list[int], int | None] | None, record: PrologRecord | None,
                table: ProcessTable, now: float) -> None:
        local = self._jobs.get(job_id)
        if local is None or local.ended is not None:  # new here, or back (requeued onto this node): a new life
            local = self._jobs[job_id] = _Local(job_id, now)
            self._schedule(job_id, "first", now)
        local.glimpsed = False
        if record is not None:
            local.prolog = record
            local.uid = local.uid if local.uid is not None else record.uid
        if found is not None:
            pids, uid = found
            local.stepped = True
            local.refs = _top_refs(pids, table, local.refs)
            if local.uid is None:
                local.uid = uid if uid is not None else next((u for r in local.refs if (u := r.uid()) is not None),
                                                              None)
        if local.raw is not None and (local.record is None or local.record.uid != local.uid) and local.uid is not None:
            _adopt(local, parse_job_record(local.raw, local.uid) or local.record)

    # building a Job ----------------------------------------------------------------------------------------------
    def _job(self, local: _Local) -> Job:
        rec, pro = local.record, local.prolog
        name = rec.name if rec else (pro.name if pro else None)
        array_job = rec.array_job_id if rec else (pro.array_job_id if pro else None)
        task = rec.array_task_id if rec else (pro.array_task_id if pro else None)
        user = (rec.user if rec and rec.uid == local.uid else None) or (pro.user if pro else None)
        workdir = (rec.workdir if rec else None) or (pro.workdir if pro else None)
        stdout = rec.stdout if rec else None
        stderr = rec.stderr if rec else None
        if rec is None and pro is not None:  # the prolog sees the patterns as submitted
            fields = {"job_id": local.job_id, "name": name, "user": user, "array_job_id": array_job,
                      "array_task_id": task, "node": self._named or self.node}
            stdout = expand_output_path(pro.stdout, **fields) if pro.stdout else None
            stderr = expand_output_path(pro.stderr, **fields) if pro.stderr else stdout
        state, exit_code = "RUNNING", None
        if local.ended is not None:
            state, exit_code = _final(local)
        elif rec is not None and rec.state not in LIVE_STATES:
            state = "COMPLETING"  # steps still here, but the controller says the job ended or is ending
        start = (rec.start_time if rec else None) or (pro.started if pro else None) or min(
            (r.create_time for r in local.refs), default=None)
        extra: dict[str, object] = {"found_by": self._discovery.method if local.stepped else "prolog"}
        if rec is None:
            extra["incomplete"] = "not yet known to the agent: " + (self._stale or "asking slurmctld")
            if local.fetched is None and local.failures == 0:
                extra["record_pending"] = True  # asked, not answered yet (a second, usually)
        if local.array_pending is not None:
            extra["array_pending"] = local.array_pending
        fields = {"workdir": workdir or "", "job_id": local.job_id, "array_job_id": array_job or local.job_id,
                  "name": name or "", "user": user or ""}
        try:
            switch_dir = self.switch_template.format(**fields) if self.switch_template and workdir else None
        except (KeyError, IndexError, ValueError):
            switch_dir = None
        return Job(
            key=f"slurm:{local.job_id}", source="slurm", name=name or "", state=state, job_id=local.job_id,
            array_job_id=array_job, array_task_id=task, user=user, uid=local.uid,
            reason=rec.reason if rec and local.ended is not None else None, start_time=start,
            end_time=(rec.end_time if rec else None) or (pro.end_time if pro else None), exit_code=exit_code,
            workdir=workdir, stdout=stdout, stderr=stderr, on_this_node=True,
            processes=local.refs if local.ended is None else (), switch_dir=switch_dir,
            log_paths=tuple(dict.fromkeys(p for p in (stdout, stderr) if p)),
            requeue=rec.requeue if rec else True, batch_host=local.placed[0], node_list=local.placed[1],
            restarts=rec.restarts if rec else None, extra=extra)

    # the controller, in the background ------------------------------------------------------------------------------
    def stale(self) -> str | None:
        """Why what the controller knows of these jobs may be out of date (it did not answer); None when it did."""
        return self._stale

    def refresh(self, job_id: str, max_age: float = 0.0) -> None:
        """Fetch a job's record again (in the background) unless it is younger than `max_age`, or than the settings'
        `slurm_refetch_min` (a minute)."""
        with self._lock:
            local = self._jobs.get(job_id)
            if local is None or local.ended is not None or job_id in self._due or local.fetching:
                return  # one is due or under way (a retry after a failure keeps its backoff: the controller is down)
            last = max(t for t in (local.fetched, local.attempted, -math.inf) if t is not None)
            if self.clock() - last >= max(max_age, self.settings.slurm_refetch_min):
                self._schedule(job_id, "refresh", self.clock())

    def _schedule(self, job_id: str, kind: str, at: float) -> None:
        """Under the lock. A due fetch of the job is replaced only by an earlier or more final one."""
        current = self._due.get(job_id)
        if current is not None and current.kind == "final" and kind != "final":
            pass  # the final fetch answers everything
        elif current is None or kind == "final" or at < current.at:
            self._due[job_id] = _Due(job_id, kind, at)
        if self._worker is None and not self._closed:
            self._worker = threading.Thread(target=self._work, name="slurm-fetch", daemon=True)
            self._worker.start()
        self._wake.notify()

    def _work(self) -> None:
        while True:
            with self._lock:
                due = None
                while due is None:
                    if self._closed:
                        return
                    now = self.clock()
                    soonest = min(self._due.values(), key=lambda d: d.at, default=None)
                    if soonest is not None and soonest.at <= now:
                        due = self._due.pop(soonest.job_id)
                    else:
                        self._wake.wait(None if soonest is None else min(60.0, soonest.at - now))
                local = self._jobs.get(due.job_id)
                uid = local.uid if local else None
                if local is not None:
                    local.attempted, local.fetching = self.clock(), True
            if local is None:
                continue
            try:
                self._fetch(due, uid)
            finally:
                with self._lock:
                    local.fetching = False
            if due.kind == "first":  # answered or failed: a check waiting for the job's life reads it now
                self._announce("first record")

    def _fetch(self, due: _Due, uid: int | None) -> None:
        text, error, pending = None, None, None
        try:
            text = self.client.show_job(due.job_id)
            if due.kind == "final" and text is not None:
                record = parse_job_record(text, uid)
                if record is not None and record.array_job_id:
                    pending = bool(self.client.pending_tasks(record.array_job_id))
        except SlurmError as exc:
            error = str(exc)
        now = self.clock()
        with self._lock:
            local = self._jobs.get(due.job_id)
            if local is None:
                return
            if error is not None:
                self._fetched.notify_all()
                if self._stale is None:
                    log.warning("slurmctld not answering; jobs of this node as last known",
                                extra=kv(job=due.job_id, error=error))
                self._stale = f"slurmctld not answering ({error})"
                local.failures += 1
                self._schedule(due.job_id, due.kind, now + RETRY_S[min(local.failures, len(RETRY_S)) - 1])
                return
            if self._stale is not None:
                log.info("slurmctld answering again", extra=kv(job=due.job_id))
            self._stale = None
            local.failures = 0
            local.fetched = now
            if text is not None:  # None: the controller forgot it (MinJobAge): what we had stays
                local.raw = text
                _adopt(local, parse_job_record(text, local.uid) or local.record)
                if local.uid is None and local.record is not None:  # a job the watcher alone saw (spool, v2):
                    local.uid = local.record.uid  # the controller's word (None where the name forged a UserId)
            if due.kind == "final" and local.ended is not None:
                local.final_tries += 1
                local.array_pending = pending if pending is not None else local.array_pending
                still = local.record is not None and local.record.state in ("RUNNING", "CONFIGURING", "COMPLETING")
                if still and local.final_tries < FINAL_TRIES:
                    self._schedule(due.job_id, "final", now + 2.0 * local.final_tries)
            self._dirty = True
            self._fetched.notify_all()

    def settle(self, timeout: float) -> None:
        """Wait, `timeout` at most, until the controller answered (or failed to) for every running job found so
        far (by its steps or its prolog): a one-shot `trainguard check` reports jobs with their attributes, and an
        action about a job listed before its record came acts on what the record says (its switch dir); the checks
        never wait."""
        with self._lock:
            self._fetched.wait_for(lambda: all(
                local.fetched is not None or local.failures > 0 for local in self._jobs.values()
                if local.ended is None), timeout)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._closed = True
            self._wake.notify_all()


def _adopt(local: _Local, record: JobRecord | None) -> None:
    """Take the controller's record of the job (under the lock), with the owner and nodes of the life running here."""
    if record is not None and record.state in LIVE_STATES and local.ended is None:
        local.life = record  # the life running here, as last said
    elif record is not None and _later_life(record, local.life) and (local.ended is not None
                                                                     or record.state not in LIVE_STATES):
        # Requeued: what the controller describes now is the job's next life (pending, or running on other nodes)
        # while this one is being killed here or is gone. The life that ran here ended REQUEUED; its owner, nodes and
        # log story are that life's, or this node would speak for (and act on) a job it no longer runs. (One
        # requeued back onto this node is a new life when it shows up.)
        assert local.life is not None
        record = dataclasses.replace(local.life, state="REQUEUED")
    local.record = record
    if record is not None and record.node_list:  # a requeued (pending) job has none: its owner is this life's
        local.placed = (record.batch_host, record.node_list)


def _later_life(new: JobRecord | None, life: JobRecord | None) -> bool:
    """Whether `new` describes a later life of the job than `life` (its restart count is higher)."""
    return (new is not None and life is not None and new.restarts is not None and life.restarts is not None
            and new.restarts > life.restarts)


def _final(local: _Local) -> tuple[str, str | None]:
    """An ended job's state and exit code: the controller's once it said them; the epilog's exit code while the
    controller does not answer; else ENDED, exit code unknown yet (a check reporting how jobs end waits for it)."""
    rec, pro = local.record, local.prolog
    if rec is not None and local.final_tries and rec.state not in ("RUNNING", "CONFIGURING", "COMPLETING"):
        return rec.state, rec.exit_code
    code = pro.exit_code if pro is not None else None
    if code is not None and local.failures:
        return ("COMPLETED" if code == "0:0" else "FAILED"), code
    return "ENDED", None


def _top_refs(pids: list[int], table: ProcessTable, known: tuple[ProcessRef, ...]) -> tuple[ProcessRef, ...]:
    """The topmost of a job's pids (a parent not among them) as trusted references: the table dates them; a pid
    newer than the table is dated by psutil; a pid that is gone is left out."""
    wanted = set(pids)
    refs = {r.pid: r for r in known if r.pid in wanted}
    out = []
    for pid in dict.fromkeys(pids):
        info = table.procs.get(pid)
        if info is not None and info.ppid in wanted:
            continue
        ref = refs.get(pid)
        if ref is None:
            ref = ProcessRef(pid, info.create_time) if info is not None else ProcessRef.of(pid)
        if ref is not None:
            out.append(ref)
    return tuple(out)


def _mtime(path: Path) -> int | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns ^ st.st_ino
