"""The SLURM prolog and epilog gates (`slurm-prolog --check`, `slurm-epilog --check`) as slurmd runs them: real
subprocesses, the job's record first, real leftover processes of a test user, the scripted NVML."""

from __future__ import annotations

import json
import os
import pwd
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, HungMount, require_root, require_tool, wait_until
from tests.slurm_cluster import ensure_user

JOB_USER = "tgjob"


def gate(hook: str, tmp: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """The hook as slurmd runs it (as root, SLURM_* in its environment), through the scripted NVML."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    full |= {"TRAINGUARD_FAKE_GPUS": "2", "TRAINGUARD_FAKE_GPU_HEALTHY": "1", **env}
    return subprocess.run([sys.executable, "-m", "tests.helpers.fake_gpu_agent", hook, "--dir", str(tmp / "jobs"),
                           "--gate-dir", str(tmp / "gates"), *args], capture_output=True, text=True, timeout=60,
                          env=full, cwd=REPO)


def job_env(job_id: str, uid: int, **more: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": job_id, "SLURM_JOB_UID": str(uid), "SLURM_JOB_USER": pwd.getpwuid(uid).pw_name,
            "SLURMD_NODENAME": "gatenode", **more}


def prolog_config(tmp: Path, free_critical: str = "0%") -> Path:
    path = tmp / "prolog.toml"
    path.write_text(f"""[agent]
listen = ""
node_name = "gatenode"
state_dir = "{tmp}/state"
[checks.scratch]
type = "disk"
paths = ["{tmp}"]
free_critical = "{free_critical}"
free_warning = "0%"
inodes_free_warning = "0%"
inodes_free_critical = "0%"
""")
    return path


def record(tmp: Path, job_id: str) -> dict[str, object]:
    return json.loads((tmp / "jobs" / f"{job_id}.json").read_text())


def verdict(tmp: Path, name: str) -> dict[str, object]:
    return json.loads((tmp / "gates" / f"{name}.json").read_text())


# the prolog gate -----------------------------------------------------------------------------------------------------
def test_the_prolog_gate_passes_a_healthy_node_records_the_job_and_the_gpu_baseline(tmp_path: Path) -> None:
    # --checks: the gpu and disk checks; the xid check reads the shared /dev/kmsg, where other tests write XIDs
    done = gate("slurm-prolog", tmp_path, job_env("101", os.getuid()), "--check", "--config",
                str(prolog_config(tmp_path)), "--checks", "gpu,scratch")
    assert done.returncode == 0, done.stderr
    assert record(tmp_path, "101")["job_id"] == "101"
    assert verdict(tmp_path, "prolog")["pass"] is True
    baseline = json.loads((tmp_path / "gates" / "gpu-baseline.json").read_text())["used"]
    assert baseline == {"GPU-00000000-0000-4000-8000-000000000000": 2 << 30,
                        "GPU-00000001-0000-4000-8000-000000000000": 3 << 30}


def test_the_prolog_gate_fails_a_critical_gpu_or_disk_with_the_reason_and_still_writes_the_record(
        tmp_path: Path) -> None:
    done = gate("slurm-prolog", tmp_path, job_env("102", os.getuid(), TRAINGUARD_FAKE_GPU_HEALTHY="",
                                                  TRAINGUARD_FAKE_GPU_FAULT="remap_failed"),
                "--check", "--config", str(prolog_config(tmp_path)), "--checks", "gpu,scratch")
    assert done.returncode == 2
    assert "trainguard prolog gate: FAIL: gpu: GPU 1: row remapping failed: hardware fault, RMA the GPU" in done.stderr
    assert record(tmp_path, "102")["job_id"] == "102"  # the record first, whatever the gate says
    assert verdict(tmp_path, "prolog")["reason"] == "gpu: GPU 1: row remapping failed: hardware fault, RMA the GPU"
    done = gate("slurm-prolog", tmp_path, job_env("103", os.getuid()), "--check", "--config",
                str(prolog_config(tmp_path, free_critical="100%")), "--checks", "scratch")
    assert done.returncode == 2 and f"FAIL: scratch: {tmp_path}" in done.stderr, done.stderr


def test_without_check_the_hook_keeps_its_contract_and_an_unknown_gate_check_is_a_config_error(tmp_path: Path) -> None:
    done = gate("slurm-prolog", tmp_path, job_env("104", os.getuid(), TRAINGUARD_FAKE_GPU_FAULT="remap_failed",
                                                  TRAINGUARD_FAKE_GPU_HEALTHY=""))
    assert (done.returncode, done.stderr) == (0, "") and record(tmp_path, "104")["job_id"] == "104"
    assert not (tmp_path / "gates").exists()  # no gate ran
    done = gate("slurm-prolog", tmp_path, job_env("105", os.getuid()), "--check", "--config",
                str(prolog_config(tmp_path)), "--checks", "nope")
    assert done.returncode == 2 and "no check nope in" in done.stderr
    assert record(tmp_path, "105")["job_id"] == "105"


def test_the_prolog_gate_lets_the_job_start_when_its_checks_overrun_the_budget(tmp_path: Path) -> None:
    script = tmp_path / "slow.sh"
    script.write_text("#!/bin/sh\nsleep 5\nexit 2\n")
    script.chmod(0o755)
    config = prolog_config(tmp_path)
    config.write_text(config.read_text() + f'[checks.slow]\ntype = "command"\ncommand = ["{script}"]\n')
    t0 = time.monotonic()
    done = gate("slurm-prolog", tmp_path, job_env("106", os.getuid()), "--check", "--config", str(config),
                "--checks", "slow", "--budget", "1s")
    assert time.monotonic() - t0 < 5  # the interpreter's start plus the 1s budget, not the check's 5s
    assert done.returncode == 0 and "still running after the budget of 1s: node not refused" in done.stderr


def test_the_prolog_gate_runs_the_configured_quick_diag_within_its_budget_and_records_it(tmp_path: Path) -> None:
    """`--diag diag`: after the checks, the diag action's quick level by the scripted tools (their real output); a
    failed test refuses the node, named, and every run goes into the agent's ledger; a level whose budget does not
    fit what is left of the gate's is skipped with a line, its tools never started."""
    from tests.test_diag import cat, ran
    from trainguard.pipeline.ledger import read_history
    from trainguard.pipeline.store import Store

    tools = tmp_path / "tools"
    tools.mkdir()
    cat(tools, "nvidia-smi", "nvidia-smi-q-h100-pass.txt")
    cat(tools, "dcgmi", "dcgmi-r1-fail-gb10.json", rc=226)
    config = prolog_config(tmp_path)
    config.write_text(config.read_text() + f'[actions.diag]\ntool_dir = "{tools}"\ngpus = 1\nbudget_quick = "5s"\n'
                      f'[actions.slow_diag]\ntype = "diag"\ntool_dir = "{tools}"\nbudget_quick = "30s"\n')
    Store(tmp_path / "state").close()  # the agent's database, as an agent that ran here leaves it
    done = gate("slurm-prolog", tmp_path, job_env("107", os.getuid()), "--check", "--config", str(config),
                "--checks", "gpu,scratch", "--diag", "diag")
    assert done.returncode == 2, done.stderr
    assert "trainguard prolog gate: FAIL: diag: dcgmi diag -r 1: failed software: GPU 0: Persistence" in done.stderr
    assert str(verdict(tmp_path, "prolog")["reason"]).startswith("diag: dcgmi diag -r 1: failed software")
    assert ran(tools) == ["nvidia-smi -q", "dcgmi diag -r 1 -j"]

    cat(tools, "dcgmi", "dcgmi-r3-pass-8gpu.json")
    done = gate("slurm-prolog", tmp_path, job_env("108", os.getuid()), "--check", "--config", str(config),
                "--checks", "gpu,scratch", "--diag", "diag")
    assert done.returncode == 0 and verdict(tmp_path, "prolog")["pass"] is True, done.stderr
    rows = [r for r in read_history(tmp_path / "state", 0)[0] if r.event == "diag"]
    assert [(r.component, r.cls, r.data["source"], r.data["passed"], [f["test"] for f in r.data["failed"]])
            for r in rows] == [("gatenode", "quick", "prolog", False, ["dcgmi diag -r 1"]),
                               ("gatenode", "quick", "prolog", True, [])]

    (tools / "ran").unlink()
    done = gate("slurm-prolog", tmp_path, job_env("109", os.getuid()), "--check", "--config", str(config),
                "--checks", "gpu,scratch", "--diag", "slow_diag")
    assert done.returncode == 0, done.stderr
    assert "quick diag skipped: its budget (30s) does not fit what is left of the gate's (" in done.stderr
    assert ran(tools) == []
    done = gate("slurm-prolog", tmp_path, job_env("110", os.getuid()), "--check", "--config", str(config),
                "--checks", "gpu", "--diag", "nope")
    assert done.returncode == 2 and "no diag action 'nope' in" in done.stderr


# the epilog gate -----------------------------------------------------------------------------------------------------
@pytest.fixture
def job_user() -> int:
    require_root()
    require_tool("setpriv")
    ensure_user(JOB_USER)
    return pwd.getpwnam(JOB_USER).pw_uid


def start_as(uid: int, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A process of the job's user, as a job's task would leave it (its own session: slurmstepd's kill misses it)."""
    return subprocess.Popen([require_tool("setpriv"), f"--reuid={uid}", f"--regid={pwd.getpwuid(uid).pw_gid}",
                             "--clear-groups", *argv], env={"PATH": "/usr/bin:/bin", **env},
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


@pytest.fixture
def leftovers() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)


def test_a_clean_job_passes_the_epilog(tmp_path: Path, job_user: int) -> None:
    done = gate("slurm-epilog", tmp_path, job_env("201", job_user), "--check", "--tmp", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert record(tmp_path, "201")["ended"] and verdict(tmp_path, "epilog")["pass"] is True


def test_a_process_of_the_job_left_behind_fails_the_epilog_named(tmp_path: Path, job_user: int,
                                                                  leftovers: list[subprocess.Popen[bytes]]) -> None:
    """A task that escaped slurmstepd's kill: still running as the job's user with the job's SLURM_JOB_ID. A process
    of the same user from another job is not this job's."""
    leftovers.append(start_as(job_user, ["sleep", "300"], {"SLURM_JOB_ID": "202"}))
    leftovers.append(start_as(job_user, ["sleep", "301"], {"SLURM_JOB_ID": "999"}))  # another job of the user
    wait_until(lambda: all(Path(f"/proc/{p.pid}/environ").exists() for p in leftovers), 5)
    time.sleep(0.2)  # setpriv has exec'd sleep
    done = gate("slurm-epilog", tmp_path, job_env("202", job_user), "--check", "--grace", "0.5s", "--tmp",
                str(tmp_path))
    assert done.returncode == 2
    line = next(x for x in done.stderr.splitlines() if "FAIL" in x)
    assert f"1 process(es) of the job left: pid {leftovers[0].pid} 'sleep' uid {job_user} (SLURM_JOB_ID=202)" in line
    assert str(leftovers[1].pid) not in line
    assert record(tmp_path, "202")["ended"]  # the record completed first
    assert "pid" in str(verdict(tmp_path, "epilog")["reason"])


def test_a_process_still_exiting_within_the_grace_passes(tmp_path: Path, job_user: int,
                                                         leftovers: list[subprocess.Popen[bytes]]) -> None:
    leftovers.append(start_as(job_user, ["sleep", "1"], {"SLURM_JOB_ID": "203"}))
    time.sleep(0.2)
    done = gate("slurm-epilog", tmp_path, job_env("203", job_user), "--check", "--grace", "10s", "--tmp",
                str(tmp_path))
    assert done.returncode == 0, done.stderr


def test_a_process_holding_the_jobs_gpu_and_its_memory_fail_the_epilog(tmp_path: Path, job_user: int,
                                                                       leftovers: list[subprocess.Popen[bytes]]) -> None:
    """Per NVML (scripted): a process of the job on GPU 1, the job's, holding 6 GiB over the baseline the prolog gate
    recorded. GPU 0 is not the job's: what it holds is not this job's."""
    assert gate("slurm-prolog", tmp_path, job_env("204", job_user), "--check", "--config",
                str(prolog_config(tmp_path)), "--checks", "gpu").returncode == 0
    holder = start_as(job_user, ["sleep", "300"], {"SLURM_JOB_ID": "204"})
    leftovers.append(holder)
    other = start_as(job_user, ["sleep", "302"], {})
    leftovers.append(other)
    procs = f"1:{holder.pid}:{6 << 30},0:{other.pid}:{1 << 30}"
    done = gate("slurm-epilog", tmp_path, job_env("204", job_user, SLURM_JOB_GPUS="1",
                                                  TRAINGUARD_FAKE_GPU_PROCS=procs), "--check", "--grace", "0.3s",
                "--tmp", str(tmp_path))
    assert done.returncode == 2
    line = next(x for x in done.stderr.splitlines() if "FAIL" in x)
    assert f"pid {holder.pid} 'sleep' uid {job_user} (on GPU 1)" in line and str(other.pid) not in line
    assert "GPU 1 holds 6.0 GiB more memory than before the job (9.0 GiB used, baseline 3.0 GiB)" in line, line


def test_zombie_and_d_state_leftovers_are_named_as_such(tmp_path: Path, leftovers: list[subprocess.Popen[bytes]],
                                                        hung_mount: HungMount) -> None:
    """A zombie: a child the job's leftover never reaped. A D-state process: blocked in statfs on a FUSE mount that
    never answers (the hung_mount fixture; root's, so this job is root's: a job user cannot reach pytest's dirs).
    Not even SIGKILL ends it until the mount is aborted (hung_mount's teardown, before the leftovers are killed)."""
    require_root()
    parent = subprocess.Popen([sys.executable, "-c", "import os, time\nif os.fork() == 0: os._exit(0)\ntime.sleep(300)"],
                              env={"SLURM_JOB_ID": "205"}, start_new_session=True)
    leftovers.append(parent)
    # A FUSE request first waits interruptibly (S); once a signal the process handles arrives, the kernel sends an
    # INTERRUPT and waits for the answer killably only: D. hangfs answers neither.
    blocked = "import os, signal, sys\nsignal.signal(signal.SIGUSR1, lambda *a: None)\nos.statvfs(sys.argv[1])"
    stuck = subprocess.Popen([sys.executable, "-c", blocked, str(hung_mount.mountpoint)], env={"SLURM_JOB_ID": "205"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    leftovers.append(stuck)

    def state(pid: int) -> str:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]

    wait_until(lambda: hung_mount.statfs_calls() >= 1 and state(stuck.pid) == "S", 10, what="statfs blocked")
    stuck.send_signal(signal.SIGUSR1)
    wait_until(lambda: state(stuck.pid) == "D", 10, what="statfs blocked in D state")
    zombie = wait_until(lambda: next((int(p) for p in os.listdir("/proc") if p.isdigit() and
                                      _ppid(int(p)) == parent.pid), None), 10, what="the zombie")
    assert isinstance(zombie, int)
    wait_until(lambda: state(zombie) == "Z", 5)
    done = gate("slurm-epilog", tmp_path, job_env("205", 0), "--check", "--grace", "0s")
    assert done.returncode == 2
    line = next(x for x in done.stderr.splitlines() if "FAIL" in x)
    comm = Path(f"/proc/{parent.pid}/comm").read_text().strip()
    assert f"pid {zombie} {comm!r} uid 0 zombie (child of {parent.pid})" in line, line
    assert f"pid {stuck.pid} {comm!r} uid 0 in D state (uninterruptible) (SLURM_JOB_ID=205)" in line, line


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def test_the_jobs_files_left_in_dev_shm_over_the_threshold_fail_the_epilog(job_user: int) -> None:
    with tempfile.TemporaryDirectory(prefix="tg-shm-") as name:
        shm = Path(name)
        big = shm / "nccl-shm-0"
        big.write_bytes(b"x" * (3 << 20))
        os.chown(big, job_user, -1)
        small = shm / "root-own"
        small.write_bytes(b"x" * (4 << 20))  # root's: not the job's
        tmp = shm / "gate"
        tmp.mkdir()
        done = gate("slurm-epilog", tmp, job_env("206", job_user), "--check", "--tmp", str(shm), "--shm-max", "2MiB")
        assert done.returncode == 2
        line = next(x for x in done.stderr.splitlines() if "FAIL" in x)
        assert f"{shm}: the job's user left 3.0 MiB in 1 file(s) (over 2.0 MiB): {big} (3.0 MiB)" in line, line
        done = gate("slurm-epilog", tmp, job_env("207", job_user), "--check", "--tmp", str(shm), "--shm-max", "4MiB")
        assert done.returncode == 0, done.stderr
