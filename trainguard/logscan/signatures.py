"""Signatures as data, and the scanner that finds them in appended log bytes.

Every signature has literal needles. The scanner finds all needles in one pass of an Aho-Corasick
automaton (ahocorasick_rs, SIMD-prefiltered, several GB/s) and runs Python only on the lines that
contain one: a log of normal training output costs one memory scan, however long it is.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import ahocorasick_rs

from trainguard.core.model import Status
from trainguard.core.settings import Field, Regex, SettingsModel, StatusName
from trainguard.core.text import Pattern, linear
from trainguard.logscan import launcher, nccl
from trainguard.logscan.lines import LAUNCHER, plain
from trainguard.node.access import Identity, read_as


@dataclass(frozen=True)
class Signature:
    name: str
    needles: tuple[bytes, ...]
    pattern: Pattern | None  # must also match the line (None: the needle is enough)
    status: Status
    advice: str = ""


class SignatureSettings(SettingsModel):
    """A site's own signature: `[checks.NAME.signatures.NAME]`."""

    needle: str = Field(min_length=3, description="Literal text every matching line contains (the fast prefilter).")
    pattern: Regex | None = Field(None, description="Regex the line must also match.")
    status: StatusName = Field(Status.WARNING, description="Status of a match.")
    advice: str = Field("", description="What to do, shown in the alert.")


# Needles are case-sensitive literals: list the spellings that occur; the regex tells signatures apart on
# the (rare) lines that contain one.
BUILTIN: tuple[Signature, ...] = (
    Signature("cuda_oom", (b"out of memory",),
              linear(r"(?:CUDA|HIP) out of memory|cuda runtime error \(2\) : out of memory"
                         r"|THCudaCheck FAIL.{0,300}?: out of memory"), Status.CRITICAL),
    Signature("nccl_timeout", (b"atchdog",),
              linear(r"Watchdog caught collective operation timeout|NCCL watchdog thread terminated"), Status.CRITICAL),
    # Where each rank's collectives stood when its watchdog fired: feeds the timeout's story; a finding of its own
    # where a log carries only these (no `Watchdog caught` line: a timeout or an error in that collective).
    Signature("nccl_progress", (b"atchdog", b"Timeout at NCCL work"),
              linear(r"detected by watchdog at work: \d|failure detected by watchdog at work sequence id: \d"
                         r"|Timeout at NCCL work: \d"), Status.CRITICAL),
    Signature("collective_failure", (b"monitoredBarrier", b"Connection closed by peer", b"Timed out waiting"),
              linear(r"failed to pass monitoredBarrier|Connection closed by peer|Timed out waiting \d{1,12}ms for "
                         r"(?:recv|send) operation"), Status.CRITICAL),
    Signature("cuda_error", (b"CUDA", b"cuda runtime error", b"error=4 :"),
              # THC's numbered errors, except 2 (out of memory: cuda_oom's)
              # (RE2 has no lookahead: "a number but 2" is spelled out)
              linear(r"CUDA (?:driver )?error: |c10::CUDAError|cuda runtime error \((?:[013-9]|\d{2,4})\) : "
                     r"|THCudaCheck FAIL.{0,300}? error=(?:[013-9]|\d{2,4}) : "), Status.CRITICAL),
    Signature("device_assert", (b"Assertion `",), linear(r"Assertion `.+` failed"), Status.OK),
    # A NaN/Inf loss or gradient norm in the forms trainers print: `loss=nan`, `'loss': nan`, Megatron's
    # `lm loss: nan`, columns (`loss        nan`), HF's `'grad_norm': nan`, Megatron's `grad norm: nan`.
    Signature("nan_loss", (b"nan", b"NaN", b"inf", b"Inf", b"non-finite"),
              linear(r"""(?:\b(?:loss|grad[_ ]norm)['"]?(?:\s{0,40}[:=]\s{0,40}['"]?|\s{1,40})(?:nan|[-+]?inf)\b"""
                     r"""|Loss became infinite or NaN|found NaN in local grad norm|returned nan values in its \d+th output"""
                     r"""|is non-finite, so it cannot be clipped)""", ignore_case=True), Status.WARNING,
              "the run diverged: lower the learning rate, check the data batch, resume from an earlier checkpoint"),
    Signature("fp16_overflow", (b"OVERFLOW!",), linear(r"OVERFLOW! Rank \d+ Skipping step"), Status.OK),
    Signature("loss_scale_min", (b"at minimum",), linear(r"loss scale already at minimum", ignore_case=True),
              Status.CRITICAL, "fp16 loss scaling gave up: the run diverged; switch to bf16 or lower the learning rate"),
    # NCCL failures other than the timeout (nccl.py: the classes and their levers)
    Signature("nccl_error", nccl.NEEDLES, nccl.PATTERN, Status.CRITICAL),
    # torchrun's summary: the worker that failed first (launcher.py)
    Signature("launcher", launcher.NEEDLES, launcher.PATTERN, Status.CRITICAL),
    Signature("traceback", (b"Traceback (",), linear(r"Traceback \(most recent call last\)"), Status.CRITICAL),
)


@dataclass(frozen=True)
class Hit:
    signature: Signature
    line: str
    offset: int  # of the line within the scanned bytes


def custom(signatures: dict[str, SignatureSettings]) -> tuple[Signature, ...]:
    return tuple(Signature(name, (s.needle.encode(),), linear(s.pattern) if s.pattern else None, s.status,
                           s.advice) for name, s in signatures.items())


class Scanner:
    """Finds signatures in appended log bytes; build once per signature table."""

    def __init__(self, signatures: Sequence[Signature]) -> None:
        self.signatures = tuple(signatures)
        needles = sorted({n for sig in self.signatures for n in sig.needles})
        # Leftmost-first lets the automaton use its SIMD prefilter (10x the standard match kind); it
        # may hide a needle overlapping an earlier one, but only on a line that is looked at anyway.
        self._automaton = ahocorasick_rs.BytesAhoCorasick(
            needles, matchkind=ahocorasick_rs.MATCHKIND_LEFTMOST_FIRST) if needles else None

    def scan(self, data: bytes) -> Iterator[Hit]:
        """Hits in `data` (complete lines), in file order; one hit per line and signature."""
        if self._automaton is None:
            return
        line_end = -1
        for _, pos, _ in self._automaton.find_matches_as_indexes(data):
            if pos <= line_end:  # another needle on a line already looked at
                continue
            start = data.rfind(b"\n", 0, pos) + 1
            line_end = data.find(b"\n", pos)
            line_end = len(data) if line_end < 0 else line_end
            raw = data[start:line_end]
            text: str | None = None
            for sig in self.signatures:
                if not any(n in raw for n in sig.needles):
                    continue
                text = raw.decode("utf-8", errors="replace") if text is None else text
                if sig.pattern is None or sig.pattern.search(text):
                    yield Hit(sig, text, start)


_EXCEPTION_TEXT = r"(?P<exception>[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Failure)\b.*)$"
_EXCEPTION = linear("^" + _EXCEPTION_TEXT)
# behind the launchers' prefixes (`[rank1]: `, mpirun's `[1,1]<stderr>:`), which `plain` strips from a hit's line
_EXCEPTION_LINE = linear(r"(?m)^(?:(?:" + LAUNCHER + r")[ \t]*)*" + _EXCEPTION_TEXT)


def final_exception(data: bytes, start: int, max_lines: int = 400) -> str | None:
    """The exception line closing the traceback that starts at `start`: the first unindented line after it."""
    pos = data.find(b"\n", start)
    for _ in range(max_lines):
        if pos < 0 or pos + 1 >= len(data):
            return None
        end = data.find(b"\n", pos + 1)
        line = data[pos + 1:end if end >= 0 else len(data)].decode("utf-8", errors="replace")
        m = _EXCEPTION.match(plain(line).text)
        if m:
            return m.group("exception")
        pos = end
    return None


def last_exception(path: str, identity: Identity, window: int = 64 << 10) -> str | None:
    """The last exception line (`RuntimeError: ...`) in the final `window` bytes of a log, for a job that exited
    non-zero without a traceback in what was scanned; read with the job user's authority."""
    try:
        tail = read_as(identity, path, window, from_end=True).decode("utf-8", errors="replace")
    except OSError:
        return None
    found = None
    for found in _EXCEPTION_LINE.finditer(tail):  # noqa: B007 - the last one is wanted
        pass
    return found.group("exception") if found else None
