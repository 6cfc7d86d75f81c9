"""The goodput benchmark's fleet fault schedule (`--schedule fleet`): the kinds of interruption a large fleet reports,
in its proportions and at its rate, mapped to what the harness can inject on this machine.

Source of the counts: Meta, "The Llama 3 Herd of Models" (arXiv 2407.21783), section 3.3.4, Table 5: the root causes
of the 419 unexpected interruptions of a 54-day snapshot of Llama 3 405B pre-training on 16,384 H100 GPUs (466 in
all; 47 were planned). Each cause is mapped to a harness kind (benchmarks/goodput.py) where one stands for it here,
or to None with the reason it is not injected. The draw is restricted to the mapped causes, weighted by their
counts; the rate stays the whole fleet's (every interruption is one the job takes), one every 54 * 24 / 419 = 3.09
hours of the whole job, scaled like the rest of the run.

The site faults the fleet tables leave out but users hit (the full checkpoint disk, a leak toward the OOM killer, the
time limit, the stop switch, a hung file system named by the kernel log) have no published rate: each comes once a
run, at a seeded time, as in the default schedule. The hung file system came last, after the runs of record (made with
the first four): their seeded draws are the same, and a seed's faults before its hung file system too.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SOURCE = "Meta, The Llama 3 Herd of Models (arXiv 2407.21783), Table 5: 419 unexpected interruptions in 54 days"
LLAMA3_DAYS, LLAMA3_INTERRUPTIONS = 54, 419
LLAMA3_MTBI_H = LLAMA3_DAYS * 24 / LLAMA3_INTERRUPTIONS  # 3.09 hours between interruptions of the whole job


@dataclass(frozen=True)
class Cause:
    name: str  # Table 5's
    count: int  # interruptions in the 54 days
    kind: str | None  # the harness kind that stands for it here; None: not injected
    how: str  # how the harness makes it, or why it does not


CAUSES = (
    Cause("Faulty GPU", 148, "xid79", "XID 79 (fell off the bus) in the node's kernel log; its scripted NVML reads "
          "the GPU lost; the rank there hangs in a CUDA call"),
    Cause("GPU HBM3 memory", 72, "hbm", "XID 48 (double bit ECC error) in the kernel log; its scripted NVML reads "
          "uncorrected volatile ECC errors and a pending row remap; the rank there hangs"),
    # Table 5 does not split its software bugs by shape: half are drawn as each of the two the harness makes.
    Cause("Software bug (half)", 27, "nan", "a NaN streak in the loss: the run diverges"),
    Cause("Software bug (half)", 27, "cuda_error", "one rank crashes on a CUDA error (PyTorch's illegal memory access "
          "lines, a real capture); srun ends the others (--kill-on-bad-exit, as torchrun ends a failed worker's peers)"),
    Cause("Network switch/cable", 35, "ib_down", "the node's HCA port (a recorded H100 sysfs tree, "
          "tests/data/infiniband) goes DOWN/Disabled; the rank there logs NCCL's NET/IB completion error and hangs "
          "in the collective"),
    Cause("Host maintenance", 32, "maintenance", "the node drained for maintenance (`maintenance: host reboot`), "
          "rebooted 5 scaled minutes later (its rank killed), back after its repair time"),
    Cause("GPU SRAM memory", 19, "sram", "XID 95 (uncontained ECC error, SRAM) in the kernel log; its scripted NVML "
          "reads uncorrected volatile ECC errors; the rank there hangs"),
    Cause("GPU system processor", 17, "gsp", "XID 119 (GSP RPC timeout) in the kernel log; its scripted NVML reads the "
          "GPU lost (the GSP answers no more); the rank there hangs"),
    Cause("NIC", 7, "nic", "the mlx5 driver's `device's health compromised` kernel line (tests/data/kernel) in the "
          "node's kernel log; the rank there logs NCCL's NET/IB error and hangs"),
    Cause("NCCL watchdog timeouts", 7, "hang", "one rank stops before the collective"),
    Cause("Silent data corruption", 6, None, "silent by definition: nothing an agent reads shows it"),
    Cause("GPU thermal interface + sensor", 6, "slow", "one rank 1.5x slower, its scripted GPU in HW slowdown"),
    Cause("SSD", 3, None, "a failed local disk: the nodes share one host's disks"),
    Cause("Power supply", 3, None, "the node loses power: the nodes share one host"),
    Cause("Server chassis", 2, None, "the node goes away: the nodes share one host"),
    Cause("IO expansion board", 2, None, "the node goes away: the nodes share one host"),
    Cause("Dependency", 2, None, "a service outside the job (storage, scheduler): no agent check answers it"),
    Cause("CPU", 2, None, "MCE lines are the kernel check's (tests/data/kernel), but the host's CPU cannot fail for "
          "one node alone"),
    Cause("System memory", 2, None, "as CPU: EDAC lines exist, the host's memory is shared"),
)
# hung_fs last: the first four's seeded draws stay as they were
SITE_KINDS = ("disk_full", "leak", "time_limit", "stop_switch", "hung_fs")


def weights() -> dict[str, int]:
    """Interruptions per harness kind (causes mapped to one kind add up), injectable causes only."""
    out: dict[str, int] = {}
    for c in CAUSES:
        if c.kind:
            out[c.kind] = out.get(c.kind, 0) + c.count
    return out


def covered() -> float:
    """The fraction of the fleet's interruptions whose cause the harness injects."""
    return sum(c.count for c in CAUSES if c.kind) / sum(c.count for c in CAUSES)


def gap_s(scale: float, mtbi_hours: float = LLAMA3_MTBI_H) -> float:
    """The mean time between interruptions here, in seconds: the fleet's, scaled."""
    return mtbi_hours * 3600 / scale


def draw(seed: int, duration: float, scale: float, ranks: int, mtbi_hours: float = LLAMA3_MTBI_H,
         site: tuple[str, ...] = SITE_KINDS, kinds: tuple[str, ...] | None = None,
         min_gap: float | None = None) -> list[tuple[float, str, int]]:
    """(at, kind, target rank) of every fault of a run of `duration` seconds: fleet faults as a Poisson process with
    the fleet's mean gap (scaled), kinds drawn by their weights (only `kinds` where given: what this run can inject),
    and each of `site` once at a seeded time; from 0.12 of the run (the job's warm-up) to 0.92, at least `min_gap`
    apart (10 scaled minutes by default: the harness charges each alert to the fault before it), later ones pushed
    back and dropped past the end."""
    rng = random.Random(seed)
    w = {k: n for k, n in weights().items() if kinds is None or k in kinds}
    start, end = 0.12 * duration, 0.92 * duration
    gap = min_gap if min_gap is not None else 600 / scale
    at = start + rng.expovariate(1 / gap_s(scale, mtbi_hours))
    fleet = []
    while at < end and w:
        fleet.append((at, rng.choices(list(w), weights=list(w.values()))[0], rng.randrange(ranks)))
        at += rng.expovariate(1 / gap_s(scale, mtbi_hours))
    sites = [(rng.uniform(start, end), kind, rng.randrange(ranks)) for kind in site]
    out: list[tuple[float, str, int]] = []
    for drawn, kind, target in sorted(fleet + sites):
        t = max(drawn, out[-1][0] + gap) if out else drawn
        if t <= end:
            out.append((round(t, 1), kind, target))
    return out
