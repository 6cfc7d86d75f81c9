"""Parsing of the human units used in the config: durations, byte sizes, counts, percentages."""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainguard.core.text import linear

_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION_PART = linear(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4, "p": 1000**5, "pb": 1000**5,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "pib": 1024**5,
}
_SIZE = linear(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_COUNT_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3}
_PERCENT = linear(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")

MAX_SIZE = 2**63 - 1  # bytes or a count: more than any filesystem or tool reports
MAX_DURATION = 366 * 86400.0  # a year: a longer interval, timeout or horizon is a typo, and overflows timers
_MAX_DIGITS = 32


MAX_INT64 = 2**63 - 1  # a sequence id, step, size or op id a real job writes fits a signed 64-bit integer
_MAX_INT_TEXT = 20  # "-9223372036854775808": longer digit strings are refused unread


def bounded_int(value: object, low: int = 0, high: int = MAX_INT64) -> int | None:
    """An integer from a file or a process a job's user controls (JSON, a pickle, a log line's digits) when it lies in
    [low, high]; None for anything else. Never raises: an int object is compared, never formatted (Python refuses to
    print or parse an int of more than 4300 digits), and text longer than 20 characters is refused unread."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (str, bytes)):
        text = value.strip()
        digits = text[1:] if text[:1] in ("-", b"-") else text
        if not 0 < len(text) <= _MAX_INT_TEXT or not digits.isascii() or not digits.isdigit():
            return None
        value = int(text)
    if not isinstance(value, int):
        return None
    return value if low <= value <= high else None


def bounded_float(value: object, low: float = -math.inf, high: float = math.inf) -> float | None:
    """A finite number from a job's files (JSON floats include NaN and Infinity) when it lies in [low, high]; None
    for anything else, an int too large for a float included."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) and low <= number <= high else None


def _show(value: object) -> str:
    """A config value in an error message: as written, cut so that one bad value is still one line."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def decimal(text: str) -> float:
    """A non-negative decimal number written with at most 32 characters. Raises ValueError, never OverflowError."""
    if len(text) > _MAX_DIGITS:
        raise ValueError(f"more than {_MAX_DIGITS} digits")
    return float(text)


def _number(text: str, what: str, original: object) -> float:
    try:
        return decimal(text)
    except ValueError as exc:
        raise ValueError(f"invalid {what} {_show(original)}: {exc}") from None


def _bounded(value: float, limit: float, what: str, original: object, limit_text: str) -> float:
    if value > limit:
        raise ValueError(f"invalid {what} {_show(original)}: more than {limit_text}")
    return value


def parse_duration(value: object) -> float:
    """Seconds from `90s`, `15m`, `2h`, `1h30m`, `250ms` or a bare number of seconds."""
    if isinstance(value, bool):
        raise ValueError(f"invalid duration {_show(value)}: expected e.g. '90s', '15m', '2h'")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower()
        pos, seconds = 0, 0.0
        for match in _DURATION_PART.finditer(text):
            if match.start() != pos:
                break
            seconds += _number(match.group(1), "duration", value) * _DURATION_UNITS[match.group(2)]
            pos = match.end()
        if not text or pos != len(text):
            raise ValueError(f"invalid duration {_show(value)}: expected e.g. '90s', '15m', '2h', '1h30m'")
    else:
        raise ValueError(f"invalid duration {_show(value)}: expected a string such as '90s'")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"invalid duration {_show(value)}: must be a finite, non-negative time")
    return _bounded(seconds, MAX_DURATION, "duration", value, "366d")


def parse_size(value: object) -> int:
    """Bytes from `512MiB`, `2TiB`, `10GB`, `4096` (SI and IEC units, case-insensitive)."""
    if isinstance(value, bool):
        raise ValueError(f"invalid size {_show(value)}: expected e.g. '512MiB', '2TiB'")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"invalid size {_show(value)}: must not be negative")
        return int(_bounded(value, MAX_SIZE, "size", value, "2^63 bytes"))
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match and match.group(2).lower() in _SIZE_UNITS:
            size = _number(match.group(1), "size", value) * _SIZE_UNITS[match.group(2).lower()]
            return int(_bounded(size, MAX_SIZE, "size", value, "2^63 bytes"))
    raise ValueError(f"invalid size {_show(value)}: expected e.g. '512MiB', '2TiB', '10GB'")


def parse_count(value: object) -> int:
    """A count such as an inode number: `50000`, `50k`, `2M`."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return int(_bounded(value, MAX_SIZE, "count", value, "2^63"))
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match and match.group(2).lower() in _COUNT_UNITS:
            count = _number(match.group(1), "count", value) * _COUNT_UNITS[match.group(2).lower()]
            return int(_bounded(count, MAX_SIZE, "count", value, "2^63"))
    raise ValueError(f"invalid count {_show(value)}: expected e.g. '50000', '50k', '2M'")


@dataclass(frozen=True)
class Limit:
    """A threshold that is either absolute (bytes, inodes) or a percentage of a total."""

    value: float
    percent: bool = False

    def resolve(self, total: float) -> float:
        return total * self.value / 100.0 if self.percent else self.value

    def __str__(self) -> str:
        # A count or a byte size in full ("5000000", not "5e+06"): printed by `validate` and read back as written.
        if self.percent or not self.value.is_integer():
            return f"{self.value:g}%" if self.percent else f"{self.value:g}"
        return f"{self.value:.0f}"

    def size_text(self) -> str:
        """As a config file writes a size: `512MiB`, `5%`, or bytes when no IEC unit divides it."""
        if self.percent or not self.value.is_integer() or self.value == 0:
            return str(self)
        for unit, size in (("PiB", 1024**5), ("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
            if self.value % size == 0:
                return f"{self.value / size:.0f}{unit}"
        return str(self)

    def describe(self, in_bytes: bool) -> str:
        """As alert text shows it: `5%`, `20.0 GiB` or `50000`."""
        return format_bytes(self.value) if in_bytes and not self.percent else str(self)


def _parse_percent(value: object) -> float | None:
    if isinstance(value, str):
        match = _PERCENT.match(value)
        if match:
            pct = _number(match.group(1), "percentage", value)
            if pct > 100:
                raise ValueError(f"invalid percentage {_show(value)}: must be between 0% and 100%")
            return pct
    return None


def parse_size_limit(value: object) -> Limit:
    """`5%` or an absolute size such as `20GiB`."""
    pct = _parse_percent(value)
    if pct is not None:
        return Limit(pct, percent=True)
    try:
        return Limit(float(parse_size(value)))
    except ValueError:
        raise ValueError(f"invalid size {_show(value)}: expected a size such as '20GiB' or a percentage such as '5%'") from None


def parse_count_limit(value: object) -> Limit:
    """`5%` or an absolute count such as `100k`."""
    pct = _parse_percent(value)
    if pct is not None:
        return Limit(pct, percent=True)
    try:
        return Limit(float(parse_count(value)))
    except ValueError:
        raise ValueError(f"invalid count {_show(value)}: expected a count such as '100k' or a percentage such as '5%'") from None


def format_bytes(n: float) -> str:
    """Human-readable IEC size, e.g. `3.1 GiB`."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"  # pragma: no cover - loop always returns


def format_duration(seconds: float) -> str:
    """Compact duration, e.g. `2h14m`, `45s`."""
    seconds = max(0, round(seconds))
    days, rem = divmod(seconds, 86400)
    hours, rem = divmod(rem, 3600)
    minutes, secs = divmod(rem, 60)
    if days:
        return f"{days}d{hours}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"
