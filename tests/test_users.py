"""User names for display (trainguard.node.users): an NSS that does not answer (LDAP, SSSD down) costs a check at most
the lookup's timeout, never a thread per call."""

from __future__ import annotations

import os
import threading

from tests.conftest import wait_until
from trainguard.node.pressure import user_name
from trainguard.node.procfs import ProcFS
from trainguard.node.users import UserNames, passwd_name


class _Nss:
    """A directory whose answers for the uids in `hung` wait for `release`; counts the lookups made."""

    def __init__(self, names: dict[int, str], hung: frozenset[int] = frozenset()) -> None:
        self.names, self.hung = names, hung
        self.asked: list[int] = []
        self.release = threading.Event()

    def __call__(self, uid: int) -> str | None:
        self.asked.append(uid)
        if uid in self.hung:
            self.release.wait(30)
        if uid == 666:
            raise OSError("nss module failed")
        return self.names.get(uid)


def _lookups(uids: range) -> list[str]:
    """The lookup threads of `uids` alive (one that answered may still be ending)."""
    return [t.name for t in threading.enumerate() if t.name in {f"getpwuid-{uid}" for uid in uids}]


def test_a_name_is_looked_up_once_and_one_nss_has_not_is_its_number_until_asked_again() -> None:
    now = [0.0]
    nss = _Nss({1000: "alice"})
    names = UserNames(timeout=5, lookup=nss, clock=lambda: now[0], retry=60)
    assert [names.name(1000), names.name(1000), names.name(4242), names.name(4242), names.name(666)] == [
        "alice", "alice", "4242", "4242", "666"]
    assert names.get(4242) is None
    assert nss.asked == [1000, 4242, 666]
    now[0] = 61.0  # a user added since is named once `retry` has passed
    nss.names[4242] = "bob"
    assert names.name(4242) == "bob"
    assert nss.asked == [1000, 4242, 666, 4242]


def test_a_hung_lookup_shows_the_uid_and_never_starts_a_second_one_for_that_uid() -> None:
    now = [0.0]
    nss = _Nss({1000: "alice", 1001: "carol"}, hung=frozenset({1000}))
    names = UserNames(timeout=0.05, lookup=nss, clock=lambda: now[0], retry=60)
    try:
        waiting = [threading.Thread(target=names.name, args=(1000,)) for _ in range(4)]  # checks at once
        for thread in waiting:
            thread.start()
        for thread in waiting:
            thread.join(10)
        assert names.name(1000) == "1000"
        now[0] = 600.0  # past `retry`: the lookup under way still hangs, and is not made again
        assert [names.name(1000) for _ in range(20)] == ["1000"] * 20
        assert names.name(1001) == "carol"  # other users are named meanwhile
        assert nss.asked.count(1000) == 1
        assert _lookups(range(1000, 1001)) == ["getpwuid-1000"]
        nss.release.set()  # NSS answers at last: the name is shown from then on
        wait_until(lambda: names.get(1000) == "alice", 10, what="the late answer kept")
        assert nss.asked.count(1000) == 1
    finally:
        nss.release.set()


def test_hung_lookups_of_many_uids_hold_at_most_in_flight_threads() -> None:
    nss = _Nss({}, hung=frozenset(range(2000, 2010)))
    names = UserNames(timeout=0.01, lookup=nss, in_flight=3)
    try:
        assert [names.name(uid) for uid in range(2000, 2010)] == [str(uid) for uid in range(2000, 2010)]
        assert sorted(nss.asked) == [2000, 2001, 2002]
        assert len(_lookups(range(2000, 2010))) == 3
    finally:
        nss.release.set()
    wait_until(lambda: not _lookups(range(2000, 2010)), 10, what="the lookups returned")


def test_the_cache_is_bounded() -> None:
    nss = _Nss({uid: f"u{uid}" for uid in range(10)})
    names = UserNames(lookup=nss, capacity=4)
    assert [names.name(uid) for uid in range(10)] == [f"u{uid}" for uid in range(10)]
    assert len(names._known) == 4
    assert names.name(9) == "u9" and nss.asked.count(9) == 1


def test_a_process_user_is_named_through_the_bounded_lookup() -> None:
    """The job_pace check's co-tenants: this process's user by its real uid, "?" for a process gone."""
    names = UserNames()
    assert user_name(ProcFS(), os.getpid(), names) == (passwd_name(os.getuid()) or str(os.getuid()))
    assert user_name(ProcFS(), 2**22 + 1, names) == "?"  # above pid_max's ceiling: never a process
