"""Many SLURM nodes on this one host: one slurmctld and N slurmd (`slurmd -N NAME`, each on its own port, spool dir
and pid file; Debian's 22.05 build allows it), for the fleet simulation of benchmarks/slurm_scale.py.

Made after /work/shared/tools/slurm-multinode (the team's script): the same layout, in Python, with ports of its
own (slurmctld 16917, slurmd 17101 and up) so that it runs beside the tests' one-node cluster (tests/slurm_cluster.py).
All nodes share this host's /proc and /dev/kmsg: an agent per node sees every node's processes, so each agent is
told its node with `[agent] node_name` and `[jobs] slurm_node`.
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import psutil

from tests.slurm_cluster import SlurmCluster, _ensure_munge, sh

CTLD_PORT, SLURMD_PORT = 16917, 17100


class SlurmFleet:
    def __init__(self, base: Path, count: int) -> None:
        self.base = base
        self.count = count
        self.host = socket.gethostname().split(".")[0]
        self.conf = base / "slurm.conf"
        self.nodes = [f"n{i}" for i in range(1, count + 1)]

    def start(self) -> SlurmFleet:
        SlurmCluster.kill_stale("trainguard-fleet-")
        _ensure_munge()
        (self.base / "state").mkdir(parents=True, exist_ok=True)
        b = self.base
        lines = [
            "ClusterName=trainguard-fleet", f"SlurmctldHost={self.host}", f"SlurmctldPort={CTLD_PORT}", "SlurmUser=root",
            "SlurmdUser=root", "AuthType=auth/munge", f"StateSaveLocation={b}/state", f"SlurmdSpoolDir={b}/spool/%n",
            f"SlurmctldPidFile={b}/slurmctld.pid", f"SlurmdPidFile={b}/slurmd-%n.pid",
            f"SlurmctldLogFile={b}/slurmctld.log", f"SlurmdLogFile={b}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres", "ReturnToService=2", "MpiDefault=none",
            *(f"NodeName={n} NodeHostname={self.host} Port={SLURMD_PORT + i} CPUs={os.cpu_count() or 2} "
              "RealMemory=2000 State=UNKNOWN" for i, n in enumerate(self.nodes, 1)),
            f"PartitionName=debug Nodes=n[1-{self.count}] Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        os.environ["SLURM_CONF"] = str(self.conf)  # every SLURM command from here on (sdiag) asks this cluster
        sh("slurmctld", "-f", str(self.conf))
        for node in self.nodes:
            (b / "spool" / node).mkdir(parents=True, exist_ok=True)
            sh("slurmd", "-f", str(self.conf), "-N", node)
        SlurmCluster.wait(lambda: len(sh("sinfo", "-h", "-N", "-t", "idle", "-o", "%N", check=False).split())
                          >= self.count, 60, f"{self.count} nodes idle")
        return self

    def ctld_pid(self) -> int:
        return int((self.base / "slurmctld.pid").read_text().strip())

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "--user=root"], capture_output=True, timeout=30)
        for pidfile in [*(self.base / f"slurmd-{n}.pid" for n in self.nodes), self.base / "slurmctld.pid"]:
            try:
                proc = psutil.Process(int(pidfile.read_text().strip()))
                proc.terminate()
                proc.wait(10)
            except (OSError, ValueError, psutil.Error):
                pass
        SlurmCluster.kill_stale("trainguard-fleet-")
