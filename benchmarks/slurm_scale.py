"""What one agent costs its node and slurmctld as the controller's queue grows, before and after issue 19.

On the tests' one-node SLURM cluster, the controller holds 0, 1,000, 4,000 and 10,000 held jobs of another user
(none on this node). At each size the agent runs the config `trainguard install` writes (node name, state dir and
no HTTP endpoint set, the disk check on /), once as this tree has it and once as the revision given with `--before`
(a git worktree of it, run with the same config), one after the other for `--seconds` each, after a warm-up. Per
run: the agent's CPU (self plus reaped children: the SLURM commands it runs) as a share of one core, its peak RSS
(sampled each second), and the REQUEST_JOB_INFO* RPCs slurmctld counted meanwhile (`sdiag -r` before, `sdiag`
after), per minute. `--running N` adds rows (at the largest size) with N toy trainers running on the node as the unprivileged test
user.

`--fleet N` then starts a second cluster of N slurmd on this host (tests/slurm_fleet.py) and N agents (both
revisions in turn), each with its own `node_name` and `[jobs] slurm_node`, and reports slurmctld's CPU and RPCs per
second, extrapolated linearly to 1,000 and 10,000 nodes.

    sudo python -m benchmarks.slurm_scale --before be2baf2 --sizes 0,1000,4000,10000 --seconds 60 --fleet 20
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
import tomli_w

from benchmarks.common import exit_cleanly_on_sigterm, heading, installed_config
from tests.slurm_cluster import JOB_USER, OTHER_USER, SlurmCluster, job_info_rpcs, parse_sdiag, sh, submit_held
from tests.slurm_fleet import SlurmFleet
from trainguard.core.state import scoped_key
from trainguard.node.kmsg import CURSOR_KEY, cursor_at_end
from trainguard.pipeline.store import Store

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Run:
    cpu_share: float  # of one core
    rss_mb: float
    job_info_per_min: float
    all_rpc_per_s: float = 0.0
    ctld_cpu_share: float = 0.0


def agent_config(tmp: Path, node: str, slurm_node: str = "") -> Path:
    raw = installed_config()
    raw["agent"] = {"node_name": node, "state_dir": str(tmp / "state"), "listen": ""}
    if slurm_node:
        raw["jobs"] = {"slurm_node": slurm_node}
    raw["checks"]["disk"]["paths"] = ["/"]
    # This boot's kernel log holds the fake XID 79s the tests wrote: replayed at start, they drained the node (no
    # trainer could start) and would signal and requeue the trainers. The check still follows and grades the log;
    # only its actions are off.
    raw["checks"]["xid"]["actions"] = {"critical": []}
    # ... and the agent starts with its kernel log cursor at the end (as one restarted resumes from its saved
    # cursor), so those fake XIDs, an XID ledger and an incident per fake GPU, are not part of the measured cost.
    store = Store(tmp / "state")
    store.put(scoped_key("check/xid", CURSOR_KEY), cursor_at_end())
    store.close()
    raw["notifiers"] = {"console": {}}
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "trainguard.toml"
    path.write_text(tomli_w.dumps(raw))
    return path


def cpu_seconds(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system + t.children_user + t.children_system


@contextlib.contextmanager
def agents(tree: Path, configs: Sequence[Path], env: dict[str, str]) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`trainguard run` of the package in `tree`, one per config, until each logged it is ready."""
    procs = []
    logs = []
    try:
        for config in configs:
            log = config.with_suffix(".log").open("wb")
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, "-m", "trainguard", "run", "--config", str(config)],
                                          cwd=tree, stderr=log, stdout=subprocess.DEVNULL,
                                          env={**os.environ, **env, "PYTHONPATH": str(tree)}))
        for config, proc in zip(configs, procs, strict=True):
            deadline = time.monotonic() + 60
            while b"msg=ready" not in config.with_suffix(".log").read_bytes():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"agent of {config} not ready: {config.with_suffix('.log').read_text()[-2000:]}")
                time.sleep(0.2)
        yield procs
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        for log in logs:
            log.close()


def measure(procs: list[subprocess.Popen[bytes]], seconds: float, warmup: float, ctld_pid: int | None = None) -> Run:
    time.sleep(warmup)
    ps = [psutil.Process(p.pid) for p in procs]
    ctld = psutil.Process(ctld_pid) if ctld_pid else None
    sh("sdiag", "-r")
    cpu0 = [cpu_seconds(p) for p in ps]
    ctld0 = ctld.cpu_times() if ctld else None
    t0 = time.monotonic()
    rss = 0
    while time.monotonic() - t0 < seconds:
        rss = max(rss, *(p.memory_info().rss for p in ps))
        time.sleep(1.0)
    elapsed = time.monotonic() - t0
    counts = parse_sdiag(sh("sdiag"))
    cpu = sum(cpu_seconds(p) for p in ps) - sum(cpu0)
    ctld_share = 0.0
    if ctld and ctld0:
        t = ctld.cpu_times()
        ctld_share = (t.user + t.system - ctld0.user - ctld0.system) / elapsed
    return Run(cpu / elapsed / len(ps), rss / 2**20, job_info_rpcs(counts) * 60 / elapsed / len(ps),
               sum(counts.values()) / elapsed, ctld_share)


def held_jobs(total: int, have: int) -> int:
    """Submit held jobs of the other test user until the controller holds `total` of them."""
    if total > have:
        submit_held(total - have)
    return total


def before_tree(rev: str, tmp: Path) -> Path:
    path = tmp / f"before-{rev}"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), rev], check=True,
                   capture_output=True, timeout=60)
    return path


def node_rows(args: argparse.Namespace, trees: dict[str, Path], tmp: Path) -> list[str]:
    cluster = SlurmCluster(Path(tempfile.mkdtemp(prefix="trainguard-slurm-", dir="/tmp"))).start()
    env = {"SLURM_CONF": str(cluster.conf)}
    rows = []
    try:
        have = 0
        sizes = [int(s) for s in args.sizes.split(",")]
        busy = [int(s) for s in args.running_sizes.split(",")] if args.running_sizes else sizes[-1:]
        plans = [(size, 0) for size in sizes] + [(size, args.running) for size in busy if args.running]
        running: list[str] = []
        # Held jobs are only ever added, so sizes go up. Within a size the trainers' row comes first when they
        # already run (started behind few held jobs): trainers submitted behind 10,000 held jobs took minutes.
        while plans:
            size = min(p[0] for p in plans)
            here = sorted((p for p in plans if p[0] == size), key=lambda p: -p[1] if running else p[1])
            size, jobs_here = here[0]
            plans.remove(here[0])
            have = held_jobs(size, have)
            if len(running) > jobs_here:
                subprocess.run(["scancel", *running], capture_output=True, timeout=120)
                for job in running:
                    cluster.wait(lambda j=job: cluster.job(j).get("JobState") not in ("RUNNING", "COMPLETING"),
                                 120, f"job {job} ended")
                running = []
            while len(running) < jobs_here:
                workdir = cluster.workdir()
                running.append(cluster.submit(cluster.toy_command("--steps", "1000000", "--step-time", "1",
                                                                  "--ckpt-dir", f"{workdir}/ckpt"),
                                              workdir=workdir, user=JOB_USER, name=f"toy{len(running)}"))
            for job in running:
                cluster.wait_state(job, ("RUNNING",), 300)
            for label, tree in trees.items():
                config = agent_config(tmp / f"{label}-{size}-{jobs_here}", cluster.node)
                with agents(tree, [config], env) as procs:
                    run = measure(procs, args.seconds, args.warmup)
                rows.append(f"| {size:,} | {jobs_here} | {label} | {run.cpu_share * 100:.2f}% | {run.rss_mb:.0f} MiB "
                            f"| {run.job_info_per_min:.1f} |")
                print(rows[-1], flush=True)
    finally:
        subprocess.run(["scancel", "-u", OTHER_USER], capture_output=True, timeout=120)
        subprocess.run(["scancel", "-u", JOB_USER], capture_output=True, timeout=120)
        cluster.stop()
    return rows


def fleet_rows(args: argparse.Namespace, trees: dict[str, Path], tmp: Path) -> list[str]:
    fleet = SlurmFleet(Path(tempfile.mkdtemp(prefix="trainguard-fleet-", dir="/tmp")), args.fleet).start()
    rows = []
    try:
        for label, tree in trees.items():
            configs = [agent_config(tmp / f"fleet-{label}-{node}", node, node) for node in fleet.nodes]
            with agents(tree, configs, {"SLURM_CONF": str(fleet.conf)}) as procs:
                run = measure(procs, args.seconds, args.warmup, fleet.ctld_pid())
            per_node = run.all_rpc_per_s / args.fleet
            cpu_per_node = run.ctld_cpu_share / args.fleet
            rows.append(f"| {label} | {args.fleet} | {run.ctld_cpu_share * 100:.2f}% | {run.all_rpc_per_s:.2f} "
                        f"| {run.job_info_per_min * args.fleet / 60:.3f} | {per_node * 1000:,.0f} / "
                        f"{cpu_per_node * 1000 * 100:.0f}% | {per_node * 10000:,.0f} / {cpu_per_node * 10000 * 100:.0f}% |")
            print(rows[-1], flush=True)
    finally:
        fleet.stop()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0,1000,4000,10000")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--warmup", type=float, default=15.0)
    parser.add_argument("--running", type=int, default=8, help="toy trainers on the node for the extra rows (0: none)")
    parser.add_argument("--running-sizes", default="", help="the sizes with rows of trainers running (default: the "
                        "largest of --sizes)")
    parser.add_argument("--before", default="", help="a git revision to compare with (a worktree of it is made)")
    parser.add_argument("--fleet", type=int, default=0, help="agents (and slurmd) in the fleet simulation; 0: none")
    args = parser.parse_args()
    exit_cleanly_on_sigterm()
    tmp = Path(tempfile.mkdtemp(prefix="tg-slurm-scale-"))
    trees = {"after": REPO}
    if args.before:
        trees = {"before": before_tree(args.before, tmp), **trees}
    try:
        out = [heading("One agent on a SLURM node, the controller's queue growing"),
               "| held jobs in slurmctld | jobs on the node | agent | CPU (self + children, one core) | peak RSS "
               "| REQUEST_JOB_INFO* per minute |", "|---|---|---|---|---|---|"]
        out += node_rows(args, trees, tmp)
        if args.fleet:
            out += ["", heading(f"{args.fleet} agents against one slurmctld"),
                    "| agents | nodes | slurmctld CPU | RPCs/s (all) | REQUEST_JOB_INFO*/s | at 1,000 nodes (RPCs/s / "
                    "slurmctld CPU) | at 10,000 nodes |", "|---|---|---|---|---|---|---|"]
            out += fleet_rows(args, trees, tmp)
        print("\n".join(out))
    finally:
        if args.before:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(trees["before"])],
                           capture_output=True, timeout=60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
