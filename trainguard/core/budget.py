"""Time budgets within a run: a deadline that work checks between its steps.

A blocking call cannot be interrupted in Python, so a budget is kept by bounding each step (a read capped in bytes, a
directory listing capped in entries, a file opened O_PATH first so that a FIFO never blocks) and checking the deadline
between steps: a run goes past its deadline by one step at most.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field


class OverBudgetError(Exception):
    """The work went past its deadline; `budget` is the time it was given, in seconds."""

    def __init__(self, budget: float) -> None:
        super().__init__(f"took longer than its budget of {budget:.1f}s")
        self.budget = budget


@dataclass(frozen=True)
class Deadline:
    """`at` on `clock` (monotonic seconds); `budget`: how long the work was given."""

    at: float = math.inf
    budget: float = math.inf
    clock: Callable[[], float] = field(default=time.monotonic, compare=False)

    @classmethod
    def after(cls, seconds: float, clock: Callable[[], float] = time.monotonic) -> Deadline:
        return cls(clock() + seconds, seconds, clock)

    def left(self) -> float:
        return self.at - self.clock()

    def check(self) -> None:
        """Raise OverBudgetError once the deadline has passed."""
        if self.at != math.inf and self.clock() >= self.at:
            raise OverBudgetError(self.budget)


NO_DEADLINE = Deadline()
