"""The one gateway to NVML (module `pynvml` from nvidia-ml-py).

Init once, re-init after a driver reload, and map every NVMLError to an outcome a check can report:
not supported -> the value is omitted; GPU lost -> `lost`; library or driver missing -> NvmlUnavailableError.
Tests hand in a scripted module with the same function names and error classes.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from types import ModuleType
from typing import Any, Generic, TypeVar

from trainguard.core.logs import kv

log = logging.getLogger("trainguard.gpu.nvml")
T = TypeVar("T")
V = TypeVar("V")

_UNAVAILABLE = ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded", "NVMLError_FunctionNotFound",
                "NVMLError_NoPermission")
_MAX_SANE_BYTES = 1 << 44  # 16 TiB: anything larger is a binding/driver version-skew artefact


class NvmlUnavailableError(Exception):
    """NVML can't be used on this node (no driver, no library, no permission)."""


_MAX_PID = 1 << 22  # the kernel's pid_max ceiling: larger "pids" are version-skew garbage (e.g. 4294967295)


@dataclass(frozen=True)
class GpuProcess:
    pid: int  # a host pid
    used: int | None  # bytes; None where the driver can't say (MIG, some vGPU modes)


@dataclass(frozen=True)
class GpuState:
    index: int
    uuid: str
    name: str
    bus_id: str
    lost: bool = False
    memory_total: int | None = None
    memory_used: int | None = None
    temperature_c: int | None = None
    ecc_uncorrected_volatile: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    retired_pages_pending: bool | None = None  # pre-Ampere page retirement
    remap_pending: bool | None = None  # Ampere+ row remapping: a reset is needed
    remap_failed: bool | None = None
    clock_event_reasons: int | None = None  # bitmask; see CLOCK_EVENTS
    processes: tuple[GpuProcess, ...] | None = None  # compute processes; None: not supported
    error: str | None = None
    serial: str = ""  # the board's serial number (the node ledger's identity of the GPU); "" where NVML has none


# Clock-event ("throttle") reasons worth a person's attention, by NVML bit.
CLOCK_EVENTS = {0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake"}


# The clock-event reasons that slow a busy GPU (fail-slow evidence): those above and the software power cap.
SLOWDOWN_REASONS = {0x4: "sw_power_cap", **CLOCK_EVENTS}


# The NVLink error counters NVML keeps per link (nvmlNvLinkErrorCounter_t), by the names the metrics use.
NVLINK_COUNTERS = {"replay": "NVML_NVLINK_ERROR_DL_REPLAY", "recovery": "NVML_NVLINK_ERROR_DL_RECOVERY",
                   "crc_flit": "NVML_NVLINK_ERROR_DL_CRC_FLIT", "crc_data": "NVML_NVLINK_ERROR_DL_CRC_DATA"}
FABRIC_STATES = {0: "not_supported", 1: "not_started", 2: "in_progress", 3: "completed"}  # nvmlGpuFabricState_t


@dataclass(frozen=True)
class GpuId:
    index: int
    uuid: str
    name: str
    bus_id: str


@dataclass(frozen=True)
class Reading(Generic[V]):
    """One GPU's answer to one family of reads: the value, or why there is none (lost, or an NVML error)."""

    gpu: GpuId
    value: V | None = None
    lost: bool = False
    error: str | None = None


@dataclass(frozen=True)
class NvLink:
    link: int
    active: bool
    errors: dict[str, int] = field(default_factory=dict)  # NVLINK_COUNTERS names; unsupported ones absent


@dataclass(frozen=True)
class PcieLink:
    generation: int | None
    generation_max: int | None  # the most this GPU in this slot can run (NVML: min of device and system)
    width: int | None
    width_max: int | None
    replays: int | None  # PCIe replay counter (link-level retransmissions)
    utilization: int | None  # GPU busy percent: an idle GPU drops its link generation to save power


@dataclass(frozen=True)
class Fabric:
    state: int  # nvmlGpuFabricState_t; FABRIC_STATES names it
    status: int  # an NVML return code: 0 once registration succeeded


@dataclass(frozen=True)
class GpuConfig:
    persistence: bool | None
    vbios: str | None


@dataclass(frozen=True)
class Clocks:
    """What sets a GPU's speed now: its SM clock against its maximum, why it is held back (a SLOWDOWN_REASONS mask),
    power against the enforced limit and temperature against the slowdown threshold. None: not supported."""

    sm_mhz: int | None
    sm_max_mhz: int | None
    reasons: int | None
    power_w: float | None
    power_limit_w: float | None
    temperature_c: int | None
    slowdown_c: int | None


def normalize_bus_id(bus_id: str | bytes) -> str:
    """`00000000:3B:00.0` (NVML) and `PCI:0000:3b:00` (kernel) both become `0000:3b:00`."""
    text = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
    text = text.strip().lower().removeprefix("pci:")
    domain, _, rest = text.partition(":")
    rest = rest.split(".")[0]
    return f"{int(domain, 16):04x}:{rest}" if rest else text


class Nvml:
    def __init__(self, lib: ModuleType | Any | None = None) -> None:
        self._lib = lib
        self._lock = threading.Lock()
        self._initialized = False
        self._links: dict[str, tuple[int, ...]] = {}  # uuid -> the links it has: probing the absent ones costs calls

    def _module(self) -> Any:
        if self._lib is None:
            import pynvml

            self._lib = pynvml
        return self._lib

    def _is(self, exc: BaseException, *names: str) -> bool:
        lib = self._module()
        return any(isinstance(exc, cls) for cls in (getattr(lib, n, None) for n in names) if isinstance(cls, type))

    def ensure(self) -> Any:
        """Initialise once; NvmlUnavailableError with the reason when NVML can't be used here."""
        lib = self._module()
        with self._lock:
            if self._initialized:
                return lib
            try:
                lib.nvmlInit()
            except lib.NVMLError as exc:
                raise NvmlUnavailableError(f"NVML not available: {exc}") from None
            except OSError as exc:
                raise NvmlUnavailableError(f"NVML not available: {exc}") from None
            self._initialized = True
            return lib

    def reset(self) -> None:
        """Forget the session, e.g. after the driver was reloaded; the next call initialises again."""
        self._links.clear()
        with self._lock:
            if self._initialized:
                try:
                    self._module().nvmlShutdown()
                except Exception as exc:  # noqa: BLE001 - shutdown of a dead session is best effort
                    log.debug("nvmlShutdown failed", extra=kv(error=exc))
            self._initialized = False

    def _optional(self, call: Callable[[], T], *absent: str) -> T | None:
        """The value, or None where the GPU doesn't support it (or, for `absent` errors, doesn't have it)."""
        try:
            return call()
        except self._module().NVMLError as exc:
            if self._unsupported(exc, *absent):
                return None
            raise

    def _unsupported(self, exc: BaseException, *absent: str) -> bool:
        """An NVML error that means the GPU doesn't support the read (or, for `absent` errors, doesn't have it)."""
        return self._is(exc, "NVMLError_NotSupported", *absent)

    def _count(self) -> tuple[Any, int]:
        lib = self.ensure()
        try:
            return lib, lib.nvmlDeviceGetCount()
        except lib.NVMLError as exc:
            if self._is(exc, "NVMLError_Uninitialized", "NVMLError_DriverNotLoaded"):
                self.reset()
            if self._is(exc, *_UNAVAILABLE):
                raise NvmlUnavailableError(f"NVML not available: {exc}") from None
            raise

    def gpus(self) -> list[GpuState]:
        lib, count = self._count()
        return [self._gpu(lib, i) for i in range(count)]

    def read(self, reader: Callable[[Any, Any, GpuId], V]) -> list[Reading[V]]:
        """One family of reads on every GPU: `reader(lib, handle, gpu)`; a lost GPU or an NVML error is that GPU's
        reading, never an exception for the others."""
        lib, count = self._count()
        out: list[Reading[V]] = []
        for index in range(count):
            gpu = GpuId(index, "", "", "")
            try:
                handle = lib.nvmlDeviceGetHandleByIndex(index)
                gpu = GpuId(index, _text(lib.nvmlDeviceGetUUID(handle)), _text(lib.nvmlDeviceGetName(handle)),
                            normalize_bus_id(lib.nvmlDeviceGetPciInfo(handle).busId))
                out.append(Reading(gpu, reader(lib, handle, gpu)))
            except lib.NVMLError as exc:
                lost = self._is(exc, "NVMLError_GpuIsLost", "NVMLError_ResetRequired")
                out.append(Reading(gpu, lost=lost, error=str(exc) if lost else f"{type(exc).__name__}: {exc}"))
        return out

    def nvlinks(self) -> list[Reading[tuple[NvLink, ...]]]:
        """Each GPU's NVLinks: state and error counters. Empty where the GPU has none (PCIe cards, no bridge)."""
        return self.read(self._nvlinks)

    def _nvlinks(self, lib: Any, handle: Any, gpu: GpuId) -> tuple[NvLink, ...]:
        links = self._links.get(gpu.uuid)
        probe = links is None
        candidates = range(int(getattr(lib, "NVML_NVLINK_MAX_LINKS", 18))) if links is None else links
        enabled = getattr(lib, "NVML_FEATURE_ENABLED", 1)
        # 18 links x 4 counters a GPU, every run: the names and constants looked up once, the calls made directly
        counters = [(name, getattr(lib, constant)) for name, constant in NVLINK_COUNTERS.items()]
        read_counter, error = lib.nvmlDeviceGetNvLinkErrorCounter, lib.NVMLError
        out = []
        for link in candidates:  # a link the GPU lacks answers NotSupported or InvalidArgument
            state = self._optional(partial(lib.nvmlDeviceGetNvLinkState, handle, link), "NVMLError_InvalidArgument")
            if state is None:
                continue
            errors = {}
            for name, constant in counters:
                try:
                    value = read_counter(handle, link, constant)
                except error as exc:  # `_optional`'s rule, without a callable made per read
                    if self._unsupported(exc, "NVMLError_InvalidArgument"):
                        continue
                    raise
                if isinstance(value, int) and 0 <= value < 2**63:
                    errors[name] = value
            out.append(NvLink(link, state == enabled, errors))
        if probe and gpu.uuid:
            self._links[gpu.uuid] = tuple(x.link for x in out)
        return tuple(out)

    def pcie(self) -> list[Reading[PcieLink]]:
        return self.read(self._pcie)

    def _pcie(self, lib: Any, handle: Any, gpu: GpuId) -> PcieLink:
        def small(call: Callable[[], Any], limit: int) -> int | None:
            value = self._optional(call)
            return int(value) if isinstance(value, int) and 0 <= value <= limit else None

        util = self._optional(lambda: lib.nvmlDeviceGetUtilizationRates(handle))
        busy = getattr(util, "gpu", None)
        return PcieLink(small(lambda: lib.nvmlDeviceGetCurrPcieLinkGeneration(handle), 16),
                        small(lambda: lib.nvmlDeviceGetMaxPcieLinkGeneration(handle), 16),
                        small(lambda: lib.nvmlDeviceGetCurrPcieLinkWidth(handle), 64),
                        small(lambda: lib.nvmlDeviceGetMaxPcieLinkWidth(handle), 64),
                        _count(self._optional(lambda: lib.nvmlDeviceGetPcieReplayCounter(handle))),
                        int(busy) if isinstance(busy, int) and 0 <= busy <= 100 else None)

    def clocks(self) -> list[Reading[Clocks]]:
        """Each GPU's clocks, clock-event reasons, power and temperature against their limits."""
        return self.read(self._clocks)

    def _clocks(self, lib: Any, handle: Any, gpu: GpuId) -> Clocks:
        sm = getattr(lib, "NVML_CLOCK_SM", 1)
        slowdown = getattr(lib, "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN", 1)
        getter = getattr(lib, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            getattr(lib, "nvmlDeviceGetCurrentClocksThrottleReasons", None)

        def small(call: Callable[[], Any], limit: int) -> int | None:
            value = self._optional(call)
            return int(value) if isinstance(value, int) and 0 <= value <= limit else None

        power = small(partial(lib.nvmlDeviceGetPowerUsage, handle), 10**7)  # milliwatts
        limit = small(partial(lib.nvmlDeviceGetEnforcedPowerLimit, handle), 10**7)
        return Clocks(small(lambda: lib.nvmlDeviceGetClockInfo(handle, sm), 100_000),
                      small(lambda: lib.nvmlDeviceGetMaxClockInfo(handle, sm), 100_000),
                      small(lambda: getter(handle), 2**32 - 1) if getter else None,
                      power / 1000 if power is not None else None, limit / 1000 if limit is not None else None,
                      small(lambda: lib.nvmlDeviceGetTemperature(handle, lib.NVML_TEMPERATURE_GPU), 199),
                      small(lambda: lib.nvmlDeviceGetTemperatureThreshold(handle, slowdown), 199))

    def fabric(self) -> list[Reading[Fabric | None]]:
        """Each GPU's NVLink fabric registration (Hopper and later on NVSwitch systems); None where unsupported."""
        return self.read(self._fabric)

    def _fabric(self, lib: Any, handle: Any, gpu: GpuId) -> Fabric | None:
        info = lib.c_nvmlGpuFabricInfo_t()
        # pynvml passes the struct to C as given: the caller hands in a pointer, as to the C API.
        done = self._optional(lambda: lib.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(info)),
                              "NVMLError_FunctionNotFound")
        if done is None:
            return None
        state, status = int(info.state), int(info.status)
        return Fabric(state, status) if state in FABRIC_STATES else None

    def config(self) -> tuple[str | None, list[Reading[GpuConfig]]]:
        """The driver version, and each GPU's persistence mode and VBIOS version."""
        lib, _ = self._count()
        driver = self._optional(lib.nvmlSystemGetDriverVersion)
        return (_text(driver) if driver else None), self.read(self._config)

    def _config(self, lib: Any, handle: Any, gpu: GpuId) -> GpuConfig:
        mode = self._optional(lambda: lib.nvmlDeviceGetPersistenceMode(handle))
        vbios = self._optional(lambda: lib.nvmlDeviceGetVbiosVersion(handle))
        return GpuConfig(bool(mode) if mode in (0, 1) else None, _text(vbios) if vbios else None)

    def _gpu(self, lib: Any, index: int) -> GpuState:
        uuid = name = bus = ""
        try:
            handle = lib.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(lib.nvmlDeviceGetUUID(handle))
            name = _text(lib.nvmlDeviceGetName(handle))
            bus = normalize_bus_id(lib.nvmlDeviceGetPciInfo(handle).busId)
            mem = self._optional(lambda: lib.nvmlDeviceGetMemoryInfo(handle, version=lib.nvmlMemory_v2))
            temp = self._optional(lambda: lib.nvmlDeviceGetTemperature(handle, lib.NVML_TEMPERATURE_GPU))
            health = self._health(lib, handle)
            procs = self._optional(lambda: lib.nvmlDeviceGetComputeRunningProcesses(handle))
            serial = self._optional(lambda: lib.nvmlDeviceGetSerial(handle))
        except lib.NVMLError as exc:
            if self._is(exc, "NVMLError_GpuIsLost", "NVMLError_ResetRequired"):
                return GpuState(index, uuid, name, bus, lost=True, error=str(exc))
            return GpuState(index, uuid, name, bus, error=f"{type(exc).__name__}: {exc}")
        total = used = None
        if mem is not None and 0 < mem.total < _MAX_SANE_BYTES and 0 <= mem.used <= mem.total:
            total, used = int(mem.total), int(mem.used)
        temperature = int(temp) if temp is not None and 0 <= temp < 200 else None
        return GpuState(index, uuid, name, bus, memory_total=total, memory_used=used, temperature_c=temperature,
                        processes=_processes(procs), serial=_text(serial).strip()[:64] if serial else "", **health)

    def _health(self, lib: Any, handle: Any) -> dict[str, Any]:
        """ECC, retirement, remapping, clock events: each omitted where the GPU doesn't support it."""
        uncorrected = getattr(lib, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)
        volatile = self._optional(lambda: lib.nvmlDeviceGetTotalEccErrors(handle, uncorrected, lib.NVML_VOLATILE_ECC))
        aggregate = self._optional(lambda: lib.nvmlDeviceGetTotalEccErrors(handle, uncorrected, lib.NVML_AGGREGATE_ECC))
        pending = self._optional(lambda: lib.nvmlDeviceGetRetiredPagesPendingStatus(handle))
        remap = self._optional(lambda: lib.nvmlDeviceGetRemappedRows(handle))
        getter = getattr(lib, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            getattr(lib, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
        reasons = self._optional(lambda: getter(handle)) if getter else None
        return {
            "ecc_uncorrected_volatile": _count(volatile), "ecc_uncorrected_aggregate": _count(aggregate),
            "retired_pages_pending": bool(pending) if pending is not None else None,
            "remap_pending": bool(remap[2]) if remap is not None else None,
            "remap_failed": bool(remap[3]) if remap is not None else None,
            "clock_event_reasons": int(reasons) if isinstance(reasons, int) and 0 <= reasons < 2**32 else None,
        }


def _processes(raw: Any) -> tuple[GpuProcess, ...] | None:
    if raw is None:
        return None
    out = []
    for p in raw:
        pid, used = getattr(p, "pid", None), getattr(p, "usedGpuMemory", None)
        if not isinstance(pid, int) or not 0 < pid < _MAX_PID:
            continue
        out.append(GpuProcess(pid, int(used) if isinstance(used, int) and 0 <= used < _MAX_SANE_BYTES else None))
    return tuple(out)


def _count(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and 0 <= value < 2**40 else None


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def probe() -> str | None:
    """None when NVML works on this node, else the reason it doesn't."""
    nvml = Nvml()
    try:
        nvml.ensure()
    except NvmlUnavailableError as exc:
        return str(exc)
    except ImportError as exc:
        return f"NVML not available: {exc}"
    finally:
        nvml.reset()
    return None
