from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.helpers.fake_nvml import FakeGpu, FakeNvml, NVMLError_GpuIsLost, NVMLError_LibraryNotFound, NVMLError_NotSupported
from trainguard.checks.base import CheckContext
from trainguard.checks.gpu import GpuCheck, GpuSettings
from trainguard.model import Status
from trainguard.nvml import Nvml, normalize_bus_id


def check(fake: FakeNvml, **settings: object) -> GpuCheck:
    ctx = CheckContext("node1", Path("/tmp"), extras={"nvml": Nvml(fake)})
    return GpuCheck("gpu", GpuSettings.model_validate(settings), ctx)


def test_healthy_gpus_and_samples() -> None:
    results = check(FakeNvml()).run()
    assert [r.status for r in results] == [Status.OK, Status.OK]
    assert results[0].summary == "GPU 0 NVIDIA H100 80GB HBM3, 2.0 GiB of 80.0 GiB used, 40°C"
    assert results[0].details["bus_id"] == "0000:18:00"
    names = {s.name for s in results[0].samples}
    assert names == {"trainguard_gpu_up", "trainguard_gpu_memory_total_bytes", "trainguard_gpu_memory_used_bytes",
                     "trainguard_gpu_temperature_celsius"}


def test_lost_gpu_is_critical_and_count_drops() -> None:
    fake = FakeNvml()
    fake.gpus[1].fail = {"nvmlDeviceGetMemoryInfo": NVMLError_GpuIsLost}
    results = {r.subject: r for r in check(fake, expected_count=2).run()}
    lost = results[fake.gpus[1].uuid]
    assert lost.status is Status.CRITICAL
    assert lost.summary == "GPU 1 lost (GPU is lost); reset or reboot needed"
    assert results["count"].status is Status.CRITICAL
    assert results["count"].summary == "1 of 2 expected GPUs answering"


def test_not_supported_omits_the_metric() -> None:
    fake = FakeNvml([FakeGpu("GPU-a", fail={"nvmlDeviceGetTemperature": NVMLError_NotSupported})])
    [result] = check(fake).run()
    assert result.status is Status.OK
    assert "trainguard_gpu_temperature_celsius" not in {s.name for s in result.samples}


def test_garbage_values_are_not_trusted() -> None:
    fake = FakeNvml([FakeGpu("GPU-a", total=2**64 - 1, used=5, temperature=4294967295)])
    [result] = check(fake).run()
    assert result.details["memory_total_bytes"] is None
    assert result.details["temperature_c"] is None


@pytest.mark.parametrize(("temp", "status"), [(84, Status.OK), (85, Status.WARNING), (95, Status.CRITICAL)])
def test_temperature_thresholds(temp: int, status: Status) -> None:
    [result] = check(FakeNvml([FakeGpu("GPU-a", temperature=temp)])).run()
    assert result.status is status


def test_nvml_missing_is_one_unknown_and_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeNvml(init_error=NVMLError_LibraryNotFound)
    gpu_check = check(fake)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            [result] = gpu_check.run()
            assert result.status is Status.UNKNOWN
            assert result.summary == "NVML not available: NVML Shared Library Not Found"
    assert sum("GPU checks off" in r.getMessage() for r in caplog.records) == 1


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
    from trainguard.nvml import probe

    reason = probe()
    results = GpuCheck("gpu", GpuSettings(), CheckContext("n", Path("/tmp"))).run()
    if reason is None:
        assert results and all(r.status is not Status.UNKNOWN for r in results)
    else:
        assert reason.startswith("NVML not available")
        assert [r.summary for r in results] == [reason]
