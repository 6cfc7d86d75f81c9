"""`python -m tests.helpers.fake_gpu_agent ARGS...`: the trainguard command with the scripted NVML in place of
pynvml, for tests and benchmarks of the whole agent on machines without a GPU. TRAINGUARD_FAKE_GPUS sets the
number of GPUs (default 8), each as on an HGX H100 board (18 NVLinks, PCIe Gen5 x16, registered with the NVLink
fabric); GPU 0 has a pending row remap and a few NVLink and PCIe replays so that fault panels have something to show;
TRAINGUARD_FAKE_GPU_FAULT=remap_failed makes the last GPU fail its row remapping (a CRITICAL fault);
TRAINGUARD_FAKE_NVML=missing makes NVML fail to load, as on a node without the driver;
TRAINGUARD_FAKE_GPU_DOMAIN=00a1 puts the GPUs in that PCI domain (several agents on one host, each its own GPUs);
TRAINGUARD_FAKE_GPU_HEALTHY=1 leaves GPU 0 without its remap and replays;
TRAINGUARD_FAKE_GPU_PROCS="0:PID:BYTES,..." lists compute processes on GPUs (and adds their memory to the GPU's used);
TRAINGUARD_FAKE_GPU_USED="0:BYTES,..." sets GPUs' memory in use;
TRAINGUARD_FAKE_GPU_SLOW=PATH puts GPU 0 in HW slowdown (SM clock 1200 of 1980 MHz) while that file exists."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.helpers.fake_nvml import (
    NVML_GPU_FABRIC_STATE_COMPLETED,
    NVML_NVLINK_ERROR_DL_REPLAY,
    FakeGpu,
    FakeNvml,
    NVMLError_LibraryNotFound,
)


class SlowableNvml(FakeNvml):
    """GPU 0 held back by a hardware slowdown while `slow` exists (the goodput benchmark's slow node)."""

    def __init__(self, gpus: list[FakeGpu], slow: Path, **kw: object) -> None:
        super().__init__(gpus, **kw)  # type: ignore[arg-type]
        self.slow = slow

    def _gpu(self, fn: str, handle: int) -> FakeGpu:
        gpu = super()._gpu(fn, handle)
        if handle == 0:
            throttled = self.slow.exists()
            gpu.clock_events, gpu.sm_clock = (0x8, 1200) if throttled else (0, gpu.sm_clock_max)
        return gpu


def main(slowable: type[SlowableNvml] = SlowableNvml) -> int:
    """`slowable`: the scripted NVML class when TRAINGUARD_FAKE_GPU_SLOW is set (benchmarks/goodput_agent.py's)."""
    count = int(os.environ.get("TRAINGUARD_FAKE_GPUS", "8"))
    domain = int(os.environ.get("TRAINGUARD_FAKE_GPU_DOMAIN", "0"), 16)
    gpus = [FakeGpu(f"GPU-{i:08x}-0000-4000-8000-{domain:012x}", bus_id=f"{domain:08X}:{0x18 + i:02X}:00.0".encode(),
                    used=(2 + i) * 2**30, nvlinks=[True] * 18, fabric=(NVML_GPU_FABRIC_STATE_COMPLETED, 0))
            for i in range(count)]
    if gpus and not os.environ.get("TRAINGUARD_FAKE_GPU_HEALTHY"):
        gpus[0].remap = (3, 0, 1, 0)
        gpus[0].nvlink_errors = {(0, NVML_NVLINK_ERROR_DL_REPLAY): 3}
        gpus[0].pcie_replays = 2
        if os.environ.get("TRAINGUARD_FAKE_GPU_FAULT") == "remap_failed":
            gpus[-1].remap = (0, 1, 0, 1)
    for item in filter(None, os.environ.get("TRAINGUARD_FAKE_GPU_USED", "").split(",")):
        index, used = item.split(":")
        gpus[int(index)].used = int(used)
    for item in filter(None, os.environ.get("TRAINGUARD_FAKE_GPU_PROCS", "").split(",")):
        index, pid, used = item.split(":")
        gpus[int(index)].processes.append((int(pid), int(used)))
        gpus[int(index)].used += int(used)
    missing = NVMLError_LibraryNotFound if os.environ.get("TRAINGUARD_FAKE_NVML") == "missing" else None
    slow = os.environ.get("TRAINGUARD_FAKE_GPU_SLOW")
    fake = slowable(gpus, Path(slow), init_error=missing) if slow else FakeNvml(gpus, init_error=missing)
    sys.modules["pynvml"] = fake  # type: ignore[assignment]
    from trainguard.cli import main as trainguard

    return trainguard(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
