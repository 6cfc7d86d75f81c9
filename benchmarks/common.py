"""What every benchmark prints the same way: the table heading naming the date and machine, and percentiles."""

from __future__ import annotations

import contextlib
import getpass
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainguard.install import DEFAULT_CONFIG

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def heading(title: str) -> str:
    """`**TITLE, DATE, HOST (N CPUs, Linux X, Python Y)**`: a table's numbers only mean something with these."""
    return (f"**{title}, {time.strftime('%Y-%m-%d')}, {platform.node()} ({os.cpu_count()} CPUs, Linux "
            f"{platform.release()}, Python {platform.python_version()})**\n")


def exit_cleanly_on_sigterm() -> None:
    """SIGTERM (`timeout` ending a run that holds the shared test lock) as SystemExit, so the `finally` blocks stop
    the SLURM daemons, agents and mounts a benchmark started instead of leaving them to the next user of the lock."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def installed_config() -> dict[str, Any]:
    """The config `trainguard install` writes (every check at its defaults), as raw tables to adjust."""
    return tomllib.loads(DEFAULT_CONFIG.read_text())


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# A stand-in trainer: one step line a second, its marker in argv for a process job to match.
WRITER = ("import sys, time\nstep = 0\nwhile True:\n    print(f'step {step} loss=1.2345', flush=True)\n"
          "    step += 1\n    time.sleep(1)\n")


@contextlib.contextmanager
def log_writers(directory: Path, count: int) -> Iterator[list[Path]]:
    """`count` processes, `tg-bench-writer-N` in their argv, each appending a step line a second to its own log."""
    directory.mkdir(parents=True, exist_ok=True)
    writers: list[subprocess.Popen[bytes]] = []
    paths = []
    try:
        for i in range(count):
            log = directory / f"rank{i}.log"
            paths.append(log)
            with log.open("ab") as out:
                writers.append(subprocess.Popen([sys.executable, "-c", WRITER, f"tg-bench-writer-{i}"], stdout=out))
        yield paths
    finally:
        for w in writers:
            w.kill()
            w.wait()


def writer_jobs(logs: list[Path]) -> dict[str, dict[str, object]]:
    """The `[jobs.processes]` tables declaring the log writers as process jobs."""
    return {f"trainer{i}": {"cmdline": f"tg-bench-writer-{i}$", "user": getpass.getuser(), "logs": [str(log)]}
            for i, log in enumerate(logs)}
