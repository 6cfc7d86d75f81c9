"""What a known failure line means: CUDA OOM (true vs fragmentation), NCCL timeouts, CUDA errors.

Pure functions over text, each returning the extracted fields and the runbook's answer, so that the
corpus tests can pin every format. Formats: ../reference facts gathered from PyTorch's allocator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainguard.core.text import MAX_MESSAGE, linear
from trainguard.core.units import format_bytes, parse_size

_SIZE = r"([\d.]+ ?(?:bytes|[KMGT]iB|B))"
_RANK = linear(r"^\[rank(\d+)\]:\s*")


def rank_of(line: str) -> tuple[str | None, str]:
    """`[rank3]: text` -> ("3", "text")."""
    m = _RANK.match(line)
    return (m.group(1), line[m.end():]) if m else (None, line)


def _bytes(text: str | None) -> int | None:
    """A size as PyTorch prints it; None when the text only looks like one (`1.2.3 GiB`, 400 digits)."""
    if text is None:
        return None
    value = text.replace(" ", "")
    try:
        return parse_size(value if not value.endswith("bytes") else value[:-5])
    except ValueError:
        return None


@dataclass(frozen=True)
class Diagnosis:
    kind: str  # oom, nccl_timeout, cuda_error, ...
    title: str  # one line: what happened
    advice: str  # the runbook's answer
    fields: dict[str, Any] = field(default_factory=dict)
    hardware: bool = False  # points at the GPU rather than the job


# CUDA out of memory -----------------------------------------------------------------------------
_OLD = linear(rf"\(GPU (\d+); {_SIZE} total capacity; {_SIZE} already allocated; {_SIZE} free; "
                  rf"(?:{_SIZE} allowed; )?{_SIZE} (reserved in total by PyTorch|cached)\)")
_NEW_TOTAL = linear(rf"GPU (\d+) has a total capac(?:i)?ty of {_SIZE} of which {_SIZE} is free")
_NEW_ALLOC = linear(rf"Of the allocated memory {_SIZE} is allocated by PyTorch, (?:with {_SIZE} allocated in "
                        rf"private pools \(e\.g\., CUDA Graphs\), )?and {_SIZE} is reserved by PyTorch but unallocated")
_TRIED = linear(rf"Tried to allocate {_SIZE}")
_OTHER = linear(rf"Process (\d+) has {_SIZE} memory in use")
_THIS = linear(rf"this process has {_SIZE} memory in use")

FRAGMENTATION_ADVICE = ("fragmentation: set PYTORCH_ALLOC_CONF=expandable_segments:True (older PyTorch: "
                        "PYTORCH_CUDA_ALLOC_CONF), then try max_split_size_mb; do not cut the batch size")
TRUE_OOM_ADVICE = ("true OOM: in order, a smaller micro-batch with gradient accumulation (same global batch), "
                   "shorter or bucketed sequences, activation checkpointing, a higher sharding degree (FSDP / ZeRO-2/3)")


def diagnose_oom(text: str) -> Diagnosis:
    """Fields of any PyTorch OOM message form, and whether it is fragmentation or a true OOM."""
    text = text[:MAX_MESSAGE]  # a message is a few KiB; a 1 MiB line is not one more to match
    f: dict[str, Any] = {"tried": _bytes(m.group(1)) if (m := _TRIED.search(text)) else None}
    if (old := _OLD.search(text)) is not None:
        gpu, total, allocated, free, allowed, reserved, word = old.groups()
        f.update(gpu=int(gpu), total=_bytes(total), allocated=_bytes(allocated), free=_bytes(free),
                 allowed=_bytes(allowed), reserved=_bytes(reserved), form="cached" if word == "cached" else "reserved")
        if f["reserved"] is not None and f["allocated"] is not None:
            f["reserved_unallocated"] = max(0, f["reserved"] - f["allocated"])
    elif (new := _NEW_TOTAL.search(text)) is not None:
        f.update(gpu=int(new.group(1)), total=_bytes(new.group(2)), free=_bytes(new.group(3)), form="2.1+")
        if (alloc := _NEW_ALLOC.search(text)) is not None:
            f.update(allocated=_bytes(alloc.group(1)), private_pools=_bytes(alloc.group(2)),
                     reserved_unallocated=_bytes(alloc.group(3)))
            f["reserved"] = (f["allocated"] or 0) + (f["reserved_unallocated"] or 0)
        this = _THIS.search(text)
        f["this_process"] = _bytes(this.group(1)) if this else None
        f["processes"] = [{"pid": int(p), "bytes": _bytes(b)} for p, b in _OTHER.findall(text)]
    elif "out of memory" in text:
        f["form"] = "THC"
    tried, rbu = f.get("tried"), f.get("reserved_unallocated")
    if tried and rbu is not None and rbu >= tried:
        kind, advice = "fragmentation", FRAGMENTATION_ADVICE
    elif tried and rbu is not None:
        kind, advice = "true OOM", TRUE_OOM_ADVICE
    else:
        kind, advice = "OOM", TRUE_OOM_ADVICE
    f["diagnosis"] = kind
    head = f"CUDA out of memory ({kind})" + (f" on GPU {f['gpu']}" if f.get("gpu") is not None else "")
    parts = []
    if tried:
        parts.append(f"tried {format_bytes(tried)}")
    if f.get("free") is not None and f.get("total"):
        parts.append(f"{format_bytes(f['free'])} free of {format_bytes(f['total'])}")
    if rbu is not None:
        parts.append(f"{format_bytes(rbu)} reserved but unallocated")
    others = [p for p in f.get("processes", []) if p["bytes"] != f.get("this_process")]
    if others:
        parts.append("other processes: " + ", ".join(f"pid {p['pid']} {format_bytes(p['bytes'])}" for p in others))
    title = head + (": " + ", ".join(parts) if parts else "")
    return Diagnosis("oom", title, advice, f)


# NCCL -------------------------------------------------------------------------------------------
_NCCL = linear(r"\[Rank (\d+)\] Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(\d+), "
                   r"OpType=(\w+).*?Timeout\(ms\)=(\d+)\) ran for (\d+) milliseconds")


def diagnose_nccl(text: str) -> Diagnosis:
    text = text[:MAX_MESSAGE]
    m = _NCCL.search(text)
    f: dict[str, Any] = {}
    if m:
        f = {"rank": int(m.group(1)), "seq": int(m.group(2)), "op": m.group(3), "timeout_ms": int(m.group(4)),
             "ran_ms": int(m.group(5))}
    what = (f"NCCL collective timeout on rank {f['rank']}: {f['op']} #{f['seq']} ran {f['ran_ms'] // 1000}s "
            f"(timeout {f['timeout_ms'] // 1000}s)") if f else "NCCL watchdog terminated the process"
    return Diagnosis("nccl_timeout", what, "a collective hang: one rank died, hung or OOMed and the others waited; "
                     "the rank that stopped first is the root cause: check its log, and XIDs on its node", f)


# CUDA errors --------------------------------------------------------------------------------------
_CUDA_ERRORS = (  # (needle, name, hardware?, advice)
    ("an illegal memory access was encountered", "illegal memory access", False,
     "an application bug (out-of-bounds index, bad custom kernel) unless the node logged XID 31/13 at the same "
     "time; rerun with CUDA_LAUNCH_BLOCKING=1 to find the kernel"),
    ("device-side assert triggered", "device-side assert", False,
     "an assertion in a kernel: usually a label or index out of range (see the assertion line)"),
    ("uncorrectable ECC error encountered", "uncorrectable ECC error", True,
     "hardware: the GPU's memory failed; drain the node and reset or RMA the GPU"),
    ("unspecified launch failure", "unspecified launch failure", True,
     "often a GPU fault (check XIDs on the node); else a kernel crashed"),
    ("unknown error", "unknown error", True, "often a GPU or driver fault: check XIDs and the GPU's health"),
)
_ASSERT = linear(r"(\S+:\d+): (\w+).*Assertion `(.+)` failed")
_CUDA_GENERIC = linear(r"CUDA (?:driver )?error: ([^.\n]+)")


def diagnose_cuda(text: str, assertion: str | None = None) -> Diagnosis:
    text, assertion = text[:MAX_MESSAGE], assertion[:MAX_MESSAGE] if assertion else assertion
    for needle, name, hardware, advice in _CUDA_ERRORS:
        if needle in text:
            f: dict[str, Any] = {"error": name}
            title = f"CUDA error: {name}"
            if assertion and (m := _ASSERT.search(assertion)):
                f.update(assert_at=m.group(1), kernel=m.group(2), condition=m.group(3))
                title += f" ({m.group(3)} in {m.group(2)} at {m.group(1)})"
            return Diagnosis("cuda_error", title, advice, f, hardware)
    m = _CUDA_GENERIC.search(text)
    return Diagnosis("cuda_error", f"CUDA error: {m.group(1) if m else 'unknown'}",
                     "check the node's XIDs and the GPU's health before blaming the job", {"error": m.group(1) if m else None})

