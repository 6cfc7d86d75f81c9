#!/usr/bin/env python3
"""A pure-Python toy trainer that behaves like a real one for trainguard's tests and demos.

It logs steps, writes checkpoints, resumes from the last one, uses trainguard.trainer, and can
simulate faults: --fault hang|leak|crash|slow|nan|oom [--fault-at STEP].
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from trainguard.trainer import Trainer


def save_checkpoint(ckpt_dir: Path, step: int, loss: float, seconds: float = 0.0) -> Path:
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    time.sleep(seconds)  # a real model's checkpoint takes minutes: the agent acts meanwhile
    path = ckpt_dir / f"ckpt-{step:06d}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"step": step, "loss": loss, "time": time.time()}))
    os.replace(tmp, path)
    print(f"checkpoint saved step={step} path={path}", flush=True)
    return path


def last_checkpoint(ckpt_dir: Path) -> int:
    ckpts = sorted(ckpt_dir.glob("ckpt-*.json")) if ckpt_dir.is_dir() else []
    return json.loads(ckpts[-1].read_text())["step"] + 1 if ckpts else 0


# What PyTorch 2.11 prints when the caching allocator's free memory is split into pieces too small for the request.
FRAGMENTED_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of 79.18 GiB "
    "of which 1.06 GiB is free. Including non-PyTorch memory, this process has 78.10 GiB memory in use. Of the "
    "allocated memory 70.86 GiB is allocated by PyTorch, and 6.63 GiB is reserved by PyTorch but unallocated. If "
    "reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
    "fragmentation.  See documentation for Memory Management  "
    "(https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)")


def stuck_in_allreduce(seconds: float) -> None:
    """Where a hung run sits: a collective waiting for a dead rank."""
    time.sleep(seconds)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--step-time", type=float, default=0.2)
    p.add_argument("--ckpt-dir", type=Path, default=Path("checkpoints"))
    p.add_argument("--ckpt-every", type=int, default=0, help="periodic checkpoints; 0: only on request")
    p.add_argument("--save-time", type=float, default=0.0, help="seconds each checkpoint takes to write")
    p.add_argument("--fault", choices=["hang", "leak", "crash", "slow", "nan", "oom"])
    p.add_argument("--fault-at", type=int, default=10)
    p.add_argument("--fault-until", type=int, default=0, help="the fault ends at this step (0: never)")
    p.add_argument("--slow-factor", type=float, default=10.0, help="--fault slow: steps this many times longer")
    p.add_argument("--leak-mb-per-step", type=float, default=10.0)
    p.add_argument("--log", type=Path, help="append output to this file (kept open, as a logging handler does)")
    args = p.parse_args()
    if args.log:
        sys.stdout = open(args.log, "a", buffering=1)  # open for the whole run

    trainer = Trainer().install()
    start = last_checkpoint(args.ckpt_dir)
    if trainer.should_stop():  # the run was stopped while this task was queued: nothing trained, nothing to save
        print(f"stop requested ({trainer.last_signal or 'switch'}) before the first step: exiting without a "
              f"checkpoint at step {start}", flush=True)
        return 0
    print(f"training start step={start} pid={os.getpid()} slurm_job={os.environ.get('SLURM_JOB_ID', '-')}", flush=True)
    saved_step = start - 1  # the last step a checkpoint holds
    leaked: list[bytearray] = []
    loss = 4.0
    for step in range(start, args.steps):
        faulty = args.fault is not None and step >= args.fault_at and not (args.fault_until and step >= args.fault_until)
        if faulty and args.fault == "hang":
            print(f"step {step}: entering allreduce", flush=True)
            stuck_in_allreduce(10**6)
        if faulty and args.fault == "crash":
            raise RuntimeError(f"simulated crash at step {step}")
        if faulty and args.fault == "oom":
            print("Traceback (most recent call last):\n  File \"train_toy.py\", line 1, in forward", flush=True)
            print(FRAGMENTED_OOM, flush=True)
            return 1
        time.sleep(args.step_time * (args.slow_factor if faulty and args.fault == "slow" else 1))
        if faulty and args.fault == "leak":
            leaked.append(bytearray(b"\x5a") * int(args.leak_mb_per_step * 2**20))  # written, so resident
        loss = math.nan if faulty and args.fault == "nan" else loss * 0.99 + random.uniform(-0.01, 0.01)
        print(f"step {step} loss={loss:.4f}", flush=True)
        trainer.heartbeat(step, loss=loss)
        if args.ckpt_every and step % args.ckpt_every == 0:
            save_checkpoint(args.ckpt_dir, step, loss, args.save_time)
            saved_step = step
        # Save asked, then stop asked, read in that order: a SIGUSR1 landing between the two reads is still one
        # checkpoint (read the other way, it saved this step for "save" and the next one for "stop").
        save, stop = trainer.should_save(), trainer.should_stop()
        if (save or stop) and saved_step < step:  # a checkpoint of this very step was just written: not twice
            save_checkpoint(args.ckpt_dir, step, loss, args.save_time)
            saved_step = step
        if save:  # true on a stop too: the agent restarting the job learns the checkpoint is written
            trainer.saved()
        if stop:
            print(f"stop requested ({trainer.last_signal or 'switch'}): exiting cleanly at step {step}", flush=True)
            return 0
    if saved_step < args.steps - 1:
        save_checkpoint(args.ckpt_dir, args.steps - 1, loss, args.save_time)
    print("training finished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
