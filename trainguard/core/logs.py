"""Structured `key=value` log lines, readable in `journalctl -u trainguard` at 3 a.m."""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from trainguard.core.text import ELLIPSIS, hidden


def kv(**fields: Any) -> dict[str, Any]:
    """`log.info("msg", extra=kv(check="disk"))` attaches fields to a log line."""
    return {"kv": fields}


_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
# A field's value is cut to this: a job's text (a summary, a path) can't make one journal line megabytes long.
# The traceback of `exc` is ours, and kept whole.
MAX_VALUE = 4096


def _escape(ch: str) -> str:
    if ch in _ESCAPES:
        return _ESCAPES[ch]
    # Other control characters and line separators (\x0b, \x85, \u2028...): a value is always one line; bidi and
    # zero-width characters (trainguard.core.text.hidden) are shown escaped, so that nothing in a line is invisible.
    if ch in "\u2028\u2029" or hidden(ch):
        return f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}"
    return ch


def _quote(value: Any, limit: int | None = MAX_VALUE) -> str:
    try:
        text = str(value)
    except ValueError:  # an integer of thousands of digits (Python's int-to-str limit): a log line never raises
        text = "(a number too large to show)"
    if limit is not None and len(text) > limit:
        text = text[:limit - 1] + ELLIPSIS
    if text == "" or any(c in text for c in ' "=') or not text.isprintable():
        return '"' + "".join(_escape(c) for c in text) + '"'
    return text


def format_fields(fields: dict[str, Any]) -> str:
    return " ".join(f"{k}={_quote(v, None if k == 'exc' else MAX_VALUE)}" for k, v in fields.items() if v is not None)


class KeyValueFormatter(logging.Formatter):
    def __init__(self, with_time: bool = True) -> None:
        super().__init__()
        self.with_time = with_time

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = {}
        if self.with_time:
            fields["ts"] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        fields["level"] = record.levelname.lower()
        fields["logger"] = record.name
        fields["msg"] = record.getMessage()
        fields.update(getattr(record, "kv", {}) or {})
        if record.exc_info:
            fields["exc"] = self.formatException(record.exc_info)
        return format_fields(fields)


def setup_logging(level: str = "info") -> None:
    # journald stamps every line itself; a second timestamp would only add noise there.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter(with_time="JOURNAL_STREAM" not in os.environ))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("urllib3").setLevel(logging.WARNING)  # a line per connection otherwise
