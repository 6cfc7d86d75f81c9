"""A bounded HTTP/1.0 server for the agent's endpoints, which any local account can reach but not exhaust.

One thread per server reads requests: a selector over the listening socket and every open connection, each read
non-blocking, each connection with a deadline for its whole request (`REQUEST_DEADLINE_S` from its accept, however
slowly the bytes come) and one for its reply. Only complete requests go to a small fixed pool of workers
(trainguard.core.worker, started on demand); the reply goes back to the loop, which writes it non-blocking too. At
most `cap` connections are open: one more evicts the oldest still sending its request (a fresh scraper sends its
request at once, so a slow client is the oldest), and none is accepted while every open one is being answered.

Idle, the loop sleeps on the listening socket and a wake pipe (no poll timeout: the idle agent's CPU matters); it
wakes for a connection, a worker's reply, a deadline of an open connection, or `stop()`.

Why not a library: http.server's threading servers take one thread per connection and their timeout is per read
(a byte every few seconds holds a thread and a descriptor for ever); asyncio or an ASGI server would be a second
concurrency model or a new dependency, for three read-only paths and three commands.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainguard.core.logs import kv
from trainguard.core.worker import Worker

log = logging.getLogger("trainguard.http")

BACKLOG = 128  # a burst of scrapers and status calls queues here instead of waiting a second for a SYN retry
# TCP: any local account can connect, and a burst of its connects (2,000 reopened at once) beyond the backlog makes
# the kernel drop every SYN meanwhile, a scraper's too (a second's retry). Queued connections cost the agent no
# descriptor, and the loop accepts them in milliseconds. The kernel clamps it to net.core.somaxconn (4096 by default).
TCP_BACKLOG = 4096
REQUEST_DEADLINE_S = 5.0  # from accept to the request's last byte: real clients send theirs at once
REPLY_DEADLINE_S = 10.0  # to take the reply: a client that stops reading is cut then
MAX_HEAD = 8 << 10  # request line and headers (a cap's worth of them is 2 MiB)
MAX_BODY = 64 << 10  # an operator command's JSON (the TCP endpoint takes no body: it refuses every command)
ACCEPT_BATCH = 64  # connections taken per wake-up: well under any cap (one accepted early in a batch is not evicted
# by the rest of it), and the reads get their turn
READ_CHUNK = 8192
PAUSE_S = 1.0  # out of descriptors with nothing to evict: the listener rests (else it is readable, and the loop spins)
REPORT_EVERY_S = 60.0  # connections cut, said at most this often
TOO_LARGE = b"HTTP/1.0 431 Request Header Fields Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
BUSY = b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"

Peer = Callable[[socket.socket, Any], Any]  # (connection, address) -> the handler's client_address; None refuses it
Handle = Callable[[bytes, Any], bytes]  # (a complete request, the peer) -> the whole reply; runs on a worker


def connection_cap(limit: int, share: int = 4) -> int:
    """At most `limit` connections, and never more than a `share`-th of this process's descriptors (RLIMIT_NOFILE):
    the rest stay for the agent's logs, sockets, state database and children."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(8, min(limit, soft // share)) if soft != resource.RLIM_INFINITY else limit


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    peer: Any
    deadline: float
    buf: bytearray = field(default_factory=bytearray)
    scanned: int = 0  # where the search for the end of the headers resumes
    need: int | None = None  # the request's whole length, once its headers are in
    out: memoryview | None = None  # what is left of the reply
    events: int = 0  # what the selector watches for it
    closed: bool = False  # read by the worker: a request cut before its turn is not served


def head_end(buf: bytearray, start: int) -> int | None:
    """The offset past the blank line that ends the headers (lines end in CRLF or LF), searched from `start`."""
    ends = [i + n for i, n in ((buf.find(b"\n\r\n", start), 3), (buf.find(b"\n\n", start), 2)) if i >= 0]
    return min(ends) if ends else None


def content_length(head: bytes, limit: int) -> int:
    """The body's length the headers declare, at most `limit`; 0 when absent or not a number (the handler answers)."""
    for line in head.split(b"\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep and name.strip().lower() == b"content-length":
            value = value.strip()
            return min(int(value), limit) if value.isdigit() and len(value) < 12 else 0
    return 0


class BoundedServer:
    """Serves `handle` on the listening `sock` until `stop()`; see the module's docstring."""

    def __init__(self, sock: socket.socket, handle: Handle, name: str, workers: int, cap: int,
                 peer: Peer = lambda _sock, address: address, max_body: int = 0) -> None:
        self.sock = sock
        self.name = name
        self.cap = cap
        self.max_body = max_body
        self._handle = handle
        self._peer = peer
        self._workers = [Worker(f"{name}-{i}") for i in range(workers)]
        self._load = [0] * workers  # requests handed to each worker and not answered (the loop's alone)
        self._reading: dict[int, _Conn] = {}  # by descriptor, in the order accepted: the oldest first
        self._working: dict[int, _Conn] = {}
        self._writing: dict[int, _Conn] = {}
        self._done: deque[tuple[int, _Conn, bytes]] = deque()  # replies from the workers
        self._lock = threading.Lock()  # the wake pipe's life: no worker writes to it once stop() began
        self._wake: tuple[int, int] | None = os.pipe()
        os.set_blocking(self._wake[1], False)  # a full pipe wakes the loop already
        self._selector: selectors.BaseSelector | None = None
        self._paused_until: float | None = None
        self._cut = {"evicted": 0, "timed_out": 0, "refused": 0}
        self._reported = -REPORT_EVERY_S

    @property
    def open_connections(self) -> int:
        return len(self._reading) + len(self._working) + len(self._writing)

    # the loop ------------------------------------------------------------------------------------------------
    def serve_until_stopped(self) -> None:
        wake = self._wake
        if wake is None:  # stopped before it started
            return
        self.sock.setblocking(False)
        with selectors.DefaultSelector() as selector:
            self._selector = selector
            selector.register(self.sock, selectors.EVENT_READ, None)
            selector.register(wake[0], selectors.EVENT_READ, wake)
            try:
                while self._wake is not None:
                    for key, events in selector.select(self._timeout()):
                        if isinstance(key.data, _Conn) and key.data.closed:
                            continue  # cut earlier in this batch (evicted): its descriptor may be another's now
                        try:
                            if key.data is None:
                                self._accept()
                            elif key.data is wake:
                                os.read(wake[0], 4096)
                            elif events & selectors.EVENT_READ:
                                self._read(key.data)
                            else:
                                self._write(key.data)
                        except OSError as exc:  # one connection's (or one accept's) trouble, never the server's end
                            log.warning("http connection failed", extra=kv(server=self.name, error=exc))
                            if isinstance(key.data, _Conn):
                                self._close(key.data)
                    self._replies()
                    self._expire(time.monotonic())
            finally:
                for conn in [*self._reading.values(), *self._working.values(), *self._writing.values()]:
                    self._close(conn)

    def _timeout(self) -> float | None:
        """Until the next deadline; None (sleep until woken) while no connection is open."""
        deadlines = [c.deadline for c in self._writing.values()]
        if self._reading:
            deadlines.append(next(iter(self._reading.values())).deadline)  # accepted first, due first
        if self._paused_until is not None:
            deadlines.append(self._paused_until)
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _accept(self) -> None:
        assert self._selector is not None
        for _ in range(ACCEPT_BATCH):
            try:
                sock, address = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    raise
                if not self._evict():  # the descriptors went elsewhere: rest, else the listener keeps us spinning
                    self._paused_until = time.monotonic() + PAUSE_S
                    self._selector.unregister(self.sock)
                    log.warning("out of descriptors; not accepting for a second", extra=kv(
                        server=self.name, error=exc.strerror, connections=self.open_connections))
                    return
                continue
            try:
                peer = self._peer(sock, address)
            except OSError:
                peer = None
            if peer is None or (self.open_connections >= self.cap and not self._evict()):
                self._cut["refused"] += peer is not None
                sock.close()
                continue
            sock.setblocking(False)
            conn = _Conn(sock, peer, time.monotonic() + REQUEST_DEADLINE_S)
            self._reading[sock.fileno()] = conn
            self._watch(conn, selectors.EVENT_READ)
            self._read(conn)  # a client sends its request with the connect: served now, never evicted

    def _evict(self) -> bool:
        """Closes the connection that has been sending its request longest; False when none is."""
        oldest = next(iter(self._reading.values()), None)
        if oldest is None:
            return False
        self._close(oldest)
        self._cut["evicted"] += 1
        return True

    def _read(self, conn: _Conn) -> None:
        try:
            chunk = conn.sock.recv(READ_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._close(conn)
            return
        conn.buf += chunk
        if conn.need is None:
            end = head_end(conn.buf, conn.scanned)
            if end is None:
                conn.scanned = max(0, len(conn.buf) - 2)
                if len(conn.buf) > MAX_HEAD:
                    self._reply(conn, TOO_LARGE)
                return
            conn.need = end + content_length(bytes(conn.buf[:end]), self.max_body)
        if len(conn.buf) >= conn.need:
            self._work(conn, bytes(conn.buf[:conn.need]))

    def _work(self, conn: _Conn, request: bytes) -> None:
        """Hands a complete request to the least busy worker."""
        fd = conn.sock.fileno()
        del self._reading[fd]
        self._working[fd] = conn
        self._watch(conn, 0)
        i = min(range(len(self._workers)), key=self._load.__getitem__)
        try:
            self._workers[i].submit(lambda: self._serve(i, conn, request))
        except RuntimeError as exc:  # no thread could start (the unit's TasksMax): say so, and go on
            log.warning("no worker thread for a request", extra=kv(server=self.name, error=exc))
            self._reply(conn, BUSY)
            return
        self._load[i] += 1

    def _serve(self, worker: int, conn: _Conn, request: bytes) -> None:
        """On a worker: the reply, handed back to the loop."""
        reply = b""
        if not conn.closed:
            try:
                reply = self._handle(request, conn.peer)
            except Exception as exc:  # noqa: BLE001 - one request's failure is its connection's, never the server's
                log.warning("http request failed", extra=kv(server=self.name, error=f"{type(exc).__name__}: {exc}"))
        self._done.append((worker, conn, reply))
        with self._lock:
            if self._wake is not None:
                try:
                    os.write(self._wake[1], b"r")
                except BlockingIOError:  # full: the loop wakes anyway
                    pass

    def _replies(self) -> None:
        while self._done:
            worker, conn, reply = self._done.popleft()
            self._load[worker] -= 1
            if conn.closed:
                continue
            if reply:
                self._reply(conn, reply)
            else:
                self._close(conn)

    def _reply(self, conn: _Conn, reply: bytes) -> None:
        fd = conn.sock.fileno()
        self._reading.pop(fd, None)
        self._working.pop(fd, None)
        self._writing[fd] = conn
        conn.out = memoryview(reply)
        conn.deadline = time.monotonic() + REPLY_DEADLINE_S
        self._write(conn)

    def _write(self, conn: _Conn) -> None:
        assert conn.out is not None
        try:
            conn.out = conn.out[conn.sock.send(conn.out):]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            log.debug("http client went away", extra=kv(server=self.name, error=type(exc).__name__))
            self._close(conn)
            return
        if conn.out:
            self._watch(conn, selectors.EVENT_WRITE)
        else:
            self._close(conn)

    def _expire(self, now: float) -> None:
        while self._reading:
            oldest = next(iter(self._reading.values()))
            if oldest.deadline > now:
                break
            self._close(oldest)
            self._cut["timed_out"] += 1
        for conn in [c for c in self._writing.values() if c.deadline <= now]:
            self._close(conn)
            self._cut["timed_out"] += 1
        if self._paused_until is not None and now >= self._paused_until and self._selector is not None:
            self._paused_until = None
            self._selector.register(self.sock, selectors.EVENT_READ, None)
        if any(self._cut.values()) and now - self._reported >= REPORT_EVERY_S:
            # said once a minute at most: a flood of slow clients must not flood the journal too
            log.warning("http connections cut", extra=kv(server=self.name, cap=self.cap, **self._cut,
                                                         open=self.open_connections))
            self._reported = now
            self._cut = dict.fromkeys(self._cut, 0)

    def _watch(self, conn: _Conn, events: int) -> None:
        assert self._selector is not None
        if conn.events and events:
            self._selector.modify(conn.sock, events, conn)
        elif events:
            self._selector.register(conn.sock, events, conn)
        elif conn.events:
            self._selector.unregister(conn.sock)
        conn.events = events

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        fd = conn.sock.fileno()
        for table in (self._reading, self._working, self._writing):
            table.pop(fd, None)
        if conn.events:
            self._watch(conn, 0)
        conn.sock.close()

    # stop ----------------------------------------------------------------------------------------------------
    def stop(self, thread: threading.Thread) -> None:
        """Once; a second call does nothing. The pipe is closed only when the serve thread is gone (a closed fd's
        number may be reused by the time a late select or write would touch it); no worker writes to it after."""
        with self._lock:
            wake, self._wake = self._wake, None
        if wake is None:
            return
        try:
            os.write(wake[1], b"x")
        except BlockingIOError:
            pass
        if thread.ident is not None:
            thread.join(5.0)
        for worker in self._workers:
            worker.close()
        if not thread.is_alive():
            for fd in wake:
                os.close(fd)
        self.sock.close()
