"""The cost of the hardware checks: the infiniband check over a 10-HCA sysfs tree, and the NVML reads the nvlink,
pcie, gpu_config and fabric checks add per GPU per round, next to the gpu check's own.

The InfiniBand tree is the real one in tests/data (an H100 host: 8 NDR HCAs and a RoCE bond) plus copies of one HCA,
so the tree has `--hcas` ports. The GPUs are the tests' scripted NVML as an HGX H100 board (18 NVLinks each), or with
`--nvml real` this node's driver. Each check keeps its state in a state store, as in the agent (the counter windows
saved when they moved). Each figure is the median of `--runs` runs after two warm-up runs: wall time and CPU time of
one run.

    python -m benchmarks.hardware --runs 200
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.common import heading
from tests.helpers.fake_nvml import NVML_GPU_FABRIC_STATE_COMPLETED, FakeGpu, FakeNvml
from trainguard.checks.base import Check, CheckContext, CheckIdle
from trainguard.checks.fabric import FabricCheck, FabricSettings
from trainguard.checks.gpu import GpuCheck, GpuSettings
from trainguard.checks.gpu_config import GpuConfigCheck, GpuConfigSettings
from trainguard.checks.infiniband import InfinibandCheck, InfinibandSettings
from trainguard.checks.nvlink import NvlinkCheck, NvlinkSettings
from trainguard.checks.pcie import PcieCheck, PcieSettings
from trainguard.core.state import ScopedState
from trainguard.gpu.nvml import Nvml
from trainguard.pipeline.store import Store

REPO = Path(__file__).resolve().parent.parent
IB_TREE = REPO / "tests" / "data" / "infiniband" / "sys-class-infiniband-h100"


def timed(run: Callable[[], object], runs: int) -> tuple[float, float]:
    """(median wall, median CPU) seconds of one call."""
    for _ in range(2):
        run()
    wall, cpu = [], []
    for _ in range(runs):
        w, c = time.perf_counter(), time.process_time()
        run()
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    return statistics.median(wall), statistics.median(cpu)


def ib_tree(root: Path, hcas: int) -> Path:
    shutil.copytree(IB_TREE, root)
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    present = sorted(p.name for p in root.iterdir())
    for i in range(len(present), hcas):
        shutil.copytree(root / "mlx5_0", root / f"mlx5_x{i}")
    return root


def hgx(count: int) -> list[FakeGpu]:
    return [FakeGpu(f"GPU-{i:08x}-0000-4000-8000-000000000000", bus_id=f"00000000:{0x18 + i:02X}:00.0".encode(),
                    nvlinks=[True] * 18, fabric=(NVML_GPU_FABRIC_STATE_COMPLETED, 0)) for i in range(count)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--hcas", type=int, default=10)
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--nvml", choices=["fake", "real"], default="fake")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="trainguard-hw-") as tmp:
        root = ib_tree(Path(tmp) / "infiniband", args.hcas)
        store = Store(Path(tmp) / "state")
        ctx = CheckContext("bench", Path(tmp), state=ScopedState(store, "check/infiniband"))
        ib = InfinibandCheck("infiniband", InfinibandSettings(sysfs_root=str(root)), ctx)
        ports = len([r for r in ib.run() if "/" in r.subject])
        ib_wall, ib_cpu = timed(ib.run, args.runs)

        print(heading(f"The infiniband check over {ports} ports ({args.hcas} HCAs), {args.runs} runs"))
        print("| one run | wall | CPU |")
        print("|---|---|---|")
        print(f"| infiniband check, {ports} ports | {1000 * ib_wall:.2f} ms | {1000 * ib_cpu:.2f} ms |")
        print(f"| per port | {1000 * ib_wall / ports:.3f} ms | {1000 * ib_cpu / ports:.3f} ms |\n")

        counts = [0] if args.nvml == "real" else args.gpus
        title = "NVML reads per round, real driver" if args.nvml == "real" else \
            "NVML reads per round, scripted NVML (HGX H100 board: 18 NVLinks a GPU)"
        print(heading(f"{title}, {args.runs} runs"))
        print("| check | " + " | ".join("this node's GPUs" if n == 0 else f"{n} GPUs" for n in counts)
              + " | per GPU |")
        print("|---|" + "---|" * (len(counts) + 1))
        walls: dict[str, dict[int, float]] = {}  # check -> column -> median wall of one run (absent: idle there)
        gpus_in: list[int] = []  # the GPUs NVML listed in each column
        idle_because: dict[str, str] = {}
        for column, count in enumerate(counts):
            fake = None if args.nvml == "real" else FakeNvml(hgx(count))
            nvml = Nvml(fake)
            gpus_in.append(len(nvml.gpus()))
            context = CheckContext("bench", Path(tmp), nvml=nvml)

            def own(name: str, context: CheckContext = context, column: int = column) -> CheckContext:
                """Each check its own keys, as the engine gives them."""
                return dataclasses.replace(context, state=ScopedState(store, f"check/{name}-{column}"))

            checks: list[Check] = [
                GpuCheck("gpu", GpuSettings(), own("gpu")), NvlinkCheck("nvlink", NvlinkSettings(), own("nvlink")),
                PcieCheck("pcie", PcieSettings(), own("pcie")),
                GpuConfigCheck("gpu_config", GpuConfigSettings(), own("gpu_config")),
                FabricCheck("fabric", FabricSettings(fabric_manager_log="", pci_root=str(Path(tmp) / "no-pci")),
                            own("fabric"))]
            for check in checks:
                try:
                    check.run()
                except CheckIdle as idle:  # a node without NVLink or a fabric: the check is idle there, nothing to time
                    idle_because[check.name] = str(idle)
                    continue
                walls.setdefault(check.name, {})[column] = timed(check.run, args.runs)[0]
        new = ("nvlink", "pcie", "gpu_config", "fabric")
        last = len(counts) - 1
        per_gpu = max(gpus_in[last], 1)

        def cell(value: float | None, bold: bool = False) -> str:
            text = "idle" if value is None else f"{1000 * value:.2f} ms"
            return f"**{text}**" if bold else text

        for name, by_column in walls.items():
            per = f"{1000 * by_column[last] / per_gpu:.3f} ms" if last in by_column else "idle"
            print(f"| {name}{' (new)' if name in new else ''} | "
                  + " | ".join(cell(by_column.get(c)) for c in range(len(counts))) + f" | {per} |")
        added = [sum(walls[n].get(c, 0.0) for n in new if n in walls) for c in range(len(counts))]
        print("| **the new reads together** | " + " | ".join(cell(a, bold=True) for a in added)
              + f" | **{1000 * added[last] / per_gpu:.3f} ms** |")
        for name, why in idle_because.items():
            print(f"\n{name}: idle ({why}), not timed")
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
