"""Hang detection overshoot past `stale_after`, and the CPU the hang and memory checks cost with 8 jobs.

Overshoot: each trial starts a process job that logs a few lines and then stops. A real engine
(hang check with py-spy stacks, as configured by default) runs it, and the trial records how long
after the deadline (last log write + stale_after) the incident fired.

Cost: 8 process jobs that log and heartbeat every second. Each check runs 60 rounds, and the
agent's CPU time per round is scaled to one hour at the checks' default intervals.

    python -m benchmarks.hang_and_leak --trials 20
"""

from __future__ import annotations

import argparse
import getpass
import logging
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.common import heading
from trainguard.agent.configfile import parse_config
from trainguard.checks.hang import HangSettings
from trainguard.checks.job_memory import JobMemorySettings
from trainguard.pipeline.engine import Engine

WORKER = """
import sys, time
sys.path.insert(0, sys.argv[1])
from trainguard.trainer import Trainer
log, steps = open(sys.argv[2], "a", buffering=1), int(sys.argv[3])
trainer = Trainer(sys.argv[4])
step = 0
while True:
    if steps < 0 or step < steps:
        log.write(f"step {step}\\n"); trainer.heartbeat(step); step += 1
    time.sleep(float(sys.argv[5]))
"""
REPO = Path(__file__).resolve().parents[1]


def worker(tmp: Path, marker: str, steps: int, period: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", WORKER, str(REPO), str(tmp / f"{marker}.log"), str(steps),
                             str(tmp / marker), str(period), marker])


def engine(tmp: Path, checks: dict[str, Any], jobs: dict[str, str]) -> Engine:
    raw = {"agent": {"state_dir": str(tmp / f"state-{uuid.uuid4().hex[:6]}"), "node_name": "bench", "listen": ""},
           "jobs": {"sources": ["process"], "refresh": "5s",
                    "processes": {name: {"cmdline": marker, "user": getpass.getuser(), "logs": [str(tmp / f"{marker}.log")],
                                         "switch_dir": str(tmp / marker)} for name, marker in jobs.items()}},
           "checks": checks, "notifiers": {"console": {"min_severity": "CRITICAL", "send_resolved": False}}}
    return Engine(parse_config(raw, "benchmark"))


def overshoot(tmp: Path, trials: int, stale_after: float) -> list[float]:
    out = []
    for _ in range(trials):
        marker = f"tg-bench-hang-{uuid.uuid4().hex[:8]}"
        proc = worker(tmp, marker, 5, 0.1)
        eng = engine(tmp, {"hang": {"stale_after": f"{stale_after}s"}}, {"trainer": marker})
        eng.start()
        try:
            deadline = time.monotonic() + stale_after + 30
            while time.monotonic() < deadline:
                fired = next((i for i in eng.tracker.incidents() if i.check == "hang" and i.firing), None)
                if fired is not None:
                    break
                time.sleep(0.01)
            else:
                sys.exit("no hang incident")
            assert fired.fired_at is not None
            last_write = (tmp / f"{marker}.log").stat().st_mtime
            out.append(fired.fired_at - (last_write + stale_after))
        finally:
            eng.stop()
            proc.kill()
            proc.wait()
    return out


def cpu_per_round(tmp: Path, checks: dict[str, Any], rounds: int, jobs: dict[str, str]) -> float:
    eng = engine(tmp, checks, jobs)
    eng.run_round()  # warm: first samples, imports
    start = time.process_time()
    for _ in range(rounds):
        eng.run_round()
    spent = (time.process_time() - start) / rounds
    eng.stop()
    return spent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--stale-after", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()
    logging.getLogger("trainguard").setLevel(logging.ERROR)
    tmp = Path(tempfile.mkdtemp(prefix="trainguard-bench-"))

    late = overshoot(tmp, args.trials, args.stale_after)
    jobs = {f"job{i}": f"tg-bench-cost-{uuid.uuid4().hex[:8]}" for i in range(8)}
    procs = [worker(tmp, marker, -1, 1.0) for marker in jobs.values()]
    try:
        time.sleep(2)
        hang = cpu_per_round(tmp, {"hang": {}}, args.rounds, jobs)
        leak = cpu_per_round(tmp, {"leak": {"type": "job_memory"}}, args.rounds, jobs)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    hang_interval, leak_interval = HangSettings().interval, JobMemorySettings().interval

    print(heading("Hang detection and memory checks"))
    print(f"| hang fired after its deadline ({args.trials} trials, stale_after {args.stale_after:g}s, py-spy on) | "
          "median | max |")
    print("|---|---|---|")
    print(f"| overshoot | {statistics.median(late) * 1000:.0f} ms | {max(late) * 1000:.0f} ms |\n")
    print("| check, 8 jobs | CPU per run | runs per hour (default interval) | CPU per hour |")
    print("|---|---|---|---|")
    for name, per_run, interval in (("hang", hang, hang_interval), ("job_memory", leak, leak_interval)):
        runs = 3600 / interval
        print(f"| {name} | {per_run * 1000:.1f} ms | {runs:.0f} | {per_run * runs:.2f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
