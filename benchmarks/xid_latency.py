"""Fault-to-action latency: an XID record written to /dev/kmsg -> incident fired -> first action -> signal delivered.

Runs a real agent engine (kernel log follower, XID check, incident tracker, action runner) in this
process against the real /dev/kmsg, with a plain-process job whose SIGUSR1 handler records when
the signal arrived. Each trial writes one XID 79 line for a fresh, fake PCI bus (a new incident),
so every trial walks the whole path. Needs root (writing /dev/kmsg).

With `--slurm-job` (and `--slurm`) the job is instead a SLURM batch job of the tests' job user, found through the
node-local job source (issue 19: slurmd and the cgroup tree, no prolog hook), a fresh one per trial that started
`--job-age` seconds (default 1) before the XID: the signal goes through `scancel --signal=USR1 --full`, and the job
writes when it arrived to its StdOut.

    sudo python -m benchmarks.xid_latency --trials 50
    sudo python -m benchmarks.xid_latency --trials 20 --slurm --slurm-job
"""

from __future__ import annotations

import argparse
import getpass
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks.common import exit_cleanly_on_sigterm, heading, percentile
from tests.slurm_cluster import JOB_USER, SlurmCluster, sh
from trainguard.agent.configfile import parse_config
from trainguard.core.state import scoped_key
from trainguard.node.kmsg import CURSOR_KEY, cursor_at_end
from trainguard.pipeline.engine import Engine

TARGET = """
import signal, sys, time
def on_usr1(signum, frame):
    sys.stdout.write(f"{time.time()!r}\\n"); sys.stdout.flush()
signal.signal(signal.SIGUSR1, on_usr1)
sys.stdout.write("ready\\n"); sys.stdout.flush()
while True:
    time.sleep(3600)
"""


def start_cluster() -> SlurmCluster:
    for sbin in ("/usr/sbin", "/sbin"):
        os.environ["PATH"] = os.environ.get("PATH", "") + ":" + sbin
    return SlurmCluster(Path(tempfile.mkdtemp(prefix="trainguard-slurm-", dir="/tmp"))).start()


class SlurmTarget:
    """A fresh batch job per trial running TARGET; the SIGUSR1 times come from its StdOut file."""

    def __init__(self, cluster: SlurmCluster, age: float) -> None:
        self.cluster = cluster
        self.age = age
        self.workdir = cluster.workdir(JOB_USER)
        script = self.workdir / "target.py"
        script.write_text(TARGET)
        os.chmod(script, 0o644)
        self.job_id = ""
        self.out: Path | None = None

    def start(self, tag: str) -> None:
        """Submit a job, wait for its handler, and return `age` seconds after the job started."""
        self.job_id = self.cluster.submit(f"exec {self.cluster.python} {self.workdir}/target.py {tag}",
                                          workdir=self.workdir, user=JOB_USER, name="tg-xid-bench")
        info = self.cluster.wait_state(self.job_id, ("RUNNING",), 60)
        self.out = Path(info["StdOut"])
        started = time.time()
        deadline = time.monotonic() + 30
        while not (self.out.exists() and "ready" in self.out.read_text(errors="replace")):
            if time.monotonic() > deadline:
                sys.exit(f"job {self.job_id} never got ready")
            time.sleep(0.01)
        time.sleep(max(0.0, started + self.age - time.time()))

    def signal_time(self, timeout: float = 10.0) -> float:
        assert self.out is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = self.out.read_text(errors="replace").split("\n")
            got = [line for line in lines[1:] if line.strip()]
            if got:
                return float(got[0])
            time.sleep(0.002)
        sys.exit(f"job {self.job_id}: no SIGUSR1 within {timeout}s")

    def end(self) -> None:
        """Cancel the trial's job and wait until slurmd no longer runs it (the next trial's job is the only one)."""
        if not self.job_id:
            return
        sh("scancel", self.job_id, check=False)
        self.cluster.wait(lambda: self.cluster.job(self.job_id).get("JobState") not in ("RUNNING", "COMPLETING"),
                          60, f"job {self.job_id} ended")
        self.job_id = ""


def node_drained(cluster: SlurmCluster, timeout: float = 10.0) -> float:
    deadline = time.monotonic() + timeout
    while "DRAIN" not in cluster.node_info()["State"]:
        if time.monotonic() > deadline:
            sys.exit("the node was not drained")
    return time.time()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--json", action="store_true", help="print the raw numbers as JSON too")
    parser.add_argument("--no-kernel", action="store_true", help="without the kernel check (the XID path alone, as "
                        "before issue 49)")
    parser.add_argument("--slurm", action="store_true", help="also drain: start the tests' one-node SLURM cluster and "
                                                             "time the node turning DRAIN in the controller")
    parser.add_argument("--slurm-job", action="store_true", help="with --slurm: signal a SLURM batch job found "
                        "through the node-local job source, a fresh one per trial")
    parser.add_argument("--job-age", type=float, default=1.0, help="with --slurm-job: seconds between the job's "
                        "start and the XID")
    args = parser.parse_args()
    exit_cleanly_on_sigterm()
    if args.slurm_job and not args.slurm:
        parser.error("--slurm-job needs --slurm")
    if not os.access("/dev/kmsg", os.W_OK):
        sys.exit("needs a writable /dev/kmsg (run as root)")

    logging.getLogger("trainguard").setLevel(logging.ERROR)  # one audit line per trial would drown the table
    tag = f"trainguard-bench-{uuid.uuid4().hex[:8]}"
    target = subprocess.Popen([sys.executable, "-c", TARGET, tag], stdout=subprocess.PIPE, text=True)
    assert target.stdout is not None
    target.stdout.readline()  # "ready": the handler is installed

    knob = Path("/proc/sys/kernel/printk_devkmsg")
    old_knob = knob.read_text().strip() if knob.exists() else None
    if old_knob is not None:
        knob.write_text("on\n")  # lift userspace rate limiting for the injected records
    state = tempfile.mkdtemp(prefix="trainguard-bench-")
    cluster = start_cluster() if args.slurm else None
    slurm_target = SlurmTarget(cluster, args.job_age) if cluster is not None and args.slurm_job else None
    jobs: dict[str, object] = {"sources": ["process"], "refresh": "60s",
                               "processes": {"bench": {"cmdline": tag, "user": getpass.getuser()}}}
    if slurm_target is not None:
        jobs = {"sources": ["slurm"], "prolog_dir": ""}  # the node-local source alone, no prolog hook
    raw = {"agent": {"state_dir": state, "node_name": cluster.node if cluster else "bench", "listen": ""},
           "jobs": jobs,
           "checks": {"xid": {"actions": {"critical": ["signal", "drain"] if cluster else ["signal"]}},
                      # the kernel event catalog in the same reader, behind the XID handler (issue 49)
                      **({} if args.no_kernel else {"kernel": {"actions": {}}})},
           "notifiers": {"console": {"min_severity": "CRITICAL", "send_resolved": False}}}
    engine = Engine(parse_config(raw, "benchmark"))
    engine.store.put(scoped_key("check/xid", CURSOR_KEY), cursor_at_end())
    engine.start()
    fired, acted, delivered, drained = [], [], [], []
    fd = os.open("/dev/kmsg", os.O_WRONLY)
    try:
        engine.responder.catalog.view()  # warm the job cache, as a running agent has it
        for trial in range(args.trials):
            bus = f"00{0x40 + trial % 0xbf:02x}:{random.randint(0, 255):02x}:00"
            line = f"<4>NVRM: Xid (PCI:{bus}): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus. [{tag}]\n"
            if slurm_target is not None:
                slurm_target.start(tag)
            written = time.time()
            os.write(fd, line.encode())
            got = slurm_target.signal_time() if slurm_target is not None else float(target.stdout.readline())
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                incident = next((i for i in engine.tracker.incidents() if i.subject == f"pci:{bus}" and i.actions), None)
                if incident is not None:
                    break
                time.sleep(0.005)
            else:
                sys.exit(f"trial {trial}: no incident with an action for {bus}")
            assert incident.fired_at is not None
            fired.append((incident.fired_at - written) * 1000)
            acted.append((incident.actions[0]["at"] - written) * 1000)
            delivered.append((got - written) * 1000)
            if cluster is not None:
                drained.append((node_drained(cluster) - written) * 1000)
                cluster.resume_node()
                while "DRAIN" in cluster.node_info()["State"]:
                    time.sleep(0.05)
            if slurm_target is not None:
                slurm_target.end()
            time.sleep(0.05)
    finally:
        os.close(fd)
        if slurm_target is not None:
            slurm_target.end()
        engine.stop()
        target.kill()
        if cluster is not None:
            cluster.stop()
        if old_knob is not None:
            knob.write_text(old_knob + "\n")

    job = (f"a SLURM batch job found by the node-local source, started {args.job_age:g} s before the XID"
           if slurm_target is not None else "a plain-process job")
    print(heading(f"XID fault-to-action latency, {args.trials} trials, {job}"))
    print("| kmsg record written -> | median | p99 | max |")
    print("|---|---|---|---|")
    rows = [("incident fired", fired), ("first action started", acted), ("SIGUSR1 received by the job", delivered)]
    if drained:
        rows.append(("node DRAIN in slurmctld (`scontrol show node` polled)", drained))
    for what, values in rows:
        print(f"| {what} | {statistics.median(values):.1f} ms | {percentile(values, 0.99):.1f} ms | {max(values):.1f} ms |")
    if args.json:
        print(json.dumps({"fired_ms": fired, "action_ms": acted, "delivered_ms": delivered, "drained_ms": drained}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
