"""Hardware error counters as increases over a trailing window: NVLink and PCIe counters from NVML, InfiniBand port
counters from sysfs.

Such counters reset when the driver reloads (or an operator clears them) and, where they are narrower than 64 bits,
wrap or saturate. `counter_delta` turns two readings into the increase between them; `CounterWindow` keeps the
increases of each counter within the window, so "more than 120 symbol errors an hour" is a comparison.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any


def counter_delta(previous: int, current: int, bits: int | None = None) -> int:
    """The increase from `previous` to `current`. A decrease is a wrap when the counter's width is known and the
    previous reading sat in the top half of its range, below the top itself (a wrapping counter only falls from
    near its top; a saturating one stuck at the top falls only when cleared); any other decrease is a reset (driver
    reload, counters cleared): what it counted since is `current`."""
    if current >= previous:
        return current - previous
    if bits is not None:
        top = (1 << bits) - 1
        # Not from the top: IBTA counters saturate there, and the note on a saturated counter says to clear it
        # (perfquery -R); read as a wrap, 255 -> 0 of an 8-bit link_downed would be a link down, and a drain.
        if top // 2 < previous < top and current <= top // 2:
            return top - previous + current + 1
    return current


def saturated(value: int, bits: int | None) -> bool:
    """An IBTA-style counter stuck at its maximum: further increases are invisible until it is cleared."""
    return bits is not None and value >= (1 << bits) - 1


# Slots, and no deque until a counter first grows: an NVLink node keeps one series per GPU, link and counter
# (8 x 18 x 4 on an HGX board), nearly all of which never grow, and an empty deque alone costs 600 bytes.
_NONE: tuple[tuple[float, int], ...] = ()


@dataclass(slots=True)
class _Series:
    last: int
    increases: deque[tuple[float, int]] | tuple[tuple[float, int], ...] = _NONE
    at: float | None = None  # when `last` was read by this process (None: loaded from saved state)


class CounterWindow:
    """Per counter: its last reading and the increases seen within `window` seconds (at most `max_events` kept, so
    memory is bounded whatever the hardware does)."""

    def __init__(self, window: float, max_events: int = 256, interval: float = 0.0) -> None:
        self.window = window
        self.max_events = max_events
        # A reading this long after the previous one closes a gap (the counter did not answer meanwhile), not a
        # period: two intervals at least, so that a window shorter than the check's interval still counts each run.
        self.gap = max(window, 2 * interval)
        self._series: dict[Hashable, _Series] = {}
        # Bumped by every change to what to_json returns: a check saves its window only when it moved (nearly every
        # run of an NVLink node reads 576 counters that never grow; encoding them all every run was the nvlink
        # check's largest cost).
        self.version = 0

    def update(self, key: Hashable, value: int, now: float, bits: int | None = None) -> int:
        """Record a reading; the increase since the previous one (0 for the first)."""
        series = self._series.get(key)
        if series is None:
            self._series[key] = _Series(value, at=now)
            self.version += 1
            return 0
        delta = counter_delta(series.last, value, bits)
        # Growth across a gap in the readings longer than the window (and two intervals; a GPU or a counter file that
        # did not answer for hours) cannot be placed within the window: it is returned, not counted as a burst at
        # `now`. A window loaded from saved state has no such time: growth while the agent was down counts, as it
        # always did.
        spread = series.at is not None and now - series.at > self.gap
        series.at = now
        if value != series.last:
            series.last = value
            self.version += 1
        if delta > 0 and not spread:
            if not isinstance(series.increases, deque):
                series.increases = deque()
            series.increases.append((now, delta))
            if len(series.increases) > self.max_events:  # fold the oldest two: the sum within the window stays right
                _, d0 = series.increases.popleft()
                t1, d1 = series.increases.popleft()
                series.increases.appendleft((t1, d0 + d1))
        self._trim(series, now)
        return delta

    def increase(self, key: Hashable, now: float, within: float | None = None) -> int:
        """How much the counter grew within the window (or the last `within` seconds of it)."""
        series = self._series.get(key)
        if series is None or not series.increases:  # never grew (or all of it left the window): the usual case
            return 0
        self._trim(series, now)
        span = self.window if within is None else min(within, self.window)
        return sum(d for t, d in series.increases if now - t <= span)

    def last(self, key: Hashable) -> int | None:
        series = self._series.get(key)
        return series.last if series is not None else None

    def keep(self, keys: Iterable[Hashable]) -> None:
        """Forget counters no longer read (a port or GPU that went away), so memory follows the hardware."""
        wanted = set(keys)
        self.keep_where(lambda key: key in wanted)

    def keep_where(self, wanted: Callable[[Hashable], bool]) -> None:
        """Forget the counters whose key `wanted` refuses."""
        for key in [k for k in self._series if not wanted(k)]:
            del self._series[key]
            self.version += 1

    def _trim(self, series: _Series, now: float) -> None:
        increases = series.increases
        if isinstance(increases, deque):
            while increases and now - increases[0][0] > self.window:
                increases.popleft()
                self.version += 1

    # persistence: a restarted agent still sees an increase that happened while it was down -------------------------
    def to_json(self, encode: Any = str) -> dict[str, Any]:
        return {encode(k): [s.last, [list(e) for e in s.increases]] for k, s in self._series.items()}

    def load_json(self, data: dict[str, Any], decode: Any = str) -> None:
        for raw_key, value in data.items():
            try:
                last, events = int(value[0]), [(float(t), int(d)) for t, d in value[1]]
                key = decode(raw_key)
            except (TypeError, ValueError, IndexError):
                continue
            self._series[key] = _Series(last, deque(events[-self.max_events:]) if events else _NONE)
