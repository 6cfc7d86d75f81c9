"""Goodput under chaos: a multi-node training job under a seeded fault schedule, with trainguard and without it.

A 4-node SLURM cluster on this machine (tests/multinode_cluster.py), a 3-rank data-parallel toy job
(benchmarks/goodput_trainer.py: the ranks wait for each other every step, rank 0 checkpoints every K steps, the job
is `--requeue`), and one trainguard agent per node with the installed config plus the settings and actions a site
binds. Seven fault kinds are drawn from a seed and injected at the same times into two runs:

- xid79: the XID 79 line NVIDIA's driver prints, written to the real /dev/kmsg with the bus id of that node's scripted
  GPU (tests/helpers/fake_nvml.py, one PCI domain per node); the rank there hangs in a CUDA call. This machine has one
  kernel for four nodes, so a relay hands each node's agent the kernel records naming its own GPUs (a FIFO as the
  agent's `kmsg_path`), as four kernels would.
- hang: one rank stops before the barrier.             - leak: one rank grows toward a memory cgroup limit.
- disk_full: the checkpoint tmpfs fills.               - stop_switch: the user touches the stop switch.
- time_limit: the job's TimeLimit is cut so that it approaches.   - nan: the loss turns NaN.

One more kind, not among the seven drawn by default (`--kinds slow`): slow, one rank's steps take 1.5x as long for the
rest of its attempt and its node's scripted GPU 0 reports a hardware slowdown at 1200 of 1980 MHz; the job_pace check
(windows scaled) names it, and with `--slow-policy restart_elsewhere` the node at fault restarts the job without
itself on the allocation's spare (docs/slow-jobs.md).

The fleet's faults (`--schedule fleet`, benchmarks/goodput_fleet.py): Llama 3 405B's interruptions in its proportions
and at its rate (one every 3.09 hours of the whole job, scaled; `--rate` a day), mapped to kinds injected here; besides
the above, hbm (XID 48 with uncorrected ECC errors and a pending row remap in the node's scripted NVML), sram (XID 95),
gsp (XID 119, the GPU lost to NVML) and ib_down (the node's HCA port DOWN in its copy of a recorded sysfs tree, the
rank's NCCL NET/IB error); each site fault once, hung_fs among them (also by `--kinds hung_fs`: the node's data mount, a
FUSE stand-in for its NFS mount `fsN:/export` that every rank reads each step, stops answering and 3 scaled minutes
later, as NFS over TCP at its defaults, the kernel says `nfs: server fsN not responding, still trying`: the rank there,
and any rank started there, blocks in D state; `--fs-stale-after` sets the hang check's `fs_stale_after`); a node
drained for a hardware fault or a dead mount is repaired and resumed `--repair-after` later, as a replacement: another
machine of the pool, a new agent with an empty state (`--repaired-same-node`: the same node, the operator clears what
its agent holds; the lemon scenario's node always is); a node the agents' lemon policy holds is sent back and, where
repaired nodes are replacements, a machine of the pool takes its place after the repair time (else it stays out).
`--scenario lemon`: n1's GPU fails every `--lemon-every` while the job runs there (until a machine of the pool takes
its place), and one more run with trainguard whose agents have no lemon rules (`--lemon-rules`: which of the two).
`--seeds 1,2,3`: each seed each way, a report of the mean and its spread and what each fault kind cost.
`--fault-free`: the agents' cost to the step and every alert they fire with no fault at all.

Without trainguard the job has what it has without it: the collective timeout (NCCL's 10-minute default, scaled), the
trainer's own signal and switch handling, SLURM's time-limit SIGTERM, and a human who looks every M minutes (and fixes
what they see: frees the disk, drains a node whose GPU is gone or whose kernel says its mount's server is not
responding, requeues the job). With trainguard the same human is
also paged: they act R minutes after an alert. Time is scaled by --scale (60: a real minute is a second here).

    python -m benchmarks.goodput [--seed 24] [--minutes 15] [--scale 60] [--look-every 30]   # one run each way; root
    python -m benchmarks.goodput --also-without 60,120   # and one more run without trainguard per human
    python -m benchmarks.goodput --schedule fleet --seeds 1,2,3,4,5 --minutes 30 --also-without 60,120,240
    python -m benchmarks.goodput --fault-free --seeds 1,2,3 --minutes 10
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import random
import re
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import tomli_w

from benchmarks import goodput_fleet as fleet
from benchmarks.common import heading, installed_config
from tests.conftest import AgentProcess, start_fuse
from tests.e2e.stack import log_time, parse_log_line
from tests.multinode_cluster import MultiNodeCluster
from tests.slurm_cluster import JOB_USER
from trainguard.agent.configfile import parse_config

REPO = Path(__file__).resolve().parent.parent
KINDS = ("xid79", "hang", "leak", "disk_full", "stop_switch", "time_limit", "nan")
# drawn only when named (or by `--schedule fleet`): the seven's seeded schedules stay as they were
EXTRA_KINDS = ("slow", "hbm", "sram", "gsp", "ib_down", "nic", "maintenance", "cuda_error", "hung_fs")
SLOW_FACTOR = 1.5
# The GPU faults: the XID line the driver prints (after "NVRM: Xid (PCI:<bus>): "; real lines, tests/test_xid.py and
# NVIDIA's XID catalog) and the NVML state of the GPU that goes with it (benchmarks/goodput_agent.py).
XID_FAULTS: dict[str, tuple[str, dict[str, Any]]] = {
    "xid79": ("79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.", {"lost": True}),
    "hbm": ("48, pid=77, name=python, DBE (double bit error).", {"ecc_volatile": 2, "remap": [0, 1, 1, 0]}),
    "sram": ("95, pid=9, name=python, Uncontained: FBHUB.", {"ecc_volatile": 1}),
    "lemon": ("79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.", {"lost": True}),  # LEMON_NODE's
    "gsp": ("119, pid=2024380, name=python, Timeout after 6s of waiting for RPC response from GPU0 GSP! Expected "
            "function 76 (GSP_RM_CONTROL) (0x20800a4c 0x4).", {"lost": True}),
}
# The check that answers each fault kind, and the action(s) that make the job come back.
CHECK_OF = {"hang": "hang", "leak": "job_memory", "disk_full": "disk", "stop_switch": "job_switch",
            "time_limit": "job_timelimit", "nan": "training_log", "cuda_error": "training_log", "slow": "job_pace",
            "ib_down": "infiniband", "hung_fs": "hang",
            "nic": "kernel", "maintenance": "node_drain",  # the drain before the reboot: the job saves and leaves
            **dict.fromkeys(XID_FAULTS, "xid")}
IB_TREE = REPO / "tests" / "data" / "infiniband" / "sys-class-infiniband-h100"  # a recorded H100 node's HCAs
IB_PORT = "mlx5_0/ports/1"  # the port a network fault takes down
# The HCA's firmware stops answering (tests/data/kernel/fixtures.toml's mlx5_health line, in the node's PCI domain).
NIC_LINE = "mlx5_core {domain}:5e:00.0: device's health compromised - reached miss count"
# Each node's data mount (a FUSE stand-in for its NFS mount, tests/helpers/hangfs.py) is `fsN:/export`: a hung one is
# named by the kernel's real lines (tests/data/kernel/fixtures.toml, nfs_not_responding and nfs_ok).
NFS_DOWN = "nfs: server {server} not responding, still trying"
NFS_OK = "nfs: server {server} OK"
# The kernel says `not responding` at the client's first major timeout, not when the server stops: NFS over TCP at its
# defaults (timeo=600, retrans=2; nfs(5)) retries for about 3 minutes first (SUSE KB 000020830: the line comes "after
# a process has stalled for approximately 3 minutes"). A server back sooner is never named.
NFS_MAJOR_TIMEOUT = 180.0
LEMON_RULES = {"both": (True, False), "installed": (True,), "none": (False,)}  # --lemon-rules: the agents' lemon rules
LEMON_NODE = "n1"  # `--scenario lemon`: the node whose GPU fails again and again, repaired in between
JOB_NAME = "goodput"
NODES, RANKS = 4, 3  # the job asks for 3-4 nodes: a spare inside its allocation while one is free
MiB = 2**20


@dataclass(frozen=True)
class Scale:
    """Real-world seconds to seconds here: every duration of the job, the agent and the humans goes through it."""

    factor: float = 60.0

    def __call__(self, real_seconds: float, floor: float = 0.5) -> float:
        return max(real_seconds / self.factor, floor)

    def dur(self, real_seconds: float, floor: float = 0.5) -> str:
        return seconds_text(self(real_seconds, floor))


def seconds_text(seconds: float) -> str:
    """A duration the agent's config reads, to the millisecond (at least 1 ms), never in exponent form (`:g` wrote
    `1e-05s`, and `1.23457e+06s` for 1234567)."""
    return f"{max(seconds, 0.001):.3f}".rstrip("0").rstrip(".") + "s"


@dataclass(frozen=True)
class Fault:
    at: float  # seconds after the job's submission
    kind: str
    target: int  # which rank (node of that rank) the fault hits


def schedule(seed: int, duration: float, kinds: tuple[str, ...] = KINDS) -> list[Fault]:
    """Each kind once, in a seeded order, spread over the run with seeded jitter; the first after a warm-up."""
    if not kinds:
        return []  # a fault-free run
    rng = random.Random(seed)
    order = list(kinds)
    rng.shuffle(order)
    start, end = 0.12 * duration, 0.9 * duration
    slot = (end - start) / len(order)
    return [Fault(round(start + i * slot + rng.uniform(0, 0.3) * slot, 1), kind, rng.randrange(RANKS))
            for i, kind in enumerate(order)]


def fleet_schedule(seed: int, duration: float, scale: Scale, per_day: float | None = None) -> list[Fault]:
    """`--schedule fleet`: the fleet's interruptions at Llama 3's rate (or `per_day` a real-world day), scaled, in
    its proportions, plus each site fault once (benchmarks/goodput_fleet.py has the mapping and its sources)."""
    mtbi = 24 / per_day if per_day else fleet.LLAMA3_MTBI_H
    return [Fault(at, kind, target) for at, kind, target in fleet.draw(seed, duration, scale.factor, RANKS, mtbi)]


def kept_apart(pending: list[Fault], injected: float, gap: float, end: float) -> list[Fault]:
    """The faults still due after one injected at `injected`, each at least `gap` after the one before it: a fault that
    waited for a running attempt pushes the later ones back, as the schedule kept them apart (the harness charges each
    alert to the fault before it: two faults a second apart on one node make one undetected); those pushed past `end`
    (the schedule's end) dropped, as the schedule drops them."""
    out: list[Fault] = []
    last = injected
    for f in pending:
        at = max(f.at, last + gap)
        if at <= end:
            out.append(f if at == f.at else replace(f, at=round(at, 1)))
            last = at
    return out


def bus_of(node: str) -> str:
    """The PCI address of node nN's scripted GPU, as the driver prints it: domain 00aN."""
    return f"00a{int(node[1:]):x}:18:00"


def xid_line(bus: str, kind: str = "xid79") -> str:
    return f"NVRM: Xid (PCI:{bus}): {XID_FAULTS[kind][0]}"


def server_of(node: str) -> str:
    """The server of node nN's data mount: fsN."""
    return f"fs{int(node[1:])}"


# what names a node in a kernel record: its GPU's or HCA's PCI domain (00aN), or its data mount's server (fsN)
_NODE_NAMED = re.compile(rb"(?:PCI:|mlx5_core )00a(?P<domain>[0-9a-f]):|nfs: server fs(?P<server>\d{1,4}) ")


def node_of_record(text: bytes) -> str | None:
    """The node whose kernel would have printed this record (its text after the `;`), None for no node's."""
    m = _NODE_NAMED.search(text)
    if m is None:
        return None
    return f"n{int(m['domain'], 16)}" if m["domain"] is not None else f"n{int(m['server'])}"


# the per-node kernel logs ------------------------------------------------------------------------------------------
class KmsgRelay:
    """Reads the real /dev/kmsg from its end and writes each record naming a node (`node_of_record`) to its FIFO, with
    that node's own sequence numbers (a node's agent sees a kernel log of its own, gap-free)."""

    def __init__(self, fifos: dict[str, Path]) -> None:
        self.fifos = fifos
        self.fds: dict[str, int] = {}
        self.seq = dict.fromkeys(fifos, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kmsg-relay", daemon=True)

    def __enter__(self) -> KmsgRelay:
        for node, path in self.fifos.items():
            os.mkfifo(path, 0o600)
            self.fds[node] = os.open(path, os.O_RDWR | os.O_NONBLOCK)  # a writer always there: readers' poll blocks
        self._kmsg = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
        os.lseek(self._kmsg, 0, os.SEEK_END)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        os.close(self._kmsg)
        for fd in self.fds.values():
            os.close(fd)

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._kmsg, select.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(200):
                continue
            while True:
                try:
                    raw = os.read(self._kmsg, 16384)
                except BlockingIOError:
                    break
                except BrokenPipeError:
                    continue
                head, sep, rest = raw.partition(b";")
                node = node_of_record(rest)
                if not sep or node not in self.fds:
                    continue
                fields = head.split(b",")
                self.seq[node] += 1
                fields[1] = str(self.seq[node]).encode()
                os.write(self.fds[node], b",".join(fields) + b";" + rest)


# the run -----------------------------------------------------------------------------------------------------------
@dataclass
class Record:
    """What one run saw, on one clock (seconds after the job's submission)."""

    trainguard: bool
    duration: float = 0.0
    faults: list[dict[str, Any]] = field(default_factory=list)  # Fault fields + node, detected, resumed, lost
    steps: list[tuple[float, int, bool]] = field(default_factory=list)  # (t, step, finite loss)
    checkpoints: list[tuple[float, int, bool]] = field(default_factory=list)
    attempts: list[tuple[float, int]] = field(default_factory=list)  # (t, first step)
    attempt_ids: list[str] = field(default_factory=list)  # job.requeues.step of each attempt, in order
    alerts: list[dict[str, Any]] = field(default_factory=list)  # fired events: t, node, check, subject, status
    actions: list[dict[str, Any]] = field(default_factory=list)  # agent audit lines and human actions: t, who, what
    drains: list[dict[str, Any]] = field(default_factory=list)  # t, node, reason, right
    paused: float = 0.0  # the user's own pause after the stop switch: not time the run could have trained
    stops: list[dict[str, Any]] = field(default_factory=list)  # how each attempt ended on each rank (the trainer's)
    ranks: list[tuple[float, str, str]] = field(default_factory=list)  # (t, attempt, node) of each rank's start
    lemon_replaced: float | None = None  # when a machine of the pool took the held lemon node's place


class Run:
    def __init__(self, base: Path, trainguard: bool, faults: list[Fault], duration: float, scale: Scale,
                 look_every: float, page_response: float, step_time: float, ckpt_every: int,
                 site: Site | None = None) -> None:
        self.base, self.trainguard, self.faults, self.duration, self.s = base, trainguard, faults, duration, scale
        self.look_every, self.page_response = look_every, page_response
        self.step_time, self.ckpt_every = step_time, ckpt_every
        self.site = site = site or Site()
        self.slow_policy = site.slow_policy
        self.rec = Record(trainguard)
        self.cluster = MultiNodeCluster(base / "cluster", NODES, cred_expire=max(5, round(scale(120))),
                                        sched_interval=max(1, round(scale(60))))
        self.agents: dict[str, AgentProcess] = {}
        self.t0 = 0.0
        self.job = ""
        # nodes whose hardware failed (a GPU, the HCA) or whose data mount hangs: the ones a drain is right for
        self.broken: set[str] = set()
        self.hung_fs: set[str] = set()  # nodes whose data mount hangs
        self.drained: set[str] = set()
        self.repair_after = site.repair_after
        self.repairs: dict[str, float] = {}  # node -> when its repair is done (run clock)
        # a replacement's resume waits for its new agent (node -> the run clock when it resumes even so)
        self.replacing: dict[str, float] = {}
        self.lives: dict[str, list[float]] = {}  # node -> when each agent after its first started (run clock)
        self.reboots: dict[str, float] = {}  # node -> when its host maintenance takes it down (run clock)
        # node -> when its kernel says its data mount's server is not responding (run clock; None once said)
        self.nfs_said: dict[str, float | None] = {}
        self.node_fail: tuple[float, str] | None = None  # when slurmctld requeues a job whose batch host went, its Restarts
        self.lemon_every, self.lemon_next = site.lemon_every, 0.12 * duration
        self.lemon_policy = site.lemon_policy
        self.ballast_stop: threading.Event | None = None
        self.paused_since: float | None = None
        self.restore_limit = False
        self.cgroups: list[Path] = []
        self.bound: dict[str, set[str]] = {}  # check -> the statuses whose alerts run actions

    def now(self) -> float:
        return time.time() - self.t0

    def hung_mark(self, node: str) -> Path:
        """While this file exists, the node's data mount hangs (tests/helpers/hangfs.py's control)."""
        return self.base / f"fs-hung-{node}"

    # setup ---------------------------------------------------------------------------------------------------------
    def start(self, stack: contextlib.ExitStack) -> None:
        self.cluster.base.mkdir(parents=True)
        self.cluster.start({"goodput_trainer.py": Path(__file__).with_name("goodput_trainer.py")})
        stack.callback(self.cluster.stop)
        self.workdir = self.cluster.workdir()
        self.run_dir, self.ckpt = self.workdir / "run", self.workdir / "ckpt"
        for d in (self.run_dir, self.run_dir / "faults", self.ckpt):
            d.mkdir()
            shutil.chown(d, JOB_USER, JOB_USER)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m,mode=0755", "tmpfs", str(self.ckpt)], check=True,
                       timeout=10)
        stack.callback(lambda: subprocess.run(["umount", "-l", str(self.ckpt)], check=False, timeout=10))
        shutil.chown(self.ckpt, JOB_USER, JOB_USER)
        self.fifos = fifos = {n: self.base / f"kmsg-{n}" for n in self.cluster.nodes}
        for node in self.cluster.nodes:
            shutil.copytree(IB_TREE, self.base / f"ib-{node}", symlinks=True)
            data_mount(stack, self.base / f"data-{node}", server_of(node), self.hung_mark(node))
        stack.enter_context(KmsgRelay(fifos))
        if self.trainguard:
            for node in self.cluster.nodes:
                self.agents[node] = self.start_agent(node, fifos[node])
            stack.callback(self.stop_agents)
            for agent in self.agents.values():
                agent.wait_for("msg=ready", timeout=60)
        stack.callback(self.cleanup_cgroups)
        lib = self.cluster.lib
        # The ranks run under the trainer helper's relaunch loop (in both runs: without trainguard nobody asks it for
        # a restart, and it only runs srun once).
        command = (f"exec {self.cluster.python} {lib}/trainguard/trainer.py relaunch --max-restarts 20 -- "
                   f"srun -N {RANKS} --kill-on-bad-exit=1 --ntasks-per-node=1 {self.cluster.python} "
                   f"{lib}/goodput_trainer.py "
                   f"--run-dir {self.run_dir} --ckpt-dir {self.ckpt} --step-time {self.step_time} "
                   f"--ckpt-every {self.ckpt_every} --collective-timeout {self.s(600)} "
                   f"--data {self.base}/data-{{node}}/data")
        self.t0 = time.time()
        # -N 3-4: the scheduler gives the job the fourth node while it is free, as a spare its ranks do not use (a
        # node lost is then left in place: `restart` with leave_node); after a drain and a requeue it starts on 3.
        self.job = self.cluster.submit(command, "-N", f"{RANKS}-{NODES}", "--requeue", workdir=self.workdir,
                                       name=JOB_NAME)
        self.out = self.run_dir / "progress.log"  # rank 0's steps and checkpoints across attempts

    def agent_config(self, node: str, fifo: Path) -> Path:
        """The installed config, with this node's name, the checkpoint file system among the disks, each check's
        durations scaled, and the actions a site binds so that the job comes back by itself."""
        s = self.s
        raw = installed_config()
        raw["agent"] = {"node_name": node, "state_dir": str(self.base / f"state-{node}"), "listen": ""}
        # One fault seen by several checks counts once for the lemon rules: within 10 (scaled) minutes.
        raw["ledger"] = {"same_fault_within": s.dur(600), **({} if self.lemon_policy else {"rules": {}})}
        raw["jobs"] = {"sources": ["slurm"], "slurm_node": node, "refresh": "1s", "slurm_timeout": "10s",
                       "slurm_refetch_min": s.dur(60)}
        fast = {"interval": "1s", "jitter": "0s"}
        c = raw["checks"]
        c["disk"].update(fast, paths=["/", str(self.ckpt)], forecast_min_span=s.dur(300, 3),
                         forecast_horizon=s.dur(6 * 3600))
        # A lost GPU: the node drained and the job restarted without it, on its allocation's spare (a requeue when
        # it has none). Faults that leave every node usable restart the ranks in place; the time limit needs a
        # requeue.
        c["xid"].update(kmsg_path=str(fifo), actions={"critical": ["drain", "restart_elsewhere"]})
        # The kernel events read the same node's kernel log: the real /dev/kmsg is the host's, where every node's
        # XID is written (a lost GPU of n1 would be a node fault of all four), and other tests' records are.
        c.setdefault("kernel", {}).update(kmsg_path=str(fifo), actions={"critical": ["drain", "restart_elsewhere"]})
        # The node's HCAs: its own copy of a recorded H100 node's sysfs tree, whose port a network fault takes down.
        # A bad link: the node drained, the job restarted without it, as for a lost GPU.
        c.setdefault("infiniband", {}).update(fast, sysfs_root=str(self.base / f"ib-{node}"),
                                              actions={"critical": ["drain", "restart_elsewhere"]})
        # The GPU read bad through NVML (lost, uncorrected ECC errors) after an XID: the XID's actions restart the job;
        # these checks only drain (their default requeue would race the restart without the node).
        # Their period scaled like the rest (the installed 30 s would be 30 minutes here): one fault seen by `xid` and by
        # `gpu` must come within the ledger's same_fault_within (10 scaled minutes), as it does at the real scale,
        # or the lemon rules count it twice and hold a node after one fault.
        for name in ("gpu", "nvlink", "fabric"):
            c.setdefault(name, {}).update(fast, actions={"critical": ["drain"]})
        # The hang check names a hang's cause from this node's kernel log: its own FIFO, not the host's /dev/kmsg.
        c["hang"].update(fast, stale_after=s.dur(300, 2), kmsg_path=str(fifo), actions={"critical": ["restart"]})
        # A hang whose ranks wait on a file system that does not answer (hung_fs): a restart in place would block at
        # the same read; the node drained, the job restarted without it, as for a lost GPU.
        c["hang"]["fs_actions"] = {"critical": ["drain", "restart_elsewhere"]}
        if self.site.fs_stale_after is not None:  # sooner, on the kernel's word about that file system
            c["hang"]["fs_stale_after"] = seconds_text(self.site.fs_stale_after)
        c["job_memory"].update(interval="0.5s", jitter="0s", window=20, min_span=s.dur(300, 3),
                               crit_horizon=s.dur(1200), warn_horizon=s.dur(7200), actions={"critical": ["restart"]})
        c["job_timelimit"].update(fast, margin=s.dur(600, 3), recheck=s.dur(300, 2),
                                  actions={"warning": ["signal", "requeue"]})
        c["job_switch"].update(fast)
        # A node drained for its maintenance: the job saves and restarts without it before the reboot, as for a lost
        # GPU (but its rank can still save). Asked every scaled minute, the installed period.
        # On its batch host the loop goes down with the node: the job saves and is requeued onto the others.
        c["node_drain"].update(interval=s.dur(60), jitter="0s", actions={"critical": ["restart_elsewhere"]},
                               batch_host_actions={"critical": ["signal", "requeue"]})
        c["training_log"].update(fast, actions={"critical": ["restart"]})
        # A step here is 0.5 s, 30 s of real time: the recent window holds 20 steps, as 2 minutes of 6-second steps.
        c["job_pace"].update(fast, window=s.dur(600), slow_for=s.dur(600), warmup_steps=5, baseline_steps=20,
                             critical_when_pinned=True,
                             actions={"critical": ["restart_elsewhere"]} if self.slow_policy == "restart_elsewhere"
                             else {})
        # Two of the four nodes may be drained at once (the installed 10% is none here): with the fleet's faults and
        # the site's repair time, a second node fails while the first is out.
        raw["actions"] = {"drain": {"type": "drain", "max_drained": "2"},
                          "requeue": {"type": "requeue", "wait_exit": s.dur(300, 2), "after_save": s.dur(30),
                                      "timeout": s.dur(330, 4)},
                          "restart": {"type": "restart", "wait_exit": s.dur(300, 2), "after_save": s.dur(30),
                                      "timeout": s.dur(330, 4)},
                          "restart_elsewhere": {"type": "restart", "leave_node": True, "wait_exit": s.dur(300, 2),
                                                "after_save": s.dur(30), "timeout": s.dur(330, 4)}}
        path = self.base / f"trainguard-{node}.toml"
        path.write_text(tomli_w.dumps(raw))
        # which alerts (check, status) have actions bound: a paged human waits for their outcome
        self.bound = {name: {st for st in ("WARNING", "CRITICAL") if getattr(c.actions, st.lower())}
                      for name, c in parse_config(raw, str(path)).checks.items()}
        return path

    def start_agent(self, node: str, fifo: Path) -> AgentProcess:
        env = {"SLURM_CONF": str(self.cluster.conf), "TRAINGUARD_FAKE_GPUS": "1", "TRAINGUARD_FAKE_GPU_HEALTHY": "1",
               "TRAINGUARD_FAKE_GPU_DOMAIN": f"00a{int(node[1:]):x}", "PYTHONPATH": str(REPO)}
        env["TRAINGUARD_FAKE_GPU_SLOW"] = str(self.run_dir / "faults" / f"slow-{node}")
        env["TRAINGUARD_FAKE_GPU_STATE"] = str(self.base / f"gpu-state-{node}.json")
        return AgentProcess(self.agent_config(node, fifo), self.base / f"agent-{node}.log", env,
                            module="benchmarks.goodput_agent").start()

    def stop_agents(self) -> None:
        for agent in self.agents.values():
            agent.stop()

    def cleanup_cgroups(self) -> None:
        for path in self.cgroups:
            with contextlib.suppress(OSError):
                for pid in (path / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), 9)
            for _ in range(50):
                try:
                    path.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)

    # the run -------------------------------------------------------------------------------------------------------
    def run(self) -> Record:
        pending = sorted(self.faults, key=lambda f: f.at)
        next_look = self.look_every
        # (when the paged human acts, the check that alerted, when it alerted, its status)
        pages: list[tuple[float, str, float, str]] = []
        seen_alerts = 0
        restarts = "0"
        while self.now() < self.duration:
            t = self.now()
            info = self.cluster.job(self.job)
            # A fault due while the job is down waits for the next attempt to run: every fault hits a running job.
            while pending and pending[0].at <= t and self.running_attempt(info, pending[0]):
                self.inject(pending.pop(0))
                if self.site.fault_gap:
                    pending = kept_apart(pending, self.now(), self.site.fault_gap, 0.92 * self.duration)
            # the lemon's GPU fails again while it runs the job (not once a machine of the pool has taken its place)
            if self.lemon_every and self.rec.lemon_replaced is None and t >= self.lemon_next \
                    and self.running_attempt(info, Fault(t, "lemon", 0)):
                self.inject(Fault(round(t, 1), "lemon", 0))  # its GPU fails again `lemon_every` after it last did
                self.lemon_next = t + self.lemon_every
            if info.get("Restarts", "0") != restarts:
                restarts = info.get("Restarts", "0")
                if self.restore_limit:  # the user's next submission has the usual limit
                    self.cluster.run("scontrol", "update", f"jobid={self.job}", "TimeLimit=UNLIMITED", check=False)
                    self.restore_limit = False
            self.watch_drains(t)
            acted: list[tuple[float, str]] = []
            if self.trainguard:
                alerts = self.fired()
                pages += [(a["t"] + self.page_response, a["check"], a["t"], a["status"]) for a in alerts[seen_alerts:]]
                seen_alerts = len(alerts)
                acted = self.agent_actions()
            if self.paused_since is not None and t - self.paused_since >= self.s(600):
                self.user_resumes(t)
            # A paged human reads the alert with what trainguard did about it: while the actions bound to it are still
            # running they wait for their outcome, then judge the job's progress since (not the stale log before).
            ready = [p for p in pages if p[0] <= t and not self.awaiting(p, acted, t)]
            due = {p[1] for p in ready}
            if t >= next_look or due:
                since = max((at for at, check in acted if check in due), default=0.0)
                why = ("look+page" if due else "look") if t >= next_look else "page"  # a page alone never counts as a look
                self.human(t, why, due, since)
                pages = [p for p in pages if p not in ready]
                if t >= next_look:
                    next_look += self.look_every
            time.sleep(0.25)
        self.rec.duration = self.now()
        if self.paused_since is not None:
            self.rec.paused += self.rec.duration - self.paused_since
        if self.ballast_stop:
            self.ballast_stop.set()
        return self.rec

    def running_attempt(self, info: dict[str, str], f: Fault) -> bool:
        attempt, nodes = self.attempt_nodes()
        if info.get("JobState") != "RUNNING" or not attempt.startswith(f"{self.job}.{info.get('Restarts', '0')}.") \
                or not nodes:
            return False
        node = LEMON_NODE if f.kind == "lemon" else nodes[f.target % len(nodes)]
        return (self.run_dir / "pids" / f"{attempt}.{node}").exists()

    def attempt_nodes(self) -> tuple[str, list[str]]:
        """The current attempt and the nodes its ranks run on (the allocation's spare, if any, runs none), once every
        rank has started."""
        attempt = (self.run_dir / "attempt").read_text().strip() if (self.run_dir / "attempt").exists() else ""
        nodes = sorted(p.name[len(attempt) + 1:] for p in (self.run_dir / "pids").glob(f"{attempt}.*")) if attempt \
            else []
        return attempt, nodes if len(nodes) == RANKS else []

    def inject(self, f: Fault) -> None:
        attempt, nodes = self.attempt_nodes()
        node = LEMON_NODE if f.kind == "lemon" else nodes[f.target % len(nodes)] if nodes else ""
        row = {**asdict(f), "node": node, "injected": self.now()}
        faults = self.run_dir / "faults"
        if f.kind in XID_FAULTS and node:
            self.broken.add(node)
            (self.base / f"gpu-state-{node}.json").write_text(json.dumps(XID_FAULTS[f.kind][1]))
            write_as_user(faults / f"gpu-lost-{node}", "lost")
            write_kmsg(4, xid_line(bus_of(node), f.kind))
        elif f.kind == "ib_down" and node:
            self.broken.add(node)
            port = self.base / f"ib-{node}" / IB_PORT
            (port / "state").write_text("1: DOWN\n")
            (port / "phys_state").write_text("3: Disabled\n")
            write_as_user(faults / f"ib-down-{node}", "down")
        elif f.kind == "maintenance" and node:
            # The host's maintenance drains the node, then reboots it a short notice later (5 scaled minutes): its rank
            # dies with it. It comes back after its repair time, as a repaired node.
            self.broken.add(node)
            self.cluster.run("scontrol", "update", f"nodename={node}", "state=drain", "reason=maintenance: host reboot",
                             check=False)
            self.reboots[node] = self.now() + self.s(300)
        elif f.kind == "nic" and node:
            self.broken.add(node)
            write_as_user(faults / f"ib-down-{node}", "down")  # its connections are lost: NCCL fails as on a port down
            write_kmsg(3, NIC_LINE.format(domain=bus_of(node)[:4]))
        elif f.kind == "hung_fs" and node:
            # Its data mount stops answering: the rank there blocks at its next read (D state), as any rank started
            # there will; the node's kernel names the server (KERN_NOTICE, as sunrpc prints it).
            self.broken.add(node)
            self.hung_fs.add(node)
            self.hung_mark(node).touch()
            self.nfs_said[node] = self.now() + self.s(NFS_MAJOR_TIMEOUT)  # watch_drains writes it then
        elif f.kind == "hang":
            write_as_user(faults / "hang", f"{attempt} {f.target}")
        elif f.kind == "leak" and node:
            row.update(self.leak(attempt, node))
        elif f.kind == "disk_full":
            self.ballast_stop = threading.Event()
            row["full_in"] = self.s(3600)
            threading.Thread(target=fill, args=(self.ckpt / "ballast", self.s(3600), self.ballast_stop),
                             daemon=True).start()
        elif f.kind == "stop_switch":
            (self.workdir / ".trainguard").mkdir(exist_ok=True)
            shutil.chown(self.workdir / ".trainguard", JOB_USER, JOB_USER)
            write_as_user(self.workdir / ".trainguard" / "stop", "")
            self.paused_since = self.now()
        elif f.kind == "time_limit":
            start = self.cluster.job(self.job).get("RunTime", "0:0")
            elapsed = sum(int(x) * 60**i for i, x in enumerate(reversed(re.split("[:-]", start)[-3:])))
            minutes = math.ceil((elapsed + 2 * self.s(600, 3)) / 60)
            self.cluster.run("scontrol", "update", f"jobid={self.job}", f"TimeLimit={minutes}", check=False)
            row["limit_at"] = self.now() + minutes * 60 - elapsed
            self.restore_limit = True
        elif f.kind == "nan":
            write_as_user(faults / "nan", attempt)
        elif f.kind == "cuda_error":
            write_as_user(faults / "crash", f"{attempt} {f.target}")
        elif f.kind == "slow" and node:
            write_as_user(faults / f"slow-{node}", f"{attempt} {SLOW_FACTOR}")
        self.rec.faults.append(row)
        self.rec.actions.append({"t": self.now(), "who": "fault", "what": f"{f.kind} {node}".strip()})

    def leak(self, attempt: str, node: str) -> dict[str, Any]:
        """The rank on `node` moved into a memory cgroup and told to grow toward its limit; what the fault's row notes."""
        pid = int((self.run_dir / "pids" / f"{attempt}.{node}").read_text())
        headroom = 160 * MiB  # the cgroup is charged only what the rank allocates from now on
        self.cgroups.append(cg := memory_cgroup(headroom))
        per_step = headroom / MiB / (self.s(40 * 60) / self.step_time)  # the limit ~40 (real) minutes away
        row: dict[str, Any] = {"oom_in": self.s(40 * 60)}
        try:
            (cg / "cgroup.procs").write_text(str(pid))
            write_as_user(self.run_dir / "faults" / "leak", f"{attempt} {node} {per_step:.3f}")
        except ProcessLookupError:  # the rank ended in between (its attempt was stopping): this leak never began
            row["missed"] = "the rank had exited"
        return row

    def user_resumes(self, t: float) -> None:
        (self.workdir / ".trainguard" / "stop").unlink(missing_ok=True)
        self.cluster.run("scontrol", "requeue", self.job, check=False)
        self.rec.paused += t - (self.paused_since or t)
        self.paused_since = None
        self.rec.actions.append({"t": t, "who": "user", "what": "stop switch removed, job requeued"})

    def awaiting(self, page: tuple[float, str, float, str], acted: list[tuple[float, str]], t: float) -> bool:
        """Whether the actions bound to this alert (its check, its status) are still running: no outcome of that
        check's since the alert, and the action's timeout not over."""
        _, check, alerted, status = page
        if status not in self.bound.get(check, ()):
            return False
        return not any(c == check and at >= alerted for at, c in acted) and t < alerted + self.s(330, 4) + 1.0

    def agent_actions(self) -> list[tuple[float, str]]:
        """(time on the run's clock, check) of every action outcome the agents logged."""
        out = []
        for agent in self.agents.values():
            for f in map(parse_log_line, agent.output().splitlines()):
                if f.get("msg") == "action":
                    out.append((log_time(f["ts"]) - self.t0, f.get("check", "")))
        return out

    def human(self, t: float, why: str, alerted: set[str], since: float = 0.0) -> None:
        """What an operator does who looks at the job (and, paged, at what the alert names): the same rules in both
        runs, only when they look differs. `since`: when trainguard last acted on what the page names (run clock):
        progress is judged from then."""
        if self.paused_since is not None:
            return  # the user stopped it on purpose
        did = []
        info = self.cluster.job(self.job)
        state = info.get("JobState", "")
        last = self.steps()[-1] if self.steps() else None
        attempt_file = self.run_dir / "attempt"
        started = attempt_file.stat().st_mtime if attempt_file.exists() else self.t0
        stale = time.time() - max(last[0] if last else 0.0, started, self.t0 + since) > self.s(600)
        nan = last is not None and not last[2]
        broken = state not in ("RUNNING", "PENDING", "REQUEUED", "CONFIGURING", "COMPLETING") or \
            (state == "RUNNING" and (stale or nan))
        if (self.ckpt / "ballast").exists() and ("disk" in alerted or broken):  # an alert, or the crash, says ENOSPC
            if self.ballast_stop:
                self.ballast_stop.set()
            (self.ckpt / "ballast").unlink(missing_ok=True)
            did.append("freed the checkpoint file system")
        if broken:
            # the log says which node's CUDA call or NCCL transport failed; of a rank hung in a read, that node's
            # kernel log says its data mount's server is not responding
            for node in sorted(self.broken):
                if "DRAIN" not in self.cluster.node_states().get(node, ("", ""))[0].upper():
                    reason = (f"operator: dead mount {server_of(node)}:/export (server not responding)"
                              if node in self.hung_fs else "operator: hardware fault")
                    self.cluster.run("scontrol", "update", f"nodename={node}", "state=drain", f"reason={reason}",
                                     check=False)
                    did.append(f"drained {node}")
            self.cluster.run("scontrol", "requeue", self.job, check=False)
            did.append(f"requeued the job ({state.lower()}{', stale log' if stale else ''}{', NaN loss' if nan else ''})")
        if did:
            self.rec.actions.append({"t": t, "who": f"human ({why})", "what": "; ".join(did)})

    def watch_drains(self, t: float) -> None:
        """Records each drain (a node drained again after a repair is a new one); with a repair time, the site's
        repair of a node whose hardware failed is due that long after its drain."""
        for node, (state, reason) in self.cluster.node_states().items():
            if "drain" not in state.lower():
                self.drained.discard(node)
            elif node not in self.drained:
                self.drained.add(node)
                self.rec.drains.append({"t": t, "node": node, "reason": reason, "right": node in self.broken})
                if self.repair_after is not None and node in self.broken:
                    self.repairs.setdefault(node, t + self.repair_after)
        for node, due in list(self.reboots.items()):
            if t >= due:
                del self.reboots[node]
                self.reboot(node, t)
        for node, due in list(self.nfs_said.items()):
            if due is not None and t >= due:  # the node's kernel names its data mount's server (KERN_NOTICE, as sunrpc)
                self.nfs_said[node] = None
                write_kmsg(5, NFS_DOWN.format(server=server_of(node)))
        self.requeue_after_node_fail(t)
        for node, due in list(self.repairs.items()):
            if t >= due:
                del self.repairs[node]
                self.repair(node, t)
        for node, latest in list(self.replacing.items()):
            # as the fleet's pool does, the replacement joins once its agent watches it (or, said, when it never does)
            ready = self.agents[node].output().count("msg=ready") > len(self.lives[node])
            if ready or t >= latest:
                del self.replacing[node]
                self.resume(node, "as a replacement, fresh agent state" + ("" if ready else "; its agent not ready"))

    def reboot(self, node: str, t: float) -> None:
        """The host's maintenance takes the node down: every process of the job there dies (SIGKILL)."""
        attempt, _ = self.attempt_nodes()
        path = self.run_dir / "pids" / f"{attempt}.{node}"
        with contextlib.suppress(ValueError, OSError):
            pid = int(path.read_text())
            # this attempt's rank, and still it (a pid is reused once its process is gone)
            if b"goodput_trainer.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, 9)
        self.rec.actions.append({"t": t, "who": "site", "what": f"{node} rebooted for maintenance"})
        info = self.cluster.job(self.job)
        if info.get("BatchHost") == node and info.get("JobState") == "RUNNING":
            # The batch script (the relaunch loop in it) goes down with its host, and the job with it. slurmctld finds
            # the node gone after its SlurmdTimeout (5 minutes) and requeues the job (NODE_FAIL, --requeue).
            self.cluster.run("scancel", "--batch", "--signal=KILL", self.job, check=False)
            self.node_fail = (t + self.s(300), info.get("Restarts", "0"))
            self.rec.actions.append({"t": t, "who": "site", "what": f"the job's batch script went down with {node}"})

    def requeue_after_node_fail(self, t: float) -> None:
        """slurmctld's answer to a batch host gone: the job requeued, unless someone requeued it meanwhile."""
        if self.node_fail is None or t < self.node_fail[0]:
            return
        _, restarts = self.node_fail
        self.node_fail = None
        if self.cluster.job(self.job).get("Restarts", "0") == restarts:
            self.cluster.run("scontrol", "requeue", self.job, check=False)
            self.rec.actions.append({"t": t, "who": "site", "what": "slurmctld requeued the job (NODE_FAIL)"})

    def repair(self, node: str, t: float) -> None:
        """The site's repair of a drained node (a reset, a reboot, a reseated cable, the NFS server back): its GPU, port
        and data mount read healthy again (`heal`), its ranks run again, and it is resumed in SLURM. As a replacement
        (`replaced_on_repair`): another machine of the pool, whose new agent starts with an empty state and holds
        nothing; else the same one, whose agent keeps its history: the operator clears what it holds (`trainguard
        clear`). A node its agent's lemon policy holds is not put back: the operator reads the reason and sends the
        machine back, and where repaired nodes are replacements a machine of the pool takes its place, as in a fleet
        (the lemon scenario's node too: its GPU fails no more); else it stays out."""
        born = self.lives.get(node, [-math.inf])[-1]  # its current agent's holds (a replaced one's went with it)
        held = self.trainguard and any(a["node"] == node and a["check"] == "lemon" and a["t"] >= born
                                       for a in self.fired())
        if held and not (self.site.replace_repaired and node in self.agents):
            self.rec.actions.append({"t": t, "who": "site", "what": f"{node} held by the lemon policy: not resumed"})
            return
        if held:
            self.rec.actions.append({"t": t, "who": "site", "what": f"{node} held by the lemon policy: sent back, "
                                     "a machine of the pool in its place"})
            if node == LEMON_NODE and self.lemon_every and self.rec.lemon_replaced is None:
                self.rec.lemon_replaced = t
        # the machine in the held lemon's place is one of the pool's like the others
        fresh = replaced_on_repair(node, self.site) or (node == LEMON_NODE and self.rec.lemon_replaced is not None)
        if node in self.agents and (held or fresh):
            self.retire_agent(node, t)  # before the repair: the old machine's agent sees none of it
            self.heal(node)
            # after it: the new agent's first round must not read the old machine's lost GPU
            self.agents[node] = self.start_agent(node, self.fifos[node])
            self.replacing[node] = t + 60.0  # watch_drains resumes it once its agent is ready
            return
        self.heal(node)
        if node in self.agents:
            self.clear_holds(node)
        self.resume(node, "the same node" if node in self.agents else "")

    def heal(self, node: str) -> None:
        """The node's GPU, HCA port and data mount healthy again (the kernel says its mount's server is OK)."""
        (self.base / f"gpu-state-{node}.json").unlink(missing_ok=True)
        for name in (f"gpu-lost-{node}", f"ib-down-{node}"):
            (self.run_dir / "faults" / name).unlink(missing_ok=True)
        for name in ("state", "phys_state"):
            shutil.copy(IB_TREE / IB_PORT / name, self.base / f"ib-{node}" / IB_PORT / name)
        if node in self.hung_fs:
            self.hung_fs.discard(node)
            self.hung_mark(node).unlink(missing_ok=True)  # the reads blocked on it return
            if node in self.nfs_said and self.nfs_said.pop(node) is None:  # an OK only after a `not responding`
                write_kmsg(5, NFS_OK.format(server=server_of(node)))
        self.broken.discard(node)

    def clear_holds(self, node: str) -> None:
        """What the node's agent holds of the hardware checks' (their CRITICAL incidents), cleared by the operator."""
        cleared = {(a["check"], a["subject"]) for a in self.fired() if a["node"] == node
                   and a["check"] in ("xid", "infiniband", "gpu", "kernel") and a["status"] == "CRITICAL"}
        for check, subject in sorted(cleared):
            proc = subprocess.run([sys.executable, "-m", "trainguard", "clear", "--config",
                                   str(self.agents[node].config), f"{check}/{subject}", "--reason", "repaired"],
                                  capture_output=True, text=True, timeout=60, check=False,
                                  env={**os.environ, "PYTHONPATH": str(REPO)})
            self.rec.actions.append({"t": self.now(), "who": "site", "what": f"trainguard clear {check}/{subject}: "
                                     f"{(proc.stdout or proc.stderr).strip()[:200]}"})

    def resume(self, node: str, how: str) -> None:
        self.cluster.run("scontrol", "update", f"nodename={node}", "state=resume", check=False)
        self.rec.actions.append({"t": self.now(), "who": "site",
                                 "what": f"repaired {node}{f' ({how})' if how else ''}, resumed"})

    def retire_agent(self, node: str, t: float) -> None:
        """The node's agent stopped as its machine leaves, its state dir kept beside it for the record (`state-nN.K`,
        K its life). The new one (`start_agent`: the same config, an empty state dir) logs to the same file: every
        reader of `agent-nN.log` (fired, agent_actions, collect) counts each life's alerts and actions, on one clock
        (the log's timestamps); when each life after the first began is `lives`."""
        self.agents[node].stop()
        # a line cut by the kill must not swallow the next life's first one
        with contextlib.suppress(FileNotFoundError), self.agents[node].log.open("rb+") as log:
            if log.seek(0, os.SEEK_END):
                log.seek(-1, os.SEEK_END)
                if log.read(1) != b"\n":
                    log.write(b"\n")
        # The scripted GPU keeps its serial (derived from the node's PCI domain, tests/helpers/fake_gpu_agent.py): it
        # is recorded only in the agent's state (the ledger counts faults by serial there), and nothing else keyed by
        # it is shared between the lives, so the empty state dir is a new machine to the lemon rules.
        lives = self.lives.setdefault(node, [])
        state = self.base / f"state-{node}"
        if state.exists():
            state.rename(self.base / f"state-{node}.{len(lives) + 1}")
        lives.append(t)
        self.rec.actions.append({"t": self.now(), "who": "site", "what": f"{node} replaced: a new agent, an empty "
                                 f"state (the old one kept as state-{node}.{len(lives)})"})

    # what happened -------------------------------------------------------------------------------------------------
    def steps(self) -> list[tuple[float, int, bool]]:
        """(unix time, step, finite loss) of every step rank 0 logged, across attempts."""
        text = self.out.read_text(errors="replace") if self.out.exists() else ""
        return [(float(m.group(3)), int(m.group(1)), m.group(2) not in ("nan", "inf"))
                for m in re.finditer(r"^step (\d+) loss=(\S+) t=(\S+)$", text, re.M)]

    def stops(self) -> list[dict[str, Any]]:
        """What each rank recorded when its attempt ended (RUN_DIR/stops.jsonl), on the run's clock. A rank killed
        (SIGKILL: a requeue's, the OOM killer) or stuck records nothing."""
        path = self.run_dir / "stops.jsonl"
        out = []
        for line in (path.read_text(errors="replace").splitlines() if path.exists() else ()):
            try:
                stop = json.loads(line)
                out.append({**stop, "t": round(float(stop["t"]) - self.t0, 2)})
            except (ValueError, KeyError, TypeError):
                continue
        return sorted(out, key=lambda s: s["t"])

    def fired(self) -> list[dict[str, Any]]:
        alerts = []
        for node, agent in self.agents.items():
            for line in agent.output().splitlines():
                f = parse_log_line(line)
                if f.get("msg") == "incident event" and f.get("event") in ("fired", "escalated"):
                    alerts.append({"t": log_time(f["ts"]) - self.t0, "node": node, "check": f.get("check", ""),
                                   "subject": f.get("subject", ""), "status": f.get("status", ""),
                                   "event": f.get("event", "")})
        return sorted(alerts, key=lambda a: a["t"])

    def collect(self) -> Record:
        text = self.out.read_text(errors="replace") if self.out.exists() else ""
        self.rec.steps = [(t - self.t0, s, ok) for t, s, ok in self.steps()]
        self.rec.checkpoints = []
        for m in re.finditer(r"^checkpoint saved step=(\d+) loss=(\S+) t=(\S+)$", text, re.M):
            self.rec.checkpoints.append((float(m.group(3)) - self.t0, int(m.group(1)), m.group(2) not in ("nan", "inf")))
        starts = list(re.finditer(r"^start attempt=(\S+) step=(\d+) t=(\S+)$", text, re.M))
        self.rec.attempts = [(float(m.group(3)) - self.t0, int(m.group(2))) for m in starts]
        self.rec.attempt_ids = [m.group(1) for m in starts]
        self.rec.stops = self.stops()
        pids = sorted((p.stat().st_mtime - self.t0, *p.name.rsplit(".", 1)) for p in (self.run_dir / "pids").glob("*.n*"))
        self.rec.ranks = [(round(t, 2), attempt, node) for t, attempt, node in pids]
        if self.trainguard:
            self.rec.alerts = self.fired()
            for node, agent in self.agents.items():
                for f in map(parse_log_line, agent.output().splitlines()):
                    if f.get("msg") == "action":
                        self.rec.actions.append({"t": log_time(f["ts"]) - self.t0, "who": f"agent {node}",
                                                 "what": f"{f.get('action')} {f.get('outcome')} ({f.get('check')})"})
        self.rec.actions.sort(key=lambda a: a["t"])
        return self.rec


def write_kmsg(level: int, text: str) -> None:
    """A record of the real kernel log (the relay hands it to the node it names)."""
    with open("/dev/kmsg", "w") as kmsg:
        kmsg.write(f"<{level}>{text}\n")


def data_mount(stack: contextlib.ExitStack, mnt: Path, server: str, hung: Path) -> None:
    """A node's data mount on `mnt`: a FUSE stand-in for its NFS mount (`server:/export` in the mount table) whose
    reads answer, and block while `hung` exists (tests/helpers/hangfs.py); unmounted when `stack` closes."""
    proc = start_fuse(mnt, "hangfs.py", str(mnt.with_name(f"{mnt.name}.statfs")), f"{server}:/export", str(hung))

    def unmount() -> None:
        hung.unlink(missing_ok=True)  # first: what blocks on it returns (the unmount's own calls would block too)
        subprocess.run(["umount", "-l", str(mnt)], check=False, timeout=10)
        proc.kill()
        proc.wait(timeout=10)
    stack.callback(unmount)


def write_as_user(path: Path, text: str) -> None:
    """Written as the job's user: the trainer helper only trusts switch files of its own user or root."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:6]}")
    tmp.write_text(text)
    shutil.chown(tmp, JOB_USER, JOB_USER)
    tmp.replace(path)


def memory_cgroup(limit: int) -> Path:
    """A memory-limited cgroup, v2 where the node has it, else v1 (as tests/conftest.py's fixture)."""
    v2 = Path("/sys/fs/cgroup/cgroup.controllers")
    if v2.exists() and "memory" in v2.read_text().split():
        path = Path("/sys/fs/cgroup") / f"trainguard-goodput-{uuid.uuid4().hex[:8]}"
        path.mkdir()
        (path / "memory.max").write_text(str(limit))
        if (path / "memory.swap.max").exists():
            (path / "memory.swap.max").write_text("0")
        return path
    path = Path("/sys/fs/cgroup/memory") / f"trainguard-goodput-{uuid.uuid4().hex[:8]}"
    if not path.parent.joinpath("memory.limit_in_bytes").exists():
        raise RuntimeError("no cgroup memory controller (v2 or v1 at /sys/fs/cgroup/memory): the leak fault needs one")
    path.mkdir()
    (path / "memory.limit_in_bytes").write_text(str(limit))
    return path


def fill(path: Path, seconds_to_full: float, stop: threading.Event) -> None:
    """Grow `path` so that its file system is full in about `seconds_to_full`, until stopped or full."""
    st = os.statvfs(path.parent)
    rate = st.f_bavail * st.f_frsize / seconds_to_full
    chunk = b"\0" * int(rate / 4)
    with contextlib.suppress(OSError), open(path, "ab") as f:
        while not stop.wait(0.25):
            f.write(chunk)
            f.flush()


# the figures ------------------------------------------------------------------------------------------------------
def analyse(rec: Record, scale: Scale, step_time: float) -> dict[str, Any]:
    """Goodput, and per fault: time to detect, time to resume, steps lost."""
    intervals = [b[0] - a[0] for a, b in zip(rec.steps, rec.steps[1:], strict=False) if b[1] == a[1] + 1]
    pace = statistics.median(intervals) if intervals else step_time
    good = [s for _, s, ok in rec.checkpoints if ok]
    counted = max(good) + 1 if good else 0
    possible = (rec.duration - rec.paused) / pace
    faults = []
    for i, f in enumerate(rec.faults):
        t = f["injected"]
        until = rec.faults[i + 1]["injected"] if i + 1 < len(rec.faults) else rec.duration
        check = CHECK_OF[f["kind"]]
        # its check's alerts up to that check's next fault: a slow check's (the time limit's margin) may come after
        # another kind of fault was injected
        mine = next((g["injected"] for g in rec.faults[i + 1:] if CHECK_OF[g["kind"]] == check), rec.duration)
        fired = [a for a in rec.alerts if a["check"] == check and t <= a["t"] < max(mine, until + 5)]
        humans = [a for a in rec.actions if a["who"].startswith("human") and t <= a["t"] < until]
        detected = fired[0]["t"] - t if fired else (humans[0]["t"] - t if humans else None)
        # a slowdown every node of the job sees: the node named is the one whose finding its own GPU explains
        named = next((a["node"] for a in fired if a["status"] == "CRITICAL"), None) if f["kind"] == "slow" else None
        by = "trainguard" if fired else ("human" if humans else "trainer" if f["kind"] == "stop_switch" else "-")
        restart = [a for a in rec.attempts if t < a[0] < until]  # a fault that stopped nothing has no restart
        before = [s for ts, s, _ in rec.steps if ts <= (restart[0][0] if restart else until)]
        lost = max(0, (max(before) + 1 - restart[0][1])) if restart and before else 0
        # the time without a step across the restart: "resumed after" also counts training that went on until then
        # (none when the next attempt made no step before the next fault or the end)
        stalled = open_stall = None
        if restart:
            last = max((ts for ts, _, _ in rec.steps if ts < restart[0][0]), default=t)
            first = min((ts for ts, _, _ in rec.steps if restart[0][0] <= ts < until), default=None)
            stalled = round(first - max(last, t), 1) if first is not None else None
            # no step again before the next fault or the end: down at least until then (what the cost charges)
            open_stall = round(until - max(last, t), 1) if first is None else None
        faults.append({"kind": f["kind"], "node": f["node"], "at": round(t, 1), "by": by,
                       "detect_s": None if detected is None else round(detected, 2),
                       "deadline_s": round(deadline(f, scale, step_time), 1),
                       "resume_s": round(restart[0][0] - t, 1) if restart else None, "stalled_s": stalled,
                       "lost_steps": lost, "window_s": round(until - t, 1), "down_to_next_s": open_stall,
                       # the user's own pause after the stop switch is no time the run could have trained
                       "user_pause_s": scale(600) if f["kind"] == "stop_switch" else 0.0,
                       **({"named": named} if f["kind"] == "slow" else {})})
    lemon = lemon_figures(rec) if any(f["kind"] == "lemon" for f in rec.faults) else None
    dup = 0
    seen: dict[tuple[str, str], float] = {}
    for a in (a for a in rec.alerts if a["event"] == "fired"):  # one problem announced by several nodes' agents
        key = (a["check"], a["subject"])
        if key in seen and a["t"] - seen[key] < 30:
            dup += 1
        seen[key] = a["t"]
    return {"trainguard": rec.trainguard, "duration_s": round(rec.duration, 1), "paused_s": round(rec.paused, 1),
            "pace_s": round(pace, 3), "possible_steps": round(possible), "counted_steps": counted,
            "goodput": round(counted / possible, 3) if possible else 0.0, "restarts": max(0, len(rec.attempts) - 1),
            "in_place": in_place(rec.attempt_ids),
            "drains": rec.drains, "alerts": len(rec.alerts), "duplicate_alerts": dup, "faults": faults,
            "attempt_ends": attempt_ends(rec),
            # a look that came with a page counts: what it did may have been the look's
            "human_looks_acted": sum(1 for a in rec.actions if a["who"] in ("human (look)", "human (look+page)")),
            "repairs": sum(1 for a in rec.actions if a["who"] == "site" and a["what"].startswith("repaired ")),
            "replaced": sum(1 for a in rec.actions if a["who"] == "site" and " replaced: " in a["what"]),
            **({"lemon": lemon} if lemon else {})}


REPAIR_SAID = {"replacement": "a replacement node (fresh agent state; the lemon scenario's node excepted)",
               "same node": "the same node (its agent's history kept, what it holds cleared)"}


def repair_model(r: dict[str, Any]) -> str | None:
    """What a run's repaired nodes were (Site.repair_model); a run saved before it was recorded repaired the same node
    (None: no repair, said or done)."""
    return r["repair"] if "repair" in r else "same node" if r.get("repairs") else None


def lemon_figures(rec: Record) -> dict[str, Any]:
    """The lemon node's faults, when its agent's lemon policy held it, when a machine of the pool took its place, and
    the ranks given it after its second fault (the goal: none; the ranks given the machine in its place are not)."""
    faults = [f["injected"] for f in rec.faults if f["kind"] == "lemon"]
    held = next((a["t"] for a in rec.alerts if a["check"] == "lemon" and a["node"] == LEMON_NODE), None)
    second = faults[1] if len(faults) > 1 else None
    gone = math.inf if rec.lemon_replaced is None else rec.lemon_replaced
    return {"faults": [round(t, 1) for t in faults], "held_at": None if held is None else round(held, 1),
            "replaced_at": None if rec.lemon_replaced is None else round(rec.lemon_replaced, 1),
            "ranks_after_second_fault": [a for t, a, n in rec.ranks if n == LEMON_NODE and second is not None
                                         and second < t < gone]}


def in_place(attempts: list[str]) -> int:
    """Restarts inside the allocation: an attempt of the same job life (job.requeues) as the one before it."""
    return sum(1 for a, b in itertools.pairwise(attempts)
               if a.rsplit(".", 1)[0] == b.rsplit(".", 1)[0])


def attempt_ends(rec: Record) -> list[dict[str, Any]]:
    """Per attempt, when and why it ended: rank 0's record, else the first rank's that has one."""
    ends: dict[str, dict[str, Any]] = {}
    for stop in rec.stops:
        have = ends.get(stop["attempt"])
        if have is None or (stop.get("rank") == 0 and have.get("rank") != 0):
            ends[stop["attempt"]] = stop
    return [{"attempt": s["attempt"], "t": s["t"], "rank": s.get("rank"), "node": s.get("node"), "step": s.get("step"),
             "why": s.get("why")} for s in sorted(ends.values(), key=lambda s: s["t"])]


def deadline(f: dict[str, Any], scale: Scale, step_time: float) -> float:
    """How long the check that answers this fault may take by its own settings (see agent_config)."""
    # hung_fs: the hang's, and the step its rank takes before it reads again
    return {**dict.fromkeys(XID_FAULTS, 1.0), "ib_down": 3.0, "nic": 1.0, "hang": scale(300, 2) + 2.0,
            "hung_fs": scale(300, 2) + step_time + 2.0,
            "maintenance": scale(60) + 2.0,  # node_drain's period: it must come before the reboot's notice is up
            "leak": f.get("oom_in", 0.0),
            "disk_full": f.get("full_in", 0.0), "stop_switch": 3.0,
            "time_limit": max(0.0, f.get("limit_at", 0.0) - f["injected"] - scale(600, 3)) + 2.0,
            "nan": 3 * step_time + 2.0, "cuda_error": step_time + 2.0, "slow": 2 * scale(600) + 2.0}[f["kind"]]


def table(results: list[dict[str, Any]], seed: int, scale: Scale) -> str:
    w = next(r for r in results if r["trainguard"])
    human = w.get("human", asdict(Human()))
    without = [r for r in results if not r["trainguard"]]
    wo = next((r for r in without if r.get("human", asdict(Human())) == human), without[0])
    model = repair_model(w)
    lines = [heading(f"Goodput under chaos (seed {seed}, time x{scale.factor:g})"),
             f"The human looks every {human['look_every_min']:g} minutes; paged, acts {human['page_response_min']:g} "
             "minutes after the alert." + (f" Repair: {REPAIR_SAID[model]}; with trainguard {w.get('repairs', 0)} "
                                           f"repairs, {w.get('replaced', 0)} replacements." if model else ""), "",
             "| | with trainguard | without |", "|---|---|---|"]
    for label, key in (("goodput (counted / possible steps)", "goodput"), ("steps counted (in a finite checkpoint)",
                       "counted_steps"), ("steps possible at the fault-free pace", "possible_steps"),
                       ("fault-free pace (s/step)", "pace_s"), ("wall time (s), of it paused by the user", None),
                       ("restarts (of them in place)", None), ("alerts fired (duplicates)", None),
                       ("drains (right)", None)):
        if label.startswith("restarts"):
            lines.append(f"| {label} | {w['restarts']} ({w.get('in_place', 0)}) | {wo['restarts']} "
                         f"({wo.get('in_place', 0)}) |")
        elif key:
            lines.append(f"| {label} | {w[key]} | {wo[key]} |")
        elif label.startswith("wall"):
            lines.append(f"| {label} | {w['duration_s']}, {w['paused_s']} | {wo['duration_s']}, {wo['paused_s']} |")
        elif label.startswith("alerts"):
            lines.append(f"| {label} | {w['alerts']} ({w['duplicate_alerts']}) | - |")
        else:
            lines.append(f"| {label} | " + " | ".join(
                ", ".join(f"{d['node']} ({'right' if d['right'] else 'WRONG'})" for d in r["drains"]) or "none"
                for r in (w, wo)) + " |")
    lines += ["", "| fault (node) | at (s) | detected by, in s (deadline) with / without | resumed after (s) "
              "with / without | no step for (s) with / without | steps lost with / without |",
              "|---|---|---|---|---|---|"]
    none = {"by": "not injected", "detect_s": None, "deadline_s": None, "resume_s": None, "lost_steps": None}
    for a, b in paired(w["faults"], wo["faults"], none):
        def det(x: dict[str, Any]) -> str:
            return f"{x['by']} {x['detect_s']}" if x["detect_s"] is not None else x["by"]
        lines.append(f"| {a['kind']} ({a.get('node') or '-'}) | {a.get('at', b.get('at'))} | {det(a)} "
                     f"({a['deadline_s']}) / {det(b)} | {a['resume_s']} / {b['resume_s']} | {a.get('stalled_s')} / "
                     f"{b.get('stalled_s')} | {a['lost_steps']} / {b['lost_steps']} |")
    for r, label in ((w, "with trainguard"), (wo, "without")):
        lines += ["", f"How each attempt ended ({label}; the trainer's own record, rank 0's where it has one):", ""]
        lines += [f"- {e['attempt']} at {e['t']} s, step {e['step']} (rank {e['rank']} on {e['node']}): {e['why']}"
                  for e in r.get("attempt_ends", [])] or ["- none recorded"]
    return "\n".join(lines + humans(w, human["look_every_min"], without) + lemons(results))


def paired(a: list[dict[str, Any]], b: list[dict[str, Any]], none: dict[str, Any]
           ) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The faults of two runs side by side: the n-th of a kind with the n-th of that kind (a fault due while the job
    is down waits, and a run may end before one is injected: `none` stands for it)."""
    def nth(faults: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
        seen: dict[str, int] = {}
        out = {}
        for f in faults:
            seen[f["kind"]] = seen.get(f["kind"], 0) + 1
            out[(f["kind"], seen[f["kind"]])] = f
        return out
    x, y = nth(a), nth(b)
    keys = sorted(x.keys() | y.keys(), key=lambda k: (x.get(k) or y[k])["at"])
    return [(x.get(k) or {**none, "kind": k[0]}, y.get(k) or {**none, "kind": k[0]}) for k in keys]


def lemons(results: list[dict[str, Any]], seeds: list[int] | None = None) -> list[str]:
    """`--scenario lemon`: the runs with trainguard with and without the agents' lemon rules, side by side (with
    `seeds`, the seed of each run of `results` in a first column: the report over the seeds)."""
    rows = [(seed, r) for seed, r in zip(seeds or [0] * len(results), results, strict=True)
            if r["trainguard"] and "lemon" in r]
    if not rows:
        return []
    first = ("| seed ", "|---") if seeds else ("", "")
    lines = ["", f"The lemon node ({LEMON_NODE}), with trainguard:", "",
             f"{first[0]}| lemon rules | goodput | the lemon's faults (s) | held by the lemon policy at (s) | a machine "
             "of the pool in its place at (s) | ranks given it after its second fault |",
             f"{first[1]}|---|---|---|---|---|---|"]

    def at(x: float | None) -> str:
        return "-" if x is None else str(x)

    for seed, r in rows:
        le = r["lemon"]
        lines.append(f"{f'| {seed} ' if seeds else ''}| {'installed' if r.get('lemon_policy', True) else 'none'} | "
                     f"{r['goodput']} | {', '.join(map(str, le['faults'])) or '-'} | {at(le['held_at'])} | "
                     f"{at(le.get('replaced_at'))} | {len(le['ranks_after_second_fault'])} |")
    if seeds:
        means = {("installed" if policy else "none"): statistics.mean(g) for policy in (True, False)
                 if (g := [r["goodput"] for _, r in rows if r.get("lemon_policy", True) is policy])}
        lines += ["", "Goodput with trainguard, mean over the seeds: "
                  + ", ".join(f"lemon rules {k} {v:.3f}" for k, v in means.items()) + "."]
    return lines


def humans(w: dict[str, Any], every: float, without: list[dict[str, Any]]) -> list[str]:
    """The runs without trainguard side by side, one per human (`--also-without`), each against the run with it,
    whose human looks every `every` minutes.
    That one run stands for another human only where its own human's looks did nothing (trainguard and the pages did
    it all) and the other one's looks are among them (every whole multiple of its interval): a human who looks at
    other times could find what it never saw."""
    if len(without) < 2:
        return []
    acted = w.get("human_looks_acted")
    why = ("its human's looks did nothing: trainguard and the pages did it all" if acted == 0 else
           "its human's looks are not on record" if acted is None else f"its human acted on {acted} of their looks")
    lines = ["", f"Without trainguard, one run per human (the run with trainguard: {w['goodput']}, its human looking "
             f"every {every:g} minutes; {why}):", "",
             "| the human looks every (minutes) | goodput without | with trainguard / without | the run with trainguard "
             "stands for this human |", "|---|---|---|---|"]
    for r in sorted(without, key=lambda r: r["human"]["look_every_min"]):
        m = r["human"]["look_every_min"]
        ratio = f"{w['goodput'] / r['goodput']:.2f}x" if r["goodput"] > 0 else "-"
        same = acted == 0 and m >= every and math.isclose(m / every, round(m / every))
        lines.append(f"| {m:g} | {r['goodput']} | {ratio} | {'yes' if same else 'no'} |")
    return lines


# several seeds, the fault-free pair ------------------------------------------------------------------------------
def spread(values: list[float]) -> dict[str, float]:
    return {"mean": round(statistics.fmean(values), 3), "stdev": round(statistics.stdev(values), 3)
            if len(values) > 1 else 0.0, "min": min(values), "max": max(values), "n": len(values)}


def fault_cost(f: dict[str, Any], pace: float) -> float:
    """The steps one fault cost the run: those redone after it, and those not made while no step was (downtime; where
    the job made no step again before the next fault or the end, the time until then)."""
    down = (f.get("stalled_s") or f.get("down_to_next_s") or 0.0) - f.get("user_pause_s", 0.0)
    return f["lost_steps"] + max(0.0, down) / pace


def missed(f: dict[str, Any]) -> bool:
    """A fault its check did not see within its deadline, though the run left it that long (the next fault, or the
    end, came later): a leak whose rank a restart replaced before the forecast is no miss."""
    if f["detect_s"] is not None:
        return bool(f["detect_s"] > f["deadline_s"])
    return bool(f.get("window_s", math.inf) >= f["deadline_s"])


def summarize(per_seed: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    """Several seeds' results (each: the run with trainguard, then the ones without): goodput's mean and spread each
    way and per human, the ratio's, the seed nearest the mean, and what each fault kind cost with trainguard."""
    withs = {seed: next(r for r in rs if r["trainguard"]) for seed, rs in per_seed.items()}
    out: dict[str, Any] = {"seeds": sorted(per_seed), "with": spread([w["goodput"] for w in withs.values()])}
    humans: dict[float, list[tuple[float, float]]] = {}
    for seed, rs in per_seed.items():
        for r in rs:
            if not r["trainguard"]:
                humans.setdefault(r["human"]["look_every_min"], []).append((withs[seed]["goodput"], r["goodput"]))
    out["without"] = {m: {"goodput": spread([b for _, b in pairs]),
                          "ratio": spread([a / b for a, b in pairs if b > 0]) if any(b > 0 for _, b in pairs) else None}
                      for m, pairs in sorted(humans.items())}
    mean = out["with"]["mean"]
    out["nearest_mean"] = min(withs, key=lambda seed: (abs(withs[seed]["goodput"] - mean), seed))
    kinds: dict[str, dict[str, float]] = {}
    possible = sum(w["possible_steps"] for w in withs.values())
    for w in withs.values():
        for f in w["faults"]:
            k = kinds.setdefault(f["kind"], {"faults": 0, "steps": 0.0, "missed": 0})
            k["faults"] += 1
            k["steps"] += fault_cost(f, w["pace_s"])
            k["missed"] += missed(f)
    out["kinds"] = sorted(({"kind": k, **v, "steps": round(v["steps"], 1),
                            "of_goodput": round(v["steps"] / possible, 4) if possible else 0.0}
                           for k, v in kinds.items()), key=lambda k: -k["steps"])
    out["repair"] = sorted({m for w in withs.values() if (m := repair_model(w))})
    out["wrong_drains"] = sum(1 for rs in per_seed.values() for r in rs for d in r["drains"] if not d["right"])
    return out


def seeds_table(summary: dict[str, Any], scale: Scale, schedule_name: str) -> str:
    def fmt(x: dict[str, float] | None, suffix: str = "") -> str:
        return "-" if x is None else (f"{x['mean']:.3f}{suffix} (stdev {x['stdev']:.3f}, {x['min']:.3f}-"
                                      f"{x['max']:.3f})")
    w = summary["with"]
    lines = [heading(f"Goodput under chaos over {w['n']} seeds ({', '.join(map(str, summary['seeds']))}; "
                     f"schedule {schedule_name}, time x{scale.factor:g})"),
             f"Goodput with trainguard: mean {fmt(w)} of the fault-free pace."
             + "".join(f" Repair: {REPAIR_SAID[m]}." for m in summary.get("repair", []))]
    if summary["without"]:  # none where only runs with trainguard were made (the lemon scenario's rules and none)
        lines += ["", "| the human looks every (minutes) | goodput without: mean (stdev, min-max) | with trainguard / "
                  "without |", "|---|---|---|"]
        lines += [f"| {m:g} | {fmt(h['goodput'])} | {fmt(h['ratio'], 'x')} |" for m, h in summary["without"].items()]
    lines += ["", f"What each fault kind cost with trainguard (all seeds; steps redone plus steps not made while none "
              f"was, against {w['n']} runs' possible steps; the seed nearest the mean: {summary['nearest_mean']}):",
              "", "| fault kind | faults | steps it cost | of the possible steps | missed its deadline |",
              "|---|---|---|---|---|"]
    lines += [f"| {k['kind']} | {k['faults']} | {k['steps']} | {k['of_goodput']:.2%} | {k['missed']} |"
              for k in summary["kinds"]]
    lines += ["", f"Wrong drains, all runs: {summary['wrong_drains']}."]
    return "\n".join(lines)


def step_cost(with_tg: Record, without: Record) -> dict[str, Any]:
    """The agents' cost to the training step: rank 0's step intervals with and without them (a fault-free pair)."""
    def intervals(rec: Record) -> list[float]:
        return [b[0] - a[0] for a, b in itertools.pairwise(rec.steps) if b[1] == a[1] + 1]
    a, b = intervals(with_tg), intervals(without)
    if not a or not b:
        return {"steps": (len(a), len(b))}
    out: dict[str, Any] = {"steps": (len(a), len(b))}
    for name, f in (("median", statistics.median), ("mean", statistics.fmean)):
        x, y = f(a), f(b)
        out[name] = (round(x, 4), round(y, 4), round((x - y) / y, 4))
    return out


def fault_free_table(pairs: list[tuple[int, dict[str, Any], list[dict[str, Any]]]]) -> str:
    """Per fault-free pair: step time with and without the agents, and every alert the agents fired (none is
    expected: a finding here is a false positive, job_pace's of issue 51 among them)."""
    lines = [heading("Fault-free: the agents' cost to the step, and their alerts"), "",
             "| run | steps with / without | median step (s) with / without | difference | mean step (s) with / "
             "without | difference | alerts fired |", "|---|---|---|---|---|---|---|"]
    for seed, cost, alerts in pairs:
        med, mean = cost.get("median"), cost.get("mean")
        lines.append(f"| {seed} | {cost['steps'][0]} / {cost['steps'][1]} | " + (
            f"{med[0]} / {med[1]} | {med[2]:+.2%} | {mean[0]} / {mean[1]} | {mean[2]:+.2%}" if med and mean else
            "- | - | - | -") + f" | {len(alerts)} |")
    for seed, _, alerts in pairs:
        lines += [f"- run {seed}: {a['event']} {a['check']} {a['status']} {a['subject']} on {a['node']} at "
                  f"{a['t']:.1f} s" for a in alerts]
    if not any(alerts for _, _, alerts in pairs):
        lines += ["", "No alert fired in any fault-free run (job_pace included)."]
    return "\n".join(lines)


def run_name(r: dict[str, Any]) -> str:
    """One run of a seed, as a plot's panel names it."""
    if not r["trainguard"]:
        return f"without trainguard (the human looks every {r['human']['look_every_min']:g} minutes)"
    return f"with trainguard, its lemon rules {'installed' if r.get('lemon_policy', True) else 'none'}" \
        if "lemon" in r else "with trainguard"


def plot(records: list[Record], path: Path, names: list[str] | None = None) -> bool:
    """Each run's steps, faults, alerts and actions, one panel each (`names`: each panel's run; else with or
    without trainguard)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    fig, axes = plt.subplots(len(records), 1, figsize=(12, 3.6 * len(records)), sharex=True, sharey=True,
                             squeeze=False)
    names = names or [("with trainguard" if rec.trainguard else "without trainguard") for rec in records]
    for ax, rec, name in zip(axes[:, 0], records, names, strict=True):  # one panel or several
        ax.plot([t for t, _, _ in rec.steps], [s for _, s, _ in rec.steps], ".", ms=1.5, color="tab:blue",
                label="step (rank 0)")
        nan = [(t, s) for t, s, ok in rec.steps if not ok]
        if nan:
            ax.plot(*zip(*nan, strict=True), ".", ms=2, color="tab:red", label="NaN loss")
        good = [(t, s) for t, s, ok in rec.checkpoints if ok]
        if good:
            ax.plot(*zip(*good, strict=True), "s", ms=3, color="tab:green", label="checkpoint")
        at = ax.get_xaxis_transform()  # x in seconds, y as a fraction of the panel: the two share one step axis
        for f in rec.faults:
            ax.axvline(f["injected"], color="tab:red", lw=0.8)
            ax.text(f["injected"], 0.98, f["kind"], rotation=90, va="top", ha="right", fontsize=7, color="tab:red",
                    transform=at)
        for a in rec.alerts:
            ax.plot(a["t"], 0.05, "v", color="tab:orange", ms=5, transform=at)
        for a in rec.actions:
            if a["who"] != "fault":
                ax.plot(a["t"], 0.12, "^", color="tab:purple" if a["who"].startswith("agent") else "black", ms=5,
                        transform=at)
        ax.set_title(f"{name} (v alert, ^ purple: agent action, ^ black: human or user action)", fontsize=9, pad=4)
        ax.set_ylabel("step")
        ax.legend(loc="upper left", fontsize=7)
    axes[-1, 0].set_xlabel("seconds since submission")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# entry points -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Site:
    """What the site does beside the agents, in seconds here: what job_pace's finding runs (`slow_policy`); how long
    after its drain a node whose hardware failed is repaired and resumed (`repair_after`; None: not during the run,
    as in the default schedule, whose one XID needs no repair); every how long the lemon node's GPU fails again
    (`lemon_every`; 0: no lemon node); whether the agents keep their lemon rules (`lemon_policy`; the installed
    default) or have none; whether a repaired node comes back as a replacement with a fresh agent state
    (`replace_repaired`, `replaced_on_repair`) or as the same node (`--repaired-same-node`: the runs before it);
    how far apart faults stay when one had to wait for a running job (`fault_gap`, `kept_apart`)."""

    slow_policy: str = "alert"
    repair_after: float | None = None
    lemon_every: float = 0.0
    lemon_policy: bool = True
    replace_repaired: bool = True
    fault_gap: float = 0.0  # a delayed fault keeps the schedule's gap to the next (0: the schedule's times, as before)
    # the hang check's `fs_stale_after`, in seconds here (None: `stale_after` alone, the installed default)
    fs_stale_after: float | None = None

    def repair_model(self) -> str | None:
        """What a repaired node is, as the run's JSON and report say it (None: no repair during the run)."""
        if self.repair_after is None:
            return None
        return "replacement" if self.replace_repaired else "same node"


def replaced_on_repair(node: str, site: Site) -> bool:
    """Whether `node`, repaired, comes back as another machine with an empty agent state. Each node here takes the
    faults of ~680 of the fleet's 2,048 (the whole job's stream lands on the job's 3) and the lemon rules count per node: a
    node kept through its repairs gathers unrelated faults into a lemon. In the fleet a drained node's place in the
    job is taken from the pool, and the node back from its repair is another machine for the job (the same one
    again: about 1 in 2,048). The lemon scenario's node is never replaced: it stands for one machine whose repairs did
    not fix it, which the site keeps putting back; its history is what the lemon rules must see."""
    return site.replace_repaired and not (site.lemon_every and node == LEMON_NODE)


def run_once(base: Path, trainguard: bool, faults: list[Fault], duration: float, scale: Scale, step_time: float,
             ckpt_every: int, human: Human, site: Site) -> Record:
    base.mkdir(parents=True)
    run = Run(base, trainguard, faults, duration, scale, look_every=scale(human.look_every_min * 60),
              page_response=scale(human.page_response_min * 60), step_time=step_time, ckpt_every=ckpt_every,
              site=site)
    with contextlib.ExitStack() as stack:
        run.start(stack)
        run.run()
        return run.collect()


@dataclass(frozen=True)
class Human:
    """The person on call, in real-world minutes (scaled like the rest): they look every `look_every_min` and fix what
    they see; paged by an alert, they act `page_response_min` after it. The run without trainguard has only the looks,
    so its goodput depends on this person most of all."""

    look_every_min: float = 30.0
    page_response_min: float = 5.0


def benchmark(seed: int, minutes: float, scale: Scale, kinds: tuple[str, ...] = KINDS, step_time: float = 0.5,
              ckpt_every: int = 20, out_dir: Path | None = None, human: Human = Human(),
              also_without: tuple[float, ...] = (), site: Site = Site(), faults: list[Fault] | None = None,
              with_tg: bool = True, without: bool = True, lemon_rules: tuple[bool, ...] = (True, False)
              ) -> tuple[list[dict[str, Any]], list[Record]]:
    """The run with trainguard and the one without it, with `human`; then one more run without it for each of
    `also_without` (how often that human looks, in minutes): the same schedule (`faults`, else the default one of
    `seed` and `kinds`) against other people on call. With a lemon node (`site.lemon_every`), last, one more run with
    trainguard whose agents have no lemon rules. `with_tg`, `without`: whether the runs with trainguard, and the one
    without it with `human`, are made (the runs without alone: more humans for seeds whose run with it is saved
    already, which `--report-from` joins); `lemon_rules`: with a lemon node, which of the runs with trainguard (its
    agents with their lemon rules, True, and without them, False)."""
    duration = minutes * 60
    faults = schedule(seed, duration, kinds) if faults is None else faults
    base = Path(tempfile.mkdtemp(prefix="trainguard-multinode-goodput-", dir="/tmp"))
    base.chmod(0o755)
    rules = lemon_rules if site.lemon_every else (True,)
    runs = [(True, human, "with", site)] * (with_tg and True in rules) + [(False, human, "without", site)] * without + [
        (False, Human(m, human.page_response_min), f"without-{i}-look{m:g}", site) for i, m in enumerate(also_without)]
    if with_tg and False in rules:
        runs.append((True, human, "with-no-lemon-policy", replace(site, lemon_policy=False)))
    records = []
    try:
        for trainguard, person, name, where in runs:
            records.append(run_once(base / name, trainguard, faults, duration, scale, step_time, ckpt_every, person,
                                    where))
    finally:
        if out_dir is None:
            shutil.rmtree(base, ignore_errors=True)
    results = [{**analyse(r, scale, step_time), "human": asdict(person), "lemon_policy": where.lemon_policy,
                "repair": where.repair_model(), "fs_stale_after": where.fs_stale_after}
               for r, (_, person, _, where) in zip(records, runs, strict=True)]
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "goodput.json").write_text(json.dumps({"seed": seed, "minutes": minutes, "results": results,
                                                          "records": [asdict(r) for r in records]}, indent=1))
    return results, records


def other_humans(text: str, look_every: float) -> tuple[float, ...]:
    """--also-without's minutes, each once, without --look-every's (whose human has its run without already)."""
    try:
        minutes = {float(m) for m in text.split(",") if m.strip()}
    except ValueError:
        minutes = {math.nan}
    if not all(math.isfinite(m) and m > 0 for m in minutes):
        raise ValueError(f"--also-without: {text!r} is not a comma-separated list of minutes above 0")
    return tuple(sorted(minutes - {look_every}))


def run_key(r: dict[str, Any]) -> tuple[bool, Any]:
    """Which run of a seed this is: without trainguard, its human; with it, its lemon rules (whoever was on call)."""
    return (True, r.get("lemon_policy", True)) if r["trainguard"] else (False, r["human"]["look_every_min"])


def saved(dirs: list[Path], scale: Scale, step_time: float = 0.5) -> dict[int, tuple[list[dict[str, Any]],
                                                                                   list[Record]]]:
    """The runs earlier invocations saved (each `--out`: its `seed-N/goodput.json`, or its `goodput.json`), joined by
    seed in the order given: the runs of record can be made a few at a time (`--without-only` adds humans to seeds
    whose run with trainguard is saved), then reported together. A seed's first run with trainguard is the one
    compared; a human already seen for a seed is not counted twice. Each run's records are analysed again by this
    code (a fix of the analysis applies to runs made before it). ValueError names a file that is not a saved run,
    or one whose length differs from its seed's first (another length is another schedule)."""
    per_seed: dict[int, tuple[list[dict[str, Any]], list[Record]]] = {}
    lengths: dict[int, float | None] = {}  # each seed's run length, where a saved run says it
    for d in dirs:
        files = sorted(d.glob("seed-*/goodput.json"), key=lambda f: f.parent.name) or [d / "goodput.json"]
        for f in files:
            try:
                data = json.loads(f.read_text())
                seed = int(data.get("seed", f.parent.name.removeprefix("seed-")))
                runs = list(zip(data["results"], [Record(**r) for r in data["records"]], strict=True))
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{f}: not a saved goodput run ({e})") from e
            # runs saved before their length was recorded join any (their schedule is the seed's at the length given)
            minutes = data.get("minutes")
            if lengths.get(seed) is None:
                lengths[seed] = minutes
            elif minutes is not None and minutes != lengths[seed]:
                raise ValueError(f"{f}: {data.get('minutes')}-minute runs, seed {seed}'s first were "
                                 f"{lengths[seed]}-minute ones: another schedule")
            results, records = per_seed.setdefault(seed, ([], []))
            seen = {run_key(r) for r in results}
            for r, rec in runs:
                if (key := run_key(r)) not in seen:
                    seen.add(key)
                    results.append({**r, **analyse(rec, scale, step_time)})
                    records.append(rec)
    if missing := [seed for seed, (rs, _) in per_seed.items() if not any(r["trainguard"] for r in rs)]:
        raise ValueError(f"seeds {missing}: no run with trainguard saved")
    return per_seed


def seed_list(text: str) -> list[int]:
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        seeds = []
    if not seeds:
        raise ValueError(f"--seeds: {text!r} is not a comma-separated list of integers")
    return list(dict.fromkeys(seeds))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=24)
    p.add_argument("--seeds", default="", metavar="SEED[,SEED...]",
                   help="several seeds, each with and without trainguard: a report of the mean and its spread")
    p.add_argument("--schedule", choices=["default", "fleet"], default="default",
                   help="default: each of --kinds once; fleet: Llama 3's interruption mix and rate, scaled, and each "
                        "site fault once (benchmarks/goodput_fleet.py)")
    p.add_argument("--rate", type=float, default=None, metavar="PER_DAY",
                   help=f"--schedule fleet: interruptions of the whole job a real-world day (default Llama 3's: "
                        f"{24 / fleet.LLAMA3_MTBI_H:.2f})")
    p.add_argument("--repair-after", type=float, default=None, metavar="MINUTES",
                   help="a drained node whose hardware failed is repaired and resumed this long after its drain "
                        "(real-world minutes, scaled; default: 30 with --schedule fleet, never with the default "
                        "schedule)")
    p.add_argument("--scenario", choices=["lemon"], default=None,
                   help=f"lemon: {LEMON_NODE}'s GPU fails (XID 79) every --lemon-every while the job runs there, "
                        "repaired after --repair-after each time; one more run with trainguard whose agents have no "
                        "lemon rules; on top of the fleet's faults (--schedule fleet), whose requeues bring the job back to it")
    p.add_argument("--repaired-same-node", action="store_true",
                   help="a repaired node comes back as the same node, its agent's history kept and what it holds "
                        "cleared (the runs of record made before this option); default: as a replacement, a new "
                        "agent with an empty state (the lemon scenario's node always keeps its own)")
    p.add_argument("--lemon-rules", choices=["both", "installed", "none"], default="both",
                   help="--scenario lemon: which runs with trainguard: its agents with their lemon rules (installed), "
                        "without them (none), or both")
    p.add_argument("--lemon-every", type=float, default=180.0, metavar="MINUTES",
                   help="--scenario lemon: how often the lemon node's GPU fails again (real-world minutes, scaled)")
    p.add_argument("--fault-free", action="store_true",
                   help="no fault: the agents' cost to the step (with and without them) and every alert they fire")
    p.add_argument("--minutes", type=float, default=15.0, help="each run (with and without trainguard, and --also-without's)")
    p.add_argument("--scale", type=float, default=60.0)
    p.add_argument("--out", type=Path, default=Path("/tmp/trainguard-goodput"))
    p.add_argument("--plot", type=Path, default=REPO / "docs" / "goodput-timeline.png")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"fault kinds, comma-separated (also: "
                   f"{', '.join(EXTRA_KINDS)}; none: a fault-free run)")
    p.add_argument("--slow-policy", choices=["alert", "restart_elsewhere"], default="alert",
                   help="what the job_pace finding does on the node at fault (docs/slow-jobs.md)")
    p.add_argument("--fs-stale-after", type=float, default=0.0, metavar="MINUTES",
                   help="the hang check's fs_stale_after (real-world minutes, scaled; 0: unset, the installed "
                        "default: a hang on a dead file system waits for stale_after)")
    p.add_argument("--look-every", type=float, default=Human.look_every_min, metavar="MINUTES",
                   help="how often the human looks (real-world minutes, scaled)")
    p.add_argument("--page-response", type=float, default=Human.page_response_min, metavar="MINUTES",
                   help="how long the paged human takes to act (real-world minutes, scaled)")
    p.add_argument("--also-without", default="", metavar="MINUTES[,MINUTES...]",
                   help="one more run without trainguard for each: a human who looks that often (minutes)")
    p.add_argument("--with-only", action="store_true",
                   help="only the run with trainguard: a seed's run with it made again (--report-from takes the "
                        "first directory's)")
    p.add_argument("--without-only", action="store_true",
                   help="only the runs without trainguard (--look-every's human and --also-without's): more humans for "
                        "seeds whose run with it is saved; --report-from joins them")
    p.add_argument("--report-from", type=Path, nargs="+", default=None, metavar="DIR",
                   help="run nothing: the report over the seeds (and the plot) from the runs saved in each DIR (an "
                        "earlier --out), joined by seed, written to --out")
    return p


def site_of(a: argparse.Namespace, scale: Scale, fleet_like: bool) -> Site:
    """The site the options say (`fleet_like`: the fleet's schedule or the lemon scenario)."""
    # 30 minutes, a reset or a reboot: at a fleet's scale a drained node's place is taken by a spare at once, and this
    # cluster has one; a longer repair would make two faults in a row leave the 3-node job without nodes
    repair = a.repair_after if a.repair_after is not None else 30.0 if fleet_like else None
    return Site(a.slow_policy, None if repair is None else scale(repair * 60),
                scale(a.lemon_every * 60) if a.scenario == "lemon" and not a.fault_free else 0.0,
                replace_repaired=not a.repaired_same_node,
                # the runs with same-node repairs were made before delayed faults kept the gap: they reproduce as made
                fault_gap=scale(600) if fleet_like and not a.repaired_same_node else 0.0,
                fs_stale_after=scale(a.fs_stale_after * 60) if a.fs_stale_after else None)


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    if not (math.isfinite(a.look_every) and a.look_every > 0 and math.isfinite(a.page_response)
            and a.page_response >= 0):
        p.error("--look-every must be a number of minutes above 0, --page-response one of at least 0")
    if a.rate is not None and not (math.isfinite(a.rate) and a.rate > 0):
        p.error("--rate must be a number of interruptions a day above 0")
    if a.with_only and a.without_only:
        p.error("--with-only and --without-only: one of them")
    if not (math.isfinite(a.fs_stale_after) and a.fs_stale_after >= 0):
        p.error("--fs-stale-after must be a number of minutes of at least 0 (0: unset)")
    if a.repair_after is not None and not (math.isfinite(a.repair_after) and a.repair_after >= 0):
        p.error("--repair-after must be a number of minutes of at least 0")
    try:
        also = other_humans(a.also_without, a.look_every)
        seeds = seed_list(a.seeds) if a.seeds else [a.seed]
    except ValueError as e:
        p.error(str(e))
    scale = Scale(a.scale)
    if a.report_from:
        try:
            per_seed = saved(a.report_from, scale)
        except ValueError as e:
            p.error(f"--report-from: {e}")
        a.out.mkdir(parents=True, exist_ok=True)
        report(per_seed, scale, a.out, a.plot, "fault-free" if a.fault_free else a.schedule)
        return 0
    kinds = () if a.fault_free else tuple(k for k in a.kinds.split(",") if k)
    if unknown := set(kinds) - set(KINDS) - set(EXTRA_KINDS):
        p.error(f"--kinds: unknown fault kinds {sorted(unknown)}; known: {', '.join(KINDS + EXTRA_KINDS)}")
    fleet_like = not a.fault_free and (a.schedule == "fleet" or a.scenario == "lemon")
    site = site_of(a, scale, fleet_like)
    per_seed: dict[int, tuple[list[dict[str, Any]], list[Record]]] = {}
    for seed in seeds:
        faults = fleet_schedule(seed, a.minutes * 60, scale, a.rate) if fleet_like else None
        out = a.out / f"seed-{seed}" if len(seeds) > 1 else a.out
        per_seed[seed] = benchmark(seed, a.minutes, scale, kinds, out_dir=out, human=Human(a.look_every, a.page_response),
                                   also_without=() if a.fault_free else also, site=site, faults=faults,
                                   with_tg=not a.without_only, without=not a.with_only,
                                   lemon_rules=LEMON_RULES[a.lemon_rules])
        if a.without_only or a.with_only:
            continue  # nothing to compare here: --report-from joins these runs to the saved ones with trainguard
        if not a.fault_free:
            print(table(per_seed[seed][0], seed, scale), flush=True)
    if not (a.without_only or a.with_only):
        report(per_seed, scale, a.out, a.plot, "fault-free" if a.fault_free else "fleet" if fleet_like else "default")
    return 0


def report(per_seed: dict[int, tuple[list[dict[str, Any]], list[Record]]], scale: Scale, out: Path, plot_to: Path,
           schedule_name: str) -> None:
    """The report over the seeds (`out`/report.md; a fault-free one: the step times and every alert), and the plot of
    the seed nearest the mean (the first seed's where there is no mean)."""
    text, shown = "", next(iter(per_seed))
    if schedule_name == "fault-free":
        text = fault_free_table([(seed, step_cost(recs[0], recs[1]), [{**x, "t": round(x["t"], 1)} for x in
                                                                       recs[0].alerts])
                                 for seed, (_, recs) in per_seed.items()])
    elif len(per_seed) > 1:
        summary = summarize({seed: results for seed, (results, _) in per_seed.items()})
        text, shown = seeds_table(summary, scale, schedule_name), summary["nearest_mean"]
        runs = [(seed, r) for seed, (results, _) in per_seed.items() for r in results]
        text = "\n".join([text, *lemons([r for _, r in runs], [seed for seed, _ in runs])])
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if text:
        print("\n" + text)
        (out / "report.md").write_text(text + "\n")
    results, records = per_seed[shown]
    if plot(records[:2], plot_to, [run_name(r) for r in results[:2]]):  # with and without, or the lemon rules and none
        print(f"\nplot: {plot_to} (seed {shown})")


if __name__ == "__main__":
    sys.exit(main())
