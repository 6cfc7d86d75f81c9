"""The ranks' report that the checkpoint the agent asked for is written, read by the actions that wait for the ranks.

`restart` and `requeue` wait (`wait_exit`, minutes) for the job's ranks to save and exit. A rank hung in a collective
or on a GPU that fell off the bus never exits, so without word from the ranks the whole job would sit idle for the
whole wait after the others saved. The trainer helper's `saved()` on global rank 0 writes `saved.<job id>` in the
job's switch dir once its checkpoint is complete, while a request of the agent's for this job is there that is newer
than the process: `restart.<job id>` (a restart in place) or `signalled.<job id>` (the save signal of `signal`, or of
`restart`'s requeue fallback). From the report on, the waiting action gives the ranks `after_save` and goes on.

No clocks are compared: the request and the report are written on different nodes. The agent removes the last
report before it writes its request, so a report there later answers this request. Every look at the user's switch
dir runs in a thread of the report's own: a switch dir on a file system that hangs never holds up a signal, a cancel
or a requeue; the waiting action reads `at` only. A user who forges a report only has their own job ended sooner;
any error reads as no report, and `wait_exit` holds.
"""

from __future__ import annotations

import threading
import time

from trainguard.actions.base import ActionContext, ActionError
from trainguard.actions.switch import create_switch, job_owner, remove_switch, switch_stats
from trainguard.core.text import one_line
from trainguard.jobs.model import Job
from trainguard.node.access import Identity

POLL = 0.2  # one lstat in the switch dir per look, only while an action waits
KEEP = 3600.0  # a report nobody closed (a bug) stops being looked for after this


def saved_name(job_id: str) -> str:
    """The ranks' report (`Trainer.saved_name` in trainguard/trainer.py, which stands alone)."""
    return f"saved.{job_id}"


def signalled_name(job_id: str) -> str:
    """The agent's request for a report after its save signal (`Trainer.signalled_name`)."""
    return f"signalled.{job_id}"


class SaveReport:
    """Whether the ranks reported the checkpoint asked for: `saved.<job id>` in the switch dir, a regular file of the
    user or root, first seen at monotonic time `at`."""

    def __init__(self, switch_dir: str, job_id: str, identity: Identity) -> None:
        self.switch_dir, self.identity, self.job_id, self.name = switch_dir, identity, job_id, saved_name(job_id)
        self.at: float | None = None
        self.note = ""
        self._stop = threading.Event()
        self._request: tuple[int, dict[str, object]] | None = None  # signalled: the owner's gid and the request

    def clear(self) -> None:
        """Before the request: the last report goes. One that stays (not the user's, or not removable) would read as
        an answer to this request: no report is read then. Before the request, since a rank reports only once it
        is there, so what is found now cannot answer it."""
        remove_switch(self.switch_dir, self.name, self.identity)
        try:
            if self.name in switch_stats(self.switch_dir, [self.name], self.identity):
                self.note = f" ({self.name} of an earlier request could not be removed: no report read)"
        except ActionError as exc:  # whether one stayed is unknown: none is read
            self.note = f" (no report read: {exc})"

    def watch(self) -> None:
        """After the signal (the request written and the last report cleared by the caller): look for the report
        every POLL until it is there or close() is called."""
        if not self.note:
            self._start()

    def ask(self, gid: int, request: dict[str, object]) -> None:
        """After a save signal: clear the last report, write `signalled.<job id>`, then look for the report, all in
        the thread. After the signal, never before: the signal is what matters and must not wait on the user's file
        system. A rank 0 that saved before the request was there reports nothing, and `wait_exit` holds."""
        self._request = (gid, request)
        self._start()

    def _start(self) -> None:
        threading.Thread(target=self._run, name=f"saved-{self.job_id}", daemon=True).start()

    def _run(self) -> None:
        request = signalled_name(self.job_id)
        deadline = time.monotonic() + KEEP
        try:
            if self._request is not None:
                self.clear()
                if self.note:
                    return
                try:
                    # a job with no switch dir runs no trainer helper that could answer: none is made for it
                    create_switch(self.switch_dir, request, self.identity, *self._request, create=False)
                except ActionError as exc:
                    self.note = f" (no report asked: {exc})"
                    return
            while not self._stop.wait(POLL) and time.monotonic() < deadline:
                try:
                    if self.name in switch_stats(self.switch_dir, [self.name], self.identity):
                        self.at = time.monotonic()
                        return
                except ActionError:
                    continue
        finally:
            if self._request is not None:
                # A signal's request and report answer one wait: gone once it is over (or the ranks never answered),
                # so the user's switch dir keeps nothing of a fault once its actions are done
                self._stop.wait(max(0.0, deadline - time.monotonic()))
                remove_switch(self.switch_dir, request, self.identity)
                remove_switch(self.switch_dir, self.name, self.identity)

    def close(self) -> None:
        self._stop.set()

    def said(self, since: float, what: str) -> str:
        """For the action's audit line: when the report came (after `what`, at monotonic `since`), or why none was
        read."""
        if self.at is not None:
            return f" ({self.name} {self.at - since:.1f}s after {what}: the checkpoint was written)"
        return self.note


def ask_after_signal(job: Job, ctx: ActionContext) -> None:
    """A save signal was sent to `job`: ask its rank 0 to report the checkpoint written (the request is written in
    the background). The actions after it in this event's list (`requeue`) wait for the report; the responder closes
    it once they are done. A job without a known switch dir or owner gets no request: its wait is `wait_exit`."""
    if job.source != "slurm" or not job.job_id or not job.switch_dir or job.uid is None:
        return
    identity, gid = job_owner(job)
    report = SaveReport(job.switch_dir, job.job_id, identity)
    earlier = ctx.saves.get(job.job_id)
    if earlier is not None:  # signalled twice in one list: the last request counts
        earlier.close()
    ctx.saves[job.job_id] = report
    report.ask(gid, {"requested_by": "trainguard", "job_id": job.job_id, "at": ctx.clock(),
                     "incident": ctx.event.incident_id, "check": ctx.event.check,
                     "reason": one_line(ctx.event.summary, 200)})
