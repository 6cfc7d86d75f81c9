from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import HungMount, wait_until
from trainguard.checks.base import CheckContext
from trainguard.checks.capacity import Usage, evaluate, summarize
from trainguard.checks.disk import DiskCheck, DiskSettings
from trainguard.core.forecast import Forecast
from trainguard.core.model import Status
from trainguard.node.mounts import (
    StatfsProbe,
    Stuck,
    device_mounts,
    mount_of,
    parse_mountinfo,
    read_mounts,
    real_mounts,
)

GiB = 2**30


def usage(avail: int = 50 * GiB, size: int = 100 * GiB, files: int = 1000, files_free: int = 900) -> Usage:
    return Usage("/scratch", "/dev/sda1", "ext4", size, avail, files, files_free)


def settings(**kw: object) -> DiskSettings:
    return DiskSettings.model_validate(kw)


# evaluate: thresholds as data -------------------------------------------------------------
@pytest.mark.parametrize(("avail", "expected"), [(50, Status.OK), (9, Status.WARNING), (4, Status.CRITICAL)])
def test_percent_thresholds(avail: int, expected: Status) -> None:
    assert evaluate(usage(avail * GiB), settings(), None, None).status is expected


def test_absolute_thresholds_and_summary() -> None:
    s = settings(free_warning="60GiB", free_critical="1GiB")
    v = evaluate(usage(), s, None, None)
    assert v.status is Status.WARNING
    assert summarize(usage(), v) == "/scratch: 50.0 GiB free (50.0%), below the 60.0 GiB warning threshold"


def test_inodes_separately_from_bytes() -> None:
    v = evaluate(usage(files=1000, files_free=30), settings(), None, None)
    assert v.status is Status.CRITICAL
    assert v.reasons == ("30 inodes free (3.0%), below the 5% critical threshold",)


def test_no_inode_limit_is_not_an_alarm() -> None:
    assert evaluate(usage(files=0, files_free=0), settings(), None, None).status is Status.OK


def test_forecast_warns_before_thresholds() -> None:
    soon, late = Forecast(-1000.0, 2 * 3600), Forecast(-1.0, 48 * 3600)
    v = evaluate(usage(), settings(forecast_horizon="6h"), soon, None)
    assert v.status is Status.WARNING
    assert v.reasons == ("space predicted full in 2h00m at the current rate",)
    assert evaluate(usage(), settings(), late, None).status is Status.OK
    assert evaluate(usage(), settings(forecast_horizon=0), soon, None).status is Status.OK


# mounts -------------------------------------------------------------------------------------
def test_mount_table_excludes_pseudo_filesystems() -> None:
    mounts = read_mounts()
    assert any(m.mountpoint == "/" for m in mounts)
    real = real_mounts(mounts)
    assert all(m.fstype not in ("proc", "sysfs", "cgroup", "devpts") for m in real)
    assert not any(m.mountpoint.startswith("/proc") for m in real)
    assert mount_of("/", mounts) is not None


def test_mountinfo_escapes(tmp_path: Path) -> None:
    [m] = parse_mountinfo("36 35 98:0 / /mnt/my\\040disk rw,noatime master:1 - ext3 /dev/root rw,errors=continue\n"
                          "garbage line\n")
    assert m.mountpoint == "/mnt/my disk"
    assert (m.fstype, m.device, m.dev_id) == ("ext3", "/dev/root", "98:0")


def test_probe_never_stacks_calls_on_a_stuck_path() -> None:
    release, calls = threading.Event(), []

    def slow_statvfs(path: str) -> os.statvfs_result:
        calls.append(path)
        release.wait()
        return os.statvfs("/")

    probe = StatfsProbe(statvfs=slow_statvfs)
    first = probe.stat("/nfs", 0.1)
    assert isinstance(first, Stuck)
    assert isinstance(probe.stat("/nfs", 0.1), Stuck)
    assert calls == ["/nfs"]
    release.set()
    wait_until(lambda: probe.stuck_paths() == [], 2)
    assert isinstance(probe.stat("/nfs", 1), os.statvfs_result)
    assert calls == ["/nfs", "/nfs"]
    probe.close()


def test_probe_stats_on_one_kept_thread_and_replaces_it_when_a_call_blocks() -> None:
    release, threads = threading.Event(), {}

    def statvfs(path: str) -> os.statvfs_result:
        threads[path] = threading.get_ident()
        if path == "/nfs":
            release.wait()
        return os.statvfs("/")

    probe = StatfsProbe(statvfs=statvfs)
    try:
        for path in ("/a", "/b", "/c"):
            assert isinstance(probe.stat(path, 1), os.statvfs_result)
        assert threads["/a"] == threads["/b"] == threads["/c"]  # one thread, kept between calls
        assert isinstance(probe.stat("/nfs", 0.1), Stuck)
        assert threads["/nfs"] == threads["/a"]
        # the blocked call holds that thread: the next path is answered on another
        assert isinstance(probe.stat("/d", 1), os.statvfs_result)
        assert threads["/d"] != threads["/nfs"]
        assert probe.stuck_paths() == ["/nfs"]
    finally:
        release.set()
        probe.close()


def test_a_call_that_returns_as_the_wait_gives_up_is_an_answer() -> None:
    probe: StatfsProbe

    def statvfs(path: str) -> os.statvfs_result:
        # Hold the probe's lock past the caller's timeout, so that it waits for the lock with the call unanswered,
        # and let go only after this call has returned.
        probe._lock.acquire()
        time.sleep(0.3)
        threading.Timer(0.2, probe._lock.release).start()
        return os.statvfs("/")

    probe = StatfsProbe(statvfs=statvfs)
    try:
        assert isinstance(probe.stat("/slow", 0.1), os.statvfs_result)
        assert probe.stuck_paths() == []
    finally:
        probe.close()


# real filesystems ---------------------------------------------------------------------------
def _check(paths: list[str], clock: Callable[[], float] = time.time, **kw: object) -> DiskCheck:
    s = DiskSettings.model_validate({"paths": paths, **kw})
    return DiskCheck("disk", s, CheckContext("node1", Path("/tmp"), clock))


def test_tmpfs_filled_past_byte_thresholds(tmpfs: Callable[..., Path]) -> None:
    mnt = tmpfs(size="4m", inodes=1000)
    check = _check([str(mnt)])
    [ok] = check.run()
    assert ok.status is Status.OK
    assert ok.details["fstype"] == "tmpfs"
    (mnt / "blob").write_bytes(b"\0" * int(3.7 * 2**20))  # >90% used: WARNING
    [warn] = check.run()
    assert warn.status is Status.WARNING, warn.summary
    with (mnt / "blob").open("ab") as f:
        f.write(b"\0" * int(0.2 * 2**20))  # >95% used: CRITICAL
    [crit] = check.run()
    assert crit.status is Status.CRITICAL
    assert crit.summary.startswith(f"{mnt}: ") and "critical threshold" in crit.summary
    names = {s.name for s in crit.samples}
    assert {"trainguard_filesystem_avail_bytes", "trainguard_filesystem_files_free"} <= names


def test_tmpfs_filled_past_inode_thresholds(tmpfs: Callable[..., Path]) -> None:
    mnt = tmpfs(size="64m", inodes=100)
    check = _check([str(mnt)])
    for i in range(92):
        (mnt / f"f{i}").touch()
    [warn] = check.run()
    assert warn.status is Status.WARNING
    assert "inodes free" in warn.summary and "space" not in warn.summary
    for i in range(92, 97):
        (mnt / f"f{i}").touch()
    [crit] = check.run()
    assert crit.status is Status.CRITICAL
    assert crit.details["avail_bytes"] > 60 * 2**20  # bytes are fine: inodes alone are CRITICAL


def test_time_to_full_from_real_growth(tmpfs: Callable[..., Path]) -> None:
    mnt = tmpfs(size="16m", inodes=1000)
    now = [1000.0]
    check = _check([str(mnt)], clock=lambda: now[0], forecast_horizon="6h", forecast_min_span="5m")
    for i in range(8):  # 1 MiB every 10 minutes: 16 MiB fills in under 3 hours
        (mnt / f"ckpt{i}").write_bytes(b"\0" * 2**20)
        [result] = check.run()
        now[0] += 600
    assert result.status is Status.WARNING
    assert "space predicted full in" in result.summary
    ttf = [s for s in result.samples if s.name == "trainguard_filesystem_time_to_full_seconds"
           and s.labels["resource"] == "bytes"]
    assert ttf and 0 < ttf[0].value < 6 * 3600


def test_missing_path_is_unknown_with_reason(tmp_path: Path) -> None:
    [result] = _check([str(tmp_path / "nope")]).run()
    assert result.status is Status.UNKNOWN
    assert result.summary.endswith("cannot stat: No such file or directory")


def test_hung_fuse_mount(hung_mount: HungMount) -> None:
    check = _check([str(hung_mount.mountpoint), "/"], mount_timeout="0.5s", timeout="3s")
    t0 = time.monotonic()
    results = {r.subject: r for r in check.run()}
    assert time.monotonic() - t0 < 2.0
    hung = results[str(hung_mount.mountpoint)]
    assert hung.status is Status.UNKNOWN
    assert "mount not responding" in hung.summary
    assert results["/"].status is not Status.UNKNOWN
    for _ in range(3):
        again = {r.subject: r for r in check.run()}
        assert "mount not responding" in again[str(hung_mount.mountpoint)].summary
    assert hung_mount.statfs_calls() == 1
    assert check.probe.stuck_paths() == [str(hung_mount.mountpoint)]
    hung_mount.abort()
    wait_until(lambda: check.probe.stuck_paths() == [], 5, what="blocked statvfs thread to return")


def test_a_file_system_gone_read_only_under_a_read_write_mount_is_reported_on_its_path(
        tmpfs: Callable[..., Path], tmp_path: Path) -> None:
    """What the kernel does after an ext4 error (errors=remount-ro): the file system read-only, the mount still rw. A
    bind mount of a tmpfs whose original is remounted read-only is the same state, really mounted."""
    mnt = tmpfs(size="1m")
    bound = tmp_path / "bound"
    bound.mkdir()
    subprocess.run(["mount", "--bind", str(mnt), str(bound)], check=True, timeout=10)
    try:
        check = _check([str(bound), str(mnt)])
        assert [r.status for r in check.run()] == [Status.OK, Status.OK]
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True, timeout=10)
        mounts = {m.mountpoint: m for m in read_mounts()}
        assert mounts[str(bound)].went_read_only and not mounts[str(mnt)].went_read_only  # ro on purpose: not a fault
        gone, on_purpose = check.run()
        assert gone.status is Status.WARNING and gone.details["read_only"]
        assert gone.summary.startswith(f"{bound}: file system read-only under a read-write mount (tmpfs: ")
        assert on_purpose.status is Status.OK
    finally:
        subprocess.run(["umount", "-l", str(bound)], check=False, timeout=10)


def test_device_mounts_finds_the_mounts_of_a_kernel_device_name_by_device_number(tmp_path: Path) -> None:
    text = ("27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard\n"
            "40 27 254:1 / /scratch rw,relatime - xfs /dev/mapper/vg-scratch ro,attr2\n"
            "41 27 0:40 / /data rw - btrfs /dev/sdb2 rw\n")
    mounts = parse_mountinfo(text)
    assert mounts[1].went_read_only and mounts[1].options == "rw,relatime" and mounts[1].super_options == "ro,attr2"
    sysfs = tmp_path / "class-block"  # /sys/class/block's layout: each device's `dev` is its major:minor
    for name, number in (("vda", "254:0"), ("dm-1", "254:1")):
        (sysfs / name).mkdir(parents=True)
        (sysfs / name / "dev").write_text(f"{number}\n")
    assert [m.mountpoint for m in device_mounts("dm-1", mounts, str(sysfs))] == ["/scratch"]  # /dev/mapper's
    assert [m.mountpoint for m in device_mounts("sdb2", mounts, str(sysfs))] == ["/data"]  # by its source's name
    assert device_mounts("..", mounts, str(sysfs)) == [] and device_mounts("sdz", mounts, str(sysfs)) == []
