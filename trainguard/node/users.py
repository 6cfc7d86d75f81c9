"""Users' names for display, each NSS lookup bounded.

On a node whose NSS asks LDAP or SSSD, `getpwuid` can block for minutes while the directory does not answer, and a
check that names a co-tenant's user in its summary would stall with it. A name only shown is not worth that: each
uid is looked up on a daemon thread of its own, waited for `timeout`, and shown as its number when it does not
answer. At most one lookup per uid is ever under way (a uid whose lookup hangs is shown as its number, without
another thread, until that lookup returns), and at most `in_flight` in all, so a hung NSS cannot pile threads up.

Lookups that decide something (who may control the agent, a job's owner, the user a command runs as) are not made
here: they need the answer, not a placeholder (node/access.py).
"""

from __future__ import annotations

import logging
import pwd
import threading
import time
from collections.abc import Callable

from trainguard.core.logs import kv

log = logging.getLogger("trainguard.users")

LOOKUP_S = 0.5  # how long a caller waits for a name: NSS answers from its cache in microseconds, LDAP in milliseconds
RETRY_S = 300.0  # a uid NSS did not answer for, or has no name for, is shown as its number this long before asking again
MAX_CACHED = 4096  # uids whose answer is kept: more users than run processes on a node
MAX_IN_FLIGHT = 8  # lookups under way at once: a hung NSS holds at most this many threads


def passwd_name(uid: int) -> str | None:
    """The name NSS gives `uid`; None when it has none."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


class UserNames:
    """uid -> user name for display, shared by the checks of one agent (CheckContext.user_names), which owns it."""

    def __init__(self, timeout: float = LOOKUP_S, lookup: Callable[[int], str | None] = passwd_name,
                 clock: Callable[[], float] = time.monotonic, retry: float = RETRY_S, capacity: int = MAX_CACHED,
                 in_flight: int = MAX_IN_FLIGHT) -> None:
        self.timeout, self.lookup, self.clock = timeout, lookup, clock
        self.retry, self.capacity, self.in_flight = retry, capacity, in_flight
        self._known: dict[int, tuple[str | None, float]] = {}  # uid -> (its name or None, when None is asked again)
        self._pending: dict[int, threading.Event] = {}  # uid -> set when its lookup under way returns
        self._lock = threading.Lock()

    def name(self, uid: int) -> str:
        """`uid`'s name; its number when NSS has none or does not answer within `timeout`."""
        return self.get(uid) or str(uid)

    def get(self, uid: int) -> str | None:
        """`uid`'s name; None when NSS has none or does not answer within `timeout`."""
        with self._lock:
            known = self._known.get(uid)
            if known is not None and (known[0] is not None or self.clock() < known[1]):
                return known[0]
            done = self._pending.get(uid)
            if done is None:
                done = self._start(uid)
            elif known is not None:  # its lookup already did not answer once: no wait again until it returns
                return None
            if done is None:
                return None
        done.wait(self.timeout)
        with self._lock:
            known = self._known.get(uid)
            hung = not done.is_set() and (known is None or self.clock() >= known[1])  # the first to give up says it
            if hung:
                self._keep(uid, None)
                known = self._known.get(uid)
        if hung:
            log.warning("user name lookup did not answer; the uid is shown", extra=kv(uid=uid, timeout=self.timeout))
        return known[0] if known is not None else None

    def _start(self, uid: int) -> threading.Event | None:
        """A lookup of `uid` started on its own thread (under the lock); None when too many are under way."""
        if len(self._pending) >= self.in_flight:
            return None
        done = threading.Event()
        try:
            threading.Thread(target=self._look_up, args=(uid, done), name=f"getpwuid-{uid}", daemon=True).start()
        except RuntimeError:  # no thread to be had (a pids limit): the number is shown
            return None
        self._pending[uid] = done
        return done

    def _look_up(self, uid: int, done: threading.Event) -> None:
        try:
            name = self.lookup(uid)
        except Exception as exc:  # noqa: BLE001 - NSS modules raise what they like; the number is shown
            log.warning("user name lookup failed", extra=kv(uid=uid, error=exc))
            name = None
        with self._lock:
            self._keep(uid, name)
            self._pending.pop(uid, None)
            done.set()

    def _keep(self, uid: int, name: str | None) -> None:
        self._known.pop(uid, None)
        while len(self._known) >= self.capacity:
            self._known.pop(next(iter(self._known)))
        self._known[uid] = (name, self.clock() + self.retry)
