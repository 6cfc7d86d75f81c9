"""How the cost of a check round grows with the node: CPU time per round of the default checks with 1, 8 and 64
jobs and 1, 8 and 16 GPUs.

A real engine runs in this process with the config `trainguard install` writes, plus gpu_memory; the jobs are process jobs
(a stand-in trainer each, logging a step a second, whose log the hang and training_log checks read) and the GPUs
are the tests' scripted NVML, or with `--nvml real` this node's own GPUs. Each cell is the median CPU time
(all threads) of one round over `--rounds` rounds, after two warm-up rounds.

    python -m benchmarks.round_cost --rounds 10
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

from benchmarks.common import heading, installed_config, log_writers, writer_jobs
from tests.helpers.fake_nvml import FakeGpu, FakeNvml
from trainguard.agent.configfile import parse_config
from trainguard.gpu.nvml import Nvml
from trainguard.pipeline.engine import Engine


def engine(tmp: Path, logs: list[Path], nvml: Nvml) -> Engine:
    # No actions: the cost of deciding is measured, not of signalling the stand-in trainers.
    checks = {name: {**table, "actions": {"critical": [], "warning": []}}
              for name, table in installed_config()["checks"].items()}
    checks["disk"]["paths"] = ["/"]
    checks["gpu_memory"] = {}
    config = {"agent": {"state_dir": str(tmp / "state"), "listen": ""},
              "jobs": {"sources": ["process"], "processes": writer_jobs(logs)},
              "checks": checks, "notifiers": {}}
    return Engine(parse_config(config, "benchmark"), nvml=nvml)


def fake_nvml(gpus: int, pids: list[int]) -> Nvml:
    fakes = [FakeGpu(f"GPU-{i:08x}-0000-4000-8000-000000000000", bus_id=f"00000000:{0x18 + i:02X}:00.0".encode(),
                     used=(2 + i) * 2**30, processes=[(pid, 2**30) for pid in pids[i::gpus]]) for i in range(gpus)]
    return Nvml(FakeNvml(fakes))


def cpu_per_round(e: Engine, rounds: int) -> tuple[float, dict[str, float]]:
    for _ in range(2):
        e.run_round()
    totals, per_check = [], {name: 0.0 for name in e.runners}
    for _ in range(rounds):
        start = time.process_time()
        for name, runner in e.runners.items():  # one at a time, so each check's share is measured alone
            t = time.process_time()
            e.ingest(runner.run_once(e.stop_event))
            per_check[name] += time.process_time() - t
        totals.append(time.process_time() - start)
    return statistics.median(totals), {n: v / rounds for n, v in per_check.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--nvml", choices=["fake", "real"], default="fake")
    args = parser.parse_args()
    logging.disable(logging.CRITICAL)  # incidents would log; the cost is what counts
    gpu_counts = [0] if args.nvml == "real" else args.gpus
    cells: dict[tuple[int, int], float] = {}
    breakdown: dict[str, float] = {}
    for jobs in args.jobs:
        with tempfile.TemporaryDirectory(prefix="trainguard-rounds-") as tmp, \
                log_writers(Path(tmp) / "logs", jobs) as logs:
            time.sleep(1.5)  # every writer has logged a step
            for gpus in gpu_counts:
                pids = [p.pid for p in psutil.process_iter(["cmdline"])
                        if any("tg-bench-writer-" in a for a in p.info["cmdline"] or [])]
                e = engine(Path(tmp) / f"g{gpus}", logs, Nvml() if args.nvml == "real" else fake_nvml(gpus, pids))
                cells[(jobs, gpus)], per_check = cpu_per_round(e, args.rounds)
                e.store.close()
                if (jobs, gpus) == (max(args.jobs), max(gpu_counts)):
                    breakdown = per_check
    title = "CPU per check round, default checks + gpu_memory" + (", real NVML" if args.nvml == "real" else "")
    print(heading(title))
    label = "this node's GPUs" if args.nvml == "real" else None
    print("| jobs | " + " | ".join(label or f"{g} GPUs" for g in gpu_counts) + " |")
    print("|---|" + "---|" * len(gpu_counts))
    for jobs in args.jobs:
        print(f"| {jobs} | " + " | ".join(f"{1000 * cells[(jobs, g)]:.1f} ms" for g in gpu_counts) + " |")
    print(f"\nPer check, {max(args.jobs)} jobs and {label or f'{max(gpu_counts)} GPUs'} (ms per run):\n")
    print("| check | CPU per run |")
    print("|---|---|")
    for name, cpu in sorted(breakdown.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {1000 * cpu:.1f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
