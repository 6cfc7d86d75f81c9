"""A CUDA (or ROCm) out-of-memory message, read in three steps that are each tested alone.

1. parse: one parser per message form PyTorch has printed (THC, `cached`, `reserved in total`, `total capacity of`),
   each returning the numbers it states (`OomReport`), or None when the form is not its own.
2. classify: what the numbers mean, decided by one table of rules (`RULES`, first match wins), over the message's
   numbers and what the node knows about that GPU now (`GpuContext`: its other processes, its faults, MIG).
3. explain: the title and the lever of each outcome.

Outcomes: *fragmentation* (the allocator's own free blocks hold the request), *true OOM* (the job's working set
fills its GPU), and *not this job's working set*: a cap on the allocator, free memory the allocator could not use,
the job's own other ranks on the card (rank-to-device placement), other processes on the card, or memory held outside
the job's PyTorch pool. Only a true OOM gets "a smaller micro-batch": whenever the card had room, the batch is not
the lever.

Text is hostile input: every regex here is linear (no nested or adjacent unbounded quantifiers over the same
characters) and runs over at most `MAX_TEXT` characters; a number that does not parse is left out, never raised.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from trainguard.core.text import linear
from trainguard.core.units import format_bytes, parse_size

MAX_TEXT = 4096  # the longest real message (several listed processes) is under 1 KiB
_MAX_SANE = 1 << 50  # 1 PiB: larger byte counts are NVML version-skew garbage (seen: "17179869184.00 GiB")
MiB, GiB = 1 << 20, 1 << 30

_SIZE = r"(\d{1,12}(?:\.\d{1,4})? ?(?:bytes|[KMGT]iB|B))"
_DEVICE = linear(r"\b(CUDA|HIP) out of memory")
_TRIED = linear(rf"Tried to allocate {_SIZE}")
# ≤1.4: "(GPU 0; 10.92 GiB total capacity; 8.57 MiB already allocated; 9.28 GiB free; 4.68 MiB cached)"
_CACHED = linear(rf"\(GPU (\d{{1,7}}); {_SIZE} total capacity; {_SIZE} already allocated; {_SIZE} free; {_SIZE} cached\)")
# 1.5-2.0: "...; 1.02 GiB free; [36.20 GiB allowed; ]36.54 GiB reserved in total by PyTorch)"
_RESERVED = linear(rf"\(GPU (\d{{1,7}}); {_SIZE} total capacity; {_SIZE} already allocated; {_SIZE} free; "
                       rf"(?:{_SIZE} allowed; )?{_SIZE} reserved in total by PyTorch\)")
# 2.1+: "GPU 0 has a total capac(i)ty of 79.15 GiB of which 1.06 GiB is free."
_CAPACITY = linear(rf"GPU (\d{{1,7}}) has a total capac(?:i)?ty of {_SIZE} of which {_SIZE} is free")
_ALLOWED = linear(rf"{_SIZE} allowed; Of the allocated memory")
_ALLOCATED = linear(rf"Of the allocated memory {_SIZE} is allocated by PyTorch, (?:with {_SIZE} allocated in "
                        rf"private pools \(e\.g\., (?:CUDA|HIP) Graphs\), )?and {_SIZE} is reserved by PyTorch but "
                        rf"unallocated")
_ALLOCATED_ONLY = linear(rf"Of the allocated memory {_SIZE} is allocated by PyTorch")
_PROCESS = linear(rf"Process (\d{{1,10}}) has {_SIZE} memory in use")
_THIS = linear(rf"this process has {_SIZE} memory in use")
# A request no working set makes: "more than 1EB" (2.x prints that above 1 EiB), or billions of GiB (a negative size
# read as unsigned): a bug that computed the size, or a knock-on of an earlier failure (NVIDIA/nccl#1284: after a
# NCCL timeout), never a batch to cut.
_IMPOSSIBLE = linear(r"Tried to allocate (?:more than 1EB|\d{7,12}(?:\.\d{1,4})? ?[GT]iB)")
_THC = linear(r"cuda runtime error \(2\) : out of memory|THCudaCheck FAIL.{0,300}? : out of memory")


def _bytes(text: str | None) -> int | None:
    if text is None:
        return None
    value = text.replace(" ", "")
    try:
        size = parse_size(value[:-5] if value.endswith("bytes") else value)
    except ValueError:
        return None
    return size if size < _MAX_SANE else None


@dataclass(frozen=True)
class OomReport:
    """The numbers one OOM message states; None where its form does not say."""

    form: str  # THC, cached (<=1.4), reserved (1.5-2.0), capacity (2.1+)
    device: str = "CUDA"  # or HIP (ROCm builds print the same allocator's message)
    gpu: int | None = None  # a CUDA ordinal of the process, not an NVML index
    tried: int | None = None
    total: int | None = None
    free: int | None = None
    allocated: int | None = None
    reserved_unallocated: int | None = None
    private_pools: int | None = None
    allowed: int | None = None  # the allocator's cap (set_per_process_memory_fraction)
    this_process: int | None = None  # 2.1+: the process's memory including non-PyTorch allocations
    processes: tuple[tuple[int, int], ...] = ()  # 2.1+: (pid, bytes) of the other listed processes
    impossible: bool = False  # a request no working set makes (more than 1EB, billions of GiB)

    @property
    def reserved(self) -> int | None:
        """All memory PyTorch's allocator holds: allocated plus reserved-but-unallocated."""
        if self.allocated is None or self.reserved_unallocated is None:
            return None
        return self.allocated + self.reserved_unallocated

    def fields(self) -> dict[str, Any]:
        return {"form": self.form, "device": self.device, "gpu": self.gpu, "tried": self.tried, "total": self.total,
                "free": self.free, "allocated": self.allocated, "reserved_unallocated": self.reserved_unallocated,
                "reserved": self.reserved, "private_pools": self.private_pools, "allowed": self.allowed,
                "this_process": self.this_process,
                "processes": [{"pid": pid, "bytes": used} for pid, used in self.processes]}


# 1. parse ---------------------------------------------------------------------------------------------------------

def _parse_cached(text: str) -> OomReport | None:
    """PyTorch <=1.4. Its `cached` is what the allocator holds but has not handed out (its source: cached -
    allocated), i.e. what later forms call reserved but unallocated."""
    m = _CACHED.search(text)
    if m is None:
        return None
    gpu, total, allocated, free, cached = m.groups()
    return OomReport("cached", gpu=int(gpu), total=_bytes(total), allocated=_bytes(allocated), free=_bytes(free),
                     reserved_unallocated=_bytes(cached))


def _parse_reserved(text: str) -> OomReport | None:
    """PyTorch 1.5-2.0: `reserved in total` is everything the allocator holds; `allowed` when a fraction is set."""
    m = _RESERVED.search(text)
    if m is None:
        return None
    gpu, total, allocated, free, allowed, reserved = m.groups()
    alloc, held = _bytes(allocated), _bytes(reserved)
    unallocated = max(0, held - alloc) if held is not None and alloc is not None else None
    return OomReport("reserved", gpu=int(gpu), total=_bytes(total), allocated=alloc, free=_bytes(free),
                     allowed=_bytes(allowed), reserved_unallocated=unallocated)


def _parse_capacity(text: str) -> OomReport | None:
    """PyTorch 2.1 and later (2.1 spells it "capacty"), with the processes NVML lists on that GPU."""
    m = _CAPACITY.search(text)
    if m is None:
        return None
    report = OomReport("capacity", gpu=int(m.group(1)), total=_bytes(m.group(2)), free=_bytes(m.group(3)))
    if (alloc := _ALLOCATED.search(text)) is not None:
        report = replace(report, allocated=_bytes(alloc.group(1)), private_pools=_bytes(alloc.group(2)),
                         reserved_unallocated=_bytes(alloc.group(3)))
    elif (only := _ALLOCATED_ONLY.search(text)) is not None:  # a message cut after the allocated figure
        report = replace(report, allocated=_bytes(only.group(1)))
    this = _THIS.search(text)
    allowed = _ALLOWED.search(text)
    processes = tuple((int(pid), used) for pid, size in _PROCESS.findall(text) if (used := _bytes(size)) is not None)
    return replace(report, this_process=_bytes(this.group(1)) if this else None,
                   allowed=_bytes(allowed.group(1)) if allowed else None, processes=processes)


def _parse_thc(text: str) -> OomReport | None:
    """PyTorch 0.x: no numbers at all."""
    return OomReport("THC") if _THC.search(text) else None


PARSERS: tuple[Callable[[str], OomReport | None], ...] = (_parse_capacity, _parse_reserved, _parse_cached, _parse_thc)


def parse_oom(text: str) -> OomReport:
    """The numbers of any OOM form PyTorch printed (an unknown form: just `OOM`)."""
    text = text[:MAX_TEXT]
    report = next((r for parse in PARSERS if (r := parse(text)) is not None), None) or OomReport("unknown")
    device = _DEVICE.search(text)
    tried = _TRIED.search(text)
    return replace(report, device=device.group(1) if device else "CUDA", tried=_bytes(tried.group(1)) if tried else None,
                   impossible=_IMPOSSIBLE.search(text) is not None)


# 2. classify ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CoTenant:
    """Another process holding memory on the OOMed GPU: from the message (pid, bytes) or NVML (and the node)."""

    pid: int
    bytes: int | None
    command: str | None = None
    user: str | None = None
    job: str | None = None  # the job it belongs to, as a label, when it is a known job's

    def describe(self) -> str:
        who = ", ".join(w for w in (self.command, f"user {self.user}" if self.user else None, self.job) if w)
        return f"pid {self.pid}" + (f" ({who})" if who else "") + (f" {format_bytes(self.bytes)}" if self.bytes else "")


@dataclass(frozen=True)
class GpuContext:
    """What the node knows about the OOMed GPU when the message is read (NVML, the job's environment)."""

    index: int | None = None  # NVML index
    others: tuple[CoTenant, ...] = ()  # processes other than the job's holding memory on it now
    faults: tuple[str, ...] = ()  # ECC, row remapping, retired pages (gpu.health.gpu_faults)
    mig: bool = False  # the job sees a MIG slice (CUDA_VISIBLE_DEVICES=MIG-...)
    own_pids: frozenset[int] = frozenset()  # the job's own processes (its process tree), whatever they hold
    user: str | None = None  # the job's user: a process of that user in no other job is the job's (root's are not:
    # system services and other jobs' helpers run as root)


CONTEXT_ALLOWANCE = GiB  # a CUDA context plus library workspaces: what a process holds outside PyTorch's pool
COTENANT_MIN = GiB  # other processes holding at least this much (or COTENANT_SHARE of the card) are a lever
COTENANT_SHARE = 0.10
OUTSIDE_SHARE = 0.25  # memory nobody in the message accounts for: a lever from a quarter of the card
CAP_SLACK = 0.99  # the message rounds to two decimals: reserved + tried within 1% of `allowed` hits the cap
# Free memory a little above the request is no room: the allocator rounds requests up (2 MiB pages, 20 MiB segments)
# and the driver keeps some back. Free memory beyond the request by this much is room the allocator failed to use.
UNUSABLE_MARGIN = 256 * MiB


@dataclass(frozen=True)
class OomFacts:
    """The quantities the rules compare, derived from the report and the context (None: unknown)."""

    tried: int | None
    total: int | None
    free: int | None
    reserved: int | None
    reserved_unallocated: int | None
    allowed: int | None
    shortfall: int | None  # tried - free: what the card lacked
    others: tuple[CoTenant, ...]  # named processes other than this one (message, else NVML)
    others_bytes: int
    outside: int | None  # memory on the card that neither this job's memory nor a named process accounts for
    outside_unowned: int | None  # ... less a context's worth when the message does not say what this process holds
    faults: tuple[str, ...]
    mig: bool
    impossible: bool = False
    own: tuple[CoTenant, ...] = ()  # processes of this job other than the failing one (its other ranks)
    own_bytes: int = 0
    own_known: bool = False  # from the job's process tree or user; else told by their look (near-identical sizes,
    # consecutive pids: ranks that each created a context on this GPU)


def _others_from_message(r: OomReport) -> tuple[CoTenant, ...]:
    """The listed processes that are not this one. 2.1 in a container lists the job's own process by its host pid
    (not as "this process"): when the listed processes account for the whole card, the one closest above the job's
    own reserved memory is taken as the job itself."""
    listed = [CoTenant(pid, used) for pid, used in r.processes]
    if r.this_process is not None or not listed or r.reserved is None or r.total is None or r.free is None:
        return tuple(listed)
    used = r.total - r.free
    if sum(p.bytes or 0 for p in listed) >= used - CONTEXT_ALLOWANCE:
        mine = min((p for p in listed if (p.bytes or 0) >= r.reserved), key=lambda p: p.bytes or 0, default=None)
        return tuple(p for p in listed if p is not mine)
    return tuple(listed)


# Ranks of one job that each created a CUDA context on the same GPU (before torch.cuda.set_device) look alike: several
# processes of near-identical size with pids close together (one launcher started them at once).
RANKS_MIN = 3
RANKS_SIZE_SLACK = 0.05  # of the largest, or 64 MiB
RANKS_PID_SPREAD = 4  # the pids lie within this many per process


def _lookalike_ranks(others: tuple[CoTenant, ...]) -> bool:
    sizes = [o.bytes for o in others if o.bytes is not None]
    if len(others) < RANKS_MIN or len(sizes) != len(others):
        return False
    pids = [o.pid for o in others]
    return (max(sizes) - min(sizes) <= max(64 * MiB, max(sizes) * RANKS_SIZE_SLACK)
            and max(pids) - min(pids) <= RANKS_PID_SPREAD * len(pids))


def _own(others: tuple[CoTenant, ...], ctx: GpuContext) -> tuple[tuple[CoTenant, ...], tuple[CoTenant, ...], bool]:
    """(the job's own processes, the others, whether the job's own were known rather than told by their look)."""
    mine = tuple(o for o in others if o.pid in ctx.own_pids
                 or (ctx.user not in (None, "root") and o.user == ctx.user and o.job is None))
    if mine:
        return mine, tuple(o for o in others if o not in mine), True
    if all(o.job is None for o in others) and _lookalike_ranks(others):  # another job's ranks look alike too
        return others, (), False
    return (), others, False


def facts(r: OomReport, ctx: GpuContext | None = None) -> OomFacts:
    ctx = ctx or GpuContext()
    others = _others_from_message(r)
    this = r.this_process if r.this_process is not None else r.reserved
    room = r.total - r.free - this if r.total is not None and r.free is not None and this is not None else None
    now = not others and bool(ctx.others)
    if others and ctx.others:  # the message gives the bytes at the failure; the node can name who they are
        named = {o.pid: o for o in ctx.others}
        others = tuple(replace(named[o.pid], bytes=o.bytes) if o.pid in named else o for o in others)
    elif now:  # NVML tells who holds the GPU now; at the failure they held at most what the message leaves
        others = ctx.others
    mine, others, known = _own(others, ctx)
    own_bytes, others_bytes = sum(o.bytes or 0 for o in mine), sum(o.bytes or 0 for o in others)
    if now and room is not None:
        own_bytes, others_bytes = min(own_bytes, max(0, room)), min(others_bytes, max(0, room - own_bytes))
    outside = unowned = None
    if room is not None:
        outside = max(0, room - others_bytes - own_bytes)
        unowned = max(0, outside - (0 if r.this_process is not None else CONTEXT_ALLOWANCE))
    shortfall = r.tried - r.free if r.tried is not None and r.free is not None else None
    return OomFacts(r.tried, r.total, r.free, r.reserved, r.reserved_unallocated, r.allowed, shortfall, others,
                    others_bytes, outside, unowned, ctx.faults, ctx.mig, r.impossible, mine, own_bytes, known)


def _inconsistent(f: OomFacts) -> bool:
    """More free than the GPU's capacity: unified or shared memory (an APU, a WDDM driver); no number holds."""
    return f.free is not None and f.total is not None and f.free > f.total


def _larger_than_gpu(f: OomFacts) -> bool:
    return f.tried is not None and f.total is not None and f.tried > f.total


def _capped(f: OomFacts) -> bool:
    return (f.allowed is not None and f.tried is not None and f.reserved is not None
            and (f.total is None or f.allowed < f.total * 0.98) and f.reserved + f.tried >= f.allowed * CAP_SLACK)


def _free_unusable(f: OomFacts) -> bool:
    return f.tried is not None and f.free is not None and f.free >= f.tried + UNUSABLE_MARGIN


def _cotenants(f: OomFacts) -> bool:
    big = f.others_bytes >= COTENANT_MIN or (f.total is not None and f.others_bytes >= f.total * COTENANT_SHARE)
    return big and f.shortfall is not None and f.others_bytes >= f.shortfall


def _own_ranks(f: OomFacts) -> bool:
    return bool(f.own) and f.shortfall is not None and f.own_bytes >= f.shortfall


def _outside(f: OomFacts) -> bool:
    return (f.outside_unowned is not None and f.total is not None and f.shortfall is not None
            and f.outside_unowned >= f.total * OUTSIDE_SHARE and f.outside_unowned >= f.shortfall)


def _fragmented(f: OomFacts) -> bool:
    return f.tried is not None and f.reserved_unallocated is not None and f.reserved_unallocated >= f.tried


def _measured(f: OomFacts) -> bool:
    return f.tried is not None and f.reserved_unallocated is not None


FRAGMENTATION = "fragmentation"
TRUE_OOM = "true OOM"
NOT_WORKING_SET = "not this job's working set"
IMPOSSIBLE = "an impossible allocation"


@dataclass(frozen=True)
class Rule:
    kind: str
    cause: str | None
    applies: Callable[[OomFacts], bool]


# The decision, in order: the first rule that applies names the outcome.
RULES: tuple[Rule, ...] = (
    Rule(IMPOSSIBLE, None, lambda f: f.impossible),
    Rule("OOM", "inconsistent numbers", _inconsistent),
    Rule(TRUE_OOM, "larger than the GPU", _larger_than_gpu),
    Rule(NOT_WORKING_SET, "cap", _capped),
    Rule(NOT_WORKING_SET, "free memory unusable", _free_unusable),
    Rule(NOT_WORKING_SET, "the job's own ranks", _own_ranks),
    Rule(NOT_WORKING_SET, "co-tenant", _cotenants),
    Rule(NOT_WORKING_SET, "outside PyTorch", _outside),
    Rule(FRAGMENTATION, None, _fragmented),
    Rule(NOT_WORKING_SET, "MIG slice", lambda f: f.mig and _measured(f)),
    Rule(TRUE_OOM, None, _measured),
    Rule("OOM", None, lambda f: True),  # no numbers (THC): the true-OOM levers, hedged
)


def classify(r: OomReport, ctx: GpuContext | None = None) -> tuple[Rule, OomFacts]:
    f = facts(r, ctx)
    return next(rule for rule in RULES if rule.applies(f)), f


# 3. explain -------------------------------------------------------------------------------------------------------

FRAGMENTATION_ADVICE = ("fragmentation: set PYTORCH_ALLOC_CONF=expandable_segments:True (older PyTorch: "
                        "PYTORCH_CUDA_ALLOC_CONF), then try max_split_size_mb; do not cut the batch size")
TRUE_OOM_ADVICE = ("true OOM: in order, a smaller micro-batch with gradient accumulation (same global batch), "
                   "shorter or bucketed sequences, activation checkpointing, a higher sharding degree (FSDP / ZeRO-2/3)")
NO_BATCH = "do not cut the batch size: the GPU had room for the job"


def _advice(rule: Rule, f: OomFacts) -> str:
    b = format_bytes
    if rule.kind == IMPOSSIBLE:
        return ("no working set asks for that much: a size computed from garbage, a knock-on of an earlier failure "
                "(a NCCL timeout or error just before it: that is the cause) or a bug in the shape that asked for it; "
                "do not cut the batch size")
    if rule.kind == FRAGMENTATION:
        return FRAGMENTATION_ADVICE
    if rule.cause == "inconsistent numbers":
        return (f"the driver reports {b(f.free or 0)} free on a GPU of {b(f.total or 0)} (unified or shared memory): "
                "the message's numbers can't tell the cause; see what else uses that memory, then treat it as a true "
                "OOM")
    if rule.cause == "larger than the GPU":
        return (f"one allocation of {b(f.tried or 0)} is larger than the whole GPU ({b(f.total or 0)}): look at the "
                "shape that asked for it (a sequence length, vocabulary or batch dimension out of range) or shard "
                "that tensor (tensor or sequence parallelism)")
    if rule.cause == "cap":
        return (f"the allocator is capped at {b(f.allowed or 0)} (torch.cuda.set_per_process_memory_fraction) while "
                f"the GPU had {b(f.free or 0)} free: raise or remove the cap; {NO_BATCH}")
    if rule.cause == "free memory unusable":
        if f.faults:
            return (f"hardware suspect: the GPU reported {b(f.free or 0)} free, more than the {b(f.tried or 0)} "
                    f"asked for, and it has {', '.join(f.faults)}: drain the node and reset or replace the GPU; "
                    f"{NO_BATCH}")
        return (f"the GPU reported {b(f.free or 0)} free, more than the {b(f.tried or 0)} asked for, so the "
                "allocation failed for another reason: a memory-fraction cap, another allocator in the process "
                "(NCCL buffers, cuBLAS/cuDNN workspaces outside PyTorch's pool), memory released just after the "
                "failure, or a faulty GPU; check its ECC and row-remap state and the node's XIDs before rerunning; "
                f"{NO_BATCH}")
    if rule.cause == "the job's own ranks":
        how = "" if f.own_known else " (their near-identical sizes and consecutive pids tell)"
        return (f"{len(f.own)} other processes of this job hold {b(f.own_bytes)} on this GPU{how}: its ranks each "
                "created a CUDA context here, so the lever is rank-to-device placement: call "
                "torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before any CUDA call (model, tensors, "
                "init_process_group's device_id), or give each rank its own CUDA_VISIBLE_DEVICES; not co-tenants "
                f"to stop; {NO_BATCH}")
    if rule.cause == "co-tenant":
        contexts = len(f.others) > 1 and all(o.bytes is not None and o.bytes < GiB for o in f.others)
        hint = ("; several processes of about one CUDA context each are usually other ranks touching this GPU: "
                "call torch.cuda.set_device(local_rank) before any CUDA work") if contexts else ""
        return (f"other processes hold {b(f.others_bytes)} on this GPU, more than the {b(max(f.shortfall or 0, 0))} "
                f"that was missing: stop them, or ask the scheduler for exclusive GPUs{hint}; {NO_BATCH}")
    if rule.cause == "outside PyTorch":
        return (f"{b(f.outside or 0)} of the GPU is held outside this job's PyTorch memory: another process (run "
                "nvidia-smi on the node), or allocations in this process outside PyTorch's pool (NCCL buffers, "
                f"cuBLAS/cuDNN workspaces, another framework); {NO_BATCH}")
    if rule.cause == "MIG slice":
        return ("the job runs on a MIG slice: ask for a larger MIG profile or a whole GPU; else, as for a true OOM: "
                + TRUE_OOM_ADVICE.removeprefix("true OOM: "))
    return TRUE_OOM_ADVICE


def _title(r: OomReport, rule: Rule, f: OomFacts) -> str:
    kind = rule.kind + (f": {rule.cause}" if rule.kind != FRAGMENTATION and rule.cause else "")
    head = f"{r.device} out of memory ({kind})" + (f" on GPU {r.gpu}" if r.gpu is not None else "")
    parts = []
    if r.tried:
        parts.append(f"tried {format_bytes(r.tried)}")
    if r.free is not None and r.total:
        parts.append(f"{format_bytes(r.free)} free of {format_bytes(r.total)}")
    if r.allowed is not None:
        parts.append(f"{format_bytes(r.allowed)} allowed")
    if f.reserved is not None:
        parts.append(f"this job's PyTorch memory {format_bytes(f.reserved)}")
    if r.reserved_unallocated is not None:
        parts.append(f"{format_bytes(r.reserved_unallocated)} of it reserved but unallocated")
    if f.own:
        sizes = sorted({format_bytes(o.bytes) for o in f.own if o.bytes})
        parts.append(f"{len(f.own)} processes of the job itself (pids {min(o.pid for o in f.own)}-"
                     f"{max(o.pid for o in f.own)}, {'/'.join(sizes[:3])} each)")
    if f.others:
        parts.append("other processes: " + ", ".join(o.describe() for o in f.others[:6]))
    elif rule.cause == "outside PyTorch" and f.outside:
        parts.append(f"{format_bytes(f.outside)} held outside it")
    if f.faults:
        parts.append("GPU faults: " + ", ".join(f.faults))
    return head + (": " + ", ".join(parts) if parts else "")


@dataclass(frozen=True)
class OomDiagnosis:
    kind: str  # fragmentation, true OOM, not this job's working set, OOM (no numbers)
    cause: str | None  # for "not this job's working set": cap, free memory unusable, co-tenant, outside PyTorch, MIG
    title: str
    advice: str
    hardware: bool = False  # free memory the GPU could not give, on a GPU with memory faults
    fields: dict[str, Any] = field(default_factory=dict)


def explain(r: OomReport, rule: Rule, f: OomFacts) -> OomDiagnosis:
    hardware = rule.cause == "free memory unusable" and bool(f.faults)
    fields = {**r.fields(), "diagnosis": rule.kind, "cause": rule.cause, "shortfall": f.shortfall,
              "others_bytes": f.others_bytes, "outside": f.outside, "hardware": hardware}
    return OomDiagnosis(rule.kind, rule.cause, _title(r, rule, f), _advice(rule, f), hardware, fields)


def diagnose_oom(text: str, ctx: GpuContext | None = None) -> OomDiagnosis:
    report = parse_oom(text)
    rule, f = classify(report, ctx)
    return explain(report, rule, f)

