"""BudgetWalker: the bytes and inodes under a directory, measured a slice at a time.

A checkpoint directory can hold millions of files; one `du` over it would block a check for
minutes. The walker instead advances with `os.scandir` for at most a time budget per call,
keeps its place (a stack of directories still to read), and publishes a figure only when a
walk completes, with the time that walk started: the figure says how fresh it is.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Measurement:
    bytes: int
    inodes: int
    measured_at: float | None  # start of the walk the figure comes from; None: no walk finished yet
    complete: bool  # False: a lower bound from the walk in progress
    walks: int
    errors: int


class BudgetWalker:
    def __init__(self, root: str) -> None:
        self.root = root
        self._stack: list[str] = []
        self._bytes = self._inodes = self._errors = 0
        self._seen: set[tuple[int, int]] = set()  # hard-linked files count once
        self._started = 0.0
        self._last: Measurement | None = None
        self._walks = 0

    def _restart(self) -> None:
        self._stack = [self.root]
        self._bytes = self._inodes = self._errors = 0
        self._seen.clear()
        self._started = time.time()

    def advance(self, budget_s: float) -> Measurement:
        """Walk for about `budget_s`; the last complete figure, or the running lower bound before the first."""
        if not self._stack:
            self._restart()
        deadline = time.monotonic() + budget_s
        while self._stack and time.monotonic() < deadline:
            self._read(self._stack.pop())
        if not self._stack:
            self._walks += 1
            self._last = Measurement(self._bytes, self._inodes, self._started, True, self._walks, self._errors)
        if self._last is not None:
            return self._last
        return Measurement(self._bytes, self._inodes, None, False, self._walks, self._errors)

    def _read(self, directory: str) -> None:
        try:
            with os.scandir(directory) as entries:
                for entry in entries:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        self._errors += 1
                        continue
                    if st.st_nlink > 1 and not entry.is_dir(follow_symlinks=False):
                        key = (st.st_dev, st.st_ino)
                        if key in self._seen:
                            continue
                        self._seen.add(key)
                    self._inodes += 1
                    self._bytes += st.st_blocks * 512  # allocated, as quotas count it
                    if entry.is_dir(follow_symlinks=False):
                        self._stack.append(entry.path)
        except OSError:
            self._errors += 1
