"""Structured `key=value` log lines, readable in `journalctl -u trainguard` at 3 a.m."""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any


def kv(**fields: Any) -> dict[str, Any]:
    """`log.info("msg", extra=kv(check="disk"))` attaches fields to a log line."""
    return {"kv": fields}


_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(ch: str) -> str:
    if ch in _ESCAPES:
        return _ESCAPES[ch]
    # Other control characters and line separators (\x0b, \x85, \u2028...): a value is always one line.
    if ord(ch) < 0x20 or 0x7F <= ord(ch) <= 0x9F or ch in "\u2028\u2029":
        return f"\\u{ord(ch):04x}"
    return ch


def _quote(value: Any) -> str:
    text = str(value)
    if text == "" or any(c in text for c in ' "=') or not text.isprintable():
        return '"' + "".join(_escape(c) for c in text) + '"'
    return text


def format_fields(fields: dict[str, Any]) -> str:
    return " ".join(f"{k}={_quote(v)}" for k, v in fields.items() if v is not None)


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
