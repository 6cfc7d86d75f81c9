"""`python -m benchmarks.goodput_agent ARGS...`: the fake GPU agent of tests/helpers/fake_gpu_agent.py, whose GPU 0 the
goodput harness can also fault through NVML: TRAINGUARD_FAKE_GPU_STATE=PATH, a JSON object the harness writes with
the state that goes with the XID it injects (`{"lost": true}`: the GPU fell off the bus or its GSP answers no more;
`{"ecc_volatile": 2, "remap": [0, 1, 1, 0]}`: uncorrected ECC errors and a pending row remap, as after XID 48), read
at each NVML call (no file, or one that does not parse: healthy)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.helpers.fake_gpu_agent import SlowableNvml
from tests.helpers.fake_gpu_agent import main as fake_gpu_agent
from tests.helpers.fake_nvml import FakeGpu, NVMLError_GpuIsLost


class FaultableNvml(SlowableNvml):
    """GPU 0 as the harness's state file says (and slowed while the slow file exists, as SlowableNvml)."""

    def __init__(self, gpus: list[FakeGpu], slow: Path, **kw: object) -> None:
        super().__init__(gpus, slow, **kw)
        self.state = Path(os.environ.get("TRAINGUARD_FAKE_GPU_STATE", "/nonexistent"))

    def _gpu(self, fn: str, handle: int) -> FakeGpu:
        gpu = super()._gpu(fn, handle)
        if handle != 0:
            return gpu
        try:
            state = json.loads(self.state.read_text())
        except (OSError, ValueError):
            state = {}
        if not isinstance(state, dict):
            state = {}
        if state.get("lost") and fn != "nvmlDeviceGetHandleByIndex":
            raise NVMLError_GpuIsLost()
        gpu.ecc_volatile = int(state.get("ecc_volatile", 0))
        gpu.ecc_aggregate = max(gpu.ecc_aggregate, gpu.ecc_volatile)
        corrected, uncorrected, pending, failed = state.get("remap", (0, 0, 0, 0))
        gpu.remap = (int(corrected), int(uncorrected), int(pending), int(failed))
        return gpu


if __name__ == "__main__":
    sys.exit(fake_gpu_agent(FaultableNvml))
