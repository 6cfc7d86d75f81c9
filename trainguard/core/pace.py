"""A job's pace against its own: the maths of fail-slow detection, and the ledger the checks share step samples by.

A sample is (step, time): a step line read from the job's log, or the trainer's heartbeat. Between two samples of one
series the job ran `steps` steps in `seconds`: an interval whose per-step duration is seconds/steps, weighing `steps`.
The job's pace is the step-weighted median of those durations; the median is why checkpoint saves, evaluation passes
and the first slow steps (compilation, cache warm-up) do not move it: they are a minority of the steps, however long.

- the baseline is that median over the intervals the job ran while it was not slow (at most BASELINE_INTERVALS of
  them, after `warmup_steps` of each life), once it covers `baseline_steps` steps: what the job itself repeats;
- the current pace is that median over the intervals that ended within the last `window` seconds (of the samples'
  own clock);
- the job is slow when its pace falls below the baseline's by `slowdown` (0.15: step time at least 1/0.85 = 1.18x),
  and a finding once it has stayed so for `slow_for` (the check's clock: a fake one in tests), counted from the first
  of the slow steps that tipped the median (the latest half of the window's steps, by the samples' own clock), not
  from when they tipped it.

A step lower than the last one is a restart (a relaunch, a requeue): warm-up is skipped again, the baseline is kept
(the same job on the same data). A series' state outlives the agent (`to_json`, `from_json`: the check saves it), so
that a restart or a reload during a slowdown neither takes the slow pace for the job's own nor restarts its clock.
Nothing here does I/O; the ledger is the only shared object and holds a lock.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

BASELINE_INTERVALS = 512  # intervals kept for the baseline: hours of a real job's 15 s reads
MAX_SAMPLES = 64  # samples a ledger keeps per series between two runs of the pace check
MAX_SERIES = 16  # series a ledger keeps per job (logs x ranks): one job's many ranks never fill it for the others


@dataclass(frozen=True)
class PaceSettings:
    """What the pace check is configured with, as the maths needs it."""

    slowdown: float = 0.15
    slow_for: float = 600.0
    window: float = 120.0
    warmup_steps: int = 20
    baseline_steps: int = 30


def weighted_median(values: Iterable[tuple[float, int]]) -> float | None:
    """The median of `values` (value, weight) with each value counted `weight` times; None when empty."""
    ordered = sorted(v for v in values if v[1] > 0)
    total = sum(w for _, w in ordered)
    if total <= 0:
        return None
    half, seen = total / 2, 0
    for value, weight in ordered:
        seen += weight
        if seen >= half:
            return value
    return ordered[-1][0]  # pragma: no cover - the loop returns


@dataclass
class Pace:
    """One series' pace state: its last sample, the recent intervals and the baseline pool."""

    last: tuple[int, float] | None = None
    warm_from: int | None = None  # the step this life's intervals count from (its first step + warm-up)
    recent: deque[tuple[float, float, int]] = field(default_factory=deque)  # (end time, s/step, steps)
    pool: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=BASELINE_INTERVALS))
    slow_since: float | None = None  # the check's clock when the pace first fell below the baseline
    restarts: int = 0

    def add(self, step: int, when: float, settings: PaceSettings) -> None:
        """One sample. A repeat of the last step adds nothing; a lower step (or a clock that went back) starts a new
        life: warm-up again."""
        if self.last is not None and step == self.last[0]:
            return
        if self.last is None or step < self.last[0] or when <= self.last[1]:
            if self.last is not None:
                self.restarts += 1
            self.last, self.warm_from = (step, when), step + settings.warmup_steps
            self.recent.clear()
            return
        before, at = self.last
        self.last = (step, when)
        if before < (self.warm_from or 0):  # the interval starts in warm-up: not the job's steady pace
            return
        steps = step - before
        seconds_per_step = (when - at) / steps
        self.recent.append((when, seconds_per_step, steps))
        while self.recent and self.recent[0][0] < when - settings.window:
            self.recent.popleft()
        if self.slow_since is None:  # the slow stretch never becomes the job's own pace
            self.pool.append((seconds_per_step, steps))

    def baseline(self, settings: PaceSettings) -> float | None:
        if sum(w for _, w in self.pool) < settings.baseline_steps:
            return None
        return weighted_median(self.pool)

    def current(self) -> float | None:
        return weighted_median((d, w) for _, d, w in self.recent)

    def evaluate(self, now: float, settings: PaceSettings) -> Verdict:
        """Where the series stands now: its pace, its baseline, and since when it is slow (None: it is not)."""
        base, pace = self.baseline(settings), self.current()
        if base is None or pace is None or base <= 0:
            return Verdict(pace, base, None, None)  # not known yet: neither slow nor recovered
        ratio = pace / base
        if pace >= base / (1 - settings.slowdown):
            if self.slow_since is None:
                self.slow_since = now - self._tipped()
        else:
            self.slow_since = None
        return Verdict(pace, base, ratio, self.slow_since)

    def to_json(self) -> dict[str, Any]:
        """What `from_json` restores: ~10 KB with a full pool (times to the millisecond, step times to 6 digits)."""
        return {"last": list(self.last) if self.last is not None else None, "warm_from": self.warm_from,
                "recent": [[round(e, 3), float(f"{d:.6g}"), w] for e, d, w in self.recent],
                "pool": [[float(f"{d:.6g}"), w] for d, w in self.pool],
                "slow_since": self.slow_since, "restarts": self.restarts}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Pace:
        """A series saved by `to_json`; ValueError, TypeError or KeyError when `data` is not one (another version's,
        a damaged one). Its pool keeps the last BASELINE_INTERVALS."""
        last, warm_from, since = data["last"], data["warm_from"], data["slow_since"]
        pace = cls(last=(int(last[0]), _time(last[1])) if last is not None else None,
                   warm_from=int(warm_from) if warm_from is not None else None,
                   slow_since=_time(since) if since is not None else None, restarts=int(data["restarts"]))
        pace.recent.extend((_time(e), _time(d), _steps(w)) for e, d, w in data["recent"][-BASELINE_INTERVALS:])
        pace.pool.extend((_time(d), _steps(w)) for d, w in data["pool"])
        return pace

    def _tipped(self) -> float:
        """How long ago, by the samples' own clock, the slowdown that just tipped the window's median began: the
        median tips once the slow steps are half the window's, so they are the latest half of its steps. (Walking back
        over intervals above the threshold would stop at the first one the read-time quantisation puts under it.)"""
        if self.last is None or not self.recent:
            return 0.0
        total, seen, onset = sum(w for _, _, w in self.recent), 0, self.last[1]
        for end, seconds_per_step, steps in reversed(self.recent):
            seen += steps
            onset = end - seconds_per_step * steps
            if 2 * seen >= total:
                break
        return max(0.0, self.last[1] - onset)


def _time(value: Any) -> float:
    """A saved time (or seconds a step): a finite number, else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"not a time: {value!r}")
    return float(value)


def _steps(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"not a step count: {value!r}")
    return value


@dataclass(frozen=True)
class Verdict:
    pace: float | None  # seconds per step now
    baseline: float | None  # seconds per step, the job's own
    ratio: float | None  # pace / baseline
    slow_since: float | None

    def slow(self, now: float, settings: PaceSettings) -> bool:
        return self.slow_since is not None and now - self.slow_since >= settings.slow_for


class PaceLedger:
    """Step samples handed from the checks that read them (training_log: step lines) to the pace check, per job and
    series (`path|rank`), bounded: MAX_SAMPLES per series, MAX_SERIES per job; forgotten when the job is gone."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._samples: dict[str, dict[str, deque[tuple[int, float]]]] = {}

    def record(self, job: str, series: str, step: int, when: float) -> None:
        with self._lock:
            mine = self._samples.setdefault(job, {})
            if series not in mine and len(mine) >= MAX_SERIES:
                return
            mine.setdefault(series, deque(maxlen=MAX_SAMPLES)).append((step, when))

    def take(self, job: str) -> dict[str, list[tuple[int, float]]]:
        """The samples recorded for the job since the last take, per series."""
        with self._lock:
            mine = self._samples.pop(job, {})
        return {k: list(v) for k, v in mine.items()}

    def forget(self, live: Sequence[str] | set[str]) -> None:
        with self._lock:
            for job in set(self._samples) - set(live):
                del self._samples[job]
