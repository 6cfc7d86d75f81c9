"""NCCL failures other than the watchdog timeout, each with the lever it calls for.

The classes, as NCCL's result codes and PyTorch's messages name them (nccl.h: ncclSystemError = 2, ncclInternalError
= 3, ncclRemoteError = 6; PyTorch wraps them in `DistBackendError: NCCL error in: ..., <text>, NCCL version x.y.z`):

- a system call or external library failed (`unhandled system error`): the node's network setup (the interface NCCL
  picked, a firewall, /dev/shm in a container, the IB verbs library);
- a peer went away or the network failed (`remote process exited or there was a network error`, socket errors): a
  dead peer first, the link second; an echo of the rank that failed first;
- a network plugin's transport error, read as what it is, with the peer it names: InfiniBand/RoCE verbs
  (`NET/IB : Got completion from peer X with error 12`: 12 = transport retry counter exceeded, the most common),
  libfabric/OFI (AWS EFA: `NET/OFI Request ... completed with error. RC: 113. Error: 2 (UNDELIVERABLE)`), sockets
  (`Call to recv from X failed : Connection reset by peer`, `Connection closed by remote peer X`): "a network error
  talking to peer X", never "a generic remote error", and a cause, not another rank's echo (a flushed completion and
  a socket the peer closed excepted: those follow a peer that went away);
- `internal error`: NCCL 2.18 reports every network error as internal (NVIDIA/nccl#1092): treated as the network;
- NCCL's own CUDA calls failing (`NCCL WARN Cuda failure 'out of memory'`, `unhandled cuda error`);
- ranks running different collectives (`Detected mismatch between collectives`, TORCH_DISTRIBUTED_DEBUG=DETAIL): a
  desync in the training code.

`effect` says whether the class is usually the echo of a failure elsewhere (a peer that died) rather than a cause.

A system error raised asynchronously in a named collective (`Collective WorkNCCL(SeqNum=1915265, ...) raised the
following async exception`, the watchdog's) comes from a run that had been working: not the node's network setup
(that fails at the first collective), but a peer that went away or the link mid-run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainguard.core.text import linear

NEEDLES: tuple[bytes, ...] = (
    b"unhandled system error", b"ncclSystemError", b"remote process exited", b"ncclRemoteError",
    b"internal error - please report", b"unhandled cuda error", b"Cuda failure", b"Got completion",
    b"Detected mismatch between collectives", b"Call to recv", b"Call to send", b"Call to write",
    b"Connection closed by remote peer",
    b"completed with error")
PATTERN = linear(r"unhandled system error|ncclSystemError|remote process exited or there was a network error"
                 r"|ncclRemoteError|internal error - please report|unhandled cuda error|NCCL WARN Cuda failure"
                 r"|Got completion (?:from peer \S{1,100} )?with (?:error |status=)\d"
                 r"|Detected mismatch between collectives|Call to (?:recv|send|write) from \S{1,100} failed"
                 r"|NCCL WARN Call to (?:recv|send|write) failed"
                 r"|Connection closed by remote peer|NET/OFI .{0,120}completed with error")

_VERSION = linear(r"NCCL version (\d{1,3}\.\d{1,3}\.\d{1,3})")
_COMPLETION = linear(r"Got completion (?:from peer (\S{1,100}) )?with (?:error |status=)(\d{1,3})"
                     r"(?:.{0,80}?vendor err (\d{1,5}))?")
# aws-ofi-nccl: `NET/OFI Request 0x7f.. completed with error. RC: 113. Error: 2 (UNDELIVERABLE)` (RC: the errno, 113
# EHOSTUNREACH; Error: the provider's code and its name, EFA's `Unresponsive receiver ... Peer EFA addr: ...`)
# (older plugins: `Error: unknown error.`)
_OFI = linear(r"NET/OFI .{0,120}?completed with error\.? ?RC: (-?\d{1,6})\.? ?"
              r"(?:Error: (?:-?\d{1,6} \(([^)\n]{1,160})|([A-Za-z][^.\n]{0,80})))?")
_OFI_PEER = linear(r"Peer (?:EFA addr|host id): (\S{1,120})")
# NCCL's sockets: `Call to recv from 10.0.0.1<58355> failed : Broken pipe`, `Connection closed by remote peer node2<42830>`,
# older NCCL without the peer: `Call to recv failed : Connection reset by peer`
_SOCKET = linear(r"Call to (?:recv|send|write|read)(?: from (\S{1,120}))? failed ?: ?([A-Za-z][A-Za-z ]{0,40})"
                 r"|Connection closed by remote peer (\S{1,120})")
# a system error raised by a collective the run had issued (asynchronously: the watchdog's), not at init
_ASYNC = linear(r"WorkNCCL\(SeqNum=(\d{1,12}), OpType=(\w{1,40}).{0,300}?raised the following async exception"
                r"|watchdog thread terminated with exception: NCCL error")
_CUDA_FAILURE = linear(r"Cuda failure (?:\d{1,4} )?'([^'\n]{1,80})'")
_FINGERPRINT = linear(r"Rank (\d{1,7}) is running (?:inconsistent )?collective: CollectiveFingerPrint\("
                      r"(?:SequenceNumber=(\d{1,12}),? ?)?OpType=(\w{1,40})(?:, TensorShape=\[([^\]\n]{0,80})\])?")

# ibv_wc_status (infiniband/verbs.h): the ones a NCCL job meets
IB_STATUS = {1: "local length error", 2: "local QP operation error", 4: "local protection error",
             5: "work request flushed", 9: "remote invalid request", 10: "remote access error",
             11: "remote operation error", 12: "transport retry counter exceeded", 13: "RNR retry counter exceeded"}

IB_NETWORK = ("the network between the nodes: the IB/RoCE link to that peer (ibstat, the port's error counters, the "
           "cable and switch port; the node's infiniband check); if the fabric is only congested, a larger "
           "NCCL_IB_TIMEOUT helps, a broken link it does not")
OFI_NETWORK = ("the network between the nodes: the libfabric/EFA path to that peer (a peer node that went away, the "
               "security group or routing between the instances, the EFA device: fi_info -p efa, the instance's EFA "
               "health); NCCL_DEBUG=INFO and FI_LOG_LEVEL=warn name the peer")
MID_RUN = ("raised in a collective of a run that had been working: not the network setup; a peer that exited or "
           "crashed (its log; at the end of training, ranks leaving before the last collectives completed: "
           "destroy_process_group), else the network link failing mid-run (the node's network and IB checks)")
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


NETWORK = ("ib_completion", "ofi", "socket")  # a network plugin's own error, naming the transport (and the peer)


@dataclass(frozen=True)
class NcclError:
    kind: str  # system, remote, ib_completion, ofi, socket, internal, nccl_oom, nccl_cuda, desync
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


def _network(text: str, f: dict[str, Any]) -> NcclError | None:
    """A network plugin's own error (IB verbs, OFI/EFA, sockets), with the peer it names, or None."""
    if (m := _COMPLETION.search(text)) is not None:
        status = int(m.group(2))
        name = IB_STATUS.get(status, "work completion error")
        f.update(ib_status=status, ib_status_name=name, peer=m.group(1), vendor_err=m.group(3))
        flushed = status == 5  # flushed: the queue pair had already broken (an earlier error, a peer gone)
        return NcclError("ib_completion", _talking(m.group(1), f"InfiniBand completion error {status} ({name})"),
                         DEAD_PEER if flushed else IB_NETWORK, flushed, f)
    if (m := _OFI.search(text)) is not None:
        peer = _OFI_PEER.search(text)
        error = (m.group(2) or m.group(3) or "").strip() or None
        f.update(ofi_rc=int(m.group(1)), ofi_error=error, peer=peer.group(1) if peer else None)
        what = f"libfabric/OFI completion error RC {m.group(1)}" + (f" ({error})" if error else "")
        return NcclError("ofi", _talking(f["peer"], what), OFI_NETWORK, False, f)
    if (m := _SOCKET.search(text)) is not None:
        peer = m.group(1) or m.group(3)
        how = m.group(2).strip() if m.group(2) else "connection closed by the peer"
        f.update(peer=peer, socket_error=how)
        return NcclError("socket", _talking(peer, f"NCCL socket: {how}") + " (NCCL remote error: the peer process "
                         "exited or the link failed)", DEAD_PEER, True, f)
    return None


def _talking(peer: str | None, what: str) -> str:
    return f"network error talking to {f'peer {peer}' if peer else 'a peer'}: {what}"


def diagnose_nccl_error(text: str) -> NcclError:
    """The class of one NCCL error line (or of a terminal line that carries several of its lines)."""
    text = text[:8192]
    version = _VERSION.search(text)
    f: dict[str, Any] = {"nccl_version": version.group(1)} if version else {}
    if "Detected mismatch between collectives" in text:
        return _desync(text)
    if (network := _network(text, f)) is not None:  # the root of an async remote error when both are on the line
        return network
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
        if (m := _ASYNC.search(text)) is not None:
            where = f" in {m.group(2)} #{m.group(1)}" if m.group(1) else ""
            f.update(seq=int(m.group(1)) if m.group(1) else None, op=m.group(2), mid_run=True)
            return NcclError("system", f"NCCL system error (ncclSystemError) raised asynchronously{where}, mid-run",
                             MID_RUN, False, f)
        return NcclError("system", "NCCL system error (ncclSystemError): a system call or library NCCL uses failed",
                         SETUP, False, f)
    if "internal error - please report" in text:
        return NcclError("internal", "NCCL internal error (NCCL 2.18 reports network errors so)", DEAD_PEER, True, f)
    return NcclError("remote", "NCCL remote error: a peer process exited or the network between them failed",
                     DEAD_PEER, True, f)
