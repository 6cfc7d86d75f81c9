"""Training-log scanning: throughput next to `grep -E` on the same file, and cost that follows appended bytes.

Throughput: a synthetic log (step lines, INFO lines, a few failures) scanned by trainguard's reader and
signature scanner, and by `grep -E -c` with the signatures' needles as one alternation, in the same run.
Appended bytes: 1 MiB appended to a 10 GiB (sparse) log and to a 10 MiB log, each read from the saved
position; the two should cost the same.

    python -m benchmarks.log_scan --size-mib 1024
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import heading
from trainguard.logscan.reader import LogTail
from trainguard.logscan.signatures import BUILTIN, Scanner
from trainguard.node.access import Identity

BLOCK = "".join(
    f"[rank{r}]: step {s} loss={2.5 - s / 1e5:.4f} lr=3.0e-4 tokens/s=182340 grad_norm=0.91\n"
    f"2026-11-22 03:14:{s % 60:02d} INFO trainer.py:212 throughput ok, data loader queue 64/64\n"
    for s in range(200) for r in range(4)).encode()
FAILURE = (b"[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB. GPU 3 has a total "
           b"capacity of 79.15 GiB of which 1.06 GiB is free.\n")

ROOT = Identity(0)  # the tests' own files: read with root's authority


def make_log(path: Path, size: int) -> int:
    written = 0
    with path.open("wb") as f:
        while written < size:
            f.write(BLOCK)
            written += len(BLOCK)
            if written % (64 << 20) < len(BLOCK):
                f.write(FAILURE)
                written += len(FAILURE)
    return written


def ours(path: Path) -> tuple[float, int]:
    started = time.perf_counter()
    tail, scanner = LogTail(str(path), ROOT), Scanner(BUILTIN)
    hits = sum(1 for chunk in tail.read(limit=1 << 40) for _ in scanner.scan(chunk))
    return time.perf_counter() - started, hits


def grep(path: Path) -> tuple[float, int]:
    needles = sorted({n.decode() for s in BUILTIN for n in s.needles})
    pattern = "|".join(re.escape(n).replace("\\ ", " ") for n in needles)
    started = time.perf_counter()
    out = subprocess.run(["grep", "-E", "-c", pattern, str(path)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "LC_ALL": "C"})
    return time.perf_counter() - started, int(out.stdout.strip() or 0)


def appended_cost(tmp: Path, base: int, rounds: int = 5) -> float:
    path = tmp / f"base-{base}.log"
    with path.open("wb") as f:
        f.write(BLOCK[:4096])
        f.truncate(base)  # sparse: a 10 GiB log without 10 GiB of disk
    costs = []
    for _ in range(rounds):
        tail = LogTail(str(path), ROOT)
        list(tail.read(limit=1))  # establish the position cheaply...
        assert tail.position is not None
        tail.position.offset = path.stat().st_size  # ...then as if everything so far had been read
        with path.open("ab") as f:
            f.write(BLOCK * (1 + (1 << 20) // len(BLOCK)))
        started = time.perf_counter()
        for chunk in tail.read(limit=1 << 40):
            list(Scanner(BUILTIN).scan(chunk))
        costs.append(time.perf_counter() - started)
    path.unlink()
    return statistics.median(costs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="trainguard-bench-"))
    log = tmp / "train.log"
    size = make_log(log, args.size_mib << 20)
    grep(log)  # warm the page cache for both
    t_ours, hits = ours(log)
    t_grep, lines = grep(log)
    t_ours2, _ = ours(log)
    t_grep2, _ = grep(log)
    log.unlink()
    big, small = appended_cost(tmp, 10 << 30), appended_cost(tmp, 10 << 20)
    mib = size / 2**20
    best_ours, best_grep = min(t_ours, t_ours2), min(t_grep, t_grep2)
    print(heading("Log scanning"))
    print(f"| {mib:.0f} MiB synthetic log (page cache warm) | time | throughput | matches |")
    print("|---|---|---|---|")
    print(f"| trainguard reader + scanner | {best_ours:.2f} s | {mib / best_ours:.0f} MiB/s | {hits} findings |")
    print(f"| `grep -E -c` same needles | {best_grep:.2f} s | {mib / best_grep:.0f} MiB/s | {lines} lines |")
    print(f"| ratio | {best_ours / best_grep:.1f}x grep | | |\n")
    print("| 1 MiB appended to | cost (median of 5) |")
    print("|---|---|")
    print(f"| a 10 GiB log | {big * 1000:.1f} ms |")
    print(f"| a 10 MiB log | {small * 1000:.1f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
