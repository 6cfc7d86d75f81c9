#!/usr/bin/env python3
"""Capture real flight-recorder dumps of a two-rank Gloo job (CPU build of PyTorch) into this directory.

    .venv/bin/python tests/data/flight_recorder/capture.py

- `hang/rank0.json`, `hang/rank1.json`: what each rank's worker server answered (`fr_trace_json`) while rank 1 of
  examples/train_ddp.py stood before its all_reduce and rank 0 waited in it.
- `dumps/rank_0`, `dumps/rank_1`: the pickled form the NCCL watchdog writes on a timeout (TORCH_FR_DUMP_TEMP_FILE +
  rank), made by the same entry point (`torch._C._distributed_c10d._dump_fr_trace`) in each rank: rank 1 before it
  entered an all_reduce, rank 0 while waiting in it. No GPU was lent, so no NCCL rank could time out for real.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO))

from trainguard.node.flight import query_socket, worker_socket  # noqa: E402
from trainguard.node.procfs import ProcFS  # noqa: E402

DUMP = """
import os, sys, time, datetime
import torch, torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace
out = sys.argv[1]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, t = dist.get_rank(), torch.ones(4)
for _ in range(3):
    dist.all_reduce(t)
dist.barrier()
def dump():
    with open(f"{out}/rank_{rank}.tmp", "wb") as f:
        f.write(_dump_fr_trace(True, True, False))
    os.replace(f"{out}/rank_{rank}.tmp", f"{out}/rank_{rank}")
if rank == 1:
    dump()
    while not os.path.exists(f"{out}/rank_0"):
        time.sleep(0.05)
    dist.all_reduce(t)
else:
    work = dist.all_reduce(t, async_op=True)
    time.sleep(0.5)
    dump()
    work.wait()
dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def capture_hang(out: Path) -> None:
    out.mkdir(exist_ok=True)
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "TRAINGUARD_SWITCH_DIR": str(out / "switch"), "TMPDIR": str(out)}  # the ranks' sockets: removed below
    logs = out / "logs"
    ranks = [subprocess.Popen([sys.executable, str(REPO / "examples" / "train_ddp.py"), "--hang-rank", "1",
                               "--hang-at", "3", "--log-dir", str(logs)], env={**env, "RANK": str(r)},
                              stderr=subprocess.DEVNULL) for r in (0, 1)]
    try:
        deadline = time.monotonic() + 60
        while "stops before" not in ((logs / "rank1.log").read_text() if (logs / "rank1.log").exists() else ""):
            if time.monotonic() > deadline:
                raise SystemExit("rank 1 never reached its hang")
            time.sleep(0.1)
        time.sleep(1)  # rank 0 is in its all_reduce by now
        for r, p in enumerate(ranks):
            path = worker_socket(p.pid, ProcFS())
            body = query_socket(path, p.pid, os.getuid(), "fr_trace_json", 5.0) if path else None
            if body is None:
                raise SystemExit(f"rank {r} did not answer")
            (out / f"rank{r}.json").write_bytes(body + b"\n")
    finally:
        for p in ranks:
            p.kill()
            p.wait()
    for leftover in (logs, out / "switch", *out.glob("trainguard-fr-*")):
        shutil.rmtree(leftover, ignore_errors=True)


def capture_dumps(out: Path) -> None:
    out.mkdir(exist_ok=True)
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "TORCH_FR_BUFFER_SIZE": "100"}
    ranks = [subprocess.Popen([sys.executable, "-c", DUMP, str(out)], env={**env, "RANK": str(r)},
                              stderr=subprocess.DEVNULL) for r in (0, 1)]
    for p in ranks:
        p.wait(timeout=60)


if __name__ == "__main__":
    capture_hang(HERE / "hang")
    capture_dumps(HERE / "dumps")
    print("\n".join(str(p.relative_to(HERE)) for p in sorted(HERE.rglob("*")) if p.is_file()))
