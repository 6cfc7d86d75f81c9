"""Smoke tests against the real NVIDIA driver: the same checks as the suite, over pynvml instead of the scripted
NVML. Deselected by default (marker `gpu`); on a GPU node run `python -m pytest -m gpu tests/gpu`.

PyTorch, when installed, supplies real GPU memory users and a real CUDA out-of-memory message.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_until
from trainguard.checks.base import CheckContext
from trainguard.checks.xid import XidCheck, XidSettings, gpu_problem
from trainguard.core.model import Status
from trainguard.core.state import ScopedState
from trainguard.gpu.faults import XidLedger
from trainguard.gpu.health import gpu_faults
from trainguard.gpu.nvml import Nvml, normalize_bus_id
from trainguard.gpu.xid import XidEvent
from trainguard.pipeline.store import Store

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]
GiB = 2**30


def smi(*fields: str) -> list[list[str]]:
    out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    return [[v.strip() for v in line.split(",")] for line in out.strip().splitlines()]


def trainguard_check(tmp_path: Path, config: str) -> tuple[int, dict[str, Any]]:
    path = tmp_path / "trainguard.toml"
    path.write_text(f'[agent]\nstate_dir = "{tmp_path / "state"}"\nlisten = ""\n' + textwrap.dedent(config))
    proc = subprocess.run([sys.executable, "-m", "trainguard", "check", "--json", "--config", str(path)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.stdout, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def torch_or_skip() -> None:
    probe = subprocess.run([sys.executable, "-c", "import torch; assert torch.cuda.is_available()"],
                           capture_output=True, timeout=120)
    if probe.returncode != 0:
        pytest.skip("needs PyTorch with CUDA for a real GPU memory user")


@pytest.fixture
def gpu_holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A process holding 2 GiB on GPU 0 until killed, marked so a process job can name it."""
    torch_or_skip()
    ready = tmp_path / "holder-ready"
    code = (f"import torch, time, pathlib; x = torch.empty({2 * GiB}, dtype=torch.uint8, device='cuda:0'); "
            f"pathlib.Path({str(ready)!r}).touch(); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, "trainguard-gpu-holder"], text=True)
    wait_until(lambda: ready.exists() or proc.poll() is not None, 120, what="GPU memory allocated")
    assert proc.poll() is None, "the GPU holder died"
    yield proc
    proc.kill()
    proc.wait()


def test_nvml_gateway_reads_every_gpu_as_nvidia_smi_does() -> None:
    gpus = Nvml().gpus()
    rows = smi("index", "uuid", "name", "pci.bus_id", "memory.total", "ecc.errors.uncorrected.volatile.total")
    assert len(gpus) == len(rows) > 0
    for gpu, (index, uuid, name, bus, total_mib, ecc) in zip(gpus, rows, strict=True):
        print(gpu)
        assert (gpu.index, gpu.uuid, gpu.name) == (int(index), uuid, name)
        assert gpu.bus_id == normalize_bus_id(bus) and not gpu.lost and gpu.error is None
        assert gpu.memory_total is not None and abs(gpu.memory_total / 2**20 - int(total_mib)) <= 1
        assert gpu.temperature_c is not None and 0 < gpu.temperature_c < 120
        if ecc not in ("[N/A]", "N/A"):
            assert gpu.ecc_uncorrected_volatile == int(ecc)
        assert gpu.processes is not None


def test_gpu_and_xid_checks_on_the_real_driver(tmp_path: Path) -> None:
    code, report = trainguard_check(tmp_path, """
        [checks.gpu]
        [checks.gpu_memory]
        [checks.xid]
    """)
    by_check: dict[str, list[dict[str, Any]]] = {}
    for r in report["results"]:
        by_check.setdefault(r["check"], []).append(r)
    print(json.dumps(report, indent=1)[:4000])
    gpus = [r for r in by_check["gpu"] if r["subject"].startswith("GPU-")]
    assert len(gpus) == len(smi("index"))
    for r in gpus:
        assert r["status"] in ("OK", "WARNING"), r  # WARNING only for a real fault this node has
        assert "NVML not available" not in r["summary"]
    assert by_check["gpu_memory"] and all(r["status"] != "UNKNOWN" for r in by_check["gpu_memory"])
    assert code in (0, 1, 2)


def test_gpu_memory_attributes_a_real_process_to_its_job(tmp_path: Path, gpu_holder: subprocess.Popen[str]) -> None:
    [gpu0] = [g for g in Nvml().gpus() if g.index == 0]
    assert gpu0.processes is not None
    held = {p.pid: p.used for p in gpu0.processes}
    assert gpu_holder.pid in held and (held[gpu_holder.pid] or 0) >= 2 * GiB, held

    _, report = trainguard_check(tmp_path, """
        [jobs]
        sources = ["process"]
        [jobs.processes.holder]
        cmdline = "trainguard-gpu-holder"
        user = "root"
        [checks.gpu_memory]
        unknown_process = "warning"
    """)
    [gpu_result] = [r for r in report["results"] if r["check"] == "gpu_memory" and r["details"].get("index") == 0]
    print(json.dumps(gpu_result, indent=1))
    assert gpu_result["details"].get("job_key") == "process:holder", gpu_result
    assert "no known job" not in gpu_result["summary"]


def test_a_real_cuda_oom_is_diagnosed_with_the_gpu_context(tmp_path: Path, gpu_holder: subprocess.Popen[str]) -> None:
    log = tmp_path / "train.log"
    script = tmp_path / "oom.py"
    script.write_text(textwrap.dedent(f"""
        import time, torch
        print("step 41 loss=1.25", flush=True)
        keep = torch.empty({GiB}, dtype=torch.uint8, device="cuda:0")
        try:
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda:0")
        except torch.OutOfMemoryError as exc:
            print(f"{{type(exc).__module__}}.{{type(exc).__name__}}: {{exc}}", flush=True)
        time.sleep(600)
    """))
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, str(script), "trainguard-oom-trainer"], stdout=out, stderr=out)
    try:
        wait_until(lambda: "OutOfMemoryError" in log.read_text() or proc.poll() is not None, 120, what="a CUDA OOM")
        print(log.read_text())
        time.sleep(0.5)
        _, report = trainguard_check(tmp_path, f"""
            [jobs]
            sources = ["process"]
            [jobs.processes.trainer]
            cmdline = "trainguard-oom-trainer"
            user = "root"
            logs = ["{log}"]
            [checks.training_log]
        """)
        [result] = [r for r in report["results"] if r["check"] == "training_log" and r["subject"] == "process:trainer"]
        print(json.dumps(result, indent=1))
        assert result["status"] == "CRITICAL"
        assert "CUDA out of memory" in result["summary"] and "at step 41" in result["summary"]
        [finding] = [f for f in result["details"]["findings"] if f["signature"] == "cuda_oom"]
        assert finding["gpu"]["index"] == 0
        others = {p["pid"] for p in finding["gpu"]["other_processes"]}
        assert gpu_holder.pid in others, finding
    finally:
        proc.kill()
        proc.wait()


# NVLink, PCIe, fabric, persistence and versions: read from the real driver, compared with nvidia-smi ---------------
def test_pcie_persistence_and_versions_as_nvidia_smi_reads_them() -> None:
    nvml = Nvml()
    pcie = nvml.pcie()
    driver, configs = nvml.config()
    rows = smi("pcie.link.gen.max", "pcie.link.width.max", "persistence_mode", "vbios_version", "driver_version")
    assert len(pcie) == len(configs) == len(rows) > 0
    for link, config, (gen_max, width_max, persistence, vbios, smi_driver) in zip(pcie, configs, rows, strict=True):
        print(link, config)
        assert link.error is None and config.error is None and link.value is not None and config.value is not None
        # the current generation moves with load; the maxima and the replay counter are stable reads
        assert link.value.generation_max == int(gen_max) and link.value.width_max == int(width_max)
        assert link.value.generation is not None and 1 <= link.value.generation <= link.value.generation_max
        assert link.value.replays is not None and link.value.replays >= 0
        assert config.value.persistence is (persistence == "Enabled")
        assert config.value.vbios == vbios
        assert driver == smi_driver


def test_nvlinks_and_fabric_state_from_the_real_driver() -> None:
    """An H100 PCIe card without a bridge has no NVLink and no fabric: both must read as such, not fail."""
    nvml = Nvml()
    links = nvml.nvlinks()
    status = subprocess.run(["nvidia-smi", "nvlink", "--status"], capture_output=True, text=True, timeout=60).stdout
    listed = status.count("Link ") if "Link " in status else 0
    assert sum(len(r.value or ()) for r in links) == listed
    for reading in links:
        assert reading.error is None
        for link in reading.value or ():
            assert set(link.errors) <= {"replay", "recovery", "crc_flit", "crc_data"}
    fabric = nvml.fabric()
    for reading in fabric:
        print(reading)
        assert reading.error is None
        assert reading.value is None or reading.value.state in (0, 1, 2, 3)


def test_the_hardware_checks_on_the_real_driver(tmp_path: Path) -> None:
    _, data = trainguard_check(tmp_path, """
        [checks.nvlink]
        [checks.pcie]
        [checks.gpu_config]
        [checks.fabric]
        fabric_manager_log = ""
    """)
    print(json.dumps(data, indent=1))
    by_check: dict[str, list[dict[str, Any]]] = {}
    for r in data["results"]:
        by_check.setdefault(r["check"], []).append(r)
    assert all(r["status"] != "UNKNOWN" for r in data["results"]), data["results"]
    assert by_check.get("pcie"), "the pcie check reads every GPU"
    assert "versions" in {r["subject"] for r in by_check["gpu_config"]}
    # NVLink and the fabric are idle on a node without them, never UNKNOWN
    for name in ("nvlink", "fabric"):
        assert by_check.get(name) or name in data["idle"]


# XID history (issue 20): "reads healthy now" is what the real driver says about the real GPU --------------------------
def test_xid_history_is_graded_by_what_the_real_driver_reads_now(tmp_path: Path) -> None:
    """An XID 79 logged before the agent's first start, on each real GPU: at most WARNING when the GPU reads healthy
    (no memory fault pending, not lost), as logged otherwise; the same XID logged since the start is CRITICAL."""
    nvml = Nvml()
    gpus = nvml.gpus()
    assert gpus
    store = Store(None)
    context = CheckContext("n", tmp_path, nvml=nvml, state=ScopedState(store, "check/xid"), xid_history=XidLedger(store))
    check = XidCheck("xid", XidSettings(kmsg_path=str(tmp_path / "none"), journalctl=str(tmp_path / "nojournal")), context)
    check.start(lambda: None)
    try:
        wait_until(lambda: check.follower.error is not None, 5, what="the follower to give up on a missing log")
        first = check.ledger.first_start
        assert first is not None
        for gpu in gpus:  # kernel times count from boot, and a lent GPU node may have booted minutes ago
            check.ledger.record(XidEvent(79, gpu.bus_id, "GPU has fallen off the bus.", usec=first.usec // 2))
        results = {r.subject: r for r in check.run()}
        for gpu in gpus:
            print(gpu.uuid, gpu.bus_id, gpu_faults(gpu), results[gpu.uuid].status, results[gpu.uuid].summary)
            problem = gpu_problem(gpus, gpu.bus_id)
            if problem is None:
                assert results[gpu.uuid].status is Status.WARNING
                assert f"GPU {gpu.bus_id} reads healthy now: no drain" in results[gpu.uuid].summary
            else:  # a real fault on this node: graded as logged, saying what NVML reads
                assert results[gpu.uuid].status is Status.CRITICAL and problem in results[gpu.uuid].summary
            check.ledger.record(XidEvent(79, gpu.bus_id, "GPU has fallen off the bus.", usec=first.usec + 10**6))
        for r in check.run():
            if r.subject.startswith("GPU-"):
                assert r.status is Status.CRITICAL and "before trainguard started" not in r.summary, r.summary
    finally:
        check.stop()
