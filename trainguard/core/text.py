"""Matching and cleaning text that someone else wrote: a training log, a kernel line, a tool's output, a job name.

Every pattern that sees such text is compiled here, on RE2 (google-re2): matching time is linear in the text
whatever the pattern and the input, so no line a job's user writes can make the agent backtrack for seconds while
holding the GIL. RE2 has no backreferences or lookaround; a pattern from the config that uses them is a config error.
"""

from __future__ import annotations

import unicodedata
from typing import Any

Pattern = Any  # re2's compiled pattern (search, match, fullmatch, finditer, findall, sub, split), str or bytes

# A job's text is cut to this before a diagnosis looks at it: every message the diagnoses read is a few KiB at most.
MAX_MESSAGE = 64 << 10


def linear(pattern: str | bytes, *, ignore_case: bool = False) -> Pattern:
    """Compile on RE2. Raises ValueError with RE2's reason when the pattern is not RE2 syntax."""
    import re2  # here: every command imports this module (logs clean with it), and most never match anything

    options = re2.Options()
    options.log_errors = False  # RE2 would also print the error to stderr, outside our structured logs
    options.case_sensitive = not ignore_case
    try:
        return re2.compile(pattern, options)
    except re2.error as exc:
        reason = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise ValueError(f"invalid regex {pattern!r}: {reason}") from None


_LINE_BREAKS = frozenset("\r\n\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")
# What a line break inside a value becomes: visible, so that a reader sees the value had one, and a forged line
# after it (`x\nCRITICAL node: GPU 0 lost`) reads as part of the value, never as a line of its own.
BREAK_MARK = "\u23ce"  # ⏎
ELLIPSIS = "\u2026"  # …, where a value was cut
# A terminal's colour and cursor sequences (ESC [ parameters final-byte), common in training logs: dropped whole, so
# that `\x1b[31mOOM\x1b[0m` reads `OOM`; any other ESC is shown as a control picture like the rest of C0.
_CSI_MAX = 40
# Hidden text costs at most this many characters scanned per character kept: padding can't make cleaning slow.
_SCAN_FACTOR = 8


def hidden(ch: str) -> bool:
    """Whether `ch` is a character no channel may carry as is: C0 and C1 controls and DEL (Cc), format characters
    (Cf: the bidi embeddings, overrides and isolates U+202A-U+202E and U+2066-U+2069, the marks U+200E, U+200F and
    U+061C, zero-width space, joiners, word joiner, BOM, soft hyphen, the tag characters U+E0000-U+E007F that can
    carry invisible text) and lone surrogates (Cs)."""
    return unicodedata.category(ch) in ("Cc", "Cf", "Cs")


def _csi_length(text: str, at: int) -> int:
    """The length of the colour sequence at `at` (ESC [ ... final byte), 0 if there is none."""
    if text[at + 1:at + 2] != "[":
        return 0
    for j in range(at + 2, min(len(text), at + _CSI_MAX)):
        if "\x40" <= text[j] <= "\x7e":
            return j - at + 1
        if not "\x20" <= text[j] <= "\x3f":
            return 0
    return 0


def _clean(text: str, limit: int | None, keep_newline: bool) -> str:
    if limit is not None:
        if limit <= 0:
            return ""
        text = text[:limit * _SCAN_FACTOR + 64]
    out: list[str] = []
    after_cr = False
    skip = 0
    for i, ch in enumerate(text):
        if skip:
            skip -= 1
            continue
        if ch == "\x1b":
            skip = _csi_length(text, i)
            if skip:
                skip -= 1
                continue
        if ch == "\n" and after_cr:  # \r\n is one break
            after_cr = False
            continue
        after_cr = ch == "\r"
        if keep_newline and ch in "\r\n":
            out.append("\n")
        elif ch in _LINE_BREAKS:
            out.append(BREAK_MARK)
        elif ch == "\t":
            out.append(" ")
        elif ord(ch) < 0x20 or ch == "\x7f":  # shown, as a control picture (\x1b: ␛): what was there stays legible
            out.append(chr(0x2400 + ord(ch)) if ch != "\x7f" else "\u2421")
        elif not hidden(ch):
            out.append(ch)
    line = "".join(out)
    if limit is not None and len(line) > limit:
        return line[:limit - 1] + ELLIPSIS
    return line


def one_line(text: str, limit: int | None = None) -> str:
    """`text` as one printable line, for any single-line field (a header, a label, a subject, a command argument,
    a log field): every kind of line break becomes ⏎, a tab a space, other C0 controls their control picture
    (ESC: ␛) except colour sequences, which are dropped; C1 controls, bidi and zero-width characters (`hidden`)
    are dropped. Cut to `limit` characters, the last one an ellipsis when something was cut. The one sanitizer
    every channel uses (with `printable` for bodies)."""
    return _clean(text, limit, keep_newline=False)


def printable(text: str, limit: int | None = None) -> str:
    """`text` as a multi-line body: like `one_line`, but \n (and \r\n, and a lone \r) stays a line break. For a
    body composed of lines whose values have each been through `one_line`, so that only the composer's own line
    breaks start lines."""
    return _clean(text, limit, keep_newline=True)
