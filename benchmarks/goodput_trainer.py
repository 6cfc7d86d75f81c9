#!/usr/bin/env python3
"""One rank of the data-parallel toy job of benchmarks/goodput.py, started by `srun` on every node of the job.

Standard library and trainguard.trainer only (the job user runs the system Python). Every step each rank works
(`--step-time`), then waits for all ranks in a barrier of files, as data-parallel ranks wait in all_reduce; a rank
missing for `--collective-timeout` makes the others fail the way a Gloo/NCCL timeout does. Each rank's barrier file
carries its vote (stop, save), so all ranks decide together, as a collective would. Rank 0 checkpoints every
`--ckpt-every` steps and on request; a restarted job resumes from the last checkpoint whose loss is finite.

Faults are files the harness writes into `<run-dir>/faults/`, each naming the attempt (job id, restart count, srun
step) it hits, so a requeued or restarted job runs clean: `gpu-lost-NODE` (the rank there hangs in a CUDA call, as
processes on a GPU that fell off the bus do), `ib-down-NODE` (the rank there logs NCCL's NET/IB completion error and
hangs in its collective, as over an HCA port that went down), `hang` (`ATTEMPT RANK`: that rank stops before the barrier),
`crash` (`ATTEMPT RANK`: that rank dies of a CUDA error, PyTorch's traceback in its log; srun's --kill-on-bad-exit
ends the others), `leak`
(`ATTEMPT NODE MB`: the rank there grows by MB each step), `nan` (`ATTEMPT`: the loss is NaN from now on in this
attempt), `slow-NODE` (`ATTEMPT FACTOR`: the rank there takes FACTOR times as long a step, as on a throttled GPU; the
others wait for it in the barrier).

With `--data PATH` (`{node}` replaced by the rank's node) each rank reads a small shard of its node's data mount every
step, before its work, as a data loader fetches the step's batch: while that mount hangs (a dead NFS server), the rank
blocks in the read, in D state, and so does any rank started on that node until the mount answers again.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

sys.path.insert(0, str(Path(__file__).resolve().parent))  # trainguard/trainer.py is copied beside this file

from trainguard.trainer import Trainer


def env(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def checkpoints(ckpt_dir: Path) -> list[tuple[int, float]]:
    out = []
    for path in sorted(ckpt_dir.glob("ckpt-*.json")):
        try:
            data = json.loads(path.read_text())
            out.append((int(data["step"]), float(data["loss"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a torn or foreign file is not a checkpoint
    return out


def resume_step(ckpt_dir: Path) -> tuple[int, float]:
    """The step after the last checkpoint with a finite loss (a NaN checkpoint would poison the run)."""
    good = [(s, loss) for s, loss in checkpoints(ckpt_dir) if math.isfinite(loss)]
    return (good[-1][0] + 1, good[-1][1]) if good else (0, 4.0)


def save(ckpt_dir: Path, step: int, loss: float, pad: int, progress: TextIO) -> None:
    path = ckpt_dir / f"ckpt-{step:07d}.json"
    tmp = ckpt_dir / f".ckpt-{step:07d}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps({"step": step, "loss": loss if math.isfinite(loss) else "nan", "time": time.time(),
                            "pad": "x" * pad}))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    line = f"checkpoint saved step={step} loss={loss:.4f} t={time.time():.3f}"
    print(line, flush=True)
    progress.write(line + "\n")
    for old in sorted(ckpt_dir.glob("ckpt-*.json"))[:-3]:  # keep the last three
        old.unlink(missing_ok=True)


def fault(run_dir: Path, name: str) -> list[str]:
    try:
        return (run_dir / "faults" / name).read_text().split()
    except OSError:
        return []


def stuck_in_cuda_call() -> None:
    """Where a process whose GPU fell off the bus sits: a CUDA call that never returns."""
    while True:
        time.sleep(3600)


def gpu_gone(run_dir: Path, node: str, rank: int, step: int) -> None:
    """Checked before each step, in the barrier and before a save: a rank whose GPU is gone computes nothing more and
    saves nothing (its state was on that GPU)."""
    if fault(run_dir, f"gpu-lost-{node}"):
        print(f"rank {rank}: step {step}: CUDA call not returning (GPU lost on {node})", flush=True)
        stuck_in_cuda_call()
    if fault(run_dir, f"ib-down-{node}"):  # the HCA's port is down: NCCL's transport fails, the collective never ends
        print(f"{node}:{os.getpid()}:{os.getpid()} [0] NCCL WARN NET/IB : Got completion from peer 10.0.0.{rank}<38536> "
              "with error 12, opcode 0, len 0, vendor err 129", flush=True)
        stuck_in_cuda_call()


# What PyTorch 2.8+ prints when a kernel faults: the lines of a real illegal memory access (THUDM/slime#1297, kept in
# tests/data/messages/corpus.toml), after the traceback's head.
CUDA_CRASH = """\
Traceback (most recent call last):
  File "goodput_trainer.py", in main (step {step})
torch.AcceleratorError: CUDA error: an illegal memory access was encountered
Search for `cudaErrorIllegalAddress' in \
https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html for more information.
Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions."""


SHARD = 4096  # bytes of the data mount read each step


def read_shard(path: str) -> None:
    """The step's batch from the node's data mount. Opened anew each step: a FUSE file opened without keep_cache
    drops its cached pages, so every read reaches the mount (and blocks while it hangs), as an uncached NFS read does."""
    with open(path, "rb") as f:
        f.read(SHARD)


def stuck_before_all_reduce() -> None:
    while True:
        time.sleep(3600)


STOPS: dict[str, Any] = {}  # where this rank's stop is recorded (run dir, attempt, rank, node), set by main


def stop_reason(trainer: Trainer) -> str:
    """Why this rank is asked to stop: the signal (USR1: save and exit, as `signal` sends; TERM: scancel, SLURM's
    own kill or the time limit) or the stop switch, with who made it and when."""
    if trainer.last_signal:
        return trainer.last_signal
    path = trainer.switch_dir / "stop"
    try:
        st = path.lstat()
    except OSError:
        return "stop asked, no signal or switch seen"
    return f"stop switch (uid {st.st_uid}, written {st.st_mtime:.3f})"


def record_stop(why: str, step: int | None) -> None:
    """One line per rank and attempt in RUN_DIR/stops.jsonl: how the attempt ended on this rank (issue 24's run had
    attempts that exited 0 early with no known cause). Appended with one write: lines of ranks never interleave."""
    if not STOPS or STOPS.get("recorded"):
        return
    STOPS["recorded"] = True
    line = json.dumps({"t": time.time(), "attempt": STOPS["attempt"], "rank": STOPS["rank"], "node": STOPS["node"],
                       "step": step, "why": why})
    with contextlib.suppress(OSError):
        fd = os.open(STOPS["run_dir"] / "stops.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)


def main() -> int:
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--step-time", type=float, default=0.5)
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--ckpt-pad", type=int, default=65536)
    p.add_argument("--collective-timeout", type=float, default=10.0)
    p.add_argument("--data", default="", help="a file of the node's data mount read every step ({node}: the node)")
    a = p.parse_args()
    rank, world = int(env("SLURM_PROCID", "0")), int(env("SLURM_NTASKS", "1"))
    node = env("SLURMD_NODENAME", "?")
    # job.requeues.step: a requeue (SLURM_RESTART_COUNT) or a restart in place (a new srun step) is a new attempt
    attempt = f"{env('SLURM_JOB_ID', '0')}.{env('SLURM_RESTART_COUNT', '0')}.{env('SLURM_STEP_ID', '0')}"
    trainer = Trainer(switch_dir=Path.cwd() / ".trainguard").install()  # rank 0 alone writes the heartbeat
    barrier = a.run_dir / "barrier" / attempt
    barrier.mkdir(parents=True, exist_ok=True)
    (a.run_dir / "pids").mkdir(exist_ok=True)
    (a.run_dir / "pids" / f"{attempt}.{node}").write_text(str(os.getpid()))
    if rank == 0:
        (a.run_dir / "attempt").write_text(attempt)
    STOPS.update(run_dir=a.run_dir, attempt=attempt, rank=rank, node=node)
    step, loss = resume_step(a.ckpt_dir)
    # The harness's record of progress across attempts (SLURM truncates the job's output file on a requeue).
    progress = open(a.run_dir / "progress.log", "a", buffering=1) if rank == 0 else open(os.devnull, "w")
    print(f"rank {rank} node {node} attempt {attempt} start step={step} pid={os.getpid()}", flush=True)
    progress.write(f"start attempt={attempt} step={step} t={time.time():.3f}\n")
    leaked: list[bytearray] = []
    nan = False
    data = a.data.replace("{node}", node)
    while True:
        gpu_gone(a.run_dir, node, rank, step)
        if data:
            read_shard(data)
        hang = fault(a.run_dir, "hang")
        if hang[:2] == [attempt, str(rank)]:
            print(f"rank {rank}: step {step}: stops before all_reduce", flush=True)
            stuck_before_all_reduce()
        crash = fault(a.run_dir, "crash")
        if crash[:2] == [attempt, str(rank)]:
            print(CUDA_CRASH.format(step=step), flush=True)
            record_stop("crashed: CUDA error: an illegal memory access was encountered", step)
            return 1
        time.sleep(a.step_time)
        slow = fault(a.run_dir, f"slow-{node}")
        if slow[:1] == [attempt]:
            time.sleep(a.step_time * max(0.0, float(slow[1]) - 1))
        leak = fault(a.run_dir, "leak")
        if leak[:2] == [attempt, node]:
            leaked.append(bytearray(b"\x5a") * int(float(leak[2]) * 2**20))  # written, so resident
        nan = nan or fault(a.run_dir, "nan")[:1] == [attempt]
        loss = math.nan if nan else loss * 0.999
        # a stop vote carries its reason: the rank that asked, and why, is in every rank's record
        vote = (f"stop[rank {rank}: {stop_reason(trainer)}]" if trainer.should_stop() else "") + (
            " save" if trainer.should_save() else "")
        tmp = barrier / f".{step}.{rank}.tmp"
        tmp.write_text(vote)
        os.replace(tmp, barrier / f"{step}.{rank}")  # a peer never reads a half-written vote
        votes = wait_all(barrier, step, world, a.collective_timeout, trainer, rank,
                         functools.partial(gpu_gone, a.run_dir, node, rank, step))
        if votes is None:  # a signal while a peer is missing: the last completed step is consistent, save it
            if rank == 0 and step > 0:
                save(a.ckpt_dir, step - 1, loss, a.ckpt_pad, progress)
                trainer.saved()
            print(f"rank {rank}: stop requested ({trainer.last_signal or 'switch'}) in the barrier of step {step}",
                  flush=True)
            record_stop(f"asked to stop while a peer was missing ({stop_reason(trainer)})", step)
            return 0
        if rank == 0:
            line = f"step {step} loss={loss:.4f} t={time.time():.3f}"
            print(line, flush=True)
            progress.write(line + "\n")
            trainer.heartbeat(step, loss=loss)
            for old in barrier.glob(f"{step - 2}.*"):
                old.unlink(missing_ok=True)
        stop = any("stop" in v for v in votes)
        if rank == 0 and (stop or any("save" in v for v in votes) or step % a.ckpt_every == a.ckpt_every - 1):
            if stop:  # the stop this checkpoint is for, as rank 0 sees it now: its report answers the agent's request
                trainer.should_stop()
            gpu_gone(a.run_dir, node, rank, step)
            try:
                save(a.ckpt_dir, step, loss, a.ckpt_pad, progress)
            except OSError as exc:
                print(f"Traceback (most recent call last):\n  File \"goodput_trainer.py\", in save\n"
                      f"OSError: [Errno {exc.errno}] {exc.strerror}: {a.ckpt_dir}", flush=True)
                record_stop(f"checkpoint save failed: [Errno {exc.errno}] {exc.strerror}", step)
                return 1
            trainer.saved()
        if stop:
            print(f"rank {rank}: stop requested ({trainer.last_signal or 'switch'}): exiting at step {step}", flush=True)
            record_stop("stop voted: " + "; ".join(v.split("]")[0].split("[", 1)[1] for v in votes if "stop[" in v),
                        step)
            return 0
        step += 1


def wait_all(barrier: Path, step: int, world: int, timeout: float, trainer: Trainer, rank: int,
             check_gpu: Callable[[], None]) -> list[str] | None:
    """Every rank's vote for this step; None when asked to stop while a peer is missing; exit 1 on the timeout."""
    deadline = time.monotonic() + timeout
    asked = None
    while True:
        check_gpu()
        votes = []
        for r in range(world):
            with contextlib.suppress(FileNotFoundError):
                votes.append((barrier / f"{step}.{r}").read_text())
        if len(votes) == world:
            return votes
        now = time.monotonic()
        if trainer.should_stop():
            asked = asked or now
            if now - asked > 1.0:  # the others had their chance to arrive
                return None
        if now > deadline:
            print(f"RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Timed out waiting {timeout:.0f}s "
                  f"for all_reduce of step {step} (rank {rank}: {world - len(votes)} ranks missing)", flush=True)
            record_stop(f"collective timeout: {world - len(votes)} of {world} ranks missing after {timeout:.0f}s", step)
            sys.exit(1)
        time.sleep(0.02)


def run() -> int:
    """main(), with how it ended recorded whatever the way: a return or exit not recorded above, an exception."""
    try:
        code = main()
    except SystemExit as exc:
        record_stop(f"exit {exc.code}", None)
        raise
    except BaseException as exc:  # recorded, then raised as before: the job fails the way it did
        record_stop(f"{type(exc).__name__}: {exc}"[:300], None)
        raise
    record_stop(f"exit {code}", None)
    return code


if __name__ == "__main__":
    sys.exit(run())
