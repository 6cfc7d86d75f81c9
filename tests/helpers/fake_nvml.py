"""A scripted stand-in for the `pynvml` module: same function names, same error classes.

Only tests import it; the product always loads the real pynvml.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

NVML_TEMPERATURE_GPU = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
nvmlMemory_v2 = 0x02000028  # noqa: N816 - pynvml's own name


class NVMLError(Exception):
    value = 999

    def __str__(self) -> str:
        return self.__class__.__doc__ or "Unknown Error"


def _error(name: str, code: int, text: str) -> type[NVMLError]:
    return type(name, (NVMLError,), {"value": code, "__doc__": text})


NVMLError_Uninitialized = _error("NVMLError_Uninitialized", 1, "Uninitialized")
NVMLError_NotSupported = _error("NVMLError_NotSupported", 3, "Not Supported")
NVMLError_NoPermission = _error("NVMLError_NoPermission", 4, "Insufficient Permissions")
NVMLError_DriverNotLoaded = _error("NVMLError_DriverNotLoaded", 9, "Driver Not Loaded")
NVMLError_LibraryNotFound = _error("NVMLError_LibraryNotFound", 12, "NVML Shared Library Not Found")
NVMLError_GpuIsLost = _error("NVMLError_GpuIsLost", 15, "GPU is lost")
NVMLError_ResetRequired = _error("NVMLError_ResetRequired", 16, "GPU requires restart")
NVMLError_Unknown = _error("NVMLError_Unknown", 999, "Unknown Error")


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
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
    fail: dict[str, type[NVMLError]] = field(default_factory=dict)  # function name -> error it raises


class FakeNvml:
    """Configure `gpus`, `init_error`; read `calls`. Exposes module-like attributes."""

    NVMLError = NVMLError
    NVML_TEMPERATURE_GPU = NVML_TEMPERATURE_GPU
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    NVML_VOLATILE_ECC = NVML_VOLATILE_ECC
    NVML_AGGREGATE_ECC = NVML_AGGREGATE_ECC
    nvmlMemory_v2 = nvmlMemory_v2  # noqa: N815 - pynvml's own name

    def __init__(self, gpus: list[FakeGpu] | None = None, init_error: type[NVMLError] | None = None) -> None:
        self.gpus = gpus if gpus is not None else [FakeGpu(f"GPU-{i:08d}-0000-0000-0000-000000000000") for i in range(2)]
        self.init_error = init_error
        self.calls: list[str] = []
        for name, value in globals().items():
            if name.startswith("NVMLError_"):
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

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:  # noqa: N802
        return [SimpleNamespace(pid=pid, usedGpuMemory=used)
                for pid, used in self._gpu("nvmlDeviceGetComputeRunningProcesses", h).processes]
