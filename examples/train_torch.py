#!/usr/bin/env python3
"""The trainguard helper in a PyTorch training loop (not run in CI). Submit with e.g.

    sbatch --signal=B:USR1@600 --wrap "exec python examples/train_torch.py"
"""

from __future__ import annotations

import sys

import torch

from trainguard import trainer


def main() -> None:
    trainer.install()  # SIGUSR1: save and exit, SIGUSR2: save, SIGTERM: stop
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = 0
    try:
        state = torch.load("ckpt.pt")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"] + 1
    except FileNotFoundError:
        pass
    if trainer.should_stop():  # stopped while this task was queued (an array, a dependency chain): nothing to save
        sys.exit(0)
    for step in range(start, 100_000):
        x = torch.randn(64, 512)
        loss = (model(x) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        trainer.heartbeat(step, loss=loss.item())
        if trainer.should_save():  # true on a stop request too: this step was trained, so it is saved
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, "ckpt.pt")
            trainer.saved()
        if trainer.should_stop():
            break


if __name__ == "__main__":
    main()
