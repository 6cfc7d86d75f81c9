"""Collective failures read from the ranks' logs (NCCL watchdog timeouts, Gloo), gathered per job, and told as one
story: which collective the ranks timed out in, which rank stopped first, cross-checked with the flight recorder.

One rank that died, hung or OOMed leaves every other rank waiting in the next collective until its watchdog fires:
the logs fill with timeouts from the victims, and the culprit is the rank that reported none, or whose last
enqueued collective is older than the one the others wait in ("last enqueued NCCL work: 1579" while they time out
in #1580). The per-job `Gathered` record is bounded (MAX_RANKS ranks) and JSON-able, so it survives restarts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from trainguard.core.text import linear
from trainguard.logscan.lines import MPI_TAG, plain
from trainguard.node.flight import Stall, ranges

MAX_RANKS = 4096
FAR = 10  # collectives: a rank that timed out this many before the others' is far behind
_PG = r"\[(?:PG (?:ID (\d{1,7}) PG GUID (\d{1,7})[^\]]{0,80}|(\d{1,7})[^\]]{0,80}) )?Rank (\d{1,7})\]"
_TIMEOUT = linear(r"\[Rank (\d{1,7})\] Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(\d{1,12}), "
                      r"OpType=(\w{1,40})[^)]{0,200}?Timeout\(ms\)=(\d{1,12})\) ran for (\d{1,15}) milliseconds")
# (a rank that completed nothing yet says -1)
_PROGRESS = linear(_PG + r"\s{1,4}(?:Exception \(either an error or timeout\) detected by watchdog at work: (\d{1,12}), "
                       r"last enqueued NCCL work: (-?\d{1,12}), last completed NCCL work: (-?\d{1,12})"
                       r"|failure detected by watchdog at work sequence id: (\d{1,12}) PG status: last enqueued work: "
                       r"(-?\d{1,12}), last completed work: (-?\d{1,12})"
                       r"|Timeout at NCCL work: (\d{1,12}), last enqueued NCCL work: (-?\d{1,12}), last completed NCCL "
                       r"work: (-?\d{1,12}))")
_BARRIER = linear(r"\[Rank (\d{1,7})\]: Ranks? ([\d, ]{1,200}) failed to pass monitoredBarrier in (\d{1,12}) ms")
_PEER = linear(r"Connection closed by peer \[([^\]]{1,100})\]:(\d{1,5})")
_GLOO_TIMEOUT = linear(r"Timed out waiting (\d{1,12})ms for (recv|send) operation")
_DIGITS = linear(r"\d{1,7}")
# PyTorch 2.2+'s prefix names the global rank, else mpirun's tag (`[1,3]<stderr>:`, a tag glued mid-line too); the
# message's own `[Rank N]` is the rank in its process group
_GLOBAL = linear(r"\[rank(\d{1,7})\]:|" + MPI_TAG)

ADVICE = ("a collective hang: one rank died, hung or OOMed and the others waited in the next collective until their "
          "watchdog fired; the rank that stopped first is the cause: read its log, and the XIDs of its node")


@dataclass(frozen=True)
class Observation:
    """What one log line says about one rank's collectives."""

    kind: str  # timeout, progress, barrier, peer_closed, gloo_timeout
    rank: int | None
    seq: int | None = None
    op: str | None = None
    pg: str | None = None
    enqueued: int | None = None
    completed: int | None = None
    timeout_ms: int | None = None
    culprits: tuple[int, ...] = ()  # ranks a monitored barrier names
    peer: str | None = None
    ran_ms: int | None = None  # how long the timed-out collective ran before the watchdog fired


def observe(text: str) -> Observation | None:
    """The observation in one line (at most its first 2 KiB), or None."""
    found = observe_all(text)
    return found[0] if found else None


def observe_all(text: str) -> list[Observation]:
    """Every observation in one line, in order: a terminal that lost a newline glues two ranks' watchdog messages
    onto one line, and each is its rank's (at most the line's first 4 KiB)."""
    text = text[:4096]
    named = plain(text).rank
    rank = int(named) if named else None
    found = [(m.start(), Observation("timeout", int(m.group(1)), int(m.group(2)), m.group(3),
                                     timeout_ms=int(m.group(4)), ran_ms=int(m.group(5))))
             for m in _TIMEOUT.finditer(text)]
    for m in _PROGRESS.finditer(text):
        g = m.groups()
        pg = g[1] or g[0] or g[2]
        seq, enqueued, completed = next((g[i], g[i + 1], g[i + 2]) for i in (4, 7, 10) if g[i] is not None)
        found.append((m.start(), Observation("progress", int(g[3]), int(seq), pg=pg, enqueued=int(enqueued),
                                             completed=int(completed))))
    if found:
        found.sort(key=lambda f: f[0])
        prefixes = [(m.start(), int(r)) for m in _GLOBAL.finditer(text) if (r := m.group(1) or m.group(2))]
        # each message's global rank: the last prefix before it (two glued lines carry one each)
        return [replace(obs, rank=next((r for p, r in reversed(prefixes) if p < at), obs.rank)) for at, obs in found]
    if (m := _BARRIER.search(text)) is not None:
        culprits = tuple(int(r) for r in _DIGITS.findall(m.group(2)))[:MAX_RANKS]
        return [Observation("barrier", int(m.group(1)), timeout_ms=int(m.group(3)), culprits=culprits)]
    if (m := _PEER.search(text)) is not None:
        return [Observation("peer_closed", rank, peer=f"{m.group(1)}:{m.group(2)}")]
    if (m := _GLOO_TIMEOUT.search(text)) is not None:
        return [Observation("gloo_timeout", rank, timeout_ms=int(m.group(1)), op=m.group(2))]
    return []


def gather(record: dict[str, Any], obs: Observation) -> None:
    """Fold one observation into a job's record (a JSON-able dict, bounded by MAX_RANKS per table)."""
    if obs.rank is None and obs.kind not in ("peer_closed", "gloo_timeout"):
        return
    key = str(obs.rank)
    if obs.kind == "timeout":
        table = record.setdefault("timeouts", {})
        # a rank that timed out in several collectives (several process groups, or work queued behind the first)
        # stands at the furthest: a rank is behind only when even that is behind the others
        if key in table and int(table[key]["seq"]) > (obs.seq or 0):
            return
        if key in table or len(table) < MAX_RANKS:
            table[key] = {"seq": obs.seq, "op": obs.op, "timeout_ms": obs.timeout_ms, "ran_ms": obs.ran_ms}
    elif obs.kind == "progress":
        table = record.setdefault("progress", {})
        if key in table or len(table) < MAX_RANKS:
            table[key] = {"pg": obs.pg, "seq": obs.seq, "enqueued": obs.enqueued, "completed": obs.completed}
    elif obs.kind == "barrier":
        record["barrier"] = {"reporter": obs.rank, "culprits": list(obs.culprits), "timeout_ms": obs.timeout_ms}
    else:
        table = record.setdefault(obs.kind, {})
        if len(table) < MAX_RANKS:
            table[key] = {"peer": obs.peer, "timeout_ms": obs.timeout_ms}


@dataclass(frozen=True)
class Story:
    title: str
    advice: str
    fields: dict[str, Any]
    first: tuple[int, ...] = ()  # the rank(s) that stopped first, when the messages (or the recorder) tell
    echo: str = ""  # what followed, when another finding (an OOM, a crash) is the cause: "ALLREDUCE #5 timed out ..."


def _ints(keys: Iterable[str]) -> set[int]:
    return {int(k) for k in keys if k.lstrip("-").isdigit()}


def tell(record: dict[str, Any], stall: Stall | None = None) -> Story | None:
    """The job's collective failure as one story, or None when its logs hold none."""
    barrier = record.get("barrier")
    if barrier and barrier.get("culprits"):
        culprits = tuple(barrier["culprits"])
        title = (f"rank {ranges(culprits)} failed to pass a monitored barrier (rank {barrier['reporter']} waited "
                 f"{barrier['timeout_ms'] // 1000}s): it stopped first")
        return Story(title, ADVICE, {"barrier": barrier}, culprits, title)
    timeouts: dict[str, dict[str, Any]] = record.get("timeouts", {})
    progress: dict[str, dict[str, Any]] = record.get("progress", {})
    if not timeouts and not progress:
        return _gloo(record, stall)
    if (split := _desync(timeouts)) is not None:
        return split
    # The collective most ranks time out in, and the ranks that report it
    by_seq: dict[int, set[int]] = {}
    for table in (timeouts, progress):
        for rank, t in table.items():
            by_seq.setdefault(int(t["seq"]), set()).add(int(rank))
    seq = max(by_seq, key=lambda s: (len(by_seq[s]), s))
    op = next((t["op"] for t in timeouts.values() if t["seq"] == seq), None) or "collective"
    limit = next((t["timeout_ms"] for t in timeouts.values() if t["seq"] == seq and t.get("timeout_ms")), None)
    echo = f"{op} #{seq} timed out on rank{'s' if len(by_seq[seq]) > 1 else ''} {ranges(by_seq[seq])}"
    title = f"NCCL collective timeout: {echo}" + (f" (timeout {limit // 1000}s)" if limit else "")
    evidence, first, fields = _first(timeouts, progress, seq, op)
    # the cause first, then its effect: the rank that stopped first, then the collective the others timed out in
    title = f"{evidence}; then {title}" if first else f"{title}; {evidence}"
    ran = max((t.get("ran_ms") or 0 for t in timeouts.values() if t["seq"] == seq), default=0)
    if limit and ran > 2 * limit:  # the watchdog fires once the limit is past: far past it, the watchdog was stuck
        title += (f"; it ran {ran // 60000} min against a {limit // 60000} min timeout: the watchdog itself was held "
                  "up (a hung GPU or driver call, a stopped or starved process)")
    fields.update(seq=seq, op=op, timed_out=sorted(by_seq[seq]), first=list(first))
    if stall is not None:
        check, agreed = _cross_check(stall, seq, set(first))
        title += f"; {check}"
        fields["flight_recorder"] = {**stall.fields(), "agrees": agreed}
        first = first or tuple(t.rank for t in stall.missing)
    return Story(title, ADVICE, fields, first, echo)


def _first(timeouts: dict[str, dict[str, Any]], progress: dict[str, dict[str, Any]], seq: int,
           op: str) -> tuple[str, tuple[int, ...], dict[str, Any]]:
    """The evidence for the rank that stopped first, as a clause of the story: (clause, ranks, fields)."""
    # Sequence numbers count per process group, and a timeout line does not name its group: only a rank's own
    # "last enqueued" in the group of the collective shows it never entered it.
    group = next((p["pg"] for p in progress.values() if p["seq"] == seq), None)
    mine = {int(r): p for r, p in progress.items() if p.get("pg") == group}
    behind = {r for r, p in mine.items() if p.get("enqueued") is not None and p["enqueued"] < seq}
    far = {r: p["completed"] for r, p in mine.items()
           if r not in behind and p.get("completed") is not None and p["completed"] < seq - 1}
    waiting = {r for r, p in mine.items() if p.get("completed") == seq - 1 and r not in behind}
    # A rank whose own watchdog fired in an older collective of the same type waits far behind the others
    lagging = {int(r): int(t["seq"]) for r, t in timeouts.items() if int(t["seq"]) < seq and int(r) not in behind}
    seen = _ints(timeouts) | _ints(progress)
    fields: dict[str, Any] = {"seen": sorted(seen), "far_behind": {str(r): c for r, c in far.items()},
                              "waiting": sorted(waiting), "lagging": {str(r): s for r, s in lagging.items()}}
    if behind:  # the evidence: what the others completed and wait in, what the first never entered
        last = {mine[r]["enqueued"] for r in behind}
        clause = (f"rank {ranges(behind)} never entered {op} #{seq} (last enqueued: "
                  f"#{', #'.join(str(x) for x in sorted(last))})")
        if waiting:
            clause += f"; ranks {ranges(waiting)} completed #{seq - 1} and wait in #{seq}"
        return clause, tuple(sorted(behind)), fields
    if lagging:
        told = ", ".join(f"rank {r} timed out {'far ' if seq - s >= FAR else ''}behind, in {op} #{s} ({seq - s} "
                         f"collective{'s' if seq - s > 1 else ''} before #{seq})"
                         for r, s in sorted(lagging.items(), key=lambda kv: kv[1])[:4])
        return (f"{told}: the first suspect (it stopped first), or a rank of a different process group (whose "
                "collectives count on their own): read its log first"), tuple(sorted(lagging)), fields
    if far:
        told = ", ".join(f"rank {r} (last completed #{c})" for r, c in sorted(far.items())[:8])
        return f"far behind: {told}", tuple(sorted(far)), fields
    return f"the rank that stopped first reported nothing here (seen: ranks {ranges(seen)})", (), fields


DESYNC_ADVICE = ("the ranks wait in different collectives: a desync in the training code (a rank-dependent branch "
                 "issued a collective the others did not), or ranks of different process groups, of which the one "
                 "that stalled first is to be read; a longer timeout does not help")


def _desync(timeouts: dict[str, dict[str, Any]]) -> Story | None:
    """Ranks timing out in collectives of different types: they did not run the same program of collectives."""
    by_op: dict[tuple[str, int], set[int]] = {}
    for rank, t in timeouts.items():
        by_op.setdefault((str(t["op"]), int(t["seq"])), set()).add(int(rank))
    if len({op for op, _ in by_op}) < 2:
        return None
    groups = sorted(by_op.items(), key=lambda kv: (-len(kv[1]), kv[0][1]))
    told = ", ".join(f"rank{'s' if len(r) > 1 else ''} {ranges(r)} in {op} #{seq}" for (op, seq), r in groups[:4])
    title = f"the ranks wait in different collectives (a desync?): {told}"
    return Story(title, DESYNC_ADVICE, {"desync": [{"op": op, "seq": seq, "ranks": sorted(r)}
                                                   for (op, seq), r in groups]}, (), title)


def _cross_check(stall: Stall, seq: int, first: set[int]) -> tuple[str, bool | None]:
    """What the flight recorder adds: the same rank and collective as the messages (it agrees), a rank the
    messages could not name, or something else (it disagrees)."""
    if stall.collective is None:
        return "the flight recorder shows no collective in flight", None
    missing = {t.rank for t in stall.missing}
    agrees = stall.collective.seq == seq and bool(first) and missing == first
    if not first and stall.collective.seq == seq:
        return f"flight recorder: {stall.describe()}", None
    return f"flight recorder {'agrees' if agrees else 'disagrees'}: {stall.describe()}", agrees


def _gloo(record: dict[str, Any], stall: Stall | None) -> Story | None:
    closed, timed = record.get("peer_closed", {}), record.get("gloo_timeout", {})
    if not closed and not timed:
        return None
    if closed:
        ranks = _ints(closed)
        peers = sorted({c["peer"] for c in closed.values() if c.get("peer")})
        title = (f"a peer rank died: the connection to {', '.join(peers[:3])} was closed"
                 + (f" under rank {ranges(ranks)}" if ranks else ""))
    else:
        ms = next(iter(timed.values())).get("timeout_ms") or 0
        title = f"a Gloo collective timed out after {ms // 1000}s" + (f" on rank {ranges(_ints(timed))}" if _ints(timed) else "")
    fields: dict[str, Any] = {"peer_closed": closed, "gloo_timeout": timed}
    first: tuple[int, ...] = ()
    if stall is not None and stall.collective is not None:
        title += f"; flight recorder: {stall.describe()}"
        fields["flight_recorder"] = stall.fields()
        first = tuple(t.rank for t in stall.missing)
    return Story(title, ADVICE, fields, first, title)
