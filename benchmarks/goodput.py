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

Without trainguard the job has what it has without it: the collective timeout (NCCL's 10-minute default, scaled), the
trainer's own signal and switch handling, SLURM's time-limit SIGTERM, and a human who looks every M minutes (and fixes
what they see: frees the disk, drains a node whose GPU is gone, requeues the job). With trainguard the same human is
also paged: they act R minutes after an alert. Time is scaled by --scale (60: a real minute is a second here).

    python -m benchmarks.goodput [--seed 24] [--minutes 15] [--scale 60] [--look-every 30]   # one run each way; root
    python -m benchmarks.goodput --also-without 60,120   # and one more run without trainguard per human
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from benchmarks.common import heading, installed_config
from tests.conftest import AgentProcess
from tests.e2e.stack import log_time, parse_log_line
from tests.multinode_cluster import MultiNodeCluster
from tests.slurm_cluster import JOB_USER
from trainguard.agent.configfile import parse_config

REPO = Path(__file__).resolve().parent.parent
KINDS = ("xid79", "hang", "leak", "disk_full", "stop_switch", "time_limit", "nan")
EXTRA_KINDS = ("slow",)  # drawn only when named: the seven's seeded schedules stay as they were
SLOW_FACTOR = 1.5
# The check that answers each fault kind, and the action(s) that make the job come back.
CHECK_OF = {"xid79": "xid", "hang": "hang", "leak": "job_memory", "disk_full": "disk", "stop_switch": "job_switch",
            "time_limit": "job_timelimit", "nan": "training_log", "slow": "job_pace"}
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
        return f"{self(real_seconds, floor):g}s"


@dataclass(frozen=True)
class Fault:
    at: float  # seconds after the job's submission
    kind: str
    target: int  # which rank (node of that rank) the fault hits


def schedule(seed: int, duration: float, kinds: tuple[str, ...] = KINDS) -> list[Fault]:
    """Each kind once, in a seeded order, spread over the run with seeded jitter; the first after a warm-up."""
    rng = random.Random(seed)
    order = list(kinds)
    rng.shuffle(order)
    start, end = 0.12 * duration, 0.9 * duration
    slot = (end - start) / len(order)
    return [Fault(round(start + i * slot + rng.uniform(0, 0.3) * slot, 1), kind, rng.randrange(RANKS))
            for i, kind in enumerate(order)]


def bus_of(node: str) -> str:
    """The PCI address of node nN's scripted GPU, as the driver prints it: domain 00aN."""
    return f"00a{int(node[1:]):x}:18:00"


def xid79_line(bus: str) -> str:
    return f"NVRM: Xid (PCI:{bus}): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."


# the per-node kernel logs ------------------------------------------------------------------------------------------
class KmsgRelay:
    """Reads the real /dev/kmsg from its end and writes each record naming a node's GPU to that node's FIFO, with
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
                m = re.search(rb"PCI:00a([0-9a-f]):", rest)
                node = f"n{int(m.group(1), 16)}" if m else None
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


class Run:
    def __init__(self, base: Path, trainguard: bool, faults: list[Fault], duration: float, scale: Scale,
                 look_every: float, page_response: float, step_time: float, ckpt_every: int,
                 slow_policy: str = "alert") -> None:
        self.base, self.trainguard, self.faults, self.duration, self.s = base, trainguard, faults, duration, scale
        self.look_every, self.page_response = look_every, page_response
        self.step_time, self.ckpt_every = step_time, ckpt_every
        self.slow_policy = slow_policy
        self.rec = Record(trainguard)
        self.cluster = MultiNodeCluster(base / "cluster", NODES, cred_expire=max(5, round(scale(120))),
                                        sched_interval=max(1, round(scale(60))))
        self.agents: dict[str, AgentProcess] = {}
        self.t0 = 0.0
        self.job = ""
        self.gpu_lost: set[str] = set()
        self.ballast_stop: threading.Event | None = None
        self.paused_since: float | None = None
        self.restore_limit = False
        self.cgroups: list[Path] = []
        self.bound: dict[str, set[str]] = {}  # check -> the statuses whose alerts run actions

    def now(self) -> float:
        return time.time() - self.t0

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
        fifos = {n: self.base / f"kmsg-{n}" for n in self.cluster.nodes}
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
                   f"--ckpt-every {self.ckpt_every} --collective-timeout {self.s(600)}")
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
        c.setdefault("kernel", {}).update(kmsg_path=str(fifo))
        c["hang"].update(fast, stale_after=s.dur(300, 2), actions={"critical": ["restart"]})
        c["job_memory"].update(interval="0.5s", jitter="0s", window=20, min_span=s.dur(300, 3),
                               crit_horizon=s.dur(1200), warn_horizon=s.dur(7200), actions={"critical": ["restart"]})
        c["job_timelimit"].update(fast, margin=s.dur(600, 3), recheck=s.dur(300, 2),
                                  actions={"warning": ["signal", "requeue"]})
        c["job_switch"].update(fast)
        c["training_log"].update(fast, actions={"critical": ["restart"]})
        # A step here is 0.5 s, 30 s of real time: the recent window holds 20 steps, as 2 minutes of 6-second steps.
        c["job_pace"].update(fast, window=s.dur(600), slow_for=s.dur(600), warmup_steps=5, baseline_steps=20,
                             critical_when_pinned=True,
                             actions={"critical": ["restart_elsewhere"]} if self.slow_policy == "restart_elsewhere"
                             else {})
        raw["actions"] = {"requeue": {"type": "requeue", "wait_exit": s.dur(300, 2), "after_save": s.dur(30),
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
        return AgentProcess(self.agent_config(node, fifo), self.base / f"agent-{node}.log", env,
                            module="tests.helpers.fake_gpu_agent").start()

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
        return (self.run_dir / "pids" / f"{attempt}.{nodes[f.target % len(nodes)]}").exists()

    def attempt_nodes(self) -> tuple[str, list[str]]:
        """The current attempt and the nodes its ranks run on (the allocation's spare, if any, runs none), once every
        rank has started."""
        attempt = (self.run_dir / "attempt").read_text().strip() if (self.run_dir / "attempt").exists() else ""
        nodes = sorted(p.name[len(attempt) + 1:] for p in (self.run_dir / "pids").glob(f"{attempt}.*")) if attempt \
            else []
        return attempt, nodes if len(nodes) == RANKS else []

    def inject(self, f: Fault) -> None:
        attempt, nodes = self.attempt_nodes()
        node = nodes[f.target % len(nodes)] if nodes else ""
        row = {**asdict(f), "node": node, "injected": self.now()}
        faults = self.run_dir / "faults"
        if f.kind == "xid79" and node:
            self.gpu_lost.add(node)
            write_as_user(faults / f"gpu-lost-{node}", "lost")
            with open("/dev/kmsg", "w") as kmsg:
                kmsg.write(f"<4>{xid79_line(bus_of(node))}\n")
        elif f.kind == "hang":
            write_as_user(faults / "hang", f"{attempt} {f.target}")
        elif f.kind == "leak" and node:
            pid = int((self.run_dir / "pids" / f"{attempt}.{node}").read_text())
            headroom = 160 * MiB  # the cgroup is charged only what the rank allocates from now on
            self.cgroups.append(cg := memory_cgroup(headroom))
            (cg / "cgroup.procs").write_text(str(pid))
            per_step = headroom / MiB / (self.s(40 * 60) / self.step_time)  # the limit ~40 (real) minutes away
            row["oom_in"] = self.s(40 * 60)
            write_as_user(faults / "leak", f"{attempt} {node} {per_step:.3f}")
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
        elif f.kind == "slow" and node:
            write_as_user(faults / f"slow-{node}", f"{attempt} {SLOW_FACTOR}")
        self.rec.faults.append(row)
        self.rec.actions.append({"t": self.now(), "who": "fault", "what": f"{f.kind} {node}".strip()})

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
            for node in sorted(self.gpu_lost):  # the log says which node's CUDA call never returned
                if "DRAIN" not in self.cluster.node_states().get(node, ("", ""))[0].upper():
                    self.cluster.run("scontrol", "update", f"nodename={node}", "state=drain", "reason=operator: GPU lost",
                                     check=False)
                    did.append(f"drained {node}")
            self.cluster.run("scontrol", "requeue", self.job, check=False)
            did.append(f"requeued the job ({state.lower()}{', stale log' if stale else ''}{', NaN loss' if nan else ''})")
        if did:
            self.rec.actions.append({"t": t, "who": f"human ({why})", "what": "; ".join(did)})

    def watch_drains(self, t: float) -> None:
        known = {d["node"] for d in self.rec.drains}
        for node, (state, reason) in self.cluster.node_states().items():
            if "drain" in state and node not in known:
                self.rec.drains.append({"t": t, "node": node, "reason": reason, "right": node in self.gpu_lost})

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
        if self.trainguard:
            self.rec.alerts = self.fired()
            for node, agent in self.agents.items():
                for f in map(parse_log_line, agent.output().splitlines()):
                    if f.get("msg") == "action":
                        self.rec.actions.append({"t": log_time(f["ts"]) - self.t0, "who": f"agent {node}",
                                                 "what": f"{f.get('action')} {f.get('outcome')} ({f.get('check')})"})
        self.rec.actions.sort(key=lambda a: a["t"])
        return self.rec


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
        fired = [a for a in rec.alerts if a["check"] == check and t <= a["t"] < until + 5]
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
        stalled = None
        if restart:
            last = max((ts for ts, _, _ in rec.steps if ts < restart[0][0]), default=t)
            first = min((ts for ts, _, _ in rec.steps if restart[0][0] <= ts < until), default=None)
            stalled = round(first - max(last, t), 1) if first is not None else None
        faults.append({"kind": f["kind"], "node": f["node"], "at": round(t, 1), "by": by,
                       "detect_s": None if detected is None else round(detected, 2),
                       "deadline_s": round(deadline(f, scale, step_time), 1),
                       "resume_s": round(restart[0][0] - t, 1) if restart else None, "stalled_s": stalled,
                       "lost_steps": lost, **({"named": named} if f["kind"] == "slow" else {})})
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
            "human_looks_acted": sum(1 for a in rec.actions if a["who"] in ("human (look)", "human (look+page)"))}


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
    return {"xid79": 1.0, "hang": scale(300, 2) + 2.0, "leak": f.get("oom_in", 0.0),
            "disk_full": f.get("full_in", 0.0), "stop_switch": 3.0,
            "time_limit": max(0.0, f.get("limit_at", 0.0) - f["injected"] - scale(600, 3)) + 2.0,
            "nan": 3 * step_time + 2.0, "slow": 2 * scale(600) + 2.0}[f["kind"]]


def table(results: list[dict[str, Any]], seed: int, scale: Scale) -> str:
    w = next(r for r in results if r["trainguard"])
    human = w.get("human", asdict(Human()))
    without = [r for r in results if not r["trainguard"]]
    wo = next((r for r in without if r.get("human", asdict(Human())) == human), without[0])
    lines = [heading(f"Goodput under chaos (seed {seed}, time x{scale.factor:g})"),
             f"The human looks every {human['look_every_min']:g} minutes; paged, acts {human['page_response_min']:g} "
             "minutes after the alert.", "", "| | with trainguard | without |", "|---|---|---|"]
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
    for a, b in zip(w["faults"], wo["faults"], strict=True):
        def det(x: dict[str, Any]) -> str:
            return f"{x['by']} {x['detect_s']}" if x["detect_s"] is not None else x["by"]
        lines.append(f"| {a['kind']} ({a['node'] or '-'}) | {a['at']} | {det(a)} ({a['deadline_s']}) / {det(b)} | "
                     f"{a['resume_s']} / {b['resume_s']} | {a.get('stalled_s')} / {b.get('stalled_s')} | "
                     f"{a['lost_steps']} / {b['lost_steps']} |")
    for r, label in ((w, "with trainguard"), (wo, "without")):
        lines += ["", f"How each attempt ended ({label}; the trainer's own record, rank 0's where it has one):", ""]
        lines += [f"- {e['attempt']} at {e['t']} s, step {e['step']} (rank {e['rank']} on {e['node']}): {e['why']}"
                  for e in r.get("attempt_ends", [])] or ["- none recorded"]
    return "\n".join(lines + humans(w, human["look_every_min"], without))


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


def plot(records: list[Record], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    fig, axes = plt.subplots(len(records), 1, figsize=(12, 3.6 * len(records)), sharex=True, sharey=True)
    for ax, rec in zip(axes, records, strict=True):
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
        ax.set_title(("with trainguard" if rec.trainguard else "without trainguard") +
                     " (v alert, ^ purple: agent action, ^ black: human or user action)", fontsize=9, pad=4)
        ax.set_ylabel("step")
        ax.legend(loc="upper left", fontsize=7)
    axes[-1].set_xlabel("seconds since submission")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# entry points -----------------------------------------------------------------------------------------------------
def run_once(base: Path, trainguard: bool, faults: list[Fault], duration: float, scale: Scale, step_time: float,
             ckpt_every: int, human: Human, slow_policy: str = "alert") -> Record:
    base.mkdir(parents=True)
    run = Run(base, trainguard, faults, duration, scale, look_every=scale(human.look_every_min * 60),
              page_response=scale(human.page_response_min * 60), step_time=step_time, ckpt_every=ckpt_every,
              slow_policy=slow_policy)
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
              also_without: tuple[float, ...] = (), slow_policy: str = "alert") -> tuple[list[dict[str, Any]],
                                                                                             list[Record]]:
    """The run with trainguard and the one without it, with `human`; then one more run without it for each of
    `also_without` (how often that human looks, in minutes): the same schedule against other people on call."""
    duration = minutes * 60
    faults = schedule(seed, duration, kinds)
    base = Path(tempfile.mkdtemp(prefix="trainguard-multinode-goodput-", dir="/tmp"))
    base.chmod(0o755)
    runs = [(True, human, "with"), (False, human, "without")] + [
        (False, Human(m, human.page_response_min), f"without-{i}-look{m:g}") for i, m in enumerate(also_without)]
    records = []
    try:
        for trainguard, person, name in runs:
            records.append(run_once(base / name, trainguard, faults, duration, scale, step_time, ckpt_every, person,
                                    slow_policy))
    finally:
        if out_dir is None:
            shutil.rmtree(base, ignore_errors=True)
    results = [{**analyse(r, scale, step_time), "human": asdict(person)}
               for r, (_, person, _) in zip(records, runs, strict=True)]
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "goodput.json").write_text(json.dumps({"results": results, "records": [asdict(r) for r in records]},
                                                         indent=1))
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=24)
    p.add_argument("--minutes", type=float, default=15.0, help="each run (with and without trainguard, and --also-without's)")
    p.add_argument("--scale", type=float, default=60.0)
    p.add_argument("--out", type=Path, default=Path("/tmp/trainguard-goodput"))
    p.add_argument("--plot", type=Path, default=REPO / "docs" / "goodput-timeline.png")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"fault kinds, comma-separated (also: "
                   f"{', '.join(EXTRA_KINDS)}; none: a fault-free run)")
    p.add_argument("--slow-policy", choices=["alert", "restart_elsewhere"], default="alert",
                   help="what the job_pace finding does on the node at fault (docs/slow-jobs.md)")
    p.add_argument("--look-every", type=float, default=Human.look_every_min, metavar="MINUTES",
                   help="how often the human looks (real-world minutes, scaled)")
    p.add_argument("--page-response", type=float, default=Human.page_response_min, metavar="MINUTES",
                   help="how long the paged human takes to act (real-world minutes, scaled)")
    p.add_argument("--also-without", default="", metavar="MINUTES[,MINUTES...]",
                   help="one more run without trainguard for each: a human who looks that often (minutes)")
    a = p.parse_args(argv)
    if not (math.isfinite(a.look_every) and a.look_every > 0 and math.isfinite(a.page_response)
            and a.page_response >= 0):
        p.error("--look-every must be a number of minutes above 0, --page-response one of at least 0")
    try:
        also = other_humans(a.also_without, a.look_every)
    except ValueError as e:
        p.error(str(e))
    scale = Scale(a.scale)
    kinds = tuple(k for k in a.kinds.split(",") if k)
    if unknown := set(kinds) - set(KINDS) - set(EXTRA_KINDS):
        p.error(f"--kinds: unknown fault kinds {sorted(unknown)}; known: {', '.join(KINDS + EXTRA_KINDS)}")
    results, records = benchmark(a.seed, a.minutes, scale, kinds, out_dir=a.out,
                                 human=Human(a.look_every, a.page_response), also_without=also,
                                 slow_policy=a.slow_policy)
    print(table(results, a.seed, scale))
    if plot(records[:2], a.plot):  # with and without, the same human
        print(f"\nplot: {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
