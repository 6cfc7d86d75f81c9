"""What a known failure line means: NCCL timeouts, CUDA errors (CUDA out of memory: `oom`).

Pure functions over text, each returning the extracted fields and the runbook's answer, so that the
corpus tests (tests/data/messages/corpus.toml) can pin every format.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainguard.core.text import linear
from trainguard.logscan.collectives import ADVICE, observe


@dataclass(frozen=True)
class Diagnosis:
    kind: str  # oom, nccl_timeout, cuda_error, ...
    title: str  # one line: what happened
    advice: str  # the runbook's answer
    fields: dict[str, Any] = field(default_factory=dict)
    hardware: bool = False  # points at the GPU rather than the job


# NCCL -------------------------------------------------------------------------------------------
def diagnose_nccl(text: str) -> Diagnosis:
    """One watchdog timeout line; the story across ranks is `collectives.tell`'s."""
    obs = observe(text)
    f: dict[str, Any] = {}
    if obs is not None and obs.kind == "timeout":
        f = {"rank": obs.rank, "seq": obs.seq, "op": obs.op, "timeout_ms": obs.timeout_ms}
    what = (f"NCCL collective timeout on rank {f['rank']}: {f['op']} #{f['seq']} (timeout {f['timeout_ms'] // 1000}s)"
            if f else "NCCL watchdog terminated the process")
    return Diagnosis("nccl_timeout", what, ADVICE, f)


# CUDA errors --------------------------------------------------------------------------------------
_CUDA_ERRORS = (  # (needle, name, hardware?, advice)
    ("an illegal memory access was encountered", "illegal memory access", False,
     "an application bug (out-of-bounds index, bad custom kernel) unless the node logged XID 31/13 at the same "
     "time; rerun with CUDA_LAUNCH_BLOCKING=1 to find the kernel"),
    ("device-side assert triggered", "device-side assert", False,
     "an assertion in a kernel: usually a label or index out of range (see the assertion line)"),
    ("uncorrectable ECC error", "uncorrectable ECC error", True,
     "hardware: the GPU's memory failed; drain the node and reset or RMA the GPU"),
    ("unspecified launch failure", "unspecified launch failure", True,
     "often a GPU fault (check XIDs on the node); else a kernel crashed"),
    ("unknown error", "unknown error", True, "often a GPU or driver fault: check XIDs and the GPU's health"),
    # In public threads these are mostly the software stack (a CUDA build too old for the GPU, a cuBLAS/driver
    # mismatch: isl-org/DPT#4, facebookresearch/SparseConvNet#208), seldom the GPU itself.
    ("CUBLAS_STATUS_EXECUTION_FAILED", "CUBLAS_STATUS_EXECUTION_FAILED", False, CUBLAS_ADVICE := (
        "check versions and XIDs: usually the software stack (a CUDA or cuBLAS build that does not match the GPU's "
        "architecture or the driver: torch.version.cuda, the driver, the GPU), a GPU fault only when the node logged "
        "XIDs at that time")),
    ("CUBLAS_STATUS_", "cuBLAS error", False, CUBLAS_ADVICE),
)
# What the kernels' assertions say, in the data's terms (the condition names the bound that was broken)
_ASSERTIONS = (
    ("n_classes", "a label out of range: a target outside [0, number of classes) reached the loss (nll_loss / "
                  "cross_entropy): check the labels against the model's classes or vocabulary (an ignore index other "
                  "than -100, a tokenizer larger than the embedding, 1-based labels); not the GPU"),
    ("srcIndex < srcSelectDimSize", "an index out of range in an index_select / embedding lookup: a token or index "
                                    "id at or above the table's size (tokenizer vs embedding size); not the GPU"),
    ("index out of bounds", "an index out of range in a gather/scatter or indexing kernel: check the indices "
                            "against the tensor's size; not the GPU"),
)
_ASSERT = linear(r"(\S+:\d+): (\w+).*Assertion `(.+)` failed")
_CUBLAS = linear(r"CUBLAS_STATUS_[A-Z_]{2,40}")
_CUDA_GENERIC = linear(r"CUDA (?:driver )?error: ([^.\n]+)")


def diagnose_cuda(text: str, assertion: str | None = None) -> Diagnosis:
    for needle, label, hardware, lever in _CUDA_ERRORS:
        if needle in text:
            advice = lever
            name = m.group(0) if needle == "CUBLAS_STATUS_" and (m := _CUBLAS.search(text)) else label
            f: dict[str, Any] = {"error": name}
            title = f"CUDA error: {name}"
            if assertion and (m := _ASSERT.search(assertion)):
                f.update(assert_at=m.group(1), kernel=m.group(2), condition=m.group(3))
                title += f" ({m.group(3)} in {m.group(2)} at {m.group(1)})"
                advice = next((a for needle, a in _ASSERTIONS if needle in m.group(3)), advice)
            return Diagnosis("cuda_error", title, advice, f, hardware)
    m = _CUDA_GENERIC.search(text)
    return Diagnosis("cuda_error", f"CUDA error: {m.group(1) if m else 'unknown'}",
                     "check the node's XIDs and the GPU's health before blaming the job", {"error": m.group(1) if m else None})

