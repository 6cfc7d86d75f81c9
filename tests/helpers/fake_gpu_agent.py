"""`python -m tests.helpers.fake_gpu_agent ARGS...`: the trainguard command with the scripted NVML in place of
pynvml, for tests and benchmarks of the whole agent on machines without a GPU. TRAINGUARD_FAKE_GPUS sets the
number of GPUs (default 8); GPU 0 has a pending row remap so that fault panels have something to show;
TRAINGUARD_FAKE_GPU_FAULT=remap_failed makes the last GPU fail its row remapping (a CRITICAL fault);
TRAINGUARD_FAKE_NVML=missing makes NVML fail to load, as on a node without the driver."""

from __future__ import annotations

import os
import sys

from tests.helpers.fake_nvml import FakeGpu, FakeNvml, NVMLError_LibraryNotFound


def main() -> int:
    count = int(os.environ.get("TRAINGUARD_FAKE_GPUS", "8"))
    gpus = [FakeGpu(f"GPU-{i:08x}-0000-4000-8000-000000000000", bus_id=f"00000000:{0x18 + i:02X}:00.0".encode(),
                    used=(2 + i) * 2**30) for i in range(count)]
    if gpus:
        gpus[0].remap = (3, 0, 1, 0)
        if os.environ.get("TRAINGUARD_FAKE_GPU_FAULT") == "remap_failed":
            gpus[-1].remap = (0, 1, 0, 1)
    missing = NVMLError_LibraryNotFound if os.environ.get("TRAINGUARD_FAKE_NVML") == "missing" else None
    sys.modules["pynvml"] = FakeNvml(gpus, init_error=missing)  # type: ignore[assignment]
    from trainguard.cli import main as trainguard

    return trainguard(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
