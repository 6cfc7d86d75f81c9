"""NCCL failures other than the watchdog timeout, each with the lever it calls for.

The classes, as NCCL's result codes and PyTorch's messages name them (nccl.h: ncclSystemError = 2, ncclInternalError
= 3, ncclRemoteError = 6; PyTorch wraps them in `DistBackendError: NCCL error in: ..., <text>, NCCL version x.y.z`):

- a system call or external library failed (`unhandled system error`): the node's network setup (the interface NCCL
  picked, a firewall, /dev/shm in a container, the IB verbs library);
- a peer went away or the network failed (`remote process exited or there was a network error`, socket errors): a
  dead peer first, the link second; an echo of the rank that failed first;
- an InfiniBand/RoCE work completion with an error status (`NET/IB : Got completion ... with error 12`): the link
  between this node and that peer (12 = transport retry counter exceeded, the most common);
- `internal error`: NCCL 2.18 reports every network error as internal (NVIDIA/nccl#1092): treated as the network;
- NCCL's own CUDA calls failing (`NCCL WARN Cuda failure 'out of memory'`, `unhandled cuda error`);
- ranks running different collectives (`Detected mismatch between collectives`, TORCH_DISTRIBUTED_DEBUG=DETAIL): a
  desync in the training code.

`effect` says whether the class is usually the echo of a failure elsewhere (a peer that died) rather than a cause.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainguard.core.text import linear

NEEDLES: tuple[bytes, ...] = (
    b"unhandled system error", b"ncclSystemError", b"remote process exited", b"ncclRemoteError",
    b"internal error - please report", b"unhandled cuda error", b"Cuda failure", b"Got completion",
    b"Detected mismatch between collectives", b"Call to recv", b"Connection closed by remote peer")
PATTERN = linear(r"unhandled system error|ncclSystemError|remote process exited or there was a network error"
                 r"|ncclRemoteError|internal error - please report|unhandled cuda error|NCCL WARN Cuda failure"
                 r"|Got completion (?:from peer \S{1,100} )?with (?:error |status=)\d"
                 r"|Detected mismatch between collectives|Call to recv from \S{1,100} failed"
                 r"|Connection closed by remote peer")

_VERSION = linear(r"NCCL version (\d{1,3}\.\d{1,3}\.\d{1,3})")
_COMPLETION = linear(r"Got completion (?:from peer (\S{1,100}) )?with (?:error |status=)(\d{1,3})"
                     r"(?:.{0,80}?vendor err (\d{1,5}))?")
_CUDA_FAILURE = linear(r"Cuda failure (?:\d{1,4} )?'([^'\n]{1,80})'")
_FINGERPRINT = linear(r"Rank (\d{1,7}) is running (?:inconsistent )?collective: CollectiveFingerPrint\("
                      r"(?:SequenceNumber=(\d{1,12}),? ?)?OpType=(\w{1,40})(?:, TensorShape=\[([^\]\n]{0,80})\])?")

# ibv_wc_status (infiniband/verbs.h): the ones a NCCL job meets
IB_STATUS = {1: "local length error", 2: "local QP operation error", 4: "local protection error",
             5: "work request flushed", 9: "remote invalid request", 10: "remote access error",
             11: "remote operation error", 12: "transport retry counter exceeded", 13: "RNR retry counter exceeded"}

NETWORK = ("the network between the nodes: the IB/RoCE link to that peer (ibstat, the port's error counters, the "
           "cable and switch port; the node's infiniband check); if the fabric is only congested, a larger "
           "NCCL_IB_TIMEOUT helps, a broken link it does not")
DEAD_PEER = ("a dead peer first: another rank exited or its node failed (read the log of the rank that failed first, "
             "its node's dmesg and XIDs); if every rank was alive, the network between the nodes")
SETUP = ("the node's network setup, usually at start: the interface NCCL picked (NCCL_SOCKET_IFNAME), a firewall "
         "between the nodes, /dev/shm too small in a container, the IB verbs library; NCCL_DEBUG=WARN names the call "
         "that failed (during training: also a peer that exited)")
DESYNC = ("a desync bug in the training code: the ranks took different paths (a data-dependent branch, a module "
          "skipped on some ranks, different keys logged or saved per rank) and issued different collectives; not "
          "the network, and a longer timeout does not help")
NCCL_OOM = ("the GPU was full when NCCL needed its buffers: leave NCCL headroom (a smaller micro-batch or memory "
            "fraction, fewer NCCL channels or a smaller NCCL_BUFFSIZE) and check for other processes on the GPU")
NCCL_CUDA = ("a CUDA error under NCCL: NCCL_DEBUG=WARN names it; check the node's XIDs, then the driver, CUDA and "
             "NCCL versions")


@dataclass(frozen=True)
class NcclError:
    kind: str  # system, remote, ib_completion, internal, nccl_oom, nccl_cuda, desync
    title: str
    advice: str
    effect: bool  # usually the echo of a failure elsewhere (a peer that died)
    fields: dict[str, Any] = field(default_factory=dict)


def _desync(text: str) -> NcclError:
    ranks = [(m.group(1), m.group(2), m.group(3), m.group(4)) for m in _FINGERPRINT.finditer(text)][:2]
    parts = [f"rank {r} {op}" + (f" #{seq}" if seq else "") + (f" [{shape}]" if shape else "")
             for r, seq, op, shape in ranks]
    title = "the ranks ran different collectives (a desync)" + (": " + " vs ".join(parts) if parts else "")
    return NcclError("desync", title, DESYNC, False, {"collectives": [
        {"rank": int(r), "seq": int(seq) if seq else None, "op": op, "shape": shape} for r, seq, op, shape in ranks]})


def diagnose_nccl_error(text: str) -> NcclError:
    """The class of one NCCL error line (or of a terminal line that carries several of its lines)."""
    text = text[:8192]
    version = _VERSION.search(text)
    f: dict[str, Any] = {"nccl_version": version.group(1)} if version else {}
    if "Detected mismatch between collectives" in text:
        return _desync(text)
    if (m := _COMPLETION.search(text)) is not None:  # the root of an async remote error when both are on the line
        status = int(m.group(2))
        name = IB_STATUS.get(status, "work completion error")
        f.update(ib_status=status, ib_status_name=name, peer=m.group(1), vendor_err=m.group(3))
        peer = f" from peer {m.group(1)}" if m.group(1) else ""
        flushed = status == 5  # flushed: the queue pair had already broken (an earlier error, a peer gone)
        return NcclError("ib_completion", f"InfiniBand completion error {status} ({name}){peer}",
                         DEAD_PEER if flushed else NETWORK, flushed, f)
    if (m := _CUDA_FAILURE.search(text)) is not None:
        error = m.group(1)
        f["cuda_error"] = error
        if error == "out of memory":
            return NcclError("nccl_oom", "NCCL could not allocate GPU memory (Cuda failure 'out of memory')",
                             NCCL_OOM, False, f)
        return NcclError("nccl_cuda", f"NCCL hit a CUDA error: {error}", NCCL_CUDA, False, f)
    if "unhandled cuda error" in text:
        return NcclError("nccl_cuda", "NCCL hit a CUDA error (unhandled cuda error)", NCCL_CUDA, False, f)
    if "unhandled system error" in text or "ncclSystemError" in text:
        return NcclError("system", "NCCL system error (ncclSystemError): a system call or library NCCL uses failed",
                         SETUP, False, f)
    if "internal error - please report" in text:
        return NcclError("internal", "NCCL internal error (NCCL 2.18 reports network errors so)", DEAD_PEER, True, f)
    return NcclError("remote", "NCCL remote error: a peer process exited or the network between them failed",
                     DEAD_PEER, True, f)
