#!/usr/bin/env python3
"""Print the failure messages the CPU build of PyTorch really prints, for tests/data/messages/corpus.toml.

    .venv/bin/python tests/data/messages/capture_cpu.py [single|gloo]

`single`: one process (NaN in anomaly mode, a non-finite gradient norm, the CPU allocator refusing, no CUDA).
`gloo`: two-rank Gloo jobs under torchrun in which rank 1 dies, skips a monitored barrier or never enters an
all_reduce; each failing rank's own output (PyTorch prefixes it with `[rankN]:`).
Each captured line is printed as `<case>|<line>`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

# One rank of a Gloo job; MODE picks how rank 1 lets rank 0 down. Exceptions stay uncaught: what is printed is
# PyTorch's and Python's own output.
RANK = """
import datetime, os, sys, time
import torch, torch.distributed as dist
mode = sys.argv[1]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=2))
rank, t = dist.get_rank(), torch.ones(1)
dist.all_reduce(t)
if rank == 1:
    if mode == "died":
        os._exit(3)
    time.sleep(5)
    sys.exit(0)
if mode == "died":
    time.sleep(0.5)
if mode == "monitored":
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=2))
dist.all_reduce(t)
"""


def single() -> list[str]:
    import torch

    out = []

    def caught(case: str, call: object) -> None:
        try:
            call()  # type: ignore[operator]
        except (RuntimeError, AssertionError) as exc:
            out.append(f"{case}|{type(exc).__name__}: {str(exc).splitlines()[0]}")

    def anomaly() -> None:
        x = torch.tensor([0.0], requires_grad=True)
        with torch.autograd.detect_anomaly():
            (x / x).sum().backward()

    def clip() -> None:
        p = torch.nn.Parameter(torch.ones(2))
        p.grad = torch.tensor([float("nan"), 1.0])
        torch.nn.utils.clip_grad_norm_([p], 1.0, error_if_nonfinite=True)

    caught("anomaly", anomaly)
    caught("clip_grad", clip)
    caught("cpu_allocator", lambda: torch.empty(1 << 60, dtype=torch.uint8))
    caught("no_cuda", lambda: torch.cuda.set_per_process_memory_fraction(0.5))
    return out


def gloo() -> list[str]:
    script = Path(os.environ.get("TMPDIR", "/tmp")) / f"trainguard-capture-{os.getpid()}.py"
    script.write_text(RANK)
    out = []
    try:
        for mode in ("died", "monitored", "timeout"):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if mode == "died":  # under torchrun rank 0 is stopped before it can fail: start the ranks directly
                env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
                procs = [subprocess.Popen([sys.executable, str(script), mode], env={**env, "RANK": str(r)},
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
                text = "".join(p.communicate(timeout=60)[0] for p in procs)
            else:
                text = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                       "--master-port", str(port), str(script), mode], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, timeout=60).stdout
            out += [f"{mode}|{line}" for line in text.splitlines()
                    if "Error" in line or "failed to pass" in line or "Connection closed" in line]
    finally:
        script.unlink(missing_ok=True)
    return out


if __name__ == "__main__":
    which = sys.argv[1:] or ["single", "gloo"]
    for line in (single() if "single" in which else []) + (gloo() if "gloo" in which else []):
        print(line)
