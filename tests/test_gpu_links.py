"""NVLink, PCIe, persistence and versions through the NVML gateway, on the scripted NVML: each fault injected, and the
check, the incident and the metric asserted (the alert rules are held by promtool's tests in deploy/prometheus)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import requests

from tests.conftest import REPO
from tests.helpers.fake_nvml import (
    NVML_NVLINK_ERROR_DL_CRC_FLIT,
    NVML_NVLINK_ERROR_DL_RECOVERY,
    FakeGpu,
    FakeNvml,
    NVMLError_GpuIsLost,
    NVMLError_LibraryNotFound,
    NVMLError_NotSupported,
    NVMLError_Unknown,
)
from tests.test_gpu import Clock
from trainguard.agent.configfile import parse_config
from trainguard.agent.http import HttpEndpoint
from trainguard.checks.base import CheckContext
from trainguard.checks.gpu_config import GpuConfigCheck, GpuConfigSettings
from trainguard.checks.nvlink import NvlinkCheck, NvlinkSettings
from trainguard.checks.pcie import PcieCheck, PcieSettings
from trainguard.core.model import Result, Status
from trainguard.core.state import ScopedState
from trainguard.gpu.nvml import Nvml
from trainguard.pipeline.engine import Engine
from trainguard.pipeline.runner import CheckRunner
from trainguard.pipeline.store import Store


def hgx(n: int = 2, **kw: Any) -> list[FakeGpu]:
    """GPUs of an HGX H100 board: 18 NVLinks each."""
    return [FakeGpu(f"GPU-{i:08d}-0000-0000-0000-000000000000", bus_id=f"00000000:{0x18 + i:02X}:00.0".encode(),
                    nvlinks=[True] * 18, **kw) for i in range(n)]


def context(fake: FakeNvml, clock: Clock, store: Store | None = None, name: str = "x") -> CheckContext:
    return CheckContext("node1", Path("/tmp"), clock, nvml=Nvml(fake), state=ScopedState(store, f"check/{name}"))


def by_subject(results: Any) -> dict[str, Result]:
    return {r.subject: r for r in results}


# NVLink ----------------------------------------------------------------------------------------------------------
def test_nvlink_healthy_then_a_link_down_against_what_the_gpu_had(tmp_path: Path) -> None:
    fake, clock, store = FakeNvml(hgx()), Clock(), Store(tmp_path)
    check = NvlinkCheck("nvlink", NvlinkSettings(), context(fake, clock, store, "nvlink"))
    first = by_subject(check.run())
    gpu0 = fake.gpus[0].uuid
    assert first[gpu0].status is Status.OK
    assert first[gpu0].summary == "GPU 0: 18 of 18 NVLinks up (18 seen on this node)"
    fake.gpus[0].nvlinks[3] = fake.gpus[0].nvlinks[7] = False
    # a restarted agent remembers how many links the GPU had
    again = NvlinkCheck("nvlink", NvlinkSettings(), context(fake, clock, store, "nvlink"))
    down = by_subject(again.run())[gpu0]
    assert down.status is Status.CRITICAL
    assert down.summary.startswith("GPU 0: 16 of 18 NVLinks up (links 3, 7 down; 18 seen on this node)")
    samples = {s.name: s.value for s in down.samples if "counter" not in s.labels}
    assert samples == {"trainguard_gpu_nvlink_links_up": 16, "trainguard_gpu_nvlink_links_expected": 18}


def test_nvlink_saves_its_counters_only_when_they_moved(tmp_path: Path) -> None:
    """432 counters of an HGX board, nearly all still: a run that read no change writes no state, and the change
    that is saved is what a restarted agent starts from."""
    fake, clock, store = FakeNvml(hgx(1)), Clock(), Store(tmp_path)
    writes: list[str] = []
    put = store.put
    store.put = lambda key, value: (writes.append(key), put(key, value))[1]  # type: ignore[method-assign]
    check = NvlinkCheck("nvlink", NvlinkSettings(error_window="1h"), context(fake, clock, store, "nvlink"))
    check.run()
    assert sorted(writes) == ["check/nvlink/nvlink.counters", "check/nvlink/nvlink.max_up", "check/nvlink/nvlink.totals"]
    writes.clear()
    for _ in range(3):
        clock.now += 30
        check.run()
    assert writes == []
    fake.gpus[0].nvlink_errors = {(5, NVML_NVLINK_ERROR_DL_RECOVERY): 2}
    clock.now += 30
    check.run()
    assert writes == ["check/nvlink/nvlink.counters", "check/nvlink/nvlink.totals"]
    again = NvlinkCheck("nvlink", NvlinkSettings(error_window="1h"), context(fake, clock, store, "nvlink"))
    fake.gpus[0].nvlink_errors = {(5, NVML_NVLINK_ERROR_DL_RECOVERY): 4}
    clock.now += 30
    [result] = again.run()
    assert result.details["errors_in_window"] == {"5/recovery": 4}  # +2 before the restart, +2 after
    writes.clear()
    clock.now += 3700
    again.run()
    assert writes == ["check/nvlink/nvlink.counters"]  # nothing read changed, but the increases left the window
    store.close()


def test_nvlink_saves_again_after_a_failed_save(tmp_path: Path) -> None:
    fake, clock, store = FakeNvml(hgx(1)), Clock(), Store(tmp_path)
    failing = [True]
    put = store.put

    def flaky(key: str, value: str) -> None:
        if failing[0] and key.endswith("counters"):
            raise OSError(5, "Input/output error")
        put(key, value)

    store.put = flaky  # type: ignore[method-assign]
    check = NvlinkCheck("nvlink", NvlinkSettings(), context(fake, clock, store, "nvlink"))
    check.run()  # the save fails (logged); the run's results still count
    assert ScopedState(store, "check/nvlink").load_json("nvlink.counters") == {}
    failing[0] = False
    clock.now += 30
    check.run()  # nothing read changed since, but what was never saved is saved now
    assert len(ScopedState(store, "check/nvlink").load_json("nvlink.counters")) == 18 * 4
    store.close()


def test_nvlink_configured_count() -> None:
    fake = FakeNvml(hgx(1))
    fake.gpus[0].nvlinks = [True] * 12  # an A100 board: 12 links, but 18 configured
    [result] = NvlinkCheck("nvlink", NvlinkSettings(expected_links=18), context(fake, Clock())).run()
    assert result.status is Status.CRITICAL and "12 of 18 NVLinks up (18 configured)" in result.summary


def test_nvlink_error_rates_over_the_window() -> None:
    fake, clock = FakeNvml(hgx(1)), Clock()
    check = NvlinkCheck("nvlink", NvlinkSettings(error_window="1h"), context(fake, clock))
    gpu = fake.gpus[0]
    gpu.nvlink_errors = {(5, NVML_NVLINK_ERROR_DL_CRC_FLIT): 10_000_000, (5, NVML_NVLINK_ERROR_DL_RECOVERY): 3,
                         (7, NVML_NVLINK_ERROR_DL_RECOVERY): 1}
    [baseline] = check.run()
    assert baseline.status is Status.OK  # years of counts since the driver loaded are a baseline, not a burst
    clock.now += 60
    gpu.nvlink_errors[(5, NVML_NVLINK_ERROR_DL_CRC_FLIT)] += 400_000
    gpu.nvlink_errors[(5, NVML_NVLINK_ERROR_DL_RECOVERY)] += 2
    [burst] = check.run()
    assert burst.status is Status.WARNING
    assert "link 5 crc flit errors +400000 in 1h00m (limit 360000)" in burst.summary
    assert "link 5 recovery errors +2 in 1h00m (limit 1)" in burst.summary
    errors = {s.labels["counter"]: s.value for s in burst.samples if s.name == "trainguard_gpu_nvlink_errors_total"}
    assert errors == {"replay": 0, "recovery": 6, "crc_flit": 10_400_000, "crc_data": 0}  # the GPU's links summed
    clock.now += 3700
    [quiet] = check.run()
    assert quiet.status is Status.OK  # the burst left the window


def test_the_gpus_error_total_never_falls_when_a_link_resets_or_a_read_misses_its_counters(tmp_path: Path) -> None:
    """The per-GPU series is a counter to Prometheus: were it the plain sum, one link reset alone, or counters missing
    from one read, would make it fall, and rate() would count the other links' whole history as new errors. A
    restarted agent goes on from the total it saved, adding what grew while it was down."""
    fake, clock, store = FakeNvml(hgx(1)), Clock(), Store(tmp_path)
    check = NvlinkCheck("nvlink", NvlinkSettings(), context(fake, clock, store, "nvlink"))
    gpu = fake.gpus[0]
    gpu.nvlink_errors = {(5, NVML_NVLINK_ERROR_DL_CRC_FLIT): 10_000_000, (7, NVML_NVLINK_ERROR_DL_CRC_FLIT): 100}

    def crc_total() -> float:
        [result] = check.run()
        clock.now += 60
        return {s.labels["counter"]: s.value for s in result.samples
                if s.name == "trainguard_gpu_nvlink_errors_total"}["crc_flit"]

    assert crc_total() == 10_000_100  # NVML's sum at the first read
    gpu.nvlink_errors[(7, NVML_NVLINK_ERROR_DL_CRC_FLIT)] = 5  # link 7 reset alone, and 5 errors since
    assert crc_total() == 10_000_105
    gpu.fail["nvmlDeviceGetNvLinkErrorCounter"] = NVMLError_NotSupported  # one read without counters
    assert crc_total() == 10_000_105
    del gpu.fail["nvmlDeviceGetNvLinkErrorCounter"]
    assert crc_total() == 10_000_105  # counters back: their growth counted from their last reading
    gpu.nvlink_errors[(5, NVML_NVLINK_ERROR_DL_CRC_FLIT)] += 10
    assert crc_total() == 10_000_115
    gpu.nvlink_errors[(7, NVML_NVLINK_ERROR_DL_CRC_FLIT)] += 3  # while the agent restarts: NVML's sum is 10_000_018
    check = NvlinkCheck("nvlink", NvlinkSettings(), context(fake, clock, store, "nvlink"))
    assert crc_total() == 10_000_118
    gpu.fail["nvmlDeviceGetUUID"] = NVMLError_Unknown  # a run the GPU does not answer: its total is kept
    [unanswered] = check.run()
    assert unanswered.status is Status.UNKNOWN
    del gpu.fail["nvmlDeviceGetUUID"]
    assert crc_total() == 10_000_118
    store.close()


def test_a_read_without_counters_keeps_the_window_its_alerts_are_judged_on() -> None:
    """A transient NotSupported on one run's counter reads must not forget the hour behind the link's limit: growth
    before and after it still adds up."""
    fake, clock = FakeNvml(hgx(1)), Clock()
    check = NvlinkCheck("nvlink", NvlinkSettings(error_window="1h"), context(fake, clock))
    gpu = fake.gpus[0]
    gpu.nvlink_errors = {(5, NVML_NVLINK_ERROR_DL_RECOVERY): 3}
    assert [r.status for r in check.run()] == [Status.OK]
    clock.now += 60
    gpu.nvlink_errors[(5, NVML_NVLINK_ERROR_DL_RECOVERY)] += 1  # one recovery: within the limit (1)
    assert [r.status for r in check.run()] == [Status.OK]
    clock.now += 60
    gpu.fail["nvmlDeviceGetNvLinkErrorCounter"] = NVMLError_NotSupported
    assert [r.status for r in check.run()] == [Status.OK]  # links up, no counters this once
    del gpu.fail["nvmlDeviceGetNvLinkErrorCounter"]
    clock.now += 60
    gpu.nvlink_errors[(5, NVML_NVLINK_ERROR_DL_RECOVERY)] += 1  # a second one in the hour: over the limit
    [result] = check.run()
    assert result.status is Status.WARNING and "link 5 recovery errors +2 in 1h00m (limit 1)" in result.summary


def test_nvlink_idle_where_no_gpu_has_nvlink_or_no_nvml() -> None:
    pcie_only = CheckRunner(NvlinkCheck("nvlink", NvlinkSettings(), context(FakeNvml(), Clock()))).run_once()
    assert (pcie_only.outcome, pcie_only.idle_reason) == ("idle", "no GPU on this node has NVLink")
    no_nvml = CheckRunner(NvlinkCheck("nvlink", NvlinkSettings(), context(FakeNvml(init_error=NVMLError_LibraryNotFound),
                                                                          Clock()))).run_once()
    assert no_nvml.outcome == "idle" and no_nvml.idle_reason.startswith("NVML not available")  # type: ignore[union-attr]
    configured = NvlinkCheck("nvlink", NvlinkSettings(expected_links=18), context(FakeNvml(), Clock())).run()
    assert [r.status for r in configured] == [Status.CRITICAL, Status.CRITICAL]  # expected but absent: a fault


def test_a_lost_gpu_is_left_to_the_gpu_check_an_erroring_one_is_unknown() -> None:
    fake = FakeNvml(hgx(3))
    fake.gpus[1].fail = {"nvmlDeviceGetNvLinkState": NVMLError_GpuIsLost}
    fake.gpus[2].fail = {"nvmlDeviceGetNvLinkErrorCounter": NVMLError_Unknown}
    results = NvlinkCheck("nvlink", NvlinkSettings(), context(fake, Clock())).run()
    assert [(r.subject, r.status) for r in results] == [(fake.gpus[0].uuid, Status.OK),
                                                         (fake.gpus[2].uuid, Status.UNKNOWN)]
    assert results[1].summary == "GPU 2: NVML error: NVMLError_Unknown: Unknown Error"


def test_links_are_probed_once_per_gpu() -> None:
    fake = FakeNvml(hgx(1))
    check = NvlinkCheck("nvlink", NvlinkSettings(), context(fake, Clock()))
    check.run()
    first = fake.calls.count("nvmlDeviceGetNvLinkState")
    check.run()
    assert first == 36 and fake.calls.count("nvmlDeviceGetNvLinkState") - first == 18  # absent links not asked again


# PCIe ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("pcie", "utilization", "status", "text"), [
    ((5, 5, 16, 16), 90, Status.OK, "GPU 0: PCIe Gen5 x16"),
    ((5, 5, 8, 16), 0, Status.WARNING, "PCIe link at x8 of x16: a degraded link"),
    ((1, 5, 16, 16), 0, Status.OK, "GPU 0: PCIe Gen1 x16"),  # idle GPUs lower their link speed: not a fault
    ((3, 5, 16, 16), 95, Status.WARNING, "PCIe Gen3 of Gen5 while 95% busy"),
])
def test_pcie_link_width_and_generation(pcie: tuple[int, int, int, int], utilization: int, status: Status,
                                        text: str) -> None:
    fake = FakeNvml([FakeGpu("GPU-a", pcie=pcie, utilization=utilization)])
    [result] = PcieCheck("pcie", PcieSettings(), context(fake, Clock())).run()
    assert result.status is status and text in result.summary


def test_pcie_replay_rate() -> None:
    fake, clock = FakeNvml([FakeGpu("GPU-a", pcie_replays=12)]), Clock()
    check = PcieCheck("pcie", PcieSettings(replay_max=480), context(fake, clock))
    assert check.run()[0].status is Status.OK
    clock.now += 600
    fake.gpus[0].pcie_replays += 500
    [result] = check.run()
    assert result.status is Status.WARNING and "PCIe replays +500 in 1h00m (limit 480)" in result.summary
    assert {s.name: s.value for s in result.samples}["trainguard_gpu_pcie_replays_total"] == 512


# persistence and versions ----------------------------------------------------------------------------------------
def test_persistence_off_and_vbios_drift_and_driver_expectation() -> None:
    gpus = [FakeGpu(f"GPU-{i}", vbios="96.00.99.00.01") for i in range(3)]
    gpus[1].persistence = 0
    gpus[2].vbios = "96.00.74.00.11"
    fake = FakeNvml(gpus, driver="550.54.15")
    results = by_subject(GpuConfigCheck("gpu_config", GpuConfigSettings(expected_driver="550.90.07"),
                                        context(fake, Clock())).run())
    assert results["GPU-0"].status is Status.OK
    assert results["GPU-1"].status is Status.WARNING and "persistence mode off" in results["GPU-1"].summary
    versions = results["versions"]
    assert versions.status is Status.WARNING
    assert "NVIDIA H100 80GB HBM3: mixed VBIOS versions 96.00.74.00.11, 96.00.99.00.01 on one node" in versions.summary
    assert "driver 550.54.15, expected 550.90.07" in versions.summary
    assert {s.name: s.value for s in versions.samples}["trainguard_gpu_vbios_versions"] == 2
    info = [s for s in results["GPU-2"].samples if s.name == "trainguard_gpu_info"]
    assert info[0].labels["vbios"] == "96.00.74.00.11" and info[0].labels["driver"] == "550.54.15"
    clean = by_subject(GpuConfigCheck("gpu_config", GpuConfigSettings(), context(FakeNvml(), Clock())).run())
    assert clean["versions"].summary == "driver 550.54.15, VBIOS NVIDIA H100 80GB HBM3: 96.00.99.00.01"


# through the engine: incident and /metrics ------------------------------------------------------------------------
def test_link_faults_fire_incidents_and_reach_metrics(tmp_path: Path) -> None:
    gpus = hgx(2)
    fake = FakeNvml(gpus)
    raw = {"agent": {"state_dir": str(tmp_path), "node_name": "node1", "listen": ""}, "jobs": {"sources": []},
           "checks": {"nvlink": {"actions": {"critical": []}}, "pcie": {}, "gpu_config": {}}, "notifiers": {}}
    engine = Engine(parse_config(raw, "t.toml"), nvml=Nvml(fake), store=Store(tmp_path))
    endpoint = HttpEndpoint(engine, "127.0.0.1", 0)
    endpoint.start()
    try:
        engine.run_round()
        assert engine.tracker.incidents() == []
        gpus[1].nvlinks[0] = False
        gpus[0].pcie = (5, 5, 4, 16)
        gpus[0].persistence = 0
        engine.run_round()
        firing = {(i.check, i.subject): i.status for i in engine.tracker.incidents() if i.firing}
        assert firing == {("nvlink", gpus[1].uuid): Status.CRITICAL, ("pcie", gpus[0].uuid): Status.WARNING,
                          ("gpu_config", gpus[0].uuid): Status.WARNING}
        text = requests.get(f"http://127.0.0.1:{endpoint.address[1]}/metrics", timeout=5).text
        for needle in (f'trainguard_gpu_nvlink_links_up{{gpu="1",uuid="{gpus[1].uuid}"}} 17.0',
                       f'trainguard_gpu_pcie_link_width{{gpu="0",uuid="{gpus[0].uuid}"}} 4.0',
                       f'trainguard_gpu_persistence_mode{{gpu="0",uuid="{gpus[0].uuid}"}} 0.0',
                       'trainguard_check_status{check="nvlink",subject="' + gpus[1].uuid + '",type="nvlink"} 2.0'):
            assert needle in text, needle
    finally:
        endpoint.stop()
        engine.stop()


def gpus_from_nvlink_status(capture: str) -> list[FakeGpu]:
    """Scripted GPUs with the links a real `nvidia-smi nvlink --status` capture lists (a link with a speed is up)."""
    text = (REPO / "tests" / "data" / "nvidia" / "fabric-manager" / capture).read_text()
    gpus: list[FakeGpu] = []
    for line in text.splitlines():
        if line.startswith("GPU "):
            gpus.append(FakeGpu(line.split("UUID: ")[1].rstrip(")")))
        elif line.strip().startswith("Link ") and gpus:
            gpus[-1].nvlinks.append("GB/s" in line)
    return gpus


def test_nvlink_on_captured_hosts() -> None:
    a100 = gpus_from_nvlink_status("nvidia-smi.nvlink.status.a100")
    assert len(a100) == 8 and all(len(g.nvlinks) == 12 for g in a100)
    results = NvlinkCheck("nvlink", NvlinkSettings(), context(FakeNvml(a100), Clock())).run()
    assert [r.summary for r in results][:1] == ["GPU 0: 12 of 12 NVLinks up (12 seen on this node)"]
    assert gpus_from_nvlink_status("nvidia-smi.nvlink.status.a10") == []  # the A10's capture lists no link at all
    a10 = FakeNvml([FakeGpu("GPU-a10", name="NVIDIA A10")])
    assert CheckRunner(NvlinkCheck("nvlink", NvlinkSettings(), context(a10, Clock()))).run_once().outcome == "idle"
