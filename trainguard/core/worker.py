"""Worker: a daemon thread that runs the calls handed to it one at a time, kept between calls and ended when idle.

Used where a caller hands work over and goes on: a one-shot check run (`CheckRunner.run_once`, which waits for it
with the check's timeout) and the engine's reports of runs blocked past their timeout. A worker is started on the
first call, waits for the next one, and ends after `keep` seconds without a call or at `close()`. A call that
blocks forever (a dead NFS mount) holds its worker, as it held its thread: the callers see the call not done and
do not hand that worker another (the runner skips runs while one is blocked; the engine keeps one late report per
check waiting at most).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from trainguard.core.logs import kv

log = logging.getLogger("trainguard.worker")

# Long enough that calls in quick succession (a round's, tests') share the thread; short enough that a stopped
# engine's threads (tests make hundreds) are gone 20 s later even where nobody calls close().
KEEP_S = 20.0


class Worker:
    def __init__(self, name: str, keep: float = KEEP_S) -> None:
        self.name = name
        self.keep = keep
        self._cond = threading.Condition()
        self._calls: deque[Callable[[], None]] = deque()
        self._running = False  # a thread is there to take the calls
        self._closed = False

    def submit(self, call: Callable[[], None]) -> None:
        """Run `call` on the worker thread (started if none is there). Raises RuntimeError when no thread can be
        started (a pids limit), as Thread.start does; the call is then not queued."""
        with self._cond:
            if self._running:
                self._calls.append(call)
                self._cond.notify()
                return
            thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            thread.start()  # raises before anything changed
            self._running = True
            self._calls.append(call)
            self._cond.notify()

    def close(self) -> None:
        """End the thread once the calls handed over are done (a blocked one keeps it, as before)."""
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._calls:
                    # wait() returns False on the timeout; a call handed over meanwhile is still taken
                    if self._closed or (not self._cond.wait(self.keep) and not self._calls):
                        self._running = False
                        return
                call = self._calls.popleft()
            try:
                call()
            except BaseException:  # callers catch their own; a SystemExit from a check's code would otherwise end
                # this thread with `_running` set, and no later call of the check would ever run
                log.exception("worker call failed", extra=kv(worker=self.name))
