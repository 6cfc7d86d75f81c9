"""torchrun's (torch.distributed.elastic's) own report of a failed job: which worker failed first and how.

Two forms, both printed whatever the worker printed, with or without a `Traceback (` header:

    ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: -9) local_rank: 3 (pid: 812917) of binary: ...

    Root Cause (first observed failure):
    [0]:
      time      : 2025-05-21_15:43:03
      host      : node-7
      rank      : 0 (local_rank: 0)
      exitcode  : -9 (pid: 14750)
      traceback : Signal 9 (SIGKILL) received by PID 14750

The launcher's own `ChildFailedError` traceback is not the failure: the root-cause worker, its exit code and the
signal are. A negative exit code is the signal that ended the worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainguard.core.text import linear

NEEDLES: tuple[bytes, ...] = (b"Root Cause (first observed failure)", b"failed (exitcode:")
PATTERN = linear(r"Root Cause \(first observed failure\)|failed \(exitcode: -?\d{1,4}\) local_rank: \d{1,7}")
BLOCK = 2048  # the root-cause block is a dozen short lines

_FAILED = linear(r"failed \(exitcode: (-?\d{1,4})\) local_rank: (\d{1,7})(?: \(pid: (\d{1,10})\))?")
# a paste may have lost the line breaks and underscores: `rank2 (local rank: 2)exitcode: -9 (pid: 36071)`
_RANK = linear(r"(?m)^\s{0,20}rank\s{0,20}:?\s{0,20}(\d{1,7}) \(local[_ ]rank:? ?(\d{1,7})\)")
_EXIT = linear(r"exitcode\s{0,20}:\s{0,20}(-?\d{1,4})(?: \(pid: (\d{1,10})\))?")
_HOST = linear(r"(?m)^\s{0,20}host\s{0,20}: (\S{1,200})")
_SIGNAL = linear(r"(?i)signal (\d{1,2}) \((SIG[A-Z]{2,8})\)")
_END = linear(r"(?m)^={20}")

SIGNALS = {9: "SIGKILL", 6: "SIGABRT", 15: "SIGTERM", 11: "SIGSEGV", 7: "SIGBUS", 2: "SIGINT"}
ADVICE = {
    "SIGKILL": "killed from outside, not a Python error: the host's OOM killer (dmesg, the job's cgroup memory: host "
               "RAM, not GPU memory) or the scheduler (a time or memory limit)",
    "SIGABRT": "aborted: usually the NCCL watchdog taking the process down after a collective timeout or error (that "
               "rank's log shows which), else a failed C++ assertion",
    "SIGTERM": "terminated: the scheduler (preemption, the time limit) or the launcher stopping it after another "
               "worker failed",
    "SIGSEGV": "a crash in native code (a custom kernel or extension, a library): faulthandler or a core dump shows "
               "where",
    "SIGBUS": "a bus error: a memory-mapped file that shrank, or /dev/shm full (DataLoader workers in a container)",
    "SIGINT": "interrupted (Ctrl-C or the scheduler's first signal)",
}
EXIT_ADVICE = "the worker's Python raised: read that rank's own traceback above torchrun's summary"


@dataclass(frozen=True)
class RootCause:
    title: str
    advice: str
    rank: int | None  # the global rank, when the block says
    fields: dict[str, Any] = field(default_factory=dict)


def root_cause(text: str) -> RootCause | None:
    """The first failed worker in a `failed (exitcode: ...)` line or a root-cause block (`text` from its first line
    on, at most BLOCK characters), or None when neither parses."""
    text = text[:BLOCK]
    rank = local = host = pid = None
    if (m := _FAILED.search(text)) is not None:
        code, local, pid = int(m.group(1)), int(m.group(2)), m.group(3)
    else:
        if (end := _END.search(text, 40)) is not None:  # the block ends at its closing rule
            text = text[:end.start()]
        exit_code = _EXIT.search(text)
        if exit_code is None:
            return None
        code, pid = int(exit_code.group(1)), exit_code.group(2)
        if (r := _RANK.search(text)) is not None:
            rank, local = int(r.group(1)), int(r.group(2))
        if (h := _HOST.search(text)) is not None:
            host = h.group(1)
    signal = -code if code < 0 else None
    if (s := _SIGNAL.search(text)) is not None:
        signal = int(s.group(1))
    name = SIGNALS.get(signal) if signal is not None else None
    how = (f"killed by signal {signal}" + (f" ({name})" if name else "")) if signal is not None else f"exit code {code}"
    who = f"rank {rank}" if rank is not None else f"local rank {local}"
    title = f"torchrun: {who} failed first: {how}" + (f" (on {host})" if host else "")
    advice = ADVICE.get(name or "", EXIT_ADVICE if signal is None else "ended by a signal: see its log")
    return RootCause(title, advice, rank, {"rank": rank, "local_rank": local, "host": host, "exit_code": code,
                                           "signal": name or signal, "pid": int(pid) if pid else None})
