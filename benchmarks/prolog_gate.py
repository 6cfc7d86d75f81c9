"""The prolog gate's wall time, as slurmd waits for it: `trainguard slurm-prolog --check` started as a new process
(the interpreter's start and imports included) with its default config (no config file: the built-in default's gate
checks: gpu, xid over the whole kernel ring buffer with --since 1h, and the disk check of / and the state dir), on
8 scripted H100s (tests.helpers.fake_gpu_agent: no GPU here), N times in a row (exit 2 where the kernel log holds
XIDs of the last hour, as a test machine's does); and the epilog gate likewise (a
clean job: no leftover, /dev/shm walked). The goal: p99 under 10 s (issue 50), the gate's own budget.

    python -m benchmarks.prolog_gate --runs 50
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import heading, percentile

REPO = Path(__file__).resolve().parent.parent


def run_once(hook: str, tmp: Path, env: dict[str, str]) -> tuple[float, int]:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "tests.helpers.fake_gpu_agent", hook, "--check", "--dir",
                           str(tmp / "jobs"), "--gate-dir", str(tmp / "gates")], env=env, cwd=REPO,
                          capture_output=True, timeout=120)
    return time.perf_counter() - t0, done.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "TRAINGUARD"))}
    env |= {"TRAINGUARD_FAKE_GPUS": "8", "TRAINGUARD_FAKE_GPU_HEALTHY": "1", "SLURM_JOB_ID": "4242",
            "SLURM_JOB_UID": str(os.getuid()), "SLURMD_NODENAME": "bench",
            "TRAINGUARD_CONFIG": "/nonexistent/trainguard.toml"}  # the built-in default config
    print(heading("prolog and epilog gates, wall time per run (a new process each)"))
    print("| gate | runs | exit codes | p50 | p90 | p99 | max |\n|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="tg-gate-bench-") as name:
        for hook in ("slurm-prolog", "slurm-epilog"):
            times, codes = [], set()
            for _ in range(args.runs):
                took, code = run_once(hook, Path(name), env)
                times.append(took)
                codes.add(code)
            print(f"| `{hook} --check` | {args.runs} | {', '.join(map(str, sorted(codes)))} | "
                  f"{percentile(times, 0.5):.2f} s | {percentile(times, 0.9):.2f} s | {percentile(times, 0.99):.2f} s | "
                  f"{max(times):.2f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
