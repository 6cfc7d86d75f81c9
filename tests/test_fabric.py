"""The NVSwitch fabric on real captures: sysfs PCI trees built from `lspci -nn` of an A100 SXM host (six NVSwitches)
and an A10 host (none), a real process named as the fabric manager, the GPUs' fabric registration on the scripted
NVML, and the real fabricmanager.log with its real ERROR line appended as the fabric manager writes it."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, wait_until
from tests.helpers.fake_nvml import (
    NVML_GPU_FABRIC_STATE_COMPLETED,
    NVML_GPU_FABRIC_STATE_IN_PROGRESS,
    FakeGpu,
    FakeNvml,
    NVMLError_LibraryNotFound,
)
from tests.test_gpu import Clock
from trainguard.checks.base import CheckContext
from trainguard.checks.fabric import FabricCheck, FabricSettings
from trainguard.core.model import Result, Status
from trainguard.core.state import ScopedState
from trainguard.gpu.nvml import Nvml
from trainguard.node.procfs import ProcFS
from trainguard.node.sysfs import pci_devices
from trainguard.pipeline.runner import CheckRunner
from trainguard.pipeline.store import Store

CAPTURES = REPO / "tests" / "data" / "nvidia" / "fabric-manager"
_LSPCI = re.compile(r"^(?P<addr>\S+) .*\[(?P<cls>[0-9a-f]{4})\]: .*\[(?P<vendor>[0-9a-f]{4}):(?P<device>[0-9a-f]{4})\]")


def pci_tree(root: Path, capture: str) -> Path:
    """/sys/bus/pci/devices as the kernel would list the devices of an `lspci -nn` capture."""
    for line in (CAPTURES / capture).read_text().splitlines():
        m = _LSPCI.match(line)
        if not m:
            continue
        address = m.group("addr") if m.group("addr").count(":") == 2 else f"0000:{m.group('addr')}"
        d = root / address
        d.mkdir(parents=True)
        (d / "vendor").write_text(f"0x{m.group('vendor')}\n")
        (d / "device").write_text(f"0x{m.group('device')}\n")
        (d / "class").write_text(f"0x{m.group('cls')}00\n")
    return root


def a100_gpus(fabric: tuple[int, int] | None = None) -> list[FakeGpu]:
    return [FakeGpu(f"GPU-{i:08d}-0000-0000-0000-000000000000", name="NVIDIA A100-SXM4-80GB", fabric=fabric)
            for i in range(8)]


def fabric_check(tmp_path: Path, fake: FakeNvml, clock: Clock | None = None, store: Store | None = None,
                 **settings: object) -> FabricCheck:
    ctx = CheckContext("node1", tmp_path, clock or Clock(), nvml=Nvml(fake),
                       state=ScopedState(store, "check/fabric"), proc=ProcFS())
    defaults = {"pci_root": str(tmp_path / "pci"), "fabric_manager_log": str(tmp_path / "fabricmanager.log")}
    return FabricCheck("fabric", FabricSettings.model_validate({**defaults, **settings}), ctx)


def by_subject(results: object) -> dict[str, Result]:
    return {r.subject: r for r in results}  # type: ignore[attr-defined]


@pytest.fixture
def fabric_manager(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A real process whose command name is the fabric manager's (the kernel keeps 15 characters of it)."""
    binary = tmp_path / "bin" / "nv-fabricmanager"
    binary.parent.mkdir()
    shutil.copy(shutil.which("sleep") or "/bin/sleep", binary)
    proc = subprocess.Popen([str(binary), "300"])
    wait_until(lambda: ProcFS().pids_named("nv-fabricmanager"), 5, what="the process to show in /proc")
    yield proc
    proc.kill()
    proc.wait()


def test_the_captures_make_the_trees_they_describe(tmp_path: Path) -> None:
    a100 = pci_devices(pci_tree(tmp_path / "a100", "lspci.nn.a100"))
    assert [d.address for d in a100 if d.is_nvswitch] == [f"000{i}:00:00.0" for i in range(5, 10)] + ["000a:00:00.0"]
    assert not [d for d in pci_devices(pci_tree(tmp_path / "a10", "lspci.nn.a10")) if d.is_nvswitch]


def test_idle_without_nvswitches_or_fabric(tmp_path: Path) -> None:
    pci_tree(tmp_path / "pci", "lspci.nn.a10")
    report = CheckRunner(fabric_check(tmp_path, FakeNvml([FakeGpu("GPU-a10", name="NVIDIA A10")]))).run_once()
    assert (report.outcome, report.idle_reason) == ("idle", "no NVSwitch on this node and no GPU in an NVLink fabric")
    no_nvml = CheckRunner(fabric_check(tmp_path, FakeNvml(init_error=NVMLError_LibraryNotFound))).run_once()
    assert no_nvml.outcome == "idle"


def test_nvswitch_host_without_fabric_manager_is_critical(tmp_path: Path) -> None:
    pci_tree(tmp_path / "pci", "lspci.nn.a100")
    results = by_subject(fabric_check(tmp_path, FakeNvml(a100_gpus())).run())
    fm = results["fabric-manager"]
    assert fm.status is Status.CRITICAL and fm.summary.startswith("fabric manager not running (nv-fabricmanager)")
    assert {s.name: s.value for s in fm.samples} == {"trainguard_fabric_manager_up": 0}
    assert results["nvswitches"].status is Status.OK
    assert results["nvswitches"].summary == "6 of 6 NVSwitches on the PCI bus (6 seen on this node)"
    assert "GPU-00000000-0000-0000-0000-000000000000" not in results  # A100s report no fabric state: nothing to say


def test_fabric_manager_running_and_a_vanished_nvswitch(tmp_path: Path, fabric_manager: subprocess.Popen[bytes]) -> None:
    pci = pci_tree(tmp_path / "pci", "lspci.nn.a100")
    store = Store(tmp_path / "state")
    results = by_subject(fabric_check(tmp_path, FakeNvml(a100_gpus()), store=store).run())
    assert results["fabric-manager"].status is Status.OK
    assert results["fabric-manager"].summary == f"fabric manager running (pid {fabric_manager.pid})"
    shutil.rmtree(pci / "0007:00:00.0")  # the NVSwitch fell off the bus; a restarted agent still knows there were 6
    again = by_subject(fabric_check(tmp_path, FakeNvml(a100_gpus()), store=store).run())
    assert again["nvswitches"].status is Status.CRITICAL
    assert again["nvswitches"].summary.startswith("5 of 6 NVSwitches on the PCI bus (6 seen on this node)")


@pytest.mark.parametrize(("fabric", "status", "text"), [
    ((NVML_GPU_FABRIC_STATE_COMPLETED, 0), Status.OK, "registered with the NVLink fabric"),
    ((NVML_GPU_FABRIC_STATE_IN_PROGRESS, 0), Status.CRITICAL, "not registered with the NVLink fabric (state "
                                                              "in_progress)"),
    ((NVML_GPU_FABRIC_STATE_COMPLETED, 999), Status.CRITICAL, "fabric registration failed (NVML status 999)"),
])
def test_gpu_fabric_registration(tmp_path: Path, fabric: tuple[int, int], status: Status, text: str) -> None:
    pci_tree(tmp_path / "pci", "lspci.nn.a100")
    gpus = [FakeGpu(f"GPU-h{i}", name="NVIDIA H100 80GB HBM3", fabric=(NVML_GPU_FABRIC_STATE_COMPLETED, 0))
            for i in range(2)]
    gpus[1].fabric = fabric
    results = by_subject(fabric_check(tmp_path, FakeNvml(gpus)).run())
    assert results["GPU-h0"].status is Status.OK
    assert results["GPU-h1"].status is status and text in results["GPU-h1"].summary
    metrics = {s.name: s.value for s in results["GPU-h1"].samples}
    assert metrics["trainguard_gpu_fabric_state"] == fabric[0]
    assert metrics["trainguard_gpu_fabric_registered"] == (1 if status is Status.OK else 0)


def test_fabric_manager_log_errors(tmp_path: Path) -> None:
    pci_tree(tmp_path / "pci", "lspci.nn.a100")
    log = tmp_path / "fabricmanager.log"
    lines = (CAPTURES / "fabricmanager.log").read_text().splitlines(keepends=True)
    error = next(line for line in lines if "[ERROR]" in line)
    log.write_text("".join(line for line in lines if line is not error))  # the history, without the error
    clock = Clock()
    check = fabric_check(tmp_path, FakeNvml(a100_gpus()), clock, log_clear_after="1h")
    assert by_subject(check.run())["fabric-manager-log"].status is Status.OK  # history before the agent is not news
    with log.open("a") as f:
        f.write(error)  # as the fabric manager writes it
    clock.now += 60
    result = by_subject(check.run())["fabric-manager-log"]
    assert result.status is Status.WARNING
    assert result.summary == ("fabric manager logged an error 0s ago: detected NVSwitch non-fatal error 12028 on fid 0 on "
                              "NVSwitch pci bus id 00000000:86:00.0 physical id 3 port 61")
    assert {s.name: s.value for s in result.samples} == {"trainguard_fabric_manager_log_errors_total": 1}
    clock.now += 3601
    assert by_subject(check.run())["fabric-manager-log"].status is Status.OK
