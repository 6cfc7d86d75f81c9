"""Restart a SLURM job's ranks in place, inside the job's allocation: no requeue, no wait for the scheduler.

A requeue goes through slurmctld: the job is killed, waits out its credential (`AuthInfo=cred_expire`, 120 s by
default), waits for a scheduling pass and starts from its batch script again, on nodes that may be busy by then. For
a fault that leaves every node of the job usable (a NaN streak, a hung rank, a leak) the allocation can be kept: the
ranks save and exit, and the job's batch script launches them again. Its part is one line, the trainer helper's
relaunch loop around `srun` (docs/jobs-and-actions.md):

    python3 -m trainguard.trainer relaunch -- srun python train.py

The action, in order: writes the `restart` request in the job's switch dir (as the job's user, as `switch` does:
the loop relaunches only when it finds a new request there after `srun` returns), sends the save signal to the job's
srun steps (never the batch script: the loop must live), waits up to `wait_exit` for them to end, on this node
(free) and then elsewhere (one REQUEST_JOB_STEP_INFO a second for this job), and cancels the steps still running
then (a rank hung in a collective or a CUDA call never exits by itself). The request is written before the signal:
a rank that exits before the loop could see a request would end the job instead.

With `leave_node`, for a fault of this node (a GPU lost: bind it after `drain`), the action first records the node
as left (`left.<job>.<life>.<node>` in the switch dir: one file per node, so two nodes lost at once each write their
own, and per life, so a requeued job's new allocation starts clean) and counts the nodes every agent recorded for
this life; the request names this node too. The loop starts srun again with `--exclude` of every node recorded, on
the spare node the allocation holds (`sbatch -N 3-4`, `srun -N 3`), again without a requeue. A job with no spare left
gets the fallback; when it is then neither restarted nor requeued, the record is removed again. A lost spare
(nothing of the job's work on the node: no process of its batch script or steps, no step spanning it) is only
recorded.

One fault, one answer per job: a restart of the job under way in another of the agent's lists, or done a moment ago
for a fault that began before it ended, answers a second incident's restart that would do the same (a restart in
place, or one without this node): that one is skipped, never run twice nor said done twice. A restart without this
node goes on beside one in place (the relaunch must leave the node), and a restart in place is skipped while a
restart without a node, this agent's or another's (its record and request in the switch dir, not yet in the ranks'
TRAINGUARD_LEFT), is under way or has just started the ranks again, or finds no spare (its fallback answers the fault).

A job whose ranks here do not run under the loop (their environment lacks TRAINGUARD_RESTARTS, which the loop sets)
would end at the signal, not restart: by default (`fallback = "requeue"`) it is signalled and requeued instead, as
`signal, requeue` would, so that a site may bind `restart` for every job whatever its batch script.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections.abc import Callable
from typing import Literal

from trainguard.actions.base import (
    Action,
    ActionAnsweredError,
    ActionContext,
    ActionError,
    ActionSkippedError,
    Claim,
    Report,
    each_job_at_once,
    slurm_jobs,
)
from trainguard.actions.savereport import REQUEST_WAIT, SaveReport, ask_save
from trainguard.actions.signal import signal_name
from trainguard.actions.slurmctl import RequeueAction, RequeueSettings, WaitExitSettings
from trainguard.actions.switch import create_switch_file, job_owner, remove_switch, switch_stats
from trainguard.core.settings import Duration, Field, field_validator
from trainguard.core.text import one_line
from trainguard.jobs.hostlist import expand
from trainguard.jobs.model import Job, ProcessRef
from trainguard.jobs.slurm import SlurmError
from trainguard.node.access import Identity
from trainguard.node.procfs import ProcFS

LOOP_VAR = "TRAINGUARD_RESTARTS"  # set by the trainer helper's relaunch loop for the command it runs
LOOP_MAX_VAR = "TRAINGUARD_MAX_RESTARTS"
LEFT_VAR = "TRAINGUARD_LEFT"  # set (maybe empty) when the loop can start srun without a node: those it left
STEP_NODES_VAR = "SLURM_STEP_NUM_NODES"  # srun's, in each rank's environment
LIFE_VAR = "SLURM_RESTART_COUNT"  # SLURM's, once the job was requeued (absent: 0): which life the ranks are of
LOOP_VARS = (LOOP_VAR, LOOP_MAX_VAR, LEFT_VAR, STEP_NODES_VAR, LIFE_VAR)
RELAUNCH_GRACE = 30.0  # a job restarted this recently may be between two sruns: its next step is waited for
RELAUNCH_WAIT = 10.0  # at most this long
POLL = 0.2  # the ranks on this node: /proc only
POLL_CONTROLLER = 1.0  # the ranks elsewhere: one RPC per look


def _count(value: str | None) -> int | None:
    """A count from a rank's environment (the job user's text): up to 9 ASCII digits, so int() cannot raise ("²", or
    past Python's 4300-digit limit)."""
    return int(value) if value and len(value) <= 9 and value.isascii() and value.isdigit() else None


def request_name(job_id: str) -> str:
    """One request file per job: jobs submitted from one directory (an array's tasks) share its switch dir. The
    name the relaunch loop looks for (`Trainer.restart_name` in trainguard/trainer.py, which stands alone)."""
    return f"restart.{job_id}"


class RestartUnderwayError(ActionError):
    """The restart went ahead (request written, steps signalled) and something after it failed."""


class _NothingRestartedError(ActionSkippedError):
    """Done, yet nothing restarted (a lost spare only recorded as left): said done, and answers no other restart."""


def left_name(job_id: str, life: int, node: str) -> str:
    """The record that the job's life `life` (its requeues so far) left `node`: one file per node, so that the agents
    of two nodes lost at once never replace each other's, and per life, so that a requeued job (another allocation)
    never leaves a node for an earlier life's fault (the loop reads them: `_left_records` in trainguard/trainer.py)."""
    return f"left.{job_id}.{life}.{node}"


def _hosts(node_list: str | None) -> list[str]:
    """The controller's NodeList as host names ([] when unknown or not a hostlist)."""
    try:
        return expand(node_list) if node_list else []
    except ValueError:
        return []


def _switch_files(job: Job, names: list[str]) -> dict[str, os.stat_result] | None:
    """Which of `names` are switch files in the job's switch dir, as its user's (their lstat); None when the dir
    cannot be read."""
    assert job.switch_dir
    try:
        return switch_stats(job.switch_dir, names, job_owner(job)[0])
    except ActionError:
        return None


@dataclasses.dataclass(frozen=True)
class _Leaves:
    """What the job's switch dir says of its life's restarts without a node, as a restart in place weighs them."""

    records: dict[str, str]  # the record name of each node of the allocation -> the node
    present: dict[str, os.stat_result]  # of those and the restart request, the ones written
    without: set[str]  # the nodes the ranks here run without (their TRAINGUARD_LEFT)
    started: float  # when the ranks here started (0: not known)

    @property
    def recorded(self) -> set[str]:
        """The nodes recorded as left, counted together (as `_leave` does)."""
        return {node for name, node in self.records.items() if name in self.present}

    @classmethod
    def read(cls, job: Job, life: int, looped: dict[str, list[int]], ranks: list[dict[str, str]]) -> _Leaves | None:
        """None when the switch dir cannot be read (nothing to weigh)."""
        assert job.job_id and job.switch_dir
        records = {left_name(job.job_id, life, n): n for n in _hosts(job.node_list)}
        present = _switch_files(job, [*records, request_name(job.job_id)])
        if present is None:
            return None
        started = min((r.create_time for pids in looped.values() for r in map(ProcessRef.of, pids) if r), default=0.0)
        return cls(records, present, {n for env in ranks for n in env.get(LEFT_VAR, "").split(",") if n}, started)


class RestartSettings(WaitExitSettings):
    signal: str = Field("USR1", description="The signal that asks the ranks to save and exit (the trainer helper's "
                                            "default: USR1).")
    wait_exit: Duration = Field(300.0, ge=0, description="How long the ranks get to save and exit before their "
                                                         "steps are cancelled.")
    leave_node: bool = Field(
        False, description="Restart the job without this node (bind it to a fault of the node, e.g. `xid` after "
                           "`drain`): the node is recorded as left in the job's switch dir and the relaunch loop "
                           "starts srun again with `--exclude` of every node left, on the spare node the job's "
                           "allocation holds (`sbatch -N 3-4` with `srun -N 3`). A job without a spare, or whose loop "
                           "cannot leave a node (its command is not srun itself), gets the fallback; a spare that ran "
                           "nothing of the job is only recorded.")
    fallback: Literal["requeue", "none"] = Field(
        "requeue", description="A job whose ranks on this node do not run under the trainer helper's relaunch loop "
                               "(or that has no srun step here) would end, not restart: `requeue` signals it (every "
                               "step and the batch script) and requeues it once its processes here have exited, as "
                               "`signal, requeue` do; `none` fails and says so.")

    @field_validator("signal")
    @classmethod
    def _valid_signal(cls, value: str) -> str:
        return signal_name(value)


class RestartAction(Action):
    """Restarts the job's srun steps inside its allocation; the trainer helper's relaunch loop starts them again."""

    Settings = RestartSettings
    settings: RestartSettings
    fresh_start = True
    needs_record = True

    def plan(self, ctx: ActionContext) -> str:
        without = f" without {ctx.node} (on its allocation's spare)" if self.settings.leave_node else ""
        return (f"restart in place{without} {', '.join(j.label() for j in slurm_jobs(ctx)) or 'no SLURM job'}: a "
                f"restart request in its switch dir, SIG{self.settings.signal} to its steps under the relaunch loop, those "
                f"still running after {self.settings.wait_exit:g}s cancelled; without the loop: "
                f"{'signal and requeue' if self.settings.fallback == 'requeue' else 'nothing'}")

    def run(self, ctx: ActionContext) -> str:
        others = [j.label() for j in ctx.jobs if not (j.source == "slurm" and j.job_id)]
        if others:
            raise ActionError(f"restart in place is for SLURM jobs (their allocation is kept); {', '.join(others)}: "
                              "bind `signal` and let the service manager start it again (Restart=on-failure)")
        jobs = slurm_jobs(ctx)
        if not jobs:
            raise ActionSkippedError("no SLURM job on this node to restart")
        # One lane per job user: a job's turn waits up to wait_exit for ranks that may ignore the signal (and
        # RELAUNCH_WAIT for a request its user may forge), which no other user's restart waits out. What the lanes
        # share is theirs to share: ctx is frozen, the claims and the reports lock, each job has its own report,
        # request and records (named by job id), and the SLURM commands are processes with timeouts.
        return each_job_at_once(jobs, lambda job: self._once(job, ctx))

    def _once(self, job: Job, ctx: ActionContext) -> str:
        """One answer per fault: a restart of the job under way in another of this agent's lists, or done less than
        RELAUNCH_GRACE ago for a fault that began before it ended (a later one is the fresh start's), answers this one
        when it does what this one would (any restart answers one in place; one without this node, one without it):
        this one waits for its end and is skipped (failed if it failed), never run twice nor said done twice. One
        without this node is never answered by one in place: it goes on beside it, so that the relaunch leaves the
        node (its request and record land before that restart's srun returns)."""
        assert job.job_id
        leave = ctx.node if self.settings.leave_node else ""
        mine = Claim(f"without {leave}" if leave else "in place", f"{ctx.event.check}/{ctx.event.subject}", leave)

        def answers(other: Claim) -> bool:  # a fault that began after `other` ended is the fresh start's: not its
            return (not leave or other.leave == leave) and not (other.ended_at and ctx.event.since > other.ended_at)

        other = ctx.claims.take(job.job_id, mine, RELAUNCH_GRACE, answers)
        if other is not None:
            other.ended.wait(self.settings.timeout)
            raise self._answered(other)
        error: ActionError | None = ActionError("ended without an outcome")
        try:
            outcome = self._one(job, ctx)
            error = None
            return outcome
        except _NothingRestartedError as exc:  # the lists waiting on it are skipped: "already restarted" would be false
            error = exc
            return str(exc)
        except ActionError as exc:
            error = exc
            raise
        finally:
            mine.ended_at = ctx.clock()
            ctx.claims.end(job.job_id, mine, error)

    @staticmethod
    def _answered(other: Claim) -> ActionError:
        """Why a restart that `other` answers is not run: `other`'s outcome is its own (each_job_at_once names the job)."""
        what = f"the restart {other.what} for {other.by}"
        if not other.ended.is_set():
            return ActionSkippedError(f"{what} is still under way: not restarted twice")
        if isinstance(other.error, ActionSkippedError):
            return ActionSkippedError(f"{what} was skipped: {other.error}")
        if other.error is not None:  # an "ok" would make the check forget what nothing restarted
            return ActionError(f"{what} failed: {other.error}")
        return ActionAnsweredError(f"already restarted {other.what} for {other.by} "
                                   f"({time.monotonic() - other.at:.1f}s ago): not restarted twice")

    def _one(self, job: Job, ctx: ActionContext) -> str:
        assert job.job_id
        job_id, s = job.job_id, self.settings
        if job.extra.get("incomplete"):
            # Without the controller's record its switch dir, nodes and --no-requeue are unknown: every fallback
            # below would guess, and a requeue would cost a job under the relaunch loop its allocation
            raise ActionError(f"restart {job_id}: its record has not come from slurmctld ({job.extra['incomplete']}): "
                              "not restarted, not requeued")
        deadline = time.monotonic() + s.wait_exit  # the slurm calls before the signal count too: timeout holds
        here = self._steps_here(job, ctx, deadline)
        procfs = ProcFS()
        envs = {pid: procfs.environ_vars(pid, LOOP_VARS) for pids in here.values() for pid in pids}
        looped = {step: pids for step, pids in here.items() if any(LOOP_VAR in envs[pid] for pid in pids)}
        ranks = [envs[pid] for pids in looped.values() for pid in pids if LOOP_VAR in envs[pid]]
        if not looped:  # no rank here: the loop itself may run here (the batch host a lost node's restart left)
            try:
                looped, ranks = self._launched_here(job_id, ctx, procfs)
            except SlurmError as exc:
                raise ActionError(f"restart {job_id}: {exc}") from None
        if not looped and not here and s.leave_node and self._spare(job, ctx):
            raise _NothingRestartedError(self._spare_left(job, ctx))
        if not looped and not s.leave_node and (record := self._left_here(job, ctx)):
            # the job was restarted without this node (its log is still read here): no requeue from a node it left
            raise ActionSkippedError(f"it left {ctx.node} ({record}): nothing of it runs here to "
                                     "restart in place")
        if not looped:  # a sidecar or debug step (srun --overlap) is never the one restarted
            return self._fallback(job, ctx, "its ranks here do not run under the relaunch loop" if here else
                                  "no srun step of it on this node", deadline)
        if not job.switch_dir:
            return self._fallback(job, ctx, "no switch dir to ask its relaunch loop in", deadline)
        spent = self._spent(ranks)
        if spent is not None:
            return self._fallback(job, ctx, f"its relaunch loop has used its {spent} restarts", deadline)
        if s.leave_node:
            return self._leave(job, ctx, looped, ranks, deadline)
        undoes = self._undoes_leave(job, ctx, looped, ranks)
        if undoes:
            raise ActionSkippedError(f"not restarted in place: {undoes}")
        return self._request(job, ctx, looped, {}, deadline)

    def _steps_here(self, job: Job, ctx: ActionContext, deadline: float) -> dict[str, list[int]]:
        """The job's srun steps on this node and their processes; for a job whose restart was asked a moment ago (its
        loop may be between two sruns) the next srun's, waited for up to RELAUNCH_WAIT."""
        assert job.job_id
        try:
            here = ctx.slurm.local_steps(job.job_id, ctx.slurmd)
            if not here and self._restarted_lately(job, ctx):
                until = min(deadline, time.monotonic() + RELAUNCH_WAIT)
                while not here and time.monotonic() < until:
                    time.sleep(POLL_CONTROLLER)
                    here = ctx.slurm.local_steps(job.job_id, ctx.slurmd)
        except SlurmError as exc:
            raise ActionError(f"restart {job.job_id}: {exc}") from None
        return here

    @staticmethod
    def _restarted_lately(job: Job, ctx: ActionContext) -> bool:
        """Whether a restart of the job was asked less than RELAUNCH_GRACE ago: one this agent did, or any agent's
        request in the switch dir (another node's restart for the same fault), unless the job left this node (its next
        srun never comes here). The request's change time is its file system's clock and the job user's to fake: at
        worst their own restart waits RELAUNCH_WAIT."""
        assert job.job_id
        last = ctx.claims.last(job.job_id, RELAUNCH_GRACE)
        if last is not None and last.leave != ctx.node:  # one without this node: the switch dir's record says so
            return True
        if not job.switch_dir or job.uid is None:
            return False
        name = request_name(job.job_id)
        left = left_name(job.job_id, job.restarts, ctx.node) if job.restarts is not None else ""
        present = _switch_files(job, [name, left] if left else [name]) or {}  # unreadable: no request
        request = present.get(name)
        return request is not None and left not in present and abs(time.time() - request.st_ctime) < RELAUNCH_GRACE

    def _spare_left(self, job: Job, ctx: ActionContext) -> str:
        """A node the job holds but runs nothing on (the spare itself lost its GPU): the job goes on untouched; a
        requeue would cost it its progress for nothing. The drain keeps other jobs off the node, and the record keeps
        the job's own next restart off it (srun picks from the allocation, drained nodes included)."""
        nothing = f"{job.label()}: nothing of it runs on {ctx.node}: nothing to restart"
        if not job.switch_dir or job.restarts is None:
            return f"{nothing} ({ctx.node} not recorded as left: its {'life' if job.switch_dir else 'switch dir'} " \
                   "is unknown)"
        try:
            return f"{nothing}; {ctx.node} recorded as left ({self._record_left(job, ctx, job.restarts)[0]})"
        except ActionError as exc:
            return f"{nothing} ({ctx.node} not recorded as left: {exc})"

    @staticmethod
    def _left_here(job: Job, ctx: ActionContext) -> str:
        """The record that the job's life left this node (`left.<job>.<life>.<node>`; "" when none or unknown)."""
        if not job.job_id or not job.switch_dir or job.restarts is None or job.uid is None:
            return ""
        name = left_name(job.job_id, job.restarts, ctx.node)
        return name if name in (_switch_files(job, [name]) or {}) else ""

    def _undoes_leave(self, job: Job, ctx: ActionContext, looped: dict[str, list[int]],
                      ranks: list[dict[str, str]]) -> str:
        """Why a restart in place now would undo a restart of the job without a node ("" when it would not): see
        `_undone_by` for each record of a node left by the ranks' life (any agent's `left.<job>.<life>.<node>`). The
        files are the job user's: a fake only skips their own job's restart."""
        if not any(LEFT_VAR in env for env in ranks):
            # a loop that cannot leave a node never restarts without one: a record (a lost spare's) is no such restart
            return ""
        left = _Leaves.read(job, self._life(ranks), looped, ranks)
        if left is None:
            return ""
        return next((why for name, node in left.records.items() if name in left.present
                     and (why := self._undone_by(job, ctx, left, name, node, ranks))), "")

    def _undone_by(self, job: Job, ctx: ActionContext, left: _Leaves, name: str, node: str,
                   ranks: list[dict[str, str]]) -> str:
        """Why the record `name` of `node` left makes a restart in place wrong ("" when it does not): a restart
        request written since it while the ranks here still run with the node (that restart is under way: its
        relaunch leaves the node, and a request written after it would start the job once more, even at the end of
        its training); or it was written less than `wait_exit` and RELAUNCH_GRACE ago (its fallback's wait for the
        ranks to save, then its requeue) by a restart that finds no spare in the allocation without the nodes
        recorded (its fallback, a requeue by default, answers the fault; not for a job submitted --no-requeue,
        which that fallback leaves alone); or the ranks here were started without the node less than
        RELAUNCH_GRACE ago, after the fault this restart answers began (the fault was the earlier start's)."""
        assert job.job_id
        record, now = left.present[name], time.time()
        request = left.present.get(request_name(job.job_id))
        if node not in left.without and request is not None and request.st_ctime_ns >= record.st_ctime_ns:
            return (f"a restart of it without {node} is under way ({name}, and {request_name(job.job_id)} written "
                    f"{max(0.0, now - request.st_ctime):.1f}s ago)")
        # its fallback waits up to its wait_exit for the ranks to save before it requeues (this action's own stands
        # for it: one default for both)
        fresh = now - record.st_ctime < self.settings.wait_exit + RELAUNCH_GRACE
        if node not in left.without and job.requeue and fresh \
                and (no_spare := self._no_spare(list(left.records.values()), ranks, left.recorded)):
            # that restart's fallback answers the fault (a requeue, by default): in place, the job would start again
            # on the node it leaves, and be said restarted while it is requeued. A --no-requeue job's fallback
            # leaves it alone: nothing else would restart it
            return (f"a restart of it without {node} is under way ({name}, written "
                    f"{max(0.0, now - record.st_ctime):.1f}s ago) and finds {no_spare}: its fallback answers the fault")
        if node in left.without and ctx.event.since < left.started and now - left.started < RELAUNCH_GRACE:
            return (f"it started again without {node} {now - left.started:.1f}s ago ({name}), after the fault this "
                    "restart answers began")
        return ""

    def _leave(self, job: Job, ctx: ActionContext, looped: dict[str, list[int]], ranks: list[dict[str, str]],
               deadline: float) -> str:
        """Restart the job without this node: recorded as left, then the request naming it; the fallback when the
        job's loop cannot leave it or its allocation holds no spare."""
        assert job.job_id and job.switch_dir
        job_id = job.job_id
        identity, _ = job_owner(job)
        # ctx.node: this node's SLURM name (jobs.slurm_node). Recorded before the others' records are counted: of two
        # agents acting at once, at least the later one counts both nodes.
        allocation = _hosts(job.node_list)
        no_spare = self._cannot_leave(job, ctx.node, ranks, allocation)
        record, record_ino, record_ctime = "", 0, None
        if not no_spare:
            life = self._life(ranks)  # as the loop reads it: the ranks' environment is the batch script's
            try:
                _, record_ino, record_ctime = self._record_left(job, ctx, life)
                record = left_name(job_id, life, ctx.node)
                present = switch_stats(job.switch_dir, [left_name(job_id, life, n) for n in allocation], identity)
            except ActionError as exc:
                no_spare = f"{ctx.node} cannot be recorded as left ({exc})"
            else:
                no_spare = self._no_spare(allocation, ranks, {n for n in allocation
                                                              if left_name(job_id, life, n) in present} | {ctx.node})
        try:
            if no_spare:
                return self._fallback(job, ctx, f"not restarted without {ctx.node}: {no_spare}", deadline)
            return self._request(job, ctx, looped, {"leave": ctx.node}, deadline)  # an older loop reads the request
        except ActionError as exc:
            # neither restarted nor requeued: the job goes on as it was, and a later restart of it (a NaN) must not
            # leave a node its step may need (a job without a spare would end). A restart under way keeps it.
            if record and not isinstance(exc, RestartUnderwayError):
                remove_switch(job.switch_dir, record, identity, record_ino, record_ctime)
            raise

    def _request(self, job: Job, ctx: ActionContext, looped: dict[str, list[int]], leave: dict[str, str],
                 deadline: float) -> str:
        """Ask the loop for a restart, signal the steps, wait for them and cancel those still running."""
        assert job.job_id and job.switch_dir
        job_id, s = job.job_id, self.settings
        refs = [r for pids in looped.values() for r in map(ProcessRef.of, pids) if r is not None]
        identity, gid = job_owner(job)
        name = request_name(job_id)
        ack, own, done_with = self._report(job, ctx, identity)
        try:
            if own is not None:
                own.mark()
            # the node to leave first and the reason cut to what the loop shows: the loop reads the file's first 64 KiB
            request, ino, ctime_ns = create_switch_file(job.switch_dir, name, identity, gid, {
                **leave, "requested_by": "trainguard", "job_id": job_id, "at": ctx.clock(),
                "incident": ctx.event.incident_id, "check": ctx.event.check,
                "reason": one_line(ctx.event.summary, 200)})
            if own is not None:
                own.watch()  # before the signal: a save signal's list that joins it meanwhile need not wait
            started = time.monotonic()
            steps = sorted(looped, key=int)
            try:
                gone = [step for step in steps if not ctx.slurm.signal_step(job_id, step, s.signal)]
            except SlurmError as exc:
                # Left in place, the request would restart the job the next time its srun ends, even at the end of
                # training
                remove_switch(job.switch_dir, name, identity, ino, ctime_ns)  # ours: not one written there since
                raise ActionError(f"restart {job_id}: {exc} (the request is withdrawn)") from None

            def until() -> float:  # wait_exit, cut to after_save once the ranks report their checkpoint written
                return deadline if ack.at is None else min(deadline, ack.at + s.after_save)

            while any(r.matches() for r in refs) and time.monotonic() < until():
                time.sleep(POLL)
            left = self._running(ctx, job_id, set(steps))
            while left and time.monotonic() < until():
                time.sleep(POLL_CONTROLLER)
                left = self._running(ctx, job_id, set(steps))
            cancelled = [step for step in sorted(left, key=int) if ctx.slurm.cancel_step(job_id, step)]
        except SlurmError as exc:
            raise RestartUnderwayError(f"restart {job_id}: {request} written, SIG{s.signal} sent, then: {exc}") from None
        finally:
            done_with()
        took = time.monotonic() - started
        ended = ", ".join(f"{job_id}.{step}" for step in steps)
        how = (f"cancelled {', '.join(f'{job_id}.{c}' for c in cancelled)} still running after {took:.1f}s"
               if cancelled else f"ended in {took:.1f}s")
        if cancelled or ack.at is None:
            how += ack.said(started, "the signal")
        if gone:  # ended by itself just before, or at once on the signal
            how += f" ({', '.join(f'{job_id}.{g}' for g in gone)} no longer listed when signalled)"
        if len(gone) == len(steps) and not self._relaunched(ctx, job_id, set(steps)):
            # Every step had ended before the signal: a loop whose srun failed has returned, and nothing restarts
            remove_switch(job.switch_dir, name, identity, ino, ctime_ns)
            raise ActionError(f"restart {job_id}: its steps {ended} had ended before the signal and no new step "
                              f"started within {RELAUNCH_WAIT:g}s: its relaunch loop is over (the request is withdrawn)")
        where = f" without {leave['leave']}" if leave else ""
        return f"restart of {job_id}{where} requested ({request}); SIG{s.signal} to step {ended}: {how}"

    @staticmethod
    def _report(job: Job, ctx: ActionContext, identity: Identity) -> tuple[Report, SaveReport | None,
                                                                             Callable[[], None]]:
        """The ranks' report this restart waits for, the one it marks and watches itself (None: a save signal's,
        joined), and what to call once done with it.

        One report per job on this agent: a save signal's list about the same fault (the lost GPU's `xid` while its
        CUDA error in the log restarts) may already wait on it, and the checkpoint rank 0 writes for that answers this
        request too. Joined once its request is written (its mark is then before this request: rank 0's answer to
        either is not taken for an earlier one); one whose request failed has no thread to see any answer, and this
        restart watches its own."""
        assert job.job_id
        job_id = job.job_id
        own = SaveReport(job.switch_dir or "", job_id, identity)  # no thread until watched
        joined = ctx.reports.join(job_id, ctx.actions, lambda: own)
        if joined is own:  # this restart's: a list that joins it holds it on after this one is done
            return own, own, lambda: ctx.reports.leave(job_id, ctx.actions)
        if isinstance(joined, SaveReport) and joined.requested.wait(REQUEST_WAIT) and not joined.note:
            return joined, None, lambda: None  # the lists holding it close it
        return own, own, own.close  # private to this restart

    @staticmethod
    def _launched_here(job_id: str, ctx: ActionContext,
                       procfs: ProcFS) -> tuple[dict[str, list[int]], list[dict[str, str]]]:
        """The loop's steps when its srun runs on this node but none of its ranks do: the job's processes here
        (its batch step) that carry the loop's variables are the loop's srun, and the controller says which steps
        each srun launched (`SrunHost:Pid`, this host). Step -> [] (no rank here to watch), and the srun's variables."""
        loop = {pid: env for pid in ctx.slurm.local_pids(ctx.slurmd).get(job_id, [])
                if LOOP_VAR in (env := procfs.environ_vars(pid, LOOP_VARS))}
        if not loop:
            return {}, []
        me = socket.gethostname().split(".")[0]
        steps = {step: [] for step, (host, pid) in ctx.slurm.step_sruns(job_id).items()
                 if pid in loop and host.split(".")[0] == me}
        return steps, list(loop.values()) if steps else []

    @staticmethod
    def _spent(ranks: list[dict[str, str]]) -> int | None:
        """The loop's --max-restarts when its ranks here say they are the last start it allows, else None: restarted
        again, the job would end. `ranks`: the loop's variables in each rank's environment."""
        for env in ranks:
            done, most = _count(env.get(LOOP_VAR)), _count(env.get(LOOP_MAX_VAR))
            if done is not None and most is not None and done >= most:
                return most
        return None

    @staticmethod
    def _spare(job: Job, ctx: ActionContext) -> bool:
        """Whether this node is one the job holds and runs nothing on: in its allocation, no process of the job's
        batch script or srun steps here (the batch script may train without srun; the extern step's `sleep` under
        PrologFlags=Contain is no work) and in no srun step's NodeList (a rank that died of the lost GPU leaves no
        process, yet its step still spans the node: not a spare, and the fallback applies). In doubt (the controller
        not answering, no NodeList) it is not a spare: the fallback applies."""
        assert job.job_id
        try:
            if ctx.slurm.local_work_pids(job.job_id, ctx.slurmd):
                return False
            spanned = {n for nodes in ctx.slurm.step_nodes(job.job_id).values() for n in _hosts(nodes)}
        except SlurmError:
            return False
        return ctx.node in _hosts(job.node_list) and ctx.node not in spanned

    @staticmethod
    def _life(ranks: list[dict[str, str]]) -> int:
        """The job's life as its ranks (and the loop, in the same batch environment) see it: SLURM_RESTART_COUNT, which
        SLURM sets once the job was requeued (0 without it)."""
        return next((n for n in (_count(env.get(LIFE_VAR)) for env in ranks) if n is not None), 0)

    @staticmethod
    def _cannot_leave(job: Job, node: str, ranks: list[dict[str, str]], allocation: list[str]) -> str:
        """Why the job's loop cannot start it again without `node` ("" when it can): the loop must be able to leave a
        node, its ranks must say how many nodes their step spans, and `node` must be in the allocation (the
        controller's NodeList). The ranks' variables are the job user's to set: a lie only misleads that user's own
        restart."""
        if not any(LEFT_VAR in env for env in ranks):
            return "its relaunch loop cannot leave a node (an older trainer helper, or a command that is not srun)"
        if not any(_count(env.get(STEP_NODES_VAR)) is not None for env in ranks):
            return f"its ranks here do not say how many nodes their step spans ({STEP_NODES_VAR})"
        if node not in allocation:
            # --exclude of a name srun does not know would fail the step, or leave nothing
            return f"this node ({node}) is not in its allocation ({job.node_list or 'unknown'})"
        return ""

    @staticmethod
    def _no_spare(allocation: list[str], ranks: list[dict[str, str]], recorded: set[str]) -> str:
        """Why the allocation less the nodes left (those the running loop left, in the ranks' TRAINGUARD_LEFT, and
        those recorded as left by any node's agent, this one's included) cannot hold the step ("" when it can)."""
        size = max((n for n in (_count(env.get(STEP_NODES_VAR)) for env in ranks) if n is not None), default=None)
        if size is None:  # the ranks do not say (their user's variable): nothing to weigh (`_cannot_leave` says so)
            return ""
        gone = ({n for env in ranks for n in env.get(LEFT_VAR, "").split(",") if n} | recorded) & set(allocation)
        if len(allocation) - len(gone) < size:
            return (f"no spare node in its allocation ({len(allocation)} node(s), {len(gone)} left or leaving, its "
                    f"step spans {size})")
        return ""

    @staticmethod
    def _record_left(job: Job, ctx: ActionContext, life: int) -> tuple[str, int, int | None]:
        """Record this node as left by the job's life `life` (`left.<job>.<life>.<node>` in its switch dir, as its
        user): where, and the inode and change time written (a withdrawal removes that file only)."""
        assert job.job_id and job.switch_dir
        identity, gid = job_owner(job)
        return create_switch_file(job.switch_dir, left_name(job.job_id, life, ctx.node), identity, gid, {
            "requested_by": "trainguard", "job_id": job.job_id, "life": life, "node": ctx.node, "at": ctx.clock(),
            "incident": ctx.event.incident_id, "check": ctx.event.check, "reason": one_line(ctx.event.summary, 200)})

    def _fallback(self, job: Job, ctx: ActionContext, why: str, deadline: float) -> str:
        """Without the loop the signal would end the job: requeue it instead (or fail, `fallback = "none"`)."""
        s = self.settings
        if s.fallback == "none":
            raise ActionError(f"{job.label()}: {why}: not restarted in place (fallback none); run its ranks as "
                              "`python3 -m trainguard.trainer relaunch -- srun ...` in its batch script")
        if not job.requeue:  # the signal would end a job nobody may requeue
            raise ActionError(f"{job.label()}: {why}, and it was submitted --no-requeue: left alone")
        assert job.job_id
        ask_save([job], ctx)  # the requeue waits for the ranks until `after_save` after rank 0's report
        try:
            ctx.slurm.signal(job.job_id, s.signal, "full")
        except SlurmError as exc:
            raise ActionError(f"{job.label()}: {why}; requeue instead: {exc}") from None
        wait = max(0.0, deadline - time.monotonic())
        requeue = RequeueAction(self.name, RequeueSettings(timeout=max(s.timeout, wait + 1), wait_exit=wait,
                                                           after_save=s.after_save))
        done = requeue.run(dataclasses.replace(ctx, jobs=(job,)))
        return f"{job.label()}: {why}: requeue instead: SIG{s.signal} to every step, {done}"

    @staticmethod
    def _relaunched(ctx: ActionContext, job_id: str, old: set[str]) -> bool:
        """Whether the loop started a new srun step (one the controller lists besides `old`) within RELAUNCH_WAIT."""
        until = time.monotonic() + RELAUNCH_WAIT
        while True:
            try:
                if set(ctx.slurm.steps(job_id)) - old:
                    return True
            except SlurmError:
                pass  # the controller busy for a moment: look again until the wait is over
            if time.monotonic() >= until:
                return False
            time.sleep(POLL_CONTROLLER)

    @staticmethod
    def _running(ctx: ActionContext, job_id: str, steps: set[str]) -> set[str]:
        return steps & set(ctx.slurm.steps(job_id))
