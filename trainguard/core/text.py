"""Matching and cleaning text that someone else wrote: a training log, a kernel line, a tool's output, a job name.

Every pattern that sees such text is compiled here, on RE2 (google-re2): matching time is linear in the text
whatever the pattern and the input, so no line a job's user writes can make the agent backtrack for seconds while
holding the GIL. RE2 has no backreferences or lookaround; a pattern from the config that uses them is a config error.
"""

from __future__ import annotations

import unicodedata
from typing import Any

import re2

Pattern = Any  # re2's compiled pattern (search, match, fullmatch, finditer, findall, sub, split), str or bytes

# A job's text is cut to this before a diagnosis looks at it: every message the diagnoses read is a few KiB at most.
MAX_MESSAGE = 64 << 10


def linear(pattern: str | bytes, *, ignore_case: bool = False) -> Pattern:
    """Compile on RE2. Raises ValueError with RE2's reason when the pattern is not RE2 syntax."""
    options = re2.Options()
    options.log_errors = False  # RE2 would also print the error to stderr, outside our structured logs
    options.case_sensitive = not ignore_case
    try:
        return re2.compile(pattern, options)
    except re2.error as exc:
        reason = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise ValueError(f"invalid regex {pattern!r}: {reason}") from None


_LINE_BREAKS = frozenset("\r\n\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")


def one_line(text: str, limit: int | None = None) -> str:
    """`text` as one printable line: line breaks of every kind become spaces, other control characters (NUL
    included) are dropped, so that it is safe in a mail header, a command argument or a log field."""
    out = []
    for ch in text:
        if ch in _LINE_BREAKS or ch == "\t":
            out.append(" ")
        elif unicodedata.category(ch) not in ("Cc", "Cs"):  # control characters and lone surrogates
            out.append(ch)
    line = "".join(out)
    return line[:limit] if limit is not None else line


def printable(text: str) -> str:
    """`text` without NUL, lone surrogates and control characters other than newline and tab: a message body."""
    return "".join(ch for ch in text if ch in "\n\t" or unicodedata.category(ch) not in ("Cc", "Cs"))
