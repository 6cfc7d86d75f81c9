"""PyTorch's flight recorder: which collective each rank of a distributed job entered, and which rank never did.

PyTorch records every collective of a process group in a per-process ring buffer (`TORCH_FR_BUFFER_SIZE` entries;
`TORCH_NCCL_TRACE_BUFFER_SIZE` for NCCL before 2.7): process group, sequence number, op, and whether it completed.
Gloo collectives are recorded too (verified on 2.13). Two ways out of a running or dead rank, both read here:

- on demand, from the rank's worker server: `torch.distributed.elastic.control_plane.worker_main()` serves
  PyTorch's debug handlers on the Unix socket `TORCH_WORKER_SERVER_SOCKET`, from a C++ thread that answers while the
  rank's Python thread is blocked in a collective. `fr_trace_json` is the generic (CPU, Gloo) recorder,
  `dump_nccl_trace_json` the NCCL one. The agent reads the socket path from the rank's environment.
- on the NCCL watchdog's timeout (`TORCH_NCCL_DUMP_ON_TIMEOUT=1`): each rank writes its buffer, pickled, to
  `TORCH_FR_DUMP_TEMP_FILE` + its rank. `trainguard.trainer.flight_recorder()` points that into the switch dir.

Everything a rank serves or writes is hostile input: the socket must be a socket owned by the rank's user (checked
on the opened inode, reached through /proc/PID/root so a private /tmp works, never following a final symlink), the
answer is bounded in size and time, pickles are loaded with no class resolvable (no code runs), and a dump that is
not the expected shape yields nothing rather than an exception.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import socket
import stat
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from trainguard.core.text import linear
from trainguard.core.units import MAX_INT64, bounded_int
from trainguard.node.access import NOBODY, Identity, open_as
from trainguard.node.procfs import ProcFS

SOCKET_VAR = "TORCH_WORKER_SERVER_SOCKET"
DUMP_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
HANDLERS = ("fr_trace_json", "dump_nccl_trace_json")  # CPU/Gloo recorder, NCCL recorder (404 in a CPU build)
MAX_ANSWER = 32 << 20  # a full 20000-entry buffer with stacks is a few MiB
MAX_RANKS = 1 << 17  # a pg_config rank list longer than this is not a real job's
MAX_RANK = 2**31 - 1  # torch keeps ranks in a C int
MAX_ENTRIES = 1 << 16  # TORCH_FR_BUFFER_SIZE defaults to 2000; a longer ring buffer is not read past this
_RANK_LIST = linear(r"\d{1,7}")
_DUMP_NAME = linear(r"(\d{1,7})$")


@dataclass(frozen=True, order=True)
class Collective:
    pg: str  # the process group's name ("0" is the default group)
    seq: int  # its collective sequence number in that group
    op: str = field(default="", compare=False)  # all_reduce, barrier, _reduce_scatter_base, ...

    def describe(self) -> str:
        return f"{self.op or 'collective'} #{self.seq}" + (f" (process group {self.pg})" if self.pg != "0" else "")


@dataclass(frozen=True)
class RankTrace:
    """What one rank's flight recorder says, per process group: the last collective it entered and those still in
    flight (entered, not completed)."""

    rank: int
    entered: tuple[Collective, ...] = ()  # the last collective entered, one per process group
    in_flight: tuple[Collective, ...] = ()
    groups: tuple[tuple[str, tuple[int, ...]], ...] = ()  # process group -> its global ranks (pg_config)
    pid: int | None = None
    node: str | None = None
    source: str = ""  # where it came from: a socket, a dump file
    malformed: int = 0  # entries skipped: a sequence id or process group id that is not a non-negative int64
    wait_ratio: float | None = None  # the share of its recent time the rank's collectives ran (`wait_ratio`)

    def last(self, pg: str) -> Collective | None:
        return next((c for c in self.entered if c.pg == pg), None)

    def label(self) -> str:
        where = ", ".join(w for w in (f"node {self.node}" if self.node else None,
                                      f"pid {self.pid}" if self.pid else None) if w)
        return f"rank {self.rank}" + (f" ({where})" if where else "")


def _op(entry: dict[str, Any]) -> str:
    name = entry.get("profiling_name")
    return name.split(":", 1)[-1][:64] if isinstance(name, str) else ""


def _pg(entry: dict[str, Any]) -> str | None:
    group = entry.get("process_group")
    if isinstance(group, (list, tuple)) and group and isinstance(group[0], str):
        return group[0][:64]
    pg_id = entry.get("pg_id")
    return _pg_id(pg_id) if isinstance(pg_id, int) else None


def _pg_id(value: Any) -> str | None:
    """A process group id as its name: a non-negative int64, or (a pg_status key) a string; None for anything else."""
    if isinstance(value, str):
        return value[:64]
    number = bounded_int(value) if isinstance(value, int) else None
    return str(number) if number is not None else None


def _seq(value: Any) -> int | None:
    """A collective's sequence number: 0 <= seq < 2**63, else None (the entry is malformed)."""
    return bounded_int(value, 0, MAX_INT64)


def _groups(dump: dict[str, Any], names: Iterable[str]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Each process group's global ranks from pg_config (`"ranks": "[0, 1]"`). Gloo's default group is keyed
    by an empty name while its entries say "0": a single config entry is taken as the only group's."""
    config = dump.get("pg_config")
    if not isinstance(config, dict):
        return ()
    parsed: dict[str, tuple[int, ...]] = {}
    for key, value in list(config.items())[:1024]:
        if not isinstance(value, dict) or not isinstance(value.get("ranks"), str):
            continue
        ranks = tuple(int(r) for r in _RANK_LIST.findall(value["ranks"][:MAX_RANKS * 8]))
        name = value["name"][:64] if isinstance(value.get("name"), str) else _pg_id(key)
        if name is not None:
            parsed[name] = ranks
    wanted = list(dict.fromkeys(names))
    if len(parsed) == 1 and len(wanted) == 1 and wanted[0] not in parsed:
        return ((wanted[0], next(iter(parsed.values()))),)
    return tuple((name, parsed[name]) for name in wanted if name in parsed)


def _ns(value: Any) -> int | None:
    return bounded_int(value, 1, MAX_INT64) if isinstance(value, int) else None


def wait_ratio(entries: Sequence[Any]) -> float | None:
    """The share of the time its completed collectives span that the rank spent inside them (NCCL: from the kernel's
    start to its completion as the watchdog saw them, or `duration_ms` where timing is on). A collective's kernel runs
    until the last rank joins, so the rank that sets the pace (arrives last) waits least and its peers most. None
    where the entries carry no times (Gloo's, a recorder without them) or fewer than two collectives completed."""
    busy, first, last, count = 0.0, None, None, 0
    for entry in entries[-MAX_ENTRIES:]:
        if not isinstance(entry, dict) or entry.get("is_p2p") is True or entry.get("state") != "completed":
            continue
        start, end = _ns(entry.get("time_discovered_started_ns")), _ns(entry.get("time_discovered_completed_ns"))
        if start is None or end is None or end < start:
            continue
        took = entry.get("duration_ms")
        busy += float(took) * 1e6 if isinstance(took, (int, float)) and 0 <= took < 1e9 else end - start
        first = start if first is None else min(first, start)
        last = end if last is None else max(last, end)
        count += 1
    if count < 2 or first is None or last is None or last <= first:
        return None
    return min(1.0, busy / (last - first))


def parse_dump(dump: Any, rank: int, pid: int | None = None, node: str | None = None, source: str = "") -> RankTrace | None:
    """One rank's trace from a flight-recorder dump (the JSON or the unpickled form: same keys). None when the dump
    is not a flight recorder's."""
    if not isinstance(dump, dict) or not isinstance(dump.get("entries", []), list):
        return None
    last: dict[str, Collective] = {}
    in_flight: dict[tuple[str, int], Collective] = {}
    malformed = 0
    for entry in dump.get("entries", [])[:MAX_ENTRIES]:
        if not isinstance(entry, dict) or entry.get("is_p2p") is True:
            continue
        pg, seq = _pg(entry), _seq(entry.get("collective_seq_id"))
        if pg is None or seq is None:
            malformed += 1
            continue
        if seq == 0:
            continue
        c = Collective(pg, seq, _op(entry))
        if pg not in last or seq >= last[pg].seq:
            last[pg] = c
        # NCCL entries go scheduled -> started -> completed; Gloo's stay "scheduled" and only `retired` tells
        if entry.get("retired") is not True and entry.get("state") != "completed":
            in_flight[(pg, seq)] = c
    status = dump.get("pg_status")
    for pg_id, st in (status.items() if isinstance(status, dict) else ()):
        enqueued = _seq(st.get("last_enqueued_collective")) if isinstance(st, dict) else None
        if (name := _pg_id(pg_id)) is None:  # JSON keys are strings; a pickle's may be anything
            malformed += 1
            continue
        if enqueued is not None and enqueued > 0 and (name not in last or enqueued > last[name].seq):
            last[name] = Collective(name, enqueued)  # entered beyond what the ring buffer still holds
    entries = dump.get("entries", [])
    return RankTrace(rank, tuple(sorted(last.values())), tuple(sorted(in_flight.values())),
                     _groups(dump, last), pid, node, source, malformed, wait_ratio(entries))


# Reading it ---------------------------------------------------------------------------------------------------------

class _NoClasses(pickle.Unpickler):
    """A flight-recorder pickle holds dicts, lists, tuples, strings and numbers only: nothing may name a class."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing {module}.{name}")


def load_pickle(data: bytes) -> Any:
    try:
        return _NoClasses(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError,
            OverflowError, MemoryError, RecursionError, UnicodeDecodeError):
        return None


def _read_owned(path: Path, uid: int | None, limit: int = MAX_ANSWER) -> bytes | None:
    """A regular file owned by `uid` and readable by them (walked with their authority: node.access), at most `limit`
    bytes; None for anything else (uid None: a file anyone may read)."""
    identity = Identity.of_uid(uid) if uid is not None else NOBODY
    try:
        fd = open_as(identity, str(path))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if (uid is not None and st.st_uid != uid) or st.st_size > limit:
            return None
        return os.read(fd, limit + 1)[:limit]
    except OSError:
        return None
    finally:
        os.close(fd)


def read_dumps(directory: Path, uid: int | None, node: str | None = None, limit: int = 4096) -> list[RankTrace]:
    """The traces the NCCL watchdog wrote on its timeout into `directory` (`<prefix><rank>` files), owned by the job's
    user. Read once per incident, not per round: a directory of a 4096-rank job is the most that is read."""
    traces = []
    try:
        names = sorted(os.listdir(directory))[:limit]
    except OSError:
        return []
    for name in names:
        m = _DUMP_NAME.search(name)
        data = _read_owned(directory / name, uid) if m else None
        dump = load_pickle(data) if data else None
        if isinstance(dump, bytes):  # some writers pickle the already-pickled string
            dump = load_pickle(dump)
        trace = parse_dump(dump, int(m.group(1)), node=node, source=str(directory / name)) if m else None
        if trace is not None:
            traces.append(trace)
    return traces


def _http_post(sock: socket.socket, handler: str, deadline: float) -> bytes | None:
    """POST /handler/<name> over a connected socket; the body of a 200 answer, bounded, else None."""
    sock.sendall(f"POST /handler/{handler} HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\n"
                 "Connection: close\r\n\r\n".encode())
    chunks, size = [], 0
    while size <= MAX_ANSWER:
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    answer = b"".join(chunks)
    head, sep, body = answer.partition(b"\r\n\r\n")
    if not sep or size > MAX_ANSWER or not head.startswith(b"HTTP/1.1 200"):
        return None
    return body


def query_socket(path: str, pid: int, uid: int | None, handler: str, timeout: float,
                 proc: ProcFS | None = None) -> bytes | None:
    """Ask the worker server of process `pid` at `path` (a path in that process's mount namespace) for `handler`.
    Only a socket owned by `uid` is spoken to: opened O_PATH without following a final symlink, checked, then
    connected through /proc/self/fd, so what was checked is what is connected to."""
    proc = proc or ProcFS()
    if not path.startswith("/") or "\0" in path or len(path) > 4096:
        return None
    try:
        fd = os.open(str(proc.path(pid, "root")) + path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    deadline = time.monotonic() + timeout
    try:
        st = os.fstat(fd)
        if not stat.S_ISSOCK(st.st_mode) or (uid is not None and st.st_uid != uid):
            return None
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(f"/proc/self/fd/{fd}")
            return _http_post(sock, handler, deadline)
    except OSError:
        return None
    finally:
        os.close(fd)


@dataclass(frozen=True)
class RankProcess:
    pid: int
    rank: int
    uid: int
    socket: str  # its worker server's socket, a path in the process's mount namespace


def worker_socket(pid: int, proc: ProcFS) -> str | None:
    """Where process `pid` serves its debug handlers: TORCH_WORKER_SERVER_SOCKET from its start environment, else
    where trainguard.trainer.flight_recorder() puts it ($TMPDIR/trainguard-fr-<pid>/worker.sock: a variable the
    helper sets later is not in /proc/PID/environ). None when no socket is there."""
    path = proc.environ_var(pid, SOCKET_VAR)
    if not path:
        tmp = next((v for n in ("TMPDIR", "TEMP", "TMP") if (v := proc.environ_var(pid, n))), "/tmp")
        path = f"{tmp.rstrip('/') or ''}/trainguard-fr-{pid}/worker.sock"
    try:
        return path if stat.S_ISSOCK(os.lstat(str(proc.path(pid, "root")) + path).st_mode) else None
    except (OSError, ValueError):
        return None


def _rank(pid: int, socket_path: str, uid: int, proc: ProcFS) -> int | None:
    """The rank from the launcher's variables, else from the `rank` file the helper writes beside its socket."""
    for name in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if (rank := bounded_int(proc.environ_var(pid, name), 0, MAX_RANK)) is not None:
            return rank
    data = _read_owned(Path(str(proc.path(pid, "root")) + socket_path).with_name("rank"), uid, limit=16)
    return bounded_int(data, 0, MAX_RANK) if data else None


def rank_processes(procs: Sequence[psutil.Process], proc: ProcFS | None = None) -> list[RankProcess]:
    """The job's processes that serve a flight recorder, one per socket: data-loader workers inherit the rank's
    environment (and so a TORCH_WORKER_SERVER_SOCKET): the rank is the one whose parent does not hold the socket."""
    proc = proc or ProcFS()
    groups: dict[str, list[psutil.Process]] = {}
    for p in procs:
        path = worker_socket(p.pid, proc)
        if path:
            groups.setdefault(path, []).append(p)
    found = []
    for path, members in groups.items():
        pids = {p.pid for p in members}
        for p in sorted(members, key=lambda m: m.pid):
            try:
                if p.ppid() in pids:
                    continue
                uid = p.uids().real
            except psutil.Error:
                continue
            rank = _rank(p.pid, path, uid, proc)
            if rank is not None:
                found.append(RankProcess(p.pid, rank, uid, path))
            break
    return found


def fetch(procs: Sequence[psutil.Process], node: str | None, timeout: float = 5.0,
          proc: ProcFS | None = None) -> list[RankTrace]:
    """Each rank's flight recorder, from its worker socket; ranks that do not answer are left out."""
    return fetch_ranks(rank_processes(procs, proc), node, timeout, proc)


def fetch_ranks(ranks: Sequence[RankProcess], node: str | None, timeout: float = 5.0,
                proc: ProcFS | None = None) -> list[RankTrace]:
    traces = []
    deadline = time.monotonic() + timeout
    for rp in ranks:
        merged: RankTrace | None = None
        for handler in HANDLERS:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            body = query_socket(rp.socket, rp.pid, rp.uid, handler, left, proc)
            try:
                dump = json.loads(body) if body else None
            except (ValueError, RecursionError):  # hostile: malformed, or nested past the parser's depth
                dump = None
            trace = parse_dump(dump, rp.rank, rp.pid, node, f"{rp.socket} ({handler})")
            merged = trace if merged is None else _merge(merged, trace)
        if merged is not None:
            traces.append(merged)
    return traces


def _merge(a: RankTrace, b: RankTrace | None) -> RankTrace:
    """One rank's CPU and NCCL recorders: their process groups are disjoint."""
    if b is None:
        return a
    return RankTrace(a.rank, tuple(sorted({*a.entered, *b.entered})), tuple(sorted({*a.in_flight, *b.in_flight})),
                     a.groups + b.groups, a.pid, a.node, a.source, a.malformed + b.malformed,
                     a.wait_ratio if a.wait_ratio is not None else b.wait_ratio)


# What it means ------------------------------------------------------------------------------------------------------

def ranges(ranks: Iterable[int]) -> str:
    """`0-4,6-7`."""
    out: list[str] = []
    ordered = sorted(set(ranks))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


@dataclass(frozen=True)
class Stall:
    """Where a distributed job stands: the collective the furthest ranks entered, who waits in it, who never
    entered it, and the group's ranks no trace was read from (on other nodes)."""

    collective: Collective | None  # None: no collective in flight anywhere
    waiting: tuple[RankTrace, ...] = ()
    missing: tuple[RankTrace, ...] = ()  # never entered `collective`
    elsewhere: tuple[int, ...] = ()  # ranks of the group without a trace here
    last: Collective | None = None  # with no collective in flight: the last one every rank completed

    def describe(self) -> str:
        if self.collective is None:
            done = f" (last: {self.last.describe()})" if self.last else ""
            return f"no collective in flight on ranks {ranges(t.rank for t in self.waiting)}{done}: the hang is " \
                   "outside communication"
        c = self.collective.describe()
        waiting = f"rank{'s' if len(self.waiting) > 1 else ''} {ranges(t.rank for t in self.waiting)} waiting"
        away = f"; ranks {ranges(self.elsewhere)} not on this node" if self.elsewhere else ""
        if self.missing:
            lagging = "; ".join(f"{t.label()} never entered {c}" + (f" (its last: {last.op or 'collective'} #{last.seq})" if (
                last := t.last(self.collective.pg)) else "") for t in self.missing)
            return f"{lagging}; {waiting}{away}"
        if self.elsewhere:
            return f"{waiting} in {c} for a rank on another node (ranks {ranges(self.elsewhere)} are elsewhere)"
        return f"every rank entered {c} and waits: the collective itself is stuck (network, NCCL) rather than a rank"

    def fields(self) -> dict[str, Any]:
        return {"collective": None if self.collective is None else {
                    "pg": self.collective.pg, "seq": self.collective.seq, "op": self.collective.op},
                "waiting": [t.rank for t in self.waiting], "elsewhere": list(self.elsewhere),
                "missing": [{"rank": t.rank, "pid": t.pid, "node": t.node,
                             "last_seq": (last.seq if self.collective and (last := t.last(self.collective.pg)) else None)}
                            for t in self.missing]}


def analyze(traces: Sequence[RankTrace]) -> Stall | None:
    """The stall the traces show, in the process group where a rank fell behind (else the default group);
    None without traces. Every rank that entered a collective is in its group: a rank whose last collective in
    that group is older than the furthest one never entered it."""
    if not traces:
        return None
    stalls = [s for pg in sorted({c.pg for t in traces for c in (*t.entered, *t.in_flight)}) if (s := _stall(traces, pg))]
    flying = [s for s in stalls if s.collective is not None]
    best = next((s for s in flying if s.missing), None) or (flying[0] if flying else None)
    if best is not None:
        return best
    last = max((c for t in traces for c in t.entered), default=None)
    return Stall(None, tuple(sorted(traces, key=lambda t: t.rank)), last=last)


def _stall(traces: Sequence[RankTrace], pg: str) -> Stall | None:
    members = [t for t in traces if t.last(pg) is not None or any(c.pg == pg for c in t.in_flight)]
    furthest = max((c for t in members for c in t.in_flight if c.pg == pg), default=None)
    if furthest is None:
        return None
    top = max(t.last(pg) or furthest for t in members)
    target = furthest if furthest.seq >= top.seq else top
    op = target.op or next((c.op for t in members for c in (*t.in_flight, *t.entered)
                            if c.pg == pg and c.seq == target.seq and c.op), "")
    target = Collective(pg, target.seq, op)
    waiting = tuple(sorted((t for t in members if any(c.pg == pg and c.seq == target.seq for c in t.in_flight)),
                           key=lambda t: t.rank))
    missing = tuple(sorted((t for t in members if (t.last(pg) or Collective(pg, 0)).seq < target.seq),
                           key=lambda t: t.rank))
    group = next((ranks for t in members for name, ranks in t.groups if name == pg), ())
    seen = {t.rank for t in traces}
    elsewhere = tuple(r for r in group if r not in seen)
    return Stall(target, waiting, missing, elsewhere)
