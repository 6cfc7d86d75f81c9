"""A real SLURM cluster of N nodes on this one machine: one slurmctld and N slurmd daemons (`slurmd -N NAME`, each on
its own port and spool dir; Debian's 22.05 build runs several on one host), so multi-node jobs really run across
nodes, one node can be drained while the others work, and one agent per node can watch "its" node.

Written from the recipe of the shared `slurm-multinode` tool (the suite must not need it at run time). It uses
ports of its own (16817 for slurmctld, 17001+ for the slurmd), off those of tests/slurm_cluster.py, so the one-node
fixture of the same session is not disturbed. All nodes share this host's /proc, /dev/kmsg and cgroups.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import psutil

from tests.slurm_cluster import JOB_USER, REPO, SlurmCluster, _ensure_munge, ensure_user

CTLD_PORT, SLURMD_PORT0 = 16817, 17000
MARK = "trainguard-multinode-"  # in every daemon's config path: how a stale cluster of an earlier run is found


class MultiNodeCluster:
    def __init__(self, base: Path, nodes: int, cred_expire: int = 120, sched_interval: int = 60) -> None:
        """`cred_expire`: SLURM's credential lifetime, which is also how long a requeued job waits before it may
        start again (120 s by default); `sched_interval`: the main scheduler's period (60 s; backfill's is half of
        it): a requeued job becomes eligible silently and starts at the next pass. A time-scaled benchmark scales
        both."""
        self.base = base
        self.cred_expire = cred_expire
        self.sched_interval = sched_interval
        self.nodes = [f"n{i}" for i in range(1, nodes + 1)]
        self.host = socket.gethostname().split(".")[0]
        self.conf = base / "slurm.conf"
        self.lib = base / "lib"  # the trainer helper and trainers, readable by the job user
        self.python = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else shutil.which("python3") or "python3"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *cmd: str, check: bool = True, timeout: float = 30, user: str | None = None) -> str:
        argv = ["runuser", "-u", user, "--", "env", f"SLURM_CONF={self.conf}", *cmd] if user else list(cmd)
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=self.env)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
        return proc.stdout

    # lifecycle ------------------------------------------------------------------------------
    @staticmethod
    def kill_stale() -> None:
        for p in psutil.process_iter(["name", "cmdline"]):
            cmd = " ".join(p.info.get("cmdline") or [])
            if MARK in cmd and any(d in cmd for d in ("slurmctld", "slurmd", "slurmstepd")):
                try:
                    p.kill()
                    p.wait(5)
                except psutil.Error:
                    pass

    def start(self, lib_files: dict[str, Path] | None = None) -> MultiNodeCluster:
        """`lib_files`: name under lib/ -> source file, copied for the job user (trainguard/trainer.py always is)."""
        self.kill_stale()
        ensure_user(JOB_USER)
        _ensure_munge()
        for sub in ("state", "log", "jobs", "lib/trainguard", *(f"spool/{n}" for n in self.nodes)):
            (self.base / sub).mkdir(parents=True, exist_ok=True)
        files = {"trainguard/__init__.py": REPO / "trainguard" / "__init__.py",
                 "trainguard/trainer.py": REPO / "trainguard" / "trainer.py", **(lib_files or {})}
        for name, src in files.items():
            (self.lib / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, self.lib / name)
        for path in [self.base, *self.base.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        (self.base / "jobs").chmod(0o1777)
        b = self.base
        cpus = os.cpu_count() or 2
        lines = [f"NodeName={n} NodeHostname={self.host} Port={SLURMD_PORT0 + i} CPUs={cpus} RealMemory=2000 "
                 "State=UNKNOWN" for i, n in enumerate(self.nodes, 1)]
        self.conf.write_text(f"""\
ClusterName=trainguard-multi
SlurmctldHost={self.host}
SlurmctldPort={CTLD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire={self.cred_expire}
StateSaveLocation={b}/state
SlurmdSpoolDir={b}/spool/%n
SlurmctldPidFile={b}/slurmctld.pid
SlurmdPidFile={b}/slurmd-%n.pid
SlurmctldLogFile={b}/log/slurmctld.log
SlurmdLogFile={b}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval={self.sched_interval},bf_interval={max(1, self.sched_interval // 2)}
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MinJobAge=600
MessageTimeout=5
KillWait=5
MpiDefault=none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
{chr(10).join(lines)}
PartitionName=debug Nodes=n[1-{len(self.nodes)}] Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
""")
        self.conf.chmod(0o644)
        self.run("slurmctld", "-f", str(self.conf))
        for n in self.nodes:
            self.run("slurmd", "-f", str(self.conf), "-N", n)
        self.wait(lambda: len(self.run("sinfo", "-h", "-N", "-t", "idle", "-o", "%N", check=False).split())
                  >= len(self.nodes), 60, f"{len(self.nodes)} idle nodes")
        return self

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "-u", JOB_USER], capture_output=True, timeout=10, env=self.env)
        time.sleep(1)
        for pidfile in [*(f"slurmd-{n}.pid" for n in self.nodes), "slurmctld.pid"]:
            path = self.base / pidfile
            try:
                proc = psutil.Process(int(path.read_text().strip()))
                proc.terminate()
                proc.wait(10)
            except (OSError, psutil.Error, ValueError):
                pass
        for p in psutil.process_iter(["name", "cmdline"]):
            if "slurmstepd" in (p.info.get("name") or "") and str(self.base) in " ".join(p.info.get("cmdline") or []):
                p.kill()

    # helpers ----------------------------------------------------------------------------------
    wait = staticmethod(SlurmCluster.wait)
    workdir = SlurmCluster.workdir  # a fresh directory under jobs/, owned by the job user

    def submit(self, command: str, *sbatch_args: str, workdir: Path, name: str, user: str = JOB_USER) -> str:
        script = workdir / f"job-{uuid.uuid4().hex[:6]}.sh"
        script.write_text(f"#!/bin/bash\n{command}\n")
        shutil.chown(script, user, user)
        out = self.run("sbatch", "--parsable", f"--chdir={workdir}", f"--output={workdir}/%x-%j.out",
                       f"--job-name={name}", *sbatch_args, str(script), user=user)
        return out.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        out = self.run("scontrol", "show", "job", "--oneliner", job_id, check=False)
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def node_states(self) -> dict[str, tuple[str, str]]:
        """node -> (state, reason)."""
        out = self.run("sinfo", "-h", "-N", "-o", "%N|%T|%E", check=False)
        states = {}
        for line in out.splitlines():
            name, _, rest = line.partition("|")
            state, _, reason = rest.partition("|")
            states[name] = (state, reason)
        return states

    def resume(self, node: str) -> None:
        self.run("scontrol", "update", f"nodename={node}", "state=resume", check=False)
