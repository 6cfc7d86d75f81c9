"""A real one-node SLURM cluster (Debian's slurmctld, slurmd, munge) for the tests.

The node is named after the host; munged runs as user munge with /run/munge created; jobs run as
the unprivileged test users `tgjob` and `tgother`, and `tgmate`, a member of the group `tgteam` (a teammate who may
stop tgjob's runs where the switch group is tgteam).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
JOB_USER, OTHER_USER = "tgjob", "tgother"
TEAM_USER, TEAM_GROUP = "tgmate", "tgteam"
DAEMONS = ("slurmctld", "slurmd", "slurmdbd", "munged", "mariadbd", "mariadb-install-db", "sbatch", "squeue", "scontrol",
           "scancel", "sacct", "sacctmgr")
PORTS = (6917, 6918, 6919, 6920)  # slurmctld, slurmd, mariadbd, slurmdbd: off the defaults, so a node's own is untouched


def sh(*cmd: str, user: str | None = None, check: bool = True, timeout: float = 30, cwd: str | None = None) -> str:
    argv = ["runuser", "-u", user, "--", *cmd] if user else list(cmd)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def submit_held(n: int, timeout: float = 3600) -> None:
    """`n` held jobs of the other test user (a queue that is not this node's), four submitters at once: one after
    the other, 10,000 sbatch took most of the 10 minutes a benchmark run may hold the shared test lock. xargs exits
    non-zero when any sbatch failed; `timeout` ends its whole process group, so no submitter goes on after it (the
    subprocess timeout alone would end only runuser)."""
    loop = f"seq {n} | xargs -P 4 -n 1 sh -c 'exec sbatch --hold --quiet -J held -o /dev/null --wrap true' _"
    sh("timeout", f"{timeout:.0f}", "bash", "-c", loop, user=OTHER_USER, timeout=timeout + 30, cwd=tempfile.gettempdir())


def missing_components() -> list[str]:
    return [d for d in DAEMONS if shutil.which(d) is None and not Path("/usr/sbin", d).exists()]


def ensure_user(name: str) -> None:
    try:
        import pwd

        pwd.getpwnam(name)
    except KeyError:
        sh("useradd", "--create-home", "--shell", "/bin/bash", name)


def ensure_member(user: str, group: str) -> None:
    """`user` exists with `group` among its supplementary groups (as `usermod -aG` gives a teammate)."""
    import grp

    try:
        grp.getgrnam(group)
    except KeyError:
        sh("groupadd", group)
    ensure_user(user)
    if user not in grp.getgrnam(group).gr_mem:
        sh("usermod", "-aG", group, user)


def _ensure_munge() -> None:
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        key.parent.mkdir(parents=True, exist_ok=True)
        key.write_bytes(os.urandom(128))
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
    run_dir = Path("/run/munge")
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.chown(run_dir, "munge", "munge")
    run_dir.chmod(0o755)
    if subprocess.run("munge -n | unmunge", shell=True, capture_output=True, timeout=10).returncode != 0:
        sh("runuser", "-u", "munge", "--", "/usr/sbin/munged")
        deadline = time.monotonic() + 10
        while subprocess.run("munge -n | unmunge", shell=True, capture_output=True, timeout=10).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError("munged did not come up")
            time.sleep(0.2)


class SlurmCluster:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.node = socket.gethostname().split(".")[0]
        self.conf = base / "slurm.conf"
        self.lib = base / "lib"  # the trainer helper and toy trainer, readable by the job users
        self.python = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else shutil.which("python3") or "python3"

    # lifecycle ------------------------------------------------------------------------------
    @staticmethod
    def kill_stale(marker: str = "trainguard-slurm-") -> None:
        """Daemons of an earlier test session that died without teardown would hold our ports."""
        for p in psutil.process_iter(["name", "cmdline"]):
            cmd = " ".join(p.info.get("cmdline") or [])
            if marker in cmd and any(d in cmd for d in ("slurmctld", "slurmd", "slurmstepd", "mariadbd")):
                try:
                    p.kill()
                    p.wait(5)
                except psutil.Error:
                    pass

    def start(self) -> SlurmCluster:
        self.kill_stale()
        for user in (JOB_USER, OTHER_USER):
            ensure_user(user)
        ensure_member(TEAM_USER, TEAM_GROUP)
        _ensure_munge()
        for sub in ("state", "spool", "log", "jobs", "lib/trainguard", "lib/examples"):
            (self.base / sub).mkdir(parents=True, exist_ok=True)
        for path in [self.base, *self.base.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        (self.base / "jobs").chmod(0o1777)
        shutil.copy(REPO / "trainguard" / "__init__.py", self.lib / "trainguard" / "__init__.py")
        shutil.copy(REPO / "trainguard" / "trainer.py", self.lib / "trainguard" / "trainer.py")
        for example in ("train_toy.py", "train_ddp.py"):
            shutil.copy(REPO / "examples" / example, self.lib / "examples" / example)
        cpus = os.cpu_count() or 2
        mem = max(1024, psutil.virtual_memory().total // 2**20 - 2048)
        b = self.base
        self.conf.write_text(f"""\
ClusterName=trainguard-test
SlurmctldHost={self.node}
SlurmUser=root
AuthType=auth/munge
SlurmctldPort={PORTS[0]}
SlurmdPort={PORTS[1]}
StateSaveLocation={b}/state
SlurmdSpoolDir={b}/spool
SlurmctldPidFile={b}/slurmctld.pid
SlurmdPidFile={b}/slurmd.pid
SlurmctldLogFile={b}/log/slurmctld.log
SlurmdLogFile={b}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MinJobAge=600
MaxJobCount=20000
MessageTimeout=5
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost={self.node}
AccountingStoragePort={PORTS[3]}
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
KillWait=5
Prolog={b}/hooks/prolog
HealthCheckProgram={b}/hooks/healthcheck
HealthCheckInterval=5
NodeName={self.node} CPUs={cpus} RealMemory={mem} State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
# Nodes that never register (nothing listens on port 1): a partition of 20 for the drain circuit breaker; they can
# still be drained and undrained. No job is ever placed there (the partition is not the default).
NodeName=tg-ghost[01-19] NodeAddr=127.0.0.1 Port=1 CPUs=1 RealMemory=100 State=DOWN
PartitionName=fleet Nodes={self.node},tg-ghost[01-19] Default=NO MaxTime=INFINITE State=UP
""")
        self.conf.chmod(0o644)
        (b / "hooks").mkdir(exist_ok=True)
        for hook in ("prolog", "epilog", "healthcheck"):
            self.set_hook(hook, "exit 0")
        os.environ["SLURM_CONF"] = str(self.conf)
        self.start_accounting()
        self.start_ctld()
        sh("slurmd", "-f", str(self.conf))
        self.wait(lambda: "idle" in sh("sinfo", "-h", "-o", "%T", check=False), 30, "node idle")
        return self

    def start_accounting(self) -> None:
        """MariaDB and slurmdbd, so that `sacct` knows jobs the controller has forgotten."""
        b = self.base
        db = b / "mysql"
        db.mkdir()
        shutil.chown(db, "mysql", "mysql")
        sh("mariadb-install-db", "--user=mysql", f"--datadir={db}/data", "--auth-root-authentication-method=socket",
           "--skip-test-db", timeout=120)
        socket_path = db / "mysqld.sock"
        subprocess.Popen(["mariadbd", "--no-defaults", "--user=mysql", f"--datadir={db}/data", f"--socket={socket_path}",
                          f"--port={PORTS[2]}", "--bind-address=127.0.0.1", f"--pid-file={db}/mysqld.pid",
                          "--character-set-server=utf8mb4",
                          f"--log-error={b}/log/mysqld.log", "--innodb-buffer-pool-size=32M"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.wait(socket_path.exists, 60, "mariadbd socket")
        sh("mariadb", f"--socket={socket_path}", "-e",
           "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'trainguard-test';"
           " GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';")
        dbd = b / "slurmdbd.conf"  # slurmdbd reads it next to slurm.conf; it must be private to SlurmUser
        dbd.write_text(f"""\
AuthType=auth/munge
DbdHost={self.node}
DbdPort={PORTS[3]}
SlurmUser=root
PidFile={b}/slurmdbd.pid
LogFile={b}/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={PORTS[2]}
StorageUser=slurm
StoragePass=trainguard-test
StorageLoc=slurm_acct_db
""")
        dbd.chmod(0o600)
        sh("slurmdbd")
        self.wait(lambda: subprocess.run(["sacctmgr", "-n", "list", "cluster"], capture_output=True,
                                         timeout=10).returncode == 0, 30, "slurmdbd answering")
        sh("sacctmgr", "-i", "add", "cluster", "trainguard-test", check=False)

    def start_ctld(self) -> None:
        sh("slurmctld", "-f", str(self.conf))
        self.wait(lambda: subprocess.run(["scontrol", "ping"], capture_output=True, timeout=10).returncode == 0,
                  30, "slurmctld answering")

    def restart_ctld_forgetting_jobs(self) -> None:
        """As if MinJobAge had passed for every job: only accounting still knows them."""
        self.stop_ctld()
        sh("slurmctld", "-c", "-f", str(self.conf))
        self.wait(lambda: subprocess.run(["scontrol", "ping"], capture_output=True, timeout=10).returncode == 0,
                  30, "slurmctld answering")

    def stop_ctld(self) -> None:
        self._kill("slurmctld.pid")

    def _kill(self, pidfile: str) -> None:
        path = self.base / pidfile
        if path.exists():
            try:
                proc = psutil.Process(int(path.read_text().strip()))
                proc.terminate()
                proc.wait(10)
            except (psutil.Error, ValueError):
                pass

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "-u", JOB_USER], capture_output=True, timeout=10)
        subprocess.run(["scancel", "-u", OTHER_USER], capture_output=True, timeout=10)
        time.sleep(1)
        self._kill("slurmd.pid")
        self._kill("slurmctld.pid")
        self._kill("slurmdbd.pid")
        self._kill("mysql/mysqld.pid")
        for p in psutil.process_iter(["name", "cmdline"]):
            if "slurmstepd" in (p.info.get("name") or "") and str(self.base) in " ".join(p.info.get("cmdline") or []):
                p.kill()

    # helpers ----------------------------------------------------------------------------------
    @staticmethod
    def wait(predicate: object, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():  # type: ignore[operator]
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(0.2)

    def set_hook(self, hook: str, body: str) -> None:
        """The Prolog, Epilog or HealthCheckProgram slurmd runs: `exit 0` unless a test puts trainguard there."""
        path = self.base / "hooks" / hook
        tmp = path.with_suffix(".tmp")
        tmp.write_text(f"#!/bin/sh\n{body}\n")
        tmp.chmod(0o755)
        tmp.replace(path)  # atomically: slurmd may be running it right now

    def workdir(self, user: str = JOB_USER) -> Path:
        d = self.base / "jobs" / uuid.uuid4().hex[:8]
        d.mkdir()
        shutil.chown(d, user, user)
        return d

    def toy_command(self, *args: str) -> str:
        return f"exec {self.python} {self.lib}/examples/train_toy.py " + " ".join(args)

    def submit(self, command: str, *sbatch_args: str, user: str = JOB_USER, workdir: Path | None = None,
               name: str | None = None) -> str:
        workdir = workdir or self.workdir(user)
        script = workdir / f"job-{uuid.uuid4().hex[:6]}.sh"
        script.write_text(f"#!/bin/bash\n{command}\n")
        shutil.chown(script, user, user)
        args = ["sbatch", "--parsable", f"--chdir={workdir}", f"--output={workdir}/%x-%A_%a.out"]
        if name:
            args.append(f"--job-name={name}")
        out = sh(*args, *sbatch_args, str(script), user=user, cwd=str(workdir))
        return out.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        out = sh("scontrol", "show", "job", "--oneliner", job_id, check=False)
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def jobs_of(self, array_job: str) -> list[dict[str, str]]:
        out = sh("scontrol", "show", "job", "--oneliner", array_job, check=False)
        return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in out.splitlines() if line.strip()]

    def wait_state(self, job_id: str, states: tuple[str, ...], timeout: float = 30) -> dict[str, str]:
        try:
            self.wait(lambda: self.job(job_id).get("JobState") in states, timeout, f"job {job_id} in {states}")
        except AssertionError as exc:  # why it is not: the job's state and reason, and the node's
            job, node = self.job(job_id), sh("sinfo", "-h", "-N", "-o", "%N %T %E", check=False).strip()
            raise AssertionError(f"{exc}: it is {job.get('JobState')} ({job.get('Reason')}); nodes: {node}") from None
        return self.job(job_id)

    def rpc_counts(self, reset: bool = False) -> dict[str, int]:
        """slurmctld's RPC counts by message type since the last reset (`sdiag`; `sdiag -r` first when `reset`)."""
        if reset:
            sh("sdiag", "-r")
        return parse_sdiag(sh("sdiag"))

    def use_epilog(self, on: bool) -> None:
        """Add or remove `Epilog=` (its hook) and reconfigure. Off by default: an epilog, even `exit 0`, keeps a
        job COMPLETING a moment longer, which tests of requeues and prolog failures would see."""
        line = f"Epilog={self.base}/hooks/epilog\n"
        self.conf.write_text(self.conf.read_text().replace(line, "") + (line if on else ""))
        sh("scontrol", "reconfigure")
        self.wait(lambda: subprocess.run(["scontrol", "ping"], capture_output=True, timeout=10).returncode == 0,
                  30, "slurmctld answering")

    @contextlib.contextmanager
    def trainguard_hooks(self, records: Path, prolog_tail: str = "") -> Iterator[None]:
        """`trainguard slurm-prolog`/`slurm-epilog --dir records` as this cluster's Prolog and Epilog (docs/slurm.md);
        `prolog_tail` runs after the prolog's record is written."""
        hook = f"cd / && {sys.executable} -m trainguard slurm-%s --dir {records}"
        self.set_hook("prolog", hook % "prolog" + prolog_tail)
        self.set_hook("epilog", hook % "epilog")
        self.use_epilog(True)
        try:
            yield
        finally:
            self.set_hook("prolog", "exit 0")
            self.use_epilog(False)

    def node_info(self) -> dict[str, str]:
        out = sh("scontrol", "show", "node", "--oneliner", self.node)
        state = re.search(r"\bState=(\S+)", out)
        reason = re.search(r"\bReason=(.*?)(?: \[\w+@| \w+=|$)", out)
        return {"State": state.group(1) if state else "", "Reason": reason.group(1) if reason else ""}

    def resume_node(self) -> None:
        subprocess.run(["scontrol", "update", f"nodename={self.node}", "state=resume"], capture_output=True, timeout=10)

    def tidy(self) -> str:
        """Resume the node if drained and cancel the jobs that would take or hold it (held ones stay: a queue of
        held jobs is what some tests build on purpose); says what it found, or "" when nothing."""
        found = []
        node = self.node_info()
        if "DRAIN" in node["State"]:
            found.append(f"node {node['State']} ({node['Reason']})")
            self.resume_node()
        rows = sh("squeue", "-h", "-t", "PENDING,RUNNING,CONFIGURING,SUSPENDED", "-o", "%i|%T|%r", check=False)
        live = [r.split("|")[0] for r in rows.splitlines() if r.count("|") == 2 and "Held" not in r.split("|")[2]]
        if live:
            found.append(f"jobs {' '.join(live)}")
            sh("scancel", *live, check=False)
        return "; ".join(found)


_SDIAG_RPC = re.compile(r"^\s+([A-Z][A-Z0-9_]+)\s+\(\s*\d+\) count:(\d+)", re.M)


def parse_sdiag(text: str) -> dict[str, int]:
    """The "by message type" table of `sdiag` (tests/data/slurm/sdiag.txt) as message type -> count."""
    table = text.split("Remote Procedure Call statistics by message type", 1)[-1].split("statistics by user", 1)[0]
    return {m.group(1): int(m.group(2)) for m in _SDIAG_RPC.finditer(table)}


def job_info_rpcs(counts: dict[str, int]) -> int:
    """The REQUEST_JOB_INFO* RPCs (the whole queue, one job, ...): what an agent asks about jobs (issue 19 counts
    these; a `squeue -u` is REQUEST_JOB_USER_INFO, which the agent never sends)."""
    return sum(n for name, n in counts.items() if name.startswith("REQUEST_JOB_INFO"))
