from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.helpers.fake_nvml import FakeGpu, FakeNvml, NVMLError_GpuIsLost, NVMLError_LibraryNotFound, NVMLError_NotSupported
from trainguard.checks.base import CheckContext
from trainguard.checks.gpu import GpuCheck, GpuSettings
from trainguard.core.model import Result, Status
from trainguard.core.state import ScopedState
from trainguard.gpu.nvml import Nvml, normalize_bus_id
from trainguard.pipeline.runner import CheckRunner
from trainguard.pipeline.store import Store


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def check(fake: FakeNvml, store: Store | None = None, clock: Clock | None = None, **settings: object) -> GpuCheck:
    ctx = CheckContext("node1", Path("/tmp"), clock or Clock(), nvml=Nvml(fake), state=ScopedState(store, "check/gpu"))
    return GpuCheck("gpu", GpuSettings.model_validate(settings), ctx)


def gpu_results(gpu_check: GpuCheck) -> list[Result]:
    return [r for r in gpu_check.run() if r.subject != "count"]


def test_healthy_gpus_and_samples() -> None:
    results = check(FakeNvml()).run()
    assert [r.status for r in results] == [Status.OK, Status.OK, Status.OK]
    assert results[2].summary == "2 of 2 GPUs answering (2 seen on this node)"
    assert results[0].summary == "GPU 0 NVIDIA H100 80GB HBM3, 2.0 GiB of 80.0 GiB used, 40°C"
    assert results[0].details["bus_id"] == "0000:18:00"
    names = {s.name for s in results[0].samples}
    assert names == {"trainguard_gpu_up", "trainguard_gpu_memory_total_bytes", "trainguard_gpu_memory_used_bytes",
                     "trainguard_gpu_temperature_celsius", "trainguard_gpu_ecc_uncorrected_volatile",
                     "trainguard_gpu_ecc_uncorrected_aggregate", "trainguard_gpu_retired_pages_pending",
                     "trainguard_gpu_row_remap_pending", "trainguard_gpu_row_remap_failed",
                     "trainguard_gpu_clock_event_active"}


def test_lost_gpu_is_critical_and_count_drops() -> None:
    fake = FakeNvml()
    fake.gpus[1].fail = {"nvmlDeviceGetMemoryInfo": NVMLError_GpuIsLost}
    results = {r.subject: r for r in check(fake, expected_count=2).run()}
    lost = results[fake.gpus[1].uuid]
    assert lost.status is Status.CRITICAL
    assert lost.summary == "GPU 1 lost (GPU is lost); reset or reboot needed"
    assert results["count"].status is Status.CRITICAL
    assert results["count"].summary == "1 of 2 GPUs answering (2 configured)"


def test_not_supported_omits_the_metric() -> None:
    fake = FakeNvml([FakeGpu("GPU-a", fail={"nvmlDeviceGetTemperature": NVMLError_NotSupported,
                                            "nvmlDeviceGetRemappedRows": NVMLError_NotSupported})])
    [result] = gpu_results(check(fake))
    assert result.status is Status.OK
    assert "trainguard_gpu_temperature_celsius" not in {s.name for s in result.samples}
    assert "trainguard_gpu_row_remap_pending" not in {s.name for s in result.samples}


def test_garbage_values_are_not_trusted() -> None:
    fake = FakeNvml([FakeGpu("GPU-a", total=2**64 - 1, used=5, temperature=4294967295, ecc_volatile=2**64 - 1)])
    [result] = gpu_results(check(fake))
    assert result.details["memory_total_bytes"] is None
    assert result.details["temperature_c"] is None
    assert result.details["ecc_uncorrected_volatile"] is None


@pytest.mark.parametrize(("temp", "status"), [(84, Status.OK), (85, Status.WARNING), (95, Status.CRITICAL)])
def test_temperature_thresholds(temp: int, status: Status) -> None:
    [result] = gpu_results(check(FakeNvml([FakeGpu("GPU-a", temperature=temp)])))
    assert result.status is status


@pytest.mark.parametrize(("gpu", "status", "text"), [
    (FakeGpu("GPU-a", ecc_volatile=3, ecc_aggregate=7), Status.CRITICAL,
     "3 uncorrected ECC errors since the driver loaded: reset the GPU"),
    (FakeGpu("GPU-a", remap=(0, 1, 1, 0)), Status.WARNING, "row remapping pending: reset the GPU once its job ends"),
    (FakeGpu("GPU-a", remap=(0, 1, 0, 1)), Status.CRITICAL, "row remapping failed: hardware fault, RMA the GPU"),
    (FakeGpu("GPU-a", pages_pending=1), Status.WARNING, "retired pages pending"),
])
def test_memory_health(gpu: FakeGpu, status: Status, text: str) -> None:
    [result] = gpu_results(check(FakeNvml([gpu])))
    assert result.status is status and text in result.summary


def test_sustained_hardware_slowdown_warns() -> None:
    fake, clock = FakeNvml([FakeGpu("GPU-a", clock_events=0x8 | 0x40)]), Clock()
    gpu_check = check(fake, clock=clock, throttle_for="5m")
    [first] = gpu_results(gpu_check)
    assert first.status is Status.OK  # a brief slowdown is normal
    clock.now += 301
    [later] = gpu_results(gpu_check)
    assert later.status is Status.WARNING
    assert "clocks slowed (hw_slowdown, hw_thermal) for 5m01s" in later.summary
    active = {s.labels["reason"]: s.value for s in later.samples if s.name == "trainguard_gpu_clock_event_active"}
    assert active == {"hw_slowdown": 1, "sw_thermal": 0, "hw_thermal": 1, "hw_power_brake": 0}
    fake.gpus[0].clock_events = 0
    assert gpu_results(gpu_check)[0].status is Status.OK


def test_a_gpu_vanishing_from_the_count(tmp_path: Path) -> None:
    store = Store(tmp_path)
    fake = FakeNvml()
    counts = {r.subject: r for r in check(fake, store).run()}
    assert counts["count"].status is Status.OK
    fake.gpus.pop()  # fell out of the driver: NVML no longer lists it at all
    counts = {r.subject: r for r in check(fake, store).run()}  # a restarted agent remembers the count
    assert counts["count"].status is Status.CRITICAL
    assert counts["count"].summary == "1 of 2 GPUs answering (2 seen on this node)"


def test_nvml_missing_on_a_node_without_gpus_is_idle(caplog: pytest.LogCaptureFixture) -> None:
    gpu_check = check(FakeNvml(init_error=NVMLError_LibraryNotFound))
    runner = CheckRunner(gpu_check)
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            report = runner.run_once()
            assert (report.outcome, report.results) == ("idle", ())
            assert report.idle_reason == "NVML not available: NVML Shared Library Not Found"
    assert sum(r.getMessage().startswith("check idle") for r in caplog.records) == 1


def test_nvml_missing_where_gpus_were_seen_or_configured_is_critical(tmp_path: Path) -> None:
    store = Store(tmp_path)
    check(FakeNvml(), store).run()  # this node had 2 GPUs
    [seen] = check(FakeNvml(init_error=NVMLError_LibraryNotFound), store).run()
    assert (seen.subject, seen.status) == ("count", Status.CRITICAL)
    assert seen.summary == "0 of 2 GPUs answering (2 seen on this node): NVML not available: NVML Shared Library Not Found"
    [configured] = check(FakeNvml(init_error=NVMLError_LibraryNotFound), expected_count=8).run()
    assert configured.status is Status.CRITICAL and configured.summary.startswith("0 of 8 GPUs answering (8 configured)")


def test_init_once() -> None:
    fake = FakeNvml()
    gpu_check = check(fake)
    gpu_check.run()
    gpu_check.run()
    assert fake.calls.count("nvmlInit") == 1


@pytest.mark.parametrize(("raw", "norm"), [
    (b"00000000:3B:00.0", "0000:3b:00"), ("PCI:0000:3b:00", "0000:3b:00"), ("00000004:01:00.0", "0004:01:00"),
])
def test_bus_id_normalisation(raw: str | bytes, norm: str) -> None:
    assert normalize_bus_id(raw) == norm


def test_real_pynvml_on_this_machine() -> None:
    """With no GPU here, real NVML must fail cleanly; on a GPU node it must list the GPUs."""
    from trainguard.gpu.nvml import probe

    reason = probe()
    report = CheckRunner(GpuCheck("gpu", GpuSettings(), CheckContext("n", Path("/tmp")))).run_once()
    if reason is None:
        assert report.results and all(r.status is not Status.UNKNOWN for r in report.results)
    else:
        assert reason.startswith("NVML not available")
        assert (report.outcome, report.idle_reason) == ("idle", reason)
