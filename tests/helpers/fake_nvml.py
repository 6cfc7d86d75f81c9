"""A scripted stand-in for the `pynvml` module: same function names, same error classes.

Only tests import it; the product always loads the real pynvml.
"""

from __future__ import annotations

import ctypes
import zlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

NVML_TEMPERATURE_GPU = 0
NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1
NVML_CLOCK_SM = 1
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
nvmlMemory_v2 = 0x02000028  # noqa: N816 - pynvml's own name
NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
NVML_NVLINK_MAX_LINKS = 36  # nvidia-ml-py 13's value; each GPU answers for the links it has
NVML_NVLINK_ERROR_DL_REPLAY = 0
NVML_NVLINK_ERROR_DL_RECOVERY = 1
NVML_NVLINK_ERROR_DL_CRC_FLIT = 2
NVML_NVLINK_ERROR_DL_CRC_DATA = 3
NVML_GPU_FABRIC_STATE_NOT_SUPPORTED = 0
NVML_GPU_FABRIC_STATE_NOT_STARTED = 1
NVML_GPU_FABRIC_STATE_IN_PROGRESS = 2
NVML_GPU_FABRIC_STATE_COMPLETED = 3


class c_nvmlGpuFabricInfo_t(ctypes.Structure):  # noqa: N801 - pynvml's own name and field layout
    _fields_ = [("clusterUuid", ctypes.c_uint8 * 16), ("status", ctypes.c_uint), ("cliqueId", ctypes.c_uint32),
                ("state", ctypes.c_uint)]


class NVMLError(Exception):
    value = 999

    def __str__(self) -> str:
        return self.__class__.__doc__ or "Unknown Error"


def _error(name: str, code: int, text: str) -> type[NVMLError]:
    return type(name, (NVMLError,), {"value": code, "__doc__": text})


NVMLError_Uninitialized = _error("NVMLError_Uninitialized", 1, "Uninitialized")
NVMLError_NotSupported = _error("NVMLError_NotSupported", 3, "Not Supported")
NVMLError_InvalidArgument = _error("NVMLError_InvalidArgument", 2, "Invalid Argument")
NVMLError_NoPermission = _error("NVMLError_NoPermission", 4, "Insufficient Permissions")
NVMLError_DriverNotLoaded = _error("NVMLError_DriverNotLoaded", 9, "Driver Not Loaded")
NVMLError_LibraryNotFound = _error("NVMLError_LibraryNotFound", 12, "NVML Shared Library Not Found")
NVMLError_FunctionNotFound = _error("NVMLError_FunctionNotFound", 13, "Function Not Found")
NVMLError_GpuIsLost = _error("NVMLError_GpuIsLost", 15, "GPU is lost")
NVMLError_ResetRequired = _error("NVMLError_ResetRequired", 16, "GPU requires restart")
NVMLError_Unknown = _error("NVMLError_Unknown", 999, "Unknown Error")


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    serial: str = ""  # "": derived from the uuid (a board serial is 13 digits)
    bus_id: bytes = b"00000000:18:00.0"
    total: int = 80 * 2**30
    used: int = 2 * 2**30
    temperature: int = 40
    ecc_volatile: int = 0
    ecc_aggregate: int = 0
    pages_pending: int = 0
    remap: tuple[int, int, int, int] = (0, 0, 0, 0)  # corrected, uncorrected, pending, failure
    clock_events: int = 0
    processes: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, usedGpuMemory)
    nvlinks: list[bool] = field(default_factory=list)  # per link: active; [] a GPU without NVLink
    nvlink_errors: dict[tuple[int, int], int] = field(default_factory=dict)  # (link, NVML_NVLINK_ERROR_DL_*) -> count
    pcie: tuple[int, int, int, int] = (5, 5, 16, 16)  # current gen, max gen, current width, max width
    pcie_replays: int = 0
    utilization: int = 0  # GPU busy percent
    fabric: tuple[int, int] | None = None  # (NVML_GPU_FABRIC_STATE_*, status); None: not supported (no NVSwitch)
    persistence: int = NVML_FEATURE_ENABLED
    vbios: str = "96.00.99.00.01"
    sm_clock: int = 1980  # MHz
    sm_clock_max: int = 1980
    power_mw: int = 350_000
    power_limit_mw: int = 700_000
    slowdown_c: int = 90  # the temperature at which the GPU slows itself
    fail: dict[str, type[NVMLError]] = field(default_factory=dict)  # function name -> error it raises


class FakeNvml:
    """Configure `gpus`, `init_error`; read `calls`. Exposes module-like attributes."""

    NVMLError = NVMLError
    c_nvmlGpuFabricInfo_t = c_nvmlGpuFabricInfo_t  # noqa: N815 - pynvml's own name
    NVML_TEMPERATURE_GPU = NVML_TEMPERATURE_GPU
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    NVML_VOLATILE_ECC = NVML_VOLATILE_ECC
    NVML_AGGREGATE_ECC = NVML_AGGREGATE_ECC
    nvmlMemory_v2 = nvmlMemory_v2  # noqa: N815 - pynvml's own name

    def __init__(self, gpus: list[FakeGpu] | None = None, init_error: type[NVMLError] | None = None,
                 driver: str = "550.54.15") -> None:
        self.gpus = gpus if gpus is not None else [FakeGpu(f"GPU-{i:08d}-0000-0000-0000-000000000000") for i in range(2)]
        self.init_error = init_error
        self.driver = driver
        self.calls: list[str] = []
        for name, value in globals().items():
            if name.startswith(("NVMLError_", "NVML_")):
                setattr(self, name, value)

    def _gpu(self, fn: str, handle: int) -> FakeGpu:
        self.calls.append(fn)
        gpu = self.gpus[handle]
        if fn in gpu.fail:
            raise gpu.fail[fn]()
        return gpu

    def nvmlInit(self) -> None:  # noqa: N802
        self.calls.append("nvmlInit")
        if self.init_error:
            raise self.init_error()

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.calls.append("nvmlShutdown")

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        self.calls.append("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:  # noqa: N802
        self._gpu("nvmlDeviceGetHandleByIndex", i)
        return i

    def nvmlDeviceGetUUID(self, h: int) -> str:  # noqa: N802
        return self._gpu("nvmlDeviceGetUUID", h).uuid

    def nvmlDeviceGetSerial(self, h: int) -> str:  # noqa: N802
        g = self._gpu("nvmlDeviceGetSerial", h)
        return g.serial or f"1320{zlib.crc32(g.uuid.encode()) % 10**9:09d}"  # a board serial is 13 digits

    def nvmlDeviceGetName(self, h: int) -> str:  # noqa: N802
        return self._gpu("nvmlDeviceGetName", h).name

    def nvmlDeviceGetPciInfo(self, h: int) -> Any:  # noqa: N802
        return SimpleNamespace(busId=self._gpu("nvmlDeviceGetPciInfo", h).bus_id)

    def nvmlDeviceGetMemoryInfo(self, h: int, version: int = 0) -> Any:  # noqa: N802
        g = self._gpu("nvmlDeviceGetMemoryInfo", h)
        return SimpleNamespace(total=g.total, used=g.used, free=g.total - g.used, reserved=0)

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:  # noqa: N802
        return self._gpu("nvmlDeviceGetTemperature", h).temperature

    def nvmlDeviceGetTotalEccErrors(self, h: int, error_type: int, counter: int) -> int:  # noqa: N802
        g = self._gpu("nvmlDeviceGetTotalEccErrors", h)
        return g.ecc_volatile if counter == NVML_VOLATILE_ECC else g.ecc_aggregate

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: int) -> int:  # noqa: N802
        return self._gpu("nvmlDeviceGetRetiredPagesPendingStatus", h).pages_pending

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, int, int, int]:  # noqa: N802
        return self._gpu("nvmlDeviceGetRemappedRows", h).remap

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:  # noqa: N802
        return self._gpu("nvmlDeviceGetCurrentClocksEventReasons", h).clock_events

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:  # noqa: N802
        return self._gpu("nvmlDeviceGetClockInfo", h).sm_clock

    def nvmlDeviceGetMaxClockInfo(self, h: int, clock: int) -> int:  # noqa: N802
        return self._gpu("nvmlDeviceGetMaxClockInfo", h).sm_clock_max

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:  # noqa: N802
        return self._gpu("nvmlDeviceGetPowerUsage", h).power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, h: int) -> int:  # noqa: N802
        return self._gpu("nvmlDeviceGetEnforcedPowerLimit", h).power_limit_mw

    def nvmlDeviceGetTemperatureThreshold(self, h: int, threshold: int) -> int:  # noqa: N802
        return self._gpu("nvmlDeviceGetTemperatureThreshold", h).slowdown_c

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:  # noqa: N802
        return [SimpleNamespace(pid=pid, usedGpuMemory=used)
                for pid, used in self._gpu("nvmlDeviceGetComputeRunningProcesses", h).processes]

    # NVLink, PCIe, fabric, persistence and versions: pynvml's names and shapes -------------------------------------
    def _link(self, fn: str, h: int, link: int) -> FakeGpu:
        g = self._gpu(fn, h)
        if not 0 <= link < NVML_NVLINK_MAX_LINKS:
            raise NVMLError_InvalidArgument()
        if link >= len(g.nvlinks):
            raise NVMLError_NotSupported()  # what the driver answers for a link the GPU lacks
        return g

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:  # noqa: N802
        g = self._link("nvmlDeviceGetNvLinkState", h, link)
        return NVML_FEATURE_ENABLED if g.nvlinks[link] else NVML_FEATURE_DISABLED

    def nvmlDeviceGetNvLinkErrorCounter(self, h: int, link: int, counter: int) -> int:  # noqa: N802
        return self._link("nvmlDeviceGetNvLinkErrorCounter", h, link).nvlink_errors.get((link, counter), 0)

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: int) -> int:  # noqa: N802
        return self._gpu("nvmlDeviceGetCurrPcieLinkGeneration", h).pcie[0]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: int) -> int:  # noqa: N802
        return self._gpu("nvmlDeviceGetMaxPcieLinkGeneration", h).pcie[1]

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: int) -> int:  # noqa: N802
        return self._gpu("nvmlDeviceGetCurrPcieLinkWidth", h).pcie[2]

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: int) -> int:  # noqa: N802
        return self._gpu("nvmlDeviceGetMaxPcieLinkWidth", h).pcie[3]

    def nvmlDeviceGetPcieReplayCounter(self, h: int) -> int:  # noqa: N802
        return self._gpu("nvmlDeviceGetPcieReplayCounter", h).pcie_replays

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:  # noqa: N802
        return SimpleNamespace(gpu=self._gpu("nvmlDeviceGetUtilizationRates", h).utilization, memory=0)

    def nvmlDeviceGetGpuFabricInfo(self, h: int, info: Any) -> int:  # noqa: N802
        """Like pynvml: fills the c_nvmlGpuFabricInfo_t the caller passes by reference."""
        g = self._gpu("nvmlDeviceGetGpuFabricInfo", h)
        if g.fabric is None:
            raise NVMLError_NotSupported()
        target = info._obj  # a ctypes.byref(...) argument, as the C API takes a pointer
        target.state, target.status = g.fabric
        return 0

    def nvmlDeviceGetPersistenceMode(self, h: int) -> int:  # noqa: N802
        return self._gpu("nvmlDeviceGetPersistenceMode", h).persistence

    def nvmlDeviceGetVbiosVersion(self, h: int) -> str:  # noqa: N802
        return self._gpu("nvmlDeviceGetVbiosVersion", h).vbios

    def nvmlSystemGetDriverVersion(self) -> str:  # noqa: N802
        self.calls.append("nvmlSystemGetDriverVersion")
        return self.driver
