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


def parse_duration(value: object) -> float:
    """Seconds from `90s`, `15m`, `2h`, `1h30m`, `250ms` or a bare number of seconds."""
    if isinstance(value, bool):
        raise ValueError(f"invalid duration {value!r}: expected e.g. '90s', '15m', '2h'")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower()
        pos, seconds = 0, 0.0
        for match in _DURATION_PART.finditer(text):
            if match.start() != pos:
                break
            seconds += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
            pos = match.end()
        if not text or pos != len(text):
            raise ValueError(f"invalid duration {value!r}: expected e.g. '90s', '15m', '2h', '1h30m'")
    else:
        raise ValueError(f"invalid duration {value!r}: expected a string such as '90s'")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"invalid duration {value!r}: must be a finite, non-negative time")
    return seconds


def parse_size(value: object) -> int:
    """Bytes from `512MiB`, `2TiB`, `10GB`, `4096` (SI and IEC units, case-insensitive)."""
    if isinstance(value, bool):
        raise ValueError(f"invalid size {value!r}: expected e.g. '512MiB', '2TiB'")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"invalid size {value!r}: must not be negative")
        return value
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match and match.group(2).lower() in _SIZE_UNITS:
            return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    raise ValueError(f"invalid size {value!r}: expected e.g. '512MiB', '2TiB', '10GB'")


def parse_count(value: object) -> int:
    """A count such as an inode number: `50000`, `50k`, `2M`."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match and match.group(2).lower() in _COUNT_UNITS:
            return int(float(match.group(1)) * _COUNT_UNITS[match.group(2).lower()])
    raise ValueError(f"invalid count {value!r}: expected e.g. '50000', '50k', '2M'")


@dataclass(frozen=True)
class Limit:
    """A threshold that is either absolute (bytes, inodes) or a percentage of a total."""

    value: float
    percent: bool = False

    def resolve(self, total: float) -> float:
        return total * self.value / 100.0 if self.percent else self.value

    def __str__(self) -> str:
        return f"{self.value:g}%" if self.percent else f"{self.value:g}"

    def describe(self, in_bytes: bool) -> str:
        """As alert text shows it: `5%`, `20.0 GiB` or `50000`."""
        return format_bytes(self.value) if in_bytes and not self.percent else str(self)


def _parse_percent(value: object) -> float | None:
    if isinstance(value, str):
        match = _PERCENT.match(value)
        if match:
            pct = float(match.group(1))
            if pct > 100:
                raise ValueError(f"invalid percentage {value!r}: must be between 0% and 100%")
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
        raise ValueError(f"invalid size {value!r}: expected a size such as '20GiB' or a percentage such as '5%'") from None


def parse_count_limit(value: object) -> Limit:
    """`5%` or an absolute count such as `100k`."""
    pct = _parse_percent(value)
    if pct is not None:
        return Limit(pct, percent=True)
    try:
        return Limit(float(parse_count(value)))
    except ValueError:
        raise ValueError(f"invalid count {value!r}: expected a count such as '100k' or a percentage such as '5%'") from None


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
