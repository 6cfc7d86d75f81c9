"""Fault-to-action latency: an XID record written to /dev/kmsg -> incident fired -> first action -> signal delivered.

Runs a real agent engine (kernel log follower, XID check, incident tracker, action runner) in this
process against the real /dev/kmsg, with a plain-process job whose SIGUSR1 handler records when
the signal arrived. Each trial writes one XID 79 line for a fresh, fake PCI bus (a new incident),
so every trial walks the whole path. Needs root (writing /dev/kmsg).

    sudo python -m benchmarks.xid_latency --trials 50
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

from benchmarks.common import heading, percentile
from tests.slurm_cluster import SlurmCluster
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
    parser.add_argument("--slurm", action="store_true", help="also drain: start the tests' one-node SLURM cluster and "
                                                             "time the node turning DRAIN in the controller")
    args = parser.parse_args()
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
    raw = {"agent": {"state_dir": state, "node_name": cluster.node if cluster else "bench", "listen": ""},
           "jobs": {"sources": ["process"], "refresh": "60s",
                    "processes": {"bench": {"cmdline": tag, "user": getpass.getuser()}}},
           "checks": {"xid": {"actions": {"critical": ["signal", "drain"] if cluster else ["signal"]}}},
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
            written = time.time()
            os.write(fd, line.encode())
            got = float(target.stdout.readline())
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
            time.sleep(0.05)
    finally:
        os.close(fd)
        engine.stop()
        target.kill()
        if cluster is not None:
            cluster.stop()
        if old_knob is not None:
            knob.write_text(old_knob + "\n")

    print(heading(f"XID fault-to-action latency, {args.trials} trials"))
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
