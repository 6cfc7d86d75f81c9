"""The ranks' report that the checkpoint the agent asked for is written, read by the actions that wait for the ranks.

`restart` and `requeue` wait (`wait_exit`, minutes) for the job's ranks to save and exit. A rank hung in a collective
or on a GPU that fell off the bus never exits, so without word from the ranks the whole job would sit idle for the
whole wait after the others saved. The trainer helper's `saved()` on global rank 0 writes `saved.<job id>` in the
job's switch dir once the checkpoint it took for a stop is complete, when a request of the agent's for this job was
there as it decided to stop: `restart.<job id>` (a restart in place) or `signalled.<job id>` (written by `signal`,
and by `restart`'s requeue fallback, just before the save signal). From the report on, the waiting action gives the
ranks `after_save` and goes on.

No clocks are compared: the request and the report are written on different nodes. Before it writes its request the
agent notes which report is there (inode and change time: rank 0 renames each report into place), and only another
one answers this request. The agent never removes a report: two agents asking at once (a fault seen on two nodes)
each see the one answer; the relaunch loop removes it when it returns. Every look at the user's switch dir runs in a
thread of the report's own: a switch dir on a file system that hangs holds up a signal by REQUEST_WAIT at most, and
never a cancel or a requeue, which read `at` only. A user who forges a report only has their own job ended sooner;
any error reads as no report, and `wait_exit` holds.

A list cut short by the agent's stop or crash while its `requeue` waited is taken up at the next start
(trainguard.pipeline.responder): what it needs to watch the report again (`kept()`: the switch dir, the owner, the
report noted before the request, the request's inode and change time) is kept with the list, and `resumed()` watches
again from there, so a rank on a lost GPU does not cost the job the whole `wait_exit` a second time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from functools import partial

from trainguard.actions.base import ActionContext, ActionError, Report
from trainguard.actions.switch import create_switch_file, remove_switch, switch_stats, uid_owner
from trainguard.core.text import one_line
from trainguard.jobs.model import Job
from trainguard.node.access import Identity

POLL = 0.2  # one lstat in the switch dir per look, only while a report is asked for
KEEP = 3600.0  # a report nobody closed (a bug) stops being looked for after this
REQUEST_WAIT = 0.25  # the save signal waits this long at most for its request to be written (0.7 ms on a local disk)
CLOSE_WAIT = 1.0  # close() waits this long for the thread to have removed the request and the report


def saved_name(job_id: str) -> str:
    """The ranks' report (`Trainer.saved_name` in trainguard/trainer.py, which stands alone)."""
    return f"saved.{job_id}"


def signalled_name(job_id: str) -> str:
    """The agent's request for a report with its save signal (`Trainer.signalled_name`)."""
    return f"signalled.{job_id}"


class SaveReport:
    """Whether the ranks reported the checkpoint asked for: `saved.<job id>` in the switch dir, a regular file of the
    user or root, first seen at monotonic time `at`."""

    def __init__(self, switch_dir: str, job_id: str, identity: Identity | None) -> None:
        self.switch_dir, self.identity, self.job_id, self.name = switch_dir, identity, job_id, saved_name(job_id)
        self.at: float | None = None
        self.note = ""
        self._earlier: tuple[int, int] | None = None  # mark(): the report there before the request (inode, ctime)
        self.requested = threading.Event()  # ask(): the request is written, or will not be
        self._stop = threading.Event()
        self._request: tuple[int, dict[str, object]] | None = None  # ask(): the owner's uid and the request
        self._uid: int | None = None  # the owner (ask(), resumed()): what a list taken up after a stop needs
        self._mine: dict[str, tuple[int, int]] = {}  # name -> (inode, ctime) of the request written: only that is removed
        self._taken_up = False  # resumed(): watched again after the agent's restart
        self._thread: threading.Thread | None = None

    @classmethod
    def resumed(cls, kept: Mapping[str, object], watch: bool = True) -> SaveReport:
        """The report a list cut short by a stop or a crash asked for (`kept()`, saved with the list), watched again:
        only a report other than the one noted before the request answers it, and the request (still in the switch dir:
        the agent that wrote it died) is removed when this list is done, as the agent that wrote it would, if it is
        still that file. Not `watch`: the request is only removed. Raises ValueError for a `kept` that is not one."""
        earlier, request = _pair(kept.get("earlier")), _pair(kept.get("request"))
        report = cls(str(kept["switch_dir"]), str(kept["job_id"]), None)
        report._uid = int(str(kept["uid"]))
        report._earlier, report._taken_up = earlier, True
        if request is not None:
            report._mine[signalled_name(report.job_id)] = request
        if not watch:
            report._stop.set()
        report._start()
        return report

    def kept(self) -> dict[str, object] | None:
        """What `resumed()` needs, once the request was written; None before, or when none was."""
        if self._uid is None or not self._mine:
            return None
        request = self._mine.get(signalled_name(self.job_id))
        return {"switch_dir": self.switch_dir, "job_id": self.job_id, "uid": self._uid,
                "earlier": list(self._earlier) if self._earlier is not None else None,
                "request": list(request) if request is not None else None}

    def mark(self) -> None:
        """Before the request: note the report there now. A rank reports only once a request is there, so what is
        found now cannot answer this one; a report that is not this one (rank 0 renames a new one into place) does."""
        assert self.identity is not None
        try:
            st = switch_stats(self.switch_dir, [self.name], self.identity).get(self.name)
        except ActionError as exc:  # what is there is unknown: none is read
            self.note = f" (no report read: {exc})"
            return
        self._earlier = (st.st_ino, st.st_ctime_ns) if st is not None else None

    def watch(self) -> None:
        """Once the caller (`restart`) marked the report there and wrote its request, before its signal: look for the
        report every POLL until it is there or close() is called. The relaunch loop removes the files."""
        self.requested.set()  # the request is written: a save signal that joins this report need not wait for it
        if not self.note:
            self._start()

    def ask(self, uid: int, request: dict[str, object]) -> None:
        """Before a save signal: find the owner, mark the report there, write `signalled.<job id>` (`requested` is
        set then), look for the report, and once closed remove both; all in the thread (the user lookup too: NSS may
        be slow, and the signal waits REQUEST_WAIT at most)."""
        self._request = (uid, request)
        self._uid = uid
        self._start()

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"saved-{self.job_id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        request = signalled_name(self.job_id)
        deadline = time.monotonic() + KEEP
        mine = self._mine
        try:
            if self._request is not None:
                if self._stop.is_set() or not self._write(request, mine):
                    return
            elif self.identity is None and self._uid is not None:  # resumed(): the owner, looked up here (NSS)
                try:
                    self.identity, _ = uid_owner(self._uid)
                except Exception as exc:  # noqa: BLE001 - no report read, and wait_exit holds
                    self.note = f" (no report read: {type(exc).__name__}: {exc})"
                    mine.clear()  # not removed either: whose authority to do it with is unknown
                    return
                finally:
                    self.requested.set()
            while not self._stop.wait(POLL) and time.monotonic() < deadline:
                assert self.identity is not None
                try:
                    st = switch_stats(self.switch_dir, [self.name], self.identity).get(self.name)
                except ActionError:
                    continue
                if st is not None and (st.st_ino, st.st_ctime_ns) != self._earlier:
                    self.at = time.monotonic()
                    return
        finally:
            self.requested.set()
            if request in mine:
                # The request served this fault: gone once its lists are done (or nobody answered). By inode and
                # change time: a later fault's request, written meanwhile by another list or another node's agent, is
                # not this one's to remove. The report stays: another node's agent may not have seen it yet (NFS
                # caches lookups for tens of seconds), and a later request notes it as earlier; the relaunch loop
                # removes it.
                self._stop.wait(max(0.0, deadline - time.monotonic()))
                assert self.identity is not None
                for name, (ino, ctime_ns) in mine.items():
                    remove_switch(self.switch_dir, name, self.identity, ino, ctime_ns)

    def _write(self, request: str, mine: dict[str, tuple[int, int]]) -> bool:
        """The owner, the report there marked, the request written: whether it was (else `note` says why)."""
        assert self._request is not None
        uid, payload = self._request
        try:
            self.identity, gid = uid_owner(uid)
            self.mark()
            if self.note or self._stop.is_set():
                return False
            # a job with no switch dir yet runs no trainer helper that could answer (the helper makes it at its first
            # heartbeat): none is made for it
            _, ino, ctime_ns = create_switch_file(self.switch_dir, request, self.identity, gid, payload, create=False)
            # Ours only with our inode and change time (another node's agent may have renamed its request into place
            # since). Before `requested`: the list keeps it (kept()) once its signal is over.
            if ctime_ns is not None:
                mine[request] = (ino, ctime_ns)
        except ActionError as exc:
            self.note = f" (no report asked: {exc})"
            return False
        except Exception as exc:  # noqa: BLE001 - the owner's lookup (NSS): no report, and wait_exit holds
            self.note = f" (no report asked: {type(exc).__name__}: {exc})"
            return False
        finally:
            self.requested.set()
        return True

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(CLOSE_WAIT)  # a hung file system keeps it: nothing waits on it then

    def said(self, since: float, what: str) -> str:
        """For the action's audit line: when the report came (after `what`, at monotonic `since`), or why none was
        read."""
        if self.at is not None:
            when = f"{self.at - since:.1f}s after" if self.at >= since else f"{since - self.at:.1f}s before"
            again = ", looked for again after the agent's restart" if self._taken_up else ""
            return f" ({self.name} {when} {what}{again}: the checkpoint was written)"
        return self.note or " (no report from rank 0 of the checkpoint written)"


def _pair(value: object) -> tuple[int, int] | None:
    """(inode, ctime) as kept: a list of two integers, or None."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError(f"not an (inode, change time) pair: {value!r}")
    return int(value[0]), int(value[1])


def _asked(switch_dir: str, job_id: str, uid: int, request: dict[str, object]) -> Report:
    report = SaveReport(switch_dir, job_id, None)
    report.ask(uid, request)
    return report


def ask_save(jobs: Iterable[Job], ctx: ActionContext) -> list[str]:
    """A save signal is about to go to `jobs`: ask each SLURM job's rank 0 to report its checkpoint written, for the
    actions after it in this event's list (`requeue`), and wait REQUEST_WAIT at most for the requests to be written
    (a rank that decides to stop before its request is there reports nothing). A job whose report another list
    already asked for joins it. A job without a known switch dir or owner gets no request: its wait is `wait_exit`.
    What could not be asked, in words (the signal goes anyway)."""
    asked: list[SaveReport] = []
    failed = []
    for job in jobs:
        if job.source != "slurm" or not job.job_id or not job.switch_dir or job.uid is None:
            continue
        try:
            request: dict[str, object] = {
                "requested_by": "trainguard", "job_id": job.job_id, "at": ctx.clock(),
                "incident": ctx.event.incident_id, "check": ctx.event.check,
                "reason": one_line(ctx.event.summary, 200)}
            report = ctx.reports.join(job.job_id, ctx.actions,
                                      partial(_asked, job.switch_dir, job.job_id, job.uid, request))
        except Exception as exc:  # noqa: BLE001 - the signal matters more than the report: it goes anyway
            failed.append(f"{job.label()}: no report asked: {exc}")
            continue
        if isinstance(report, SaveReport):
            asked.append(report)
    until = time.monotonic() + REQUEST_WAIT
    for report in asked:
        report.requested.wait(max(0.0, until - time.monotonic()))
    return failed
