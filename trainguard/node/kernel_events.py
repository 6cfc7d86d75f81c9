"""Kernel events other than NVIDIA's XIDs: the catalog (kernel_events.toml, data) and the parser that finds them in
kernel log records.

A record costs one Aho-Corasick pass over its text (the catalog's literal needles); only a record holding a needle
is stripped of its prefix and matched, with RE2, against the classes whose needle it holds. Lines of one report (an
AER error and its detail lines, an MCE, a CPER record, an OOM kill) make one event: the first line that grades it
opens a block, and the block's later lines are absorbed unless they grade it higher.
"""

from __future__ import annotations

import functools
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import ahocorasick_rs
import tomllib

from trainguard.core.model import Status
from trainguard.core.text import Pattern, linear, one_line
from trainguard.node.kmsg import strip_prefix

MAX_TEXT = 4096  # of a record, matched: kernel records are at most 1 KiB; a pasted line longer than this is cut
MAX_NAME = 128  # of a value a pattern names (a server, a command name) in a subject or a detail
MAX_COUNT = 1_000_000  # what one line may add to a count (`Skipped N`, `N CE`)
BLOCK_USEC = 2_000_000  # a block's lines come within this of each other (one printk burst)
BLOCK_RECORDS = 256
MEMO = 64  # texts remembered with their event  # ... and within this many records (a pasted excerpt has no timestamps)

ROLES = ("event", "head", "continuation", "clear", "repeat")
# What may come before a class's pattern in a record: the kernel's own `subsystem: ` / `driver device: ` heads (a few
# words each, then a colon and a space; a word holds no colon unless it is a PCI address), a timestamp or a syslog
# head a paste kept, a CPER record's `{N}`, Lustre's `pid:cpu:(file.c:line:`, an AER detail's `device [vvvv:dddd]`.
# Never a run of words without a colon, a word like `ip:7f...`, a quote or an `=`: user text in a kernel line (a
# crashing binary's file name after `segfault at ... in ` or a trap's `ip:... sp:... error:0 in `, a quoted name, an
# audit field) comes after such kernel words, so a file named `a: Watchdog detected hard LOCKUP on cpu 3` that
# crashes is a crash, not a CPU's hard lockup.
_WORD = r"(?:[^\s'\"=:]+|[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?)"
_SYSLOG = r"(?:\S*:)?(?:\d{4} +)?[A-Z][a-z]{2} +\d{1,2} \d\d:\d\d:\d\d(?:\.\d+)? \S+(?: [A-Z]+)? kernel: +"
_HEAD = linear(rf"(?:{_SYSLOG})?(?:\{{\d+\}})?(?:{_WORD}(?: +{_WORD}){{0,3}}: +|\[ *\d+\.\d+\] *|"
               r"\d+:\d+:\([\w.-]+:\d+:)*(?:device \[[0-9a-f]{4}:[0-9a-f]{4}\] *)?")
CLEARS = ("reboot", "window", "pair")


@dataclass(frozen=True)
class KernelClass:
    name: str
    title: str
    kind: str
    needles: tuple[str, ...]
    pattern: Pattern | None
    pattern_text: str
    subject: tuple[str, ...]
    severity: Status
    lever: str
    role: str = "event"
    block: str = ""
    family: str = ""
    then: str = ""
    clear: str = "window"
    clear_after: float | None = None
    clears: tuple[str, ...] = ()
    counted: bool = False
    rate_window: float = 3600.0
    warning_count: int = 10
    storm_window: float = 60.0
    storm_count: int = 1000
    storm_status: Status = Status.WARNING
    node_fault: bool = False
    mount_fault: bool = False
    decode: str = ""
    reported_by: str = ""

    def clearing(self) -> str:
        """How an event of this class ends, in words."""
        if self.counted:
            return (f"counted: {self.warning_count} in {_span(self.rate_window)} is a WARNING trend, "
                    f"{self.storm_count} in {_span(self.storm_window)} a storm ({self.storm_status.name}); "
                    f"over after {_span(self.clear_after or self.rate_window)} without one")
        if self.clear == "reboot":
            return "until the node reboots"
        if self.clear == "pair":
            after = f", or {_span(self.clear_after)} without another" if self.clear_after else ""
            return f"until {' / '.join(self.cleared_by)} for the same subject{after}"
        return f"over after {_span(self.clear_after or 3600)} without another"

    @property
    def cleared_by(self) -> tuple[str, ...]:
        return tuple(c.name for c in catalog().values() if self.name in c.clears)


def _span(seconds: float | None) -> str:
    s = int(seconds or 0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size and s % size == 0:
            return f"{s // size}{unit}"
    return f"{s}s"


@dataclass(frozen=True)
class KernelEvent:
    """One event of the catalog found in the kernel log: its class, what it names, and the record."""

    klass: str
    subject: str
    names: Mapping[str, str]
    line: str  # the record's first 512 characters, prefix stripped
    count: int = 1  # what it adds to its subject's count (EDAC's `4 CE`, Lustre's `Skipped 24 ...`)
    repeat: bool = False  # a `Skipped N previous similar messages`: N more of an event already reported
    usec: int = -1
    seq: int = -1

    @property
    def cls(self) -> KernelClass:
        return catalog()[self.klass]


def _status(name: str) -> Status:
    return Status[name.upper()]


def _load(raw: Mapping[str, Any]) -> dict[str, KernelClass]:
    classes: dict[str, KernelClass] = {}
    for name, c in raw["classes"].items():
        role = c.get("role", "event")
        if role not in ROLES or c.get("clear", "window") not in CLEARS:
            raise ValueError(f"kernel event class {name}: role {role!r} or clear {c.get('clear')!r} unknown")
        pattern = c.get("pattern", "")
        classes[name] = KernelClass(
            name=name, title=c["title"], kind=c["kind"], needles=tuple(c.get("needles", ())),
            pattern=linear(pattern) if pattern else None, pattern_text=pattern, subject=tuple(c.get("subject", ())),
            severity=_status(c.get("severity", "OK")), lever=c["lever"], role=role, block=c.get("block", ""),
            family=c.get("family", c.get("block", "")), then=c.get("then", ""), clear=c.get("clear", "window"),
            clear_after=c.get("clear_after"), clears=tuple(c.get("clears", ())), counted=c.get("counted", False),
            rate_window=float(c.get("rate_window", 3600)), warning_count=int(c.get("warning_count", 10)),
            storm_window=float(c.get("storm_window", 60)), storm_count=int(c.get("storm_count", 1000)),
            storm_status=_status(c.get("storm_status", "WARNING")), node_fault=c.get("node_fault", False),
            mount_fault=c.get("mount_fault", False), decode=c.get("decode", ""), reported_by=c.get("reported_by", ""))
    for c in classes.values():
        for other in (*c.clears, *([c.then] if c.then else [])):
            if other not in classes:
                raise ValueError(f"kernel event class {c.name} names {other!r}, which is not in the catalog")
        if c.decode and c.decode not in DECODERS:
            raise ValueError(f"kernel event class {c.name}: decoder {c.decode!r} unknown")
        if c.role in ("event", "clear") and c.pattern is not None and not c.subject:
            raise ValueError(f"kernel event class {c.name} has no subject")
    return classes


@functools.cache
def catalog() -> dict[str, KernelClass]:
    """The classes of kernel_events.toml, in file order (the order a record's candidates are tried in)."""
    text = resources.files("trainguard.node").joinpath("kernel_events.toml").read_text()
    return _load(tomllib.loads(text))


def _mce_uncorrected(names: Mapping[str, str]) -> bool:
    """MCi_STATUS bit 61 (UC): the error was not corrected (Intel SDM vol. 3B 16.3.2.2; AMD the same)."""
    try:
        return bool((int(names.get("status", "0"), 16) >> 61) & 1)
    except ValueError:
        return False


DECODERS = {"mce_uncorrected": _mce_uncorrected}


def number(text: str | None) -> int | None:
    """A number a class's pattern names (a pid, `anon-rss:56623104kB`'s kB, with any thousands separators); None
    where the text holds none: a forged record's `anon-rss:,kB` is no number, and reading it must not raise."""
    digits = (text or "").replace(",", "")
    return int(digits) if digits.isascii() and digits.isdigit() and len(digits) <= 18 else None


def _clean(text: str, limit: int) -> str:
    """One printable line of at most `limit` characters (str.isprintable is the fast path: kernel text mostly is)."""
    text = text[:limit]
    return text if text.isprintable() else one_line(text, limit)


def subject_of(c: KernelClass, names: Mapping[str, str]) -> str:
    """The first of the class's subject templates whose groups all matched; the class's name otherwise."""
    for template in c.subject:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f]
        if all(names.get(f) for f in fields):
            return template.format_map(names)
    return c.name


@dataclass(frozen=True)
class _Index:
    """The needle automaton of a set of classes and what each needle selects: built once per catalog (a parser per
    pasted excerpt, as `trainguard kernel` and the tests make, would otherwise spend a millisecond building it)."""

    needles: list[str]
    by_needle: list[list[KernelClass]]
    order: dict[str, int]
    automaton: Any

    @staticmethod
    def of(classes: Mapping[str, KernelClass]) -> _Index:
        needles = sorted({n for c in classes.values() for n in c.needles})
        return _Index(needles, [[c for c in classes.values() if n in c.needles and c.pattern is not None]
                                for n in needles], {name: i for i, name in enumerate(classes)},
                      ahocorasick_rs.AhoCorasick(needles, matchkind=ahocorasick_rs.MATCHKIND_STANDARD))


@functools.cache
def _catalog_index() -> _Index:
    return _Index.of(catalog())


@dataclass
class _Block:
    klass: str
    rank: int  # the severity of the event reported for it (0: none yet)
    usec: int
    record: int
    then: str = ""
    seen: set[tuple[str, frozenset[str]]] = field(default_factory=set)  # the kinds of line reported in it


@dataclass
class KernelEventParser:
    """Stateful only across the records of one report (blocks) and for `Skipped N` (the last event per family).
    Not thread-safe: one reader feeds it."""

    classes: dict[str, KernelClass] = field(default_factory=catalog)
    records: int = 0
    _blocks: dict[str, _Block] = field(default_factory=dict)
    # The last records that made an event, and what: a storm repeats one text, which is then matched once
    _memo: dict[str, tuple[KernelClass, dict[str, str], str]] = field(default_factory=dict)
    _last: dict[str, KernelEvent] = field(default_factory=dict)

    def __post_init__(self) -> None:
        index = _catalog_index() if self.classes is catalog() else _Index.of(self.classes)
        self._needles, self._by_needle, self._order, self._automaton = (
            index.needles, index.by_needle, index.order, index.automaton)

    def candidates(self, message: str) -> list[KernelClass]:
        """The classes whose needle the text holds, in catalog order: the cheap test every record gets."""
        hits = self._automaton.find_matches_as_indexes(message[:MAX_TEXT], overlapping=True)
        if not hits:
            return []
        found = {c.name: c for i, _, _ in hits for c in self._by_needle[i]}
        return sorted(found.values(), key=lambda c: self._order[c.name])

    def feed(self, message: str, usec: int = -1, seq: int = -1) -> list[KernelEvent]:
        """The events one record makes (none for most)."""
        self.records += 1
        memo = self._memo.get(message)
        if memo is not None:
            return self._event(memo[0], memo[1], memo[2], usec, seq)
        candidates = self.candidates(message)
        if not candidates:
            return []
        text = strip_prefix(message[:MAX_TEXT])
        for c in candidates:
            m = c.pattern.search(text) if c.pattern is not None else None
            if m is None or not _HEAD.fullmatch(text[:m.start()]):
                continue
            # `dev__nvme` is `dev` in another alternative of the pattern (RE2 allows a group name once)
            names = {k.split("__", 1)[0]: _clean(v, MAX_NAME) for k, v in m.groupdict().items() if v}
            if c.decode and not DECODERS[c.decode](names):
                continue
            if len(self._memo) >= MEMO:
                self._memo.clear()
            self._memo[message] = (c, names, text)
            return self._event(c, names, text, usec, seq)
        return []

    def _open(self, block: str, usec: int) -> _Block | None:
        b = self._blocks.get(block)
        if b is None:
            return None
        if (usec >= 0 and b.usec >= 0 and usec - b.usec > BLOCK_USEC) or self.records - b.record > BLOCK_RECORDS:
            del self._blocks[block]
            return None
        return b

    def _event(self, c: KernelClass, names: dict[str, str], text: str, usec: int, seq: int) -> list[KernelEvent]:
        block = self._open(c.block, usec) if c.block else None
        if block is not None:
            block.usec, block.record = usec, self.records
        if c.role == "head":
            self._blocks[c.block] = _Block(c.name, 0, usec, self.records, c.then)
            return []
        if c.role == "continuation":
            return []
        if c.role == "repeat":
            last = self._last.get(c.family)
            if last is None:
                return []
            count = min(int(names.get("count", "1")), MAX_COUNT)
            return [KernelEvent(last.klass, last.subject, last.names, last.line, count, True, usec, seq)]
        if block is not None and block.then:
            c = self.classes[block.then]
        rank = c.severity.severity
        if c.block and c.role == "event":
            # A line of a kind the block already holds (a second `Corrected error received`) is the next report
            line_kind = (c.name, frozenset(names))
            if block is not None and block.rank and rank <= block.rank and line_kind not in block.seen:
                block.seen.add(line_kind)
                return []  # another line of a report already reported
            if block is None or line_kind in block.seen:
                block = self._blocks[c.block] = _Block(c.name, 0, usec, self.records)
            block.rank = max(block.rank, rank)
            block.seen.add(line_kind)
        count = min(int(names["count"]), MAX_COUNT) if names.get("count", "").isdigit() else 1
        event = KernelEvent(c.name, subject_of(c, names), names, _clean(text, 512), max(count, 1), False, usec, seq)
        if c.family:
            self._last[c.family] = event
        return [event]
