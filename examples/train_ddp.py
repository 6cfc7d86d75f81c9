#!/usr/bin/env python3
"""A small data-parallel PyTorch trainer (CPU, Gloo) whose ranks can be made to hang: trainguard's distributed demo.

    torchrun --nproc-per-node 2 examples/train_ddp.py --steps 1000
    torchrun --nproc-per-node 2 examples/train_ddp.py --hang-rank 1 --hang-at 20

Each rank averages its gradients with one all_reduce per parameter, as DDP does in buckets. `--hang-rank R
--hang-at N` makes rank R stop before the all_reduces of step N, the way a rank stuck in its data loader or a
dead file system stops: the other ranks enter the collective and wait for it forever. The trainer helper's
`flight_recorder()` lets the agent see which rank never entered it. Ranks come from torchrun or SLURM (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT; else SLURM_PROCID, SLURM_NTASKS).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from trainguard.trainer import Trainer


def stuck_before_all_reduce(seconds: float) -> None:
    """Where the hung rank sits: anywhere but the collective (a data loader, a dead file system)."""
    time.sleep(seconds)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--hang-at", type=int, default=10)
    p.add_argument("--log-dir", type=Path, help="each rank appends to <log-dir>/rank<N>.log")
    p.add_argument("--run-name", default="ddp", help="a label for the logs (and for finding the job's processes)")
    args = p.parse_args()
    os.environ.setdefault("RANK", os.environ.get("SLURM_PROCID", "0"))
    os.environ.setdefault("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    rank = int(os.environ["RANK"])
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
        sys.stdout = open(args.log_dir / f"rank{rank}.log", "a", buffering=1)  # open for the whole run

    trainer = Trainer().install()
    socket_path = trainer.flight_recorder()  # before init_process_group: the recorder is set up with the group
    import torch  # after the helper: it only sets variables PyTorch reads when the process group starts
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(hours=1))
    world = dist.get_world_size()
    print(f"{args.run_name}: rank {rank}/{world} pid={os.getpid()} flight recorder at {socket_path}", flush=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(args.steps):
        x = torch.randn(16, 32)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if rank == args.hang_rank and step >= args.hang_at:
            print(f"step {step}: rank {rank} stops before its all_reduce", flush=True)
            stuck_before_all_reduce(10**6)
        for param in model.parameters():
            assert param.grad is not None
            dist.all_reduce(param.grad)
            param.grad /= world
        opt.step()
        print(f"step {step} loss={loss.item():.4f}", flush=True)
        if rank == 0:
            trainer.heartbeat(step, loss=loss.item())
        if trainer.should_stop():
            break
        time.sleep(args.step_time)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
