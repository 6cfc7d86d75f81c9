"""Quotas as clusters really print them: each fixture is a captured output (tests/data/quota/README.md says where it
came from, and which few are hand-written because no capture is public), parsed, then graded by the check through
stand-in tools that read their arguments the way the real tools do."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

from tests import test_quota
from tests.test_quota import DATA, GiB, KiB, MiB, quota_check, text, tool
from trainguard.core.model import Status
from trainguard.quota.parsers import parse_beegfs, parse_lfs, parse_mmlsquota, parse_quota

tools = test_quota.tools  # the bin dir first on PATH, as a fixture here too

TiB = 2**40


# quota-tools -------------------------------------------------------------------------------------
def test_quota_none_after_an_exceeded_soft_limit_is_expired_grace() -> None:
    blocks, files = parse_quota(text("quota_expired_none.txt"))
    assert (blocks.bytes_used, blocks.bytes_soft, blocks.bytes_grace) == (4194308 * KiB, 4194304 * KiB, 0.0)
    assert blocks.inodes_grace is None  # not over the inode soft limit
    assert (files.inodes_used, files.inodes_soft, files.inodes_grace, files.bytes_grace) == (9001, 9000, 0.0, None)


def test_quota_wrapped_names_and_over_soft_without_grace_column() -> None:
    user, data = parse_quota(text("quota_wrapped_human.txt"))
    assert (user.filesystem, user.owner) == ("10.118.240.67:/user", "vsc30140")
    assert (user.bytes_used, user.bytes_soft, user.bytes_hard) == (3029 * MiB, 2765 * MiB, 3072 * MiB)
    assert (user.inodes_used, user.inodes_hard, user.bytes_grace) == (41169, 100_000, None)
    assert data.filesystem == "10.118.240.67:/data" and data.inodes_hard == 10_000_000 and data.bytes_used == 75 * GiB


# Lustre ------------------------------------------------------------------------------------------
def test_lustre_failed_target_and_footer_are_problems_and_targets_keep_their_uuid_names() -> None:
    [q] = parse_lfs(text("lfs_cheatsheet_hv.txt"))
    assert (q.filesystem, q.kind, q.owner, q.inodes_used) == ("/lustre/", "user", "root", 4490)
    assert q.bytes_used == int(9.4 * GiB) and q.bytes_hard is None  # `0k`: no limit
    names = [t["target"] for t in q.extra["targets"]]
    assert names[0] == "LustreFS-MDT0000_UUID" and names[1:] == [f"LustreFS-OST000{i}_UUID" for i in range(1, 7)]
    assert q.problems[0] == "ost0 did not answer (lfs: quotactl ost0 failed)"
    assert "some targets did not answer" in q.problems[1] and len(q.problems) == 2


def test_lustre_bracketed_total_is_used_and_flagged() -> None:
    [q] = parse_lfs(text("lfs_inaccurate_total.txt"))
    assert q.bytes_used == 10200224 * KiB and q.inaccurate == ("bytes_used",)
    assert q.inodes_used == 17724 and q.problems


def test_lustre_216_bare_targets_attach_to_their_own_block() -> None:
    tfs1, tfs2 = parse_lfs(text("lfs_216_two_mounts.txt"))
    assert [t["target"] for t in tfs1.extra["targets"]] == ["tfs1-MDT0000", "tfs1-OST0000", "tfs1-OST0003"]
    assert [t["target"] for t in tfs2.extra["targets"]] == ["tfs2-MDT0000", "tfs2-OST0001"]
    assert tfs1.extra["targets"][2]["inaccurate"] == ["bytes_used", "bytes_hard"]
    assert tfs1.bytes_used == 1041408 * KiB and tfs1.inaccurate == ("bytes_used",) and tfs1.bytes_grace == 0.0
    assert tfs1.problems[0] == "tfs1-OST0003 did not answer: its figures are inaccurate"
    assert tfs2.problems == () and tfs2.bytes_hard == 4 * GiB  # the footer belongs to the first block only


def test_lustre_215_none_is_expired_and_default_quota_lines_are_not_rows() -> None:
    [q] = parse_lfs(text("lfs_215_expired_none.txt"))
    assert (q.kind, q.owner, q.bytes_grace) == ("group", "ml", 0.0)
    assert q.inodes_grace == 6 * 86400 + 23 * 3600 + 59 * 60
    [mila] = parse_lfs(text("lfs_default_quota.txt"))
    assert (mila.filesystem, mila.bytes_hard, mila.inodes_hard) == ("/home/mila", 100 * GiB, 1048576)


def test_lustre_pool() -> None:
    [q] = parse_lfs(text("lfs_pool.txt"))
    assert (q.scope, q.bytes_used, q.bytes_hard) == ("pool:flash", 950000 * KiB, 1000000 * KiB)


# GPFS --------------------------------------------------------------------------------------------
def test_gpfs_fileset_column_and_placeholder_row() -> None:
    [q] = parse_mmlsquota(text("mmlsquota_fileset_kb.txt"), owner="js3269")
    assert (q.filesystem, q.kind, q.owner, q.scope) == ("scratch", "user", "js3269", "fileset:scratch")
    assert (q.bytes_used, q.bytes_soft, q.bytes_hard) == (776405392 * KiB, 1 * TiB, 2 * TiB)
    assert q.extra["in_doubt_bytes"] == 1153712 * KiB and q.inodes_used == 108911 and q.inodes_hard is None


def test_gpfs_block_size_auto_values_and_in_doubt() -> None:
    rows = parse_mmlsquota(text("mmlsquota_auto.txt"), owner="u")
    assert [r.scope for r in rows] == ["fileset:share", "fileset:home", "fileset:projects", "fileset:work"]
    home = rows[1]
    assert (home.bytes_used, home.bytes_soft, home.bytes_hard) == (int(20.7 * GiB), 50 * GiB, 51 * GiB)
    assert home.extra["in_doubt_bytes"] == int(426.2 * MiB) and home.inodes_hard == 1_100_000
    [group] = parse_mmlsquota(text("mmlsquota_group_auto.txt"))
    assert (group.kind, group.owner, group.bytes_hard) == ("group", "ai4d-cluster-ai4d-core-08-project",
                                                          int(2.671 * TiB))


def test_gpfs_unit_header() -> None:
    [q] = parse_mmlsquota(text("mmlsquota_fileset_gb.txt"), owner="workspace1")
    assert (q.kind, q.owner, q.bytes_used, q.bytes_soft, q.bytes_hard) == (
        "fileset", "workspace1", 57 * GiB, 10240 * GiB, 11264 * GiB)  # not 57 KiB


# BeeGFS ------------------------------------------------------------------------------------------
def test_beegfs_pools_and_byte_values() -> None:
    scratch, home = parse_beegfs(text("beegfs_pools.txt"), "/beegfs")
    assert (scratch.scope, scratch.bytes_hard, scratch.inodes_hard) == ("pool:scratch", 5 * TiB, 1_000_000)
    assert (home.scope, home.bytes_used, home.bytes_hard) == ("pool:home", int(3.44 * GiB), 8 * GiB)
    [zero] = parse_beegfs(text("beegfs_zero_byte.txt"), "/beegfs")
    assert (zero.owner, zero.bytes_used, zero.bytes_hard, zero.inodes_hard) == ("freemana", 0, None, 1_000_000)
    [one] = parse_beegfs(text("beegfs_one_byte.txt"), "/beegfs", "group")
    assert (one.kind, one.bytes_used, one.bytes_hard, one.inodes_hard) == ("group", 0, 1, 1)


# the check, through stand-in tools -----------------------------------------------------------------
def fake(bin_dir: Path, name: str, body: str) -> None:
    """A stand-in that reads its arguments the way the real tool does (getopt), so a wrong flag shows."""
    script = bin_dir / name
    script.write_text(f"#!{sys.executable}\nimport getopt, pathlib, sys\nhere = pathlib.Path(__file__).parent\n{body}")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


# quota-tools 4.x: -p is --raw-grace (no argument), -P is --project; names are operands.
FAKE_QUOTA = """opts, names = getopt.gnu_getopt(sys.argv[1:], "gupPvswlqQiAmfF:")
flags = [o for o, _ in opts]
kind = "project" if "-P" in flags else "group" if "-g" in flags else "user"
for name in names:
    sys.stdout.write((here / f"quota-{kind}.out").read_text().replace("NAME", name))
"""


def test_project_quota_asks_quota_tools_with_its_project_flag(tools: Path) -> None:
    fake(tools, "quota", FAKE_QUOTA)
    (tools / "quota-project.out").write_text(text("quota_project.txt").replace("ckpt", "NAME"))
    (tools / "quota-user.out").write_text(text("quota_raw.txt").replace("alice", "NAME"))
    [project] = quota_check(provider="quota", kinds=["project"], projects=["4242"]).run()
    assert project.subject == "project:4242@/dev/sdb1" and project.status is Status.OK, project.summary
    assert project.details["bytes_hard"] == 1200000 * KiB
    # `quota -w -p -v -p 4242` (the old flag) is read as the user 4242: the provider now refuses such an answer
    (tools / "quota-project.out").write_text(text("quota_raw.txt").replace("alice", "NAME"))
    [wrong] = quota_check(provider="quota", kinds=["project"], projects=["4242"]).run()
    assert wrong.status is Status.UNKNOWN
    assert "asked for project 4242, it reported user quotas" in wrong.summary


def test_quota_expired_grace_is_critical(tools: Path) -> None:
    tool(tools, "quota", text("quota_expired_none.txt"), code=1)
    results = quota_check(provider="quota", owners=["alice"], kinds=["user"]).run()
    assert [r.status for r in results] == [Status.CRITICAL, Status.CRITICAL]
    assert "space over the soft limit and its grace period has expired: writes fail" in results[0].summary
    assert "inodes over the soft limit and its grace period has expired" in results[1].summary


# lfs 2.16: -p is --projid; --pool takes a name; exits non-zero when a target did not answer.
FAKE_LFS = """opts, args = getopt.gnu_getopt(sys.argv[2:], "vhqu:g:p:", ["pool="])
given = dict(opts)
assert sys.argv[1] == "quota" and len(args) == 1, sys.argv
name = "pool" if "--pool" in given else "partial"
sys.stdout.write((here / f"lfs-{name}.out").read_text())
sys.exit(1 if name == "partial" else 0)
"""


def test_lustre_partial_failure_is_reported_and_the_figures_still_graded(tools: Path) -> None:
    fake(tools, "lfs", FAKE_LFS)
    (tools / "lfs-partial.out").write_text(text("lfs_216_two_mounts.txt"))
    (tools / "lfs-pool.out").write_text(text("lfs_pool.txt"))
    check = quota_check(provider="lustre", mounts=["/lustre/tfs1"], owners=["alice"], kinds=["user"],
                        breakdown=True, pools=["flash"])
    tfs1, tfs2, flash = check.run()
    assert tfs1.subject == "user:alice@/lustre/tfs1" and tfs1.status is Status.CRITICAL  # expired, not UNKNOWN
    assert "tfs1-OST0003 did not answer: its figures are inaccurate" in tfs1.summary
    assert "inaccurate figures: bytes_used" in tfs1.summary and tfs1.details["bytes_used"] == 1041408 * KiB
    assert tfs2.status is Status.OK and tfs2.details["problems"] == []
    assert flash.subject == "user:alice@/scratch[pool:flash]" and flash.status is Status.WARNING
    assert flash.summary.startswith("user alice on /scratch (pool flash): ")


def test_lustre_failed_target_alone_is_a_warning(tools: Path) -> None:
    tool(tools, "lfs", text("lfs_cheatsheet_hv.txt"))
    [q] = quota_check(provider="lustre", mounts=["/lustre"], owners=["root"], kinds=["user"]).run()
    assert q.status is Status.WARNING and "ost0 did not answer" in q.summary


def test_gpfs_filesets_are_subjects_and_no_limits_is_ok(tools: Path) -> None:
    tool(tools, "mmlsquota", text("mmlsquota_auto.txt"))
    results = quota_check(provider="gpfs", mounts=["scale"], owners=["u1"], kinds=["user"]).run()
    assert [r.subject for r in results] == [f"user:u1@scale[fileset:{f}]" for f in ("share", "home", "projects",
                                                                                     "work")]
    assert {s.labels["scope"] for r in results for s in r.samples} == {f"fileset:{f}" for f in ("share", "home",
                                                                                              "projects", "work")}
    tool(tools, "mmlsquota", text("mmlsquota_no_limits.txt"))
    unlimited = quota_check(provider="gpfs", mounts=["gpfs1", "gpfs2"], owners=["u1"], kinds=["user"]).run()
    assert [r.status for r in unlimited] == [Status.OK, Status.OK]
    assert unlimited[0].summary == "user u1 on gpfs1: no byte limit"


def test_beegfs_pools_keep_their_own_figures_and_forecasts(tools: Path) -> None:
    tool(tools, "beegfs-ctl", text("beegfs_pools.txt"))
    check = quota_check(provider="beegfs", mounts=["/beegfs"], owners=["<netid>"], kinds=["user"])
    scratch, home = check.run()
    assert (scratch.subject, home.subject) == ("user:<netid>@/beegfs[pool:scratch]", "user:<netid>@/beegfs[pool:home]")
    assert scratch.details["bytes_hard"] == 5 * TiB and home.details["bytes_hard"] == 8 * GiB
    assert {key for key, _ in check.tracker._windows} == {scratch.subject, home.subject}
    assert "--uid" in (tools / "calls.log").read_text().split()
    tool(tools, "beegfs-ctl", text("beegfs_zero_byte.txt"))
    [zero] = quota_check(provider="beegfs", mounts=["/beegfs"], owners=["freemana"], kinds=["user"]).run()
    assert zero.status is Status.OK and zero.details["bytes_used"] == 0


@pytest.mark.parametrize("name", sorted(p.name for p in DATA.glob("*.txt")))
def test_every_fixture_is_cited(name: str) -> None:
    assert f"`{name}`" in (DATA / "README.md").read_text()
