"""GPU memory through a scripted NVML: a leaking process, an unknown co-tenant, a GPU lost mid-run, no NVML."""

from __future__ import annotations

import logging
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.fake_nvml import FakeGpu, FakeNvml, NVMLError_GpuIsLost, NVMLError_LibraryNotFound
from tests.test_gpu import Clock
from trainguard.checks.base import CheckContext
from trainguard.checks.gpu_memory import GpuMemoryCheck, GpuMemorySettings
from trainguard.core.model import Result, Status
from trainguard.gpu.nvml import Nvml
from trainguard.jobs.catalog import JobCatalog
from trainguard.jobs.settings import JobsSettings, ProcessJobSettings
from trainguard.pipeline.runner import CheckRunner

GiB = 2**30


@pytest.fixture
def trainer() -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    marker = f"gpu-trainer-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", marker])
    yield proc, marker
    proc.kill()
    proc.wait()


def gpu_memory_check(fake: FakeNvml, clock: Clock, marker: str | None, **settings: object) -> GpuMemoryCheck:
    jobs = None
    if marker is not None:
        jobs = JobCatalog(JobsSettings(sources=["process"], refresh=0,
                                       processes={"trainer": ProcessJobSettings(cmdline=marker, user="root")}), "node1", clock)
    ctx = CheckContext("node1", Path("/tmp"), clock, nvml=Nvml(fake), jobs=jobs)
    return GpuMemoryCheck("gpu_memory", GpuMemorySettings.model_validate({"min_span": "2m", **settings}), ctx)


def run_every_30s(check: GpuMemoryCheck, clock: Clock, fake: FakeNvml, grow: int, times: int) -> list[Result]:
    results: list[Result] = []
    for _ in range(times):
        fake.gpus[0].used += grow
        fake.gpus[0].processes = [(pid, used + grow if used is not None else None)
                                  for pid, used in fake.gpus[0].processes]
        clock.now += 30
        results = list(check.run())
    return results


def test_leaking_gpu_process_is_forecast_and_named(trainer: tuple[subprocess.Popen[bytes], str]) -> None:
    proc, marker = trainer
    fake, clock = FakeNvml([FakeGpu("GPU-a", total=80 * GiB, used=40 * GiB, processes=[(proc.pid, 39 * GiB)])]), Clock()
    check = gpu_memory_check(fake, clock, marker)
    [steady] = run_every_30s(check, clock, fake, 0, 6)
    assert steady.status is Status.OK and steady.summary == "GPU 0: 40.0 GiB of 80.0 GiB used by process job trainer"
    assert steady.details["job_key"] == "process:trainer"
    assert steady.details["processes"][0]["pid"] == proc.pid

    # +1 GiB every 30 s: 40 GiB free is gone in ~20 minutes
    [leaking] = run_every_30s(check, clock, fake, GiB, 10)
    assert leaking.status is Status.CRITICAL, leaking.summary
    assert leaking.summary.startswith("GPU 0: 50.0 GiB of 80.0 GiB used by process job trainer; growing ")
    assert "MiB/s: full in ~" in leaking.summary
    assert leaking.details["seconds_to_full"] < 20 * 60
    assert leaking.details["job_key"] == "process:trainer"  # a bound save action reaches the job that uses the GPU
    samples = {s.name for s in leaking.samples}
    assert {"trainguard_gpu_memory_seconds_to_full", "trainguard_gpu_process_memory_bytes"} <= samples


def test_unknown_co_tenant_is_reported(trainer: tuple[subprocess.Popen[bytes], str]) -> None:
    proc, marker = trainer
    stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "leftover-run"])
    try:
        fake = FakeNvml([FakeGpu("GPU-a", used=30 * GiB, processes=[(proc.pid, 20 * GiB), (stray.pid, 10 * GiB),
                                                                     (4294967295, 5 * GiB), (99999999, None)])])
        [result] = gpu_memory_check(fake, Clock(), marker).run()
        assert result.status is Status.WARNING
        assert f"memory held outside any known job: pid {stray.pid} (no known job, user root: " in result.summary
        assert "time.sleep(120) leftover" in result.summary and "10.0 GiB" in result.summary  # command cut at 80
        # version-skew garbage pids are dropped, not trusted
        assert [p["pid"] for p in result.details["processes"]] == [proc.pid, stray.pid]

        # without a job source nothing is "unknown": no false alarm on nodes that don't declare jobs
        [plain] = gpu_memory_check(fake, Clock(), None).run()
        assert plain.status is Status.OK
    finally:
        stray.kill()
        stray.wait()


def test_gpu_lost_mid_run(trainer: tuple[subprocess.Popen[bytes], str]) -> None:
    proc, marker = trainer
    fake, clock = FakeNvml([FakeGpu("GPU-a", processes=[(proc.pid, GiB)]), FakeGpu("GPU-b")]), Clock()
    check = gpu_memory_check(fake, clock, marker)
    assert [r.status for r in check.run()] == [Status.OK, Status.OK]
    fake.gpus[1].fail = {"nvmlDeviceGetMemoryInfo": NVMLError_GpuIsLost}
    ok, lost = check.run()
    assert ok.status is Status.OK
    assert lost.status is Status.CRITICAL and lost.summary.startswith("GPU 1 lost (GPU is lost)")


def test_nvml_missing_is_idle_and_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    runner = CheckRunner(gpu_memory_check(FakeNvml(init_error=NVMLError_LibraryNotFound), Clock(), None))
    with caplog.at_level(logging.INFO, logger="trainguard"):
        for _ in range(3):
            report = runner.run_once()
            assert report.outcome == "idle" and report.idle_reason and report.idle_reason.startswith("NVML not available")
    assert len([r for r in caplog.records if r.getMessage().startswith("check idle")]) == 1
