"""Quotas: the tools' documented output formats, providers run end to end against stand-in executables on
PATH, and directory budgets measured on real trees."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from trainguard.checks.base import CheckContext
from trainguard.checks.quota import QuotaCheck, QuotaSettings
from trainguard.core.model import Status
from trainguard.quota.budget import BudgetWalker
from trainguard.quota.parsers import grace_seconds, parse_beegfs, parse_lfs, parse_mmlsquota, parse_quota

DATA = Path(__file__).parent / "data" / "quota"
KiB, MiB, GiB = 1024, 2**20, 2**30
NOW = 1795400000 - 3600.0


def text(name: str) -> str:
    return (DATA / name).read_text()


def test_quota_raw_form_with_grace_as_epoch() -> None:
    local, nfs = parse_quota(text("quota_raw.txt"), now=NOW)
    assert (local.filesystem, local.kind, local.owner) == ("/dev/sdb1", "user", "alice")
    assert (local.bytes_used, local.bytes_soft, local.bytes_hard) == (4194308 * KiB, 4194304 * KiB, 5242880 * KiB)
    assert local.bytes_grace == 3600.0  # the grace ends at that epoch second: an hour from NOW
    assert (local.inodes_used, local.inodes_soft, local.inodes_hard, local.inodes_grace) == (120345, None, None, None)
    assert nfs.filesystem == "nfs01:/export/home" and nfs.inodes_hard == 12000


def test_quota_human_form_with_optional_grace_columns() -> None:
    over, unlimited = parse_quota(text("quota_human.txt"))
    assert (over.kind, over.owner) == ("group", "ml")
    assert (over.bytes_used, over.bytes_hard, over.bytes_grace) == (401 * MiB, 600 * MiB, None)
    assert (over.inodes_used, over.inodes_soft, over.inodes_hard) == (950_000, 900_000, 1_000_000)
    assert over.inodes_grace == 6 * 86400
    assert unlimited.bytes_used == 17179869184 * KiB and unlimited.bytes_hard is None and unlimited.inodes_hard is None


def test_lustre_forms() -> None:
    [scratch] = parse_lfs(text("lfs.txt"), now=NOW)
    assert (scratch.filesystem, scratch.kind, scratch.owner) == ("/scratch", "user", "alice")
    assert scratch.bytes_used == 4194308 * KiB and scratch.bytes_hard == 5242880 * KiB
    assert scratch.bytes_grace == 6 * 86400 + 23 * 3600 + 59 * 60 + 59
    assert (scratch.inodes_used, scratch.inodes_soft, scratch.inodes_hard, scratch.inodes_grace) == (
        120345, None, 150000, None)
    [project] = parse_lfs(text("lfs_verbose.txt"))
    assert (project.filesystem, project.kind, project.owner) == ("/lustre/very/long/scratch/mountpoint", "project",
                                                                 "4242")
    assert project.bytes_hard == 2 * GiB and project.inodes_hard == 100000
    assert [t["target"] for t in project.extra["targets"]] == ["scratch-MDT0000_UUID", "scratch-OST0000_UUID"]
    assert project.extra["targets"][1]["bytes_hard"] == 64 * MiB


def test_gpfs_form() -> None:
    block, files = parse_mmlsquota(text("mmlsquota.txt"), owner="alice")
    assert (block.filesystem, block.kind, block.owner) == ("gpfs1", "user", "alice")
    assert block.bytes_used == 1048580 * KiB and block.bytes_grace == 6 * 86400 and block.inodes_hard is None
    assert files.bytes_hard is None and files.inodes_used == 990001 and files.inodes_grace == 0.0  # expired


def test_beegfs_form() -> None:
    [q] = parse_beegfs(text("beegfs.txt"), "/mnt/beegfs")
    assert (q.owner, q.bytes_used, q.bytes_hard, q.inodes_used, q.inodes_hard) == (
        "alice", 95 * GiB, 100 * GiB, 12345, None)


@pytest.mark.parametrize(("token", "seconds"), [
    ("6days", 518400), ("6 days", 518400), ("6d23h59m59s", 604799), ("00:20", 1200), ("23:59", 86340),
    ("none", None), ("-", None), ("expired", 0.0), ("2 hours", 7200), ("1w", 604800),
])
def test_grace_forms(token: str, seconds: float | None) -> None:
    assert grace_seconds(token) == seconds


@pytest.mark.parametrize("garbage", ["", "quota: Cannot resolve mountpoint path /x\n", "\x00\xff binary",
                                     "Disk quotas for user alice (uid 1001): none\n",
                                     "     /dev/sdb1  lots  of  words  that  are  not  numbers\n"])
def test_garbage_parses_to_nothing(garbage: str) -> None:
    assert parse_quota(garbage) == [] and parse_lfs(garbage) == [] and parse_mmlsquota(garbage) == []
    assert parse_beegfs(garbage, "/b") == []


def test_huge_numbers() -> None:
    line = ("Disk quotas for user big (uid 1):\n     Filesystem  blocks   quota   limit   grace   files   quota   limit"
            "   grace\n  /dev/md0 999999999999999 1999999999999999 2999999999999999 0 4000000000 0 9000000000 0\n")
    [q] = parse_quota(line)
    assert q.bytes_hard == 2999999999999999 * KiB and q.inodes_hard == 9_000_000_000


# providers end to end ------------------------------------------------------------------------------
@pytest.fixture
def tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A bin dir first on PATH where tests place stand-ins for quota, lfs, mmlsquota, beegfs-ctl."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return bin_dir


def tool(bin_dir: Path, name: str, output: str, code: int = 0, delay: float = 0) -> Path:
    (bin_dir / f"{name}.out").write_text(output)
    script = bin_dir / name
    script.write_text(f'#!/bin/sh\necho "$0 $*" >> "{bin_dir}/calls.log"\nsleep {delay}\n'
                      f'cat "{bin_dir}/{name}.out"\nexit {code}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def quota_check(**settings: Any) -> QuotaCheck:
    s = QuotaSettings.model_validate({"forecast_min_span": "0s", **settings})
    return QuotaCheck("quota", s, CheckContext("node1", Path("/tmp")))


def test_lustre_provider_against_lfs_on_path(tools: Path) -> None:
    tool(tools, "lfs", text("lfs.txt"))
    check = quota_check(provider="lustre", mounts=["/scratch"], owners=["alice"], kinds=["user"],
                        free_warning="25%", free_critical="10%")
    [result] = check.run()
    assert result.subject == "user:alice@/scratch"
    # 4.0 of 5.0 GiB used: WARNING on headroom, and over the soft limit with grace left
    assert result.status is Status.WARNING
    assert result.summary.startswith("user alice on /scratch: space over the soft limit, 6d23h of grace left")
    assert "below the 25% warning threshold" in result.summary
    assert (tools / "calls.log").read_text().split()[1:] == ["quota", "-u", "alice", "/scratch"]


def test_inode_quota_is_what_runs_out(tools: Path) -> None:
    tool(tools, "quota", text("quota_human.txt"), code=1)  # quota exits 1 when a limit is exceeded
    check = quota_check(provider="quota", owners=["ml"], kinds=["group"])
    first, _ = check.run()
    assert first.status is Status.WARNING
    assert "inodes over the soft limit, 6d0h of grace left" in first.summary, first.summary
    assert "50000 inodes free (5.0%), below the 10% warning threshold" in first.summary


def test_effective_fraction(tools: Path) -> None:
    tool(tools, "beegfs-ctl", text("beegfs.txt"))
    [nominal] = quota_check(provider="beegfs", owners=["alice"], kinds=["user"]).run()
    assert nominal.status is Status.WARNING  # 95 of 100 GiB: 5% left, under 10% but not under the 5% floor
    [real] = quota_check(provider="beegfs", owners=["alice"], kinds=["user"], effective_fraction=0.8).run()
    assert real.status is Status.CRITICAL and "0 B free" in real.summary  # 95 GiB of an 80 GiB usable budget


def test_provider_failures_are_that_subjects_unknown(tools: Path) -> None:
    tool(tools, "mmlsquota", "mmlsquota: Permission denied\n", code=1)
    [failed] = quota_check(provider="gpfs", mounts=["gpfs1"], owners=["alice"], kinds=["user"]).run()
    assert failed.status is Status.UNKNOWN and failed.subject == "user:alice"
    assert "mmlsquota -u alice gpfs1 exited 1: mmlsquota: Permission denied" in failed.summary
    tool(tools, "lfs", "", delay=5)
    [slow] = quota_check(provider="lustre", mounts=["/scratch"], owners=["alice"], kinds=["user"],
                         command_timeout="0.5s").run()
    assert slow.status is Status.UNKNOWN and "timed out after 0.5s" in slow.summary
    tool(tools, "lfs", "lfs: no such filesystem\n")
    [empty] = quota_check(provider="lustre", mounts=["/scratch"], owners=["alice"], kinds=["user"]).run()
    assert empty.status is Status.UNKNOWN and "no quota lines in its output" in empty.summary


def test_site_command_with_json_pointers_and_regexes(tools: Path) -> None:
    tool(tools, "idrquota", '{"quotas": [{"used_kib": 9000000, "limit_kib": 10000000, "files": 10, "max_files": 0}]}')
    [q] = quota_check(provider="command", command=["idrquota", "--json", "{owner}"], format="json", owners=["alice"],
                      kinds=["user"], size_unit="1KiB",
                      fields={"bytes_used": "/quotas/0/used_kib", "bytes_hard": "/quotas/0/limit_kib",
                              "inodes_used": "/quotas/0/files", "inodes_hard": "/quotas/0/max_files"}).run()
    assert q.status is Status.OK and q.details["bytes_used"] == 9000000 * KiB and q.details["inodes_hard"] is None
    tool(tools, "sitequota", "alice on /work: used 950 GiB of 1 TiB\n")
    [r] = quota_check(provider="command", command=["sitequota", "{owner}"], owners=["alice"], kinds=["user"],
                      fields={"bytes_used": r"used (\S+ \w+)", "bytes_hard": r"of (\S+ \w+)"}).run()
    assert r.status is Status.WARNING and r.details["bytes_used"] == 950 * GiB


def test_default_owners_are_the_jobs_users(tools: Path) -> None:
    tool(tools, "lfs", text("lfs.txt"))
    [nobody] = quota_check(provider="lustre", mounts=["/scratch"]).run()
    assert nobody.status is Status.OK and "no quota owners" in nobody.summary


def test_config_errors_name_what_is_missing() -> None:
    with pytest.raises(ValueError, match="provider lustre needs mounts"):
        QuotaSettings.model_validate({"provider": "lustre"})
    with pytest.raises(ValueError, match="provider budget needs mounts"):
        QuotaSettings.model_validate({"provider": "budget", "mounts": ["/ckpt"]})


# directory budgets --------------------------------------------------------------------------------
def make_tree(root: Path, dirs: int, files_per_dir: int) -> None:
    for d in range(dirs):
        sub = root / f"step-{d:05d}"
        sub.mkdir(parents=True)
        for f in range(files_per_dir):
            os.close(os.open(sub / f"shard-{f:05d}", os.O_CREAT | os.O_WRONLY, 0o644))


def test_budget_of_200k_files_is_measured_across_runs_within_its_time_budget(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    make_tree(root, 400, 500)
    (root / "big.bin").write_bytes(b"x" * (4 * MiB))
    os.link(root / "big.bin", root / "big-link.bin")  # counted once
    walker = BudgetWalker(str(root))
    calls, slowest = 0, 0.0
    while True:
        started = time.monotonic()
        m = walker.advance(0.05)
        slowest = max(slowest, time.monotonic() - started)
        calls += 1
        if m.complete:
            break
        assert m.measured_at is None and m.inodes < 200_401
    assert calls > 3, "a 200k-file tree should take several slices"
    assert slowest < 0.5  # one directory of 500 entries is the unit of work past the budget
    assert m.inodes == 400 + 200_000 + 1  # directories, files, the hard-linked file once
    assert m.bytes >= 4 * MiB and m.measured_at is not None


def test_budget_check_warns_on_inodes_with_its_freshness(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    make_tree(root, 10, 90)
    check = quota_check(provider="budget", mounts=[str(root)], inodes_budget=1000, walk_budget="5s")
    [result] = check.run()
    assert result.subject == f"dir:{root}@{root}"
    assert result.status is Status.WARNING, result.summary  # 910 of 1000 inodes
    assert result.summary == (f"budget of {root}: 90 inodes free (9.0%), below the 10% warning threshold "
                              "(measured 0s ago)")


def test_tools_run_in_the_c_locale_and_decimal_commas_parse(tools: Path) -> None:
    script = tool(tools, "quota", text("quota_comma.txt"), code=1)
    script.write_text(script.read_text().replace('echo "$0 $*"', 'echo "LC_ALL=$LC_ALL $0 $*"'))
    [result] = quota_check(provider="quota", owners=["alice"], kinds=["user"]).run()
    assert (tools / "calls.log").read_text().startswith("LC_ALL=C ")  # English headers and grace units
    assert result.subject == "user:alice@/dev/sdb1"
    assert result.details["bytes_used"] == int(4.5 * GiB) and result.details["bytes_hard"] == 5 * GiB
    assert result.details["bytes_grace"] == 6 * 86400
    assert result.status is Status.WARNING


def test_quota_filtered_to_the_configured_filesystems(tools: Path) -> None:
    tool(tools, "quota", text("quota_raw.txt"))
    [nfs] = quota_check(provider="quota", owners=["alice"], kinds=["user"], mounts=["nfs01:/export/home"]).run()
    assert nfs.subject == "user:alice@nfs01:/export/home" and nfs.status is Status.OK
    [none] = quota_check(provider="quota", owners=["alice"], kinds=["user"], mounts=["/scratch"]).run()
    assert none.status is Status.UNKNOWN
    assert "no quota on /scratch (it reports /dev/sdb1, nfs01:/export/home)" in none.summary
