"""A log line as people's logs really carry it, made plain before a diagnosis reads it.

Launchers and terminals put things in front of and across the lines PyTorch prints: `[rank3]:` (PyTorch 2.2+),
`[default0]:` (torchrun --tee, the local rank), `0: ` (srun --label), mpirun's tags (`[1,3]<stderr>:`, see MPI_TAG),
`[3] ` (MPICH's -prepend-rank), indentation (a traceback inside torchrun's summary), a tqdm progress bar whose line
the next message was glued to, and a terminal or a paste that wraps a long line mid-word or mid-number. `plain`
strips the prefixes and names the rank; `unwrap` joins a wrapped line back; `timestamp` reads when a line was
printed, so findings can be ordered by time rather than by file.

All patterns are RE2 (linear in the line) and bounded; nothing here raises on any input.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from trainguard.core.text import linear

MAX_LINE = 8192  # what a diagnosis looks at of one line (messages are a few hundred characters; tracebacks longer)
MAX_WRAP = 3  # a wrapped message spans at most this many lines more

# ctime(3)'s `Thu Jun 18 14:28:35 2020` (`Jun  8` for single-digit days): mpirun --timestamp-output, horovodrun
_CTIME = r"[A-Z][a-z]{2} ([A-Z][a-z]{2}) ( [1-9]|[12]\d|3[01]) (\d{2}):(\d{2}):(\d{2}) \d{4}"
# mpirun's tag, its group the rank: Open MPI 4's --tag-output `[1,13]<stderr>:` (jobid,rank), with
# --timestamp-output `Thu Jun 18 14:28:35 2020[1,5]<stderr>:` (alone: `...2020<stderr>:`); Open MPI 5 (PMIx) adds
# a space and has more forms: `[1,0]<stdout>: `, --output tag-fullname `[prterun-f5n18-100629@1,0]<stdout>: `,
# tag-detailed `[1,0][host:pid]<stdout>: `, rank `[0]<stdout>: `, timestamp `[Thu Jun 18 14:28:35 2020]`;
# horovodrun's `[1]<stderr>:` and `Mon Oct 19 20:44:09 2020[0]<stderr>:`
_DATE = _CTIME.replace("(", "(?:")  # the same without its groups
MPI_TAG = (r"(?:\[" + _DATE + r"\]|" + _DATE + r")?"
           r"(?:\[(?:[^\[\],\n]{1,100},)?(\d{1,7})\](?:\[[^\[\]\n]{1,200}\])?)?<std(?:out|err|diag)>:")
# `[default0]:`, `[rank3]:`, `0: `, `[3] `, mpirun's tag; groups: the local rank, PyTorch's rank, the launchers'
LAUNCHER = r"\[default(\d{1,7})\]:|\[rank(\d{1,7})\]:|(\d{1,5}): |\[(\d{1,5})\] |" + MPI_TAG
# the launchers' prefixes in any of the orders they stack them, after indentation
_PREFIX = linear(r"^(?:\s{1,200}|" + LAUNCHER + ")")
# tqdm: `Loading checkpoint shards:  57% 4/7 [00:40<00:29,  9.96s/it]` (then the glued message)
_BAR = linear(r"^.{0,600}?\[\d{1,4}:\d{2}(?::\d{2})?<[^\]\n]{0,60}(?:it/s|s/it)\]")
# PyTorch's own rank inside the message: `[Rank 5]`, `[PG 3 Rank 5]`, `[PG ID 0 PG GUID 0(default_pg) Rank 1]`
_INNER_RANK = linear(r"\[(?:PG [^\]\n]{1,80} )?Rank (\d{1,7})\]")
# glog `[E1016 03:33:45.317536384` (months before October unpadded: `[E814 01:57:12`), ISO `2024-05-11 14:10:52.224`,
# torchrun's `2025-05-21_15:43:03`
_GLOG = linear(r"\[[EWIF](\d{1,2})(\d{2}) (\d{2}):(\d{2}):(\d{2}(?:\.\d{1,9})?)")
_ISO = linear(r"\b\d{4}-(\d{2})-(\d{2})[ T_](\d{2}):(\d{2}):(\d{2}(?:[.,]\d{1,9})?)")
# else the launcher's: mpirun --timestamp-output, horovodrun (when mpirun printed the line, not when the rank did)
_STAMPED = linear(r"^\[?" + _CTIME)
_MONTHS = {name: n for n, name in enumerate(("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct",
                                              "Nov", "Dec"), 1)}


@dataclass(frozen=True)
class Plain:
    text: str  # the message without launcher prefixes, progress bar or indentation
    rank: str | None  # the global rank the line names (`[rankN]:`, else a launcher's, else PyTorch's `[Rank N]`)
    local_rank: str | None = None  # torchrun --tee's `[defaultN]:`


def plain(line: str) -> Plain:
    """The message in one log line and the rank that printed it."""
    text = line[:MAX_LINE].rstrip("\r\n")
    rank = launched = local = None
    for _ in range(8):  # a few stacked prefixes at most
        m = _PREFIX.match(text)
        if m is None or m.end() == 0:
            break
        local, rank = local or m.group(1), rank or m.group(2)
        launched = launched or m.group(3) or m.group(4) or m.group(5)
        text = text[m.end():]
    # PyTorch's `[rankN]:` is the global rank; a launcher's number is its task's, the node's where it started one
    # torchrun per node (`1: [default0]:[rank12]:`)
    rank = rank or launched
    if (bar := _BAR.match(text)) is not None:
        text = text[bar.end():].lstrip()
    if rank is None and (inner := _INNER_RANK.search(text)) is not None:
        rank = inner.group(1)
    return Plain(text, rank, local)


def unwrap(data: bytes, end: int, complete: Callable[[str], bool]) -> tuple[str, int] | None:
    """The line ending at `end` in `data` joined with the lines after it, as a terminal or a paste wrapped it, when
    `complete(joined)` holds for the join and not before: (the joined text, the end of its last line); else None.

    The wrap is joined without a separator: a terminal breaks a line at its width, mid-word or mid-number
    (`NumelOut=5` / `164000`); the following lines' own leading spaces are kept."""
    start = data.rfind(b"\n", 0, end) + 1
    text = data[start:end].decode("utf-8", errors="replace")[:MAX_LINE]
    stop = end
    for _ in range(MAX_WRAP):
        if stop >= len(data):
            return None
        nxt = data.find(b"\n", stop + 1)
        nxt = len(data) if nxt < 0 else nxt
        more = data[stop + 1:nxt].decode("utf-8", errors="replace").rstrip()
        if not more or len(text) + len(more) > MAX_LINE:
            return None
        text += more
        stop = nxt
        if complete(text):
            return text, stop
    return None


def timestamp(line: str) -> float | None:
    """When the line was printed, as seconds since the start of its year (the forms PyTorch's glog and loggers
    print carry no year or a year we can ignore: findings of one job are compared), or None."""
    m = _GLOG.search(line) or _ISO.search(line) or _STAMPED.match(line)
    if m is None:
        return None
    try:
        month = _MONTHS.get(m.group(1)) or int(m.group(1))
        day, hour, minute = (int(g) for g in m.groups()[1:4])
        second = float(m.group(5).replace(",", "."))
    except ValueError:
        return None
    return ((month * 31 + day) * 24 + hour) * 3600.0 + minute * 60 + second


def stamp(when: float) -> float:
    """A wall time in the form `timestamp` gives (the node's local time, its year ignored): an event of the node (a
    kernel record) placed among the job's lines."""
    t = time.localtime(when)
    return ((t.tm_mon * 31 + t.tm_mday) * 24 + t.tm_hour) * 3600.0 + t.tm_min * 60 + t.tm_sec + when % 1
