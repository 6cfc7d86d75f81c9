"""Footprint and /metrics latency of `trainguard run`, side by side with Debian's prometheus-node-exporter.

The agent runs the config `trainguard install` writes plus the gpu_memory check over 8 simulated GPUs (the scripted NVML of
the tests), with 10 process jobs whose logs it watches and 4 tmpfs mounts in the disk check; the checks keep their
default intervals. node_exporter runs with its default collectors. Both are scraped every 15 s, as Prometheus
would, for the whole run; RSS is sampled every 5 s and CPU is the processes' own CPU time over the run. At the end
each endpoint gets a burst of back-to-back scrapes for the latency table. Wake-ups are the threads' context
switches over the run, read every 5 s (a thread that lived less than that between two reads is not counted). Needs
root (tmpfs mounts).

    sudo python -m benchmarks.footprint --minutes 10
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import requests
import tomli_w

from benchmarks.common import exit_cleanly_on_sigterm, heading, installed_config, log_writers, percentile, writer_jobs
from tests.conftest import free_port
from trainguard.core.state import scoped_key
from trainguard.node.kmsg import CURSOR_KEY, cursor_at_end
from trainguard.pipeline.store import Store

REPO = Path(__file__).resolve().parent.parent


def scrape(port: int) -> float:
    t = time.perf_counter()
    r = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    r.raise_for_status()
    return time.perf_counter() - t


def wait_ready(port: int, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited {proc.returncode}")
        with contextlib.suppress(requests.RequestException):
            scrape(port)
            return
        time.sleep(0.2)
    raise SystemExit(f"{what} did not answer on :{port}")


def switches(pid: int) -> dict[int, int]:
    """Each thread's context switches so far (voluntary and not): about its wake-ups, which on a virtual machine are
    much of an idle daemon's CPU."""
    counts: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError):
                lines = Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines()
                counts[int(tid)] = sum(int(line.split()[1]) for line in lines if "ctxt_switches:" in line)
    return counts


def cpu_seconds(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system + t.children_user + t.children_system


@contextlib.contextmanager
def tmpfs_mounts(tmp: Path, count: int) -> Iterator[list[Path]]:
    mounted: list[Path] = []
    try:
        for i in range(count):
            target = tmp / f"mnt{i}"
            target.mkdir()
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(target)], check=True, timeout=10)
            mounted.append(target)
        yield mounted
    finally:
        for target in mounted:
            subprocess.run(["umount", "-l", str(target)], check=False, timeout=10)


def agent_config(tmp: Path, port: int, mounts: list[Path], logs: list[Path]) -> Path:
    raw = installed_config()
    raw["agent"] = {"listen": f"127.0.0.1:{port}", "state_dir": str(tmp / "state")}
    raw["jobs"] = {"sources": ["process"], "processes": writer_jobs(logs)}
    raw["checks"]["disk"]["paths"] = [str(m) for m in mounts]
    raw["checks"]["gpu_memory"] = {}
    # This boot's kernel log may hold the tests' fake XID 79s: replayed at start, their signal action would kill the
    # log writers (SIGUSR1), leaving the agent fewer jobs to watch. The check still follows the log; its actions are off.
    raw["checks"]["xid"]["actions"] = {"critical": []}
    raw["notifiers"] = {"console": {}}
    # ... and the agent starts with its kernel log cursor at the end, as one restarted on a node resumes from its
    # saved cursor: replaying those fake XIDs (1,422 over 69 GPUs on one test VM) gave the agent an XID ledger and an
    # incident per fake GPU, and grew /metrics sevenfold, a cost no real node's buffer imposes.
    store = Store(tmp / "state")
    store.put(scoped_key("check/xid", CURSOR_KEY), cursor_at_end())
    store.close()
    path = tmp / "trainguard.toml"
    path.write_text(tomli_w.dumps(raw))
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--scrape-every", type=float, default=15.0)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--logs", type=int, default=10)
    parser.add_argument("--mounts", type=int, default=4)
    parser.add_argument("--burst", type=int, default=200, help="back-to-back scrapes of each for the latency table")
    args = parser.parse_args()
    exit_cleanly_on_sigterm()
    exporter = shutil.which("prometheus-node-exporter")
    if exporter is None:
        raise SystemExit("needs prometheus-node-exporter (apt install prometheus-node-exporter)")
    tmp = Path(tempfile.mkdtemp(prefix="trainguard-footprint-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with tmpfs_mounts(tmp, args.mounts) as mounts, log_writers(tmp / "logs", args.logs) as logs:
            agent_port, ne_port = free_port(), free_port()
            config = agent_config(tmp, agent_port, mounts, logs)
            env = {**os.environ, "TRAINGUARD_FAKE_GPUS": str(args.gpus)}
            with (tmp / "agent.log").open("ab") as out:
                agent = subprocess.Popen([sys.executable, "-m", "tests.helpers.fake_gpu_agent", "run", "--config",
                                          str(config)], stdout=out, stderr=out, env=env, cwd=REPO)
            node_exporter = subprocess.Popen([exporter, f"--web.listen-address=127.0.0.1:{ne_port}"],
                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs += [agent, node_exporter]
            wait_ready(agent_port, agent, "trainguard")
            wait_ready(ne_port, node_exporter, "node_exporter")
            time.sleep(20)  # past start-up: every check has run once
            who = {"trainguard": (psutil.Process(agent.pid), agent_port),
                   "node_exporter": (psutil.Process(node_exporter.pid), ne_port)}
            rss: dict[str, list[int]] = {k: [] for k in who}
            lat: dict[str, list[float]] = {k: [] for k in who}
            cpu0 = {k: cpu_seconds(p) for k, (p, _) in who.items()}
            # per thread: its count at the start (0 for threads started since) and at its latest sample
            first = {k: switches(p.pid) for k, (p, _) in who.items()}
            latest = {k: dict(v) for k, v in first.items()}
            t0 = time.monotonic()
            next_scrape = t0
            while time.monotonic() - t0 < args.minutes * 60:
                now = time.monotonic()
                if now >= next_scrape:
                    for k, (_, port) in who.items():
                        lat[k].append(scrape(port))
                    next_scrape += args.scrape_every
                for k, (p, _) in who.items():
                    rss[k].append(p.memory_info().rss)
                    for tid, count in switches(p.pid).items():
                        first[k].setdefault(tid, 0)
                        latest[k][tid] = count
                time.sleep(5)
            wall = time.monotonic() - t0
            cpu = {k: cpu_seconds(p) - cpu0[k] for k, (p, _) in who.items()}
            wakes = {k: sum(latest[k][t] - first[k][t] for t in latest[k]) for k in who}
            burst: dict[str, list[float]] = {k: [] for k in who}
            for _ in range(args.burst):
                for k, (_, port) in who.items():
                    burst[k].append(scrape(port))
            sizes = {k: len(requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).content)
                     for k, (_, port) in who.items()}
    finally:
        for p in procs:
            p.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(15)
        shutil.rmtree(tmp, ignore_errors=True)

    mib = 2**20
    print(heading(f"Footprint over {wall / 60:.0f} min, scraped every {args.scrape_every:g}s"))
    print("| process | RSS mean | RSS max | CPU (of one core) | wake-ups a minute | scrapes | /metrics size |")
    print("|---|---|---|---|---|---|---|")
    for k in who:
        print(f"| {k} | {statistics.mean(rss[k]) / mib:.1f} MiB | {max(rss[k]) / mib:.1f} MiB | "
              f"{100 * cpu[k] / wall:.3f}% | {60 * wakes[k] / wall:.0f} | {len(lat[k])} | {sizes[k] / 1024:.0f} KiB |")
    print(f"\ntrainguard: {args.gpus} simulated GPUs, {args.logs} watched logs, {args.mounts} tmpfs mounts, default checks "
          "and intervals, plus gpu_memory.\n")
    print(heading(f"/metrics latency, {args.burst} back-to-back scrapes each"))
    print("| endpoint | median | p99 | max |")
    print("|---|---|---|---|")
    for k in who:
        ms = [1000 * s for s in burst[k]]
        print(f"| {k} | {statistics.median(ms):.2f} ms | {percentile(ms, 0.99):.2f} ms | {max(ms):.2f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
