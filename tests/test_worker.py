"""Worker: the thread a check's runs share, started on demand, kept between calls, ended when idle or closed."""

from __future__ import annotations

import threading
import time

from tests.conftest import wait_until
from trainguard.core.worker import Worker


def test_calls_run_in_order_on_one_thread_kept_between_them() -> None:
    worker = Worker("w", keep=5.0)
    seen: list[tuple[int, int]] = []
    done = threading.Event()
    for i in range(5):
        worker.submit(lambda i=i: seen.append((i, threading.get_ident())))
    worker.submit(done.set)
    assert done.wait(5)
    assert [i for i, _ in seen] == [0, 1, 2, 3, 4]
    assert len({ident for _, ident in seen}) == 1
    later = threading.Event()
    idents: list[int] = []
    worker.submit(lambda: (idents.append(threading.get_ident()), later.set()))
    assert later.wait(5) and idents == [seen[0][1]]  # the same thread took the next call
    worker.close()


def test_an_idle_worker_ends_and_the_next_call_starts_another() -> None:
    worker = Worker("idle-worker", keep=0.2)
    first: list[threading.Thread] = []
    worker.submit(lambda: first.append(threading.current_thread()))
    wait_until(lambda: bool(first) and not first[0].is_alive(), 5, what="the idle worker's thread to end")
    second: list[threading.Thread] = []
    worker.submit(lambda: second.append(threading.current_thread()))
    wait_until(lambda: bool(second), 5, what="the next call to run")
    assert second[0] is not first[0]
    worker.close()


def test_a_call_that_raises_leaves_the_worker_running() -> None:
    worker = Worker("w", keep=5.0)
    done = threading.Event()

    def boom() -> None:
        raise RuntimeError("boom")

    worker.submit(boom)
    worker.submit(done.set)
    assert done.wait(5)
    worker.close()


def test_a_call_that_exits_leaves_the_worker_running() -> None:
    """sys.exit() in a check's code ends a plain thread silently; the check's later runs must still be taken."""
    worker = Worker("w", keep=5.0)
    done = threading.Event()

    def leave() -> None:
        raise SystemExit(3)

    worker.submit(leave)
    worker.submit(done.set)
    assert done.wait(5)
    later = threading.Event()
    worker.submit(later.set)
    assert later.wait(5)
    worker.close()


def test_close_ends_the_thread_after_the_calls_handed_over() -> None:
    worker = Worker("closing", keep=60.0)
    threads: list[threading.Thread] = []
    ran: list[int] = []
    gate = threading.Event()
    worker.submit(lambda: (threads.append(threading.current_thread()), gate.wait(5)))
    worker.submit(lambda: ran.append(1))
    worker.close()
    gate.set()
    wait_until(lambda: bool(threads) and not threads[0].is_alive(), 5, what="the closed worker's thread to end")
    assert ran == [1]
    started = time.monotonic()
    after: list[int] = []
    worker.submit(lambda: after.append(1))  # a call after close still runs, on a thread that then ends
    wait_until(lambda: after == [1], 5, what="the call after close")
    assert time.monotonic() - started < 5
