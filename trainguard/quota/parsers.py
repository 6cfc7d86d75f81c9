"""Parsers for the output of the quota tools sites run: `quota`, `lfs quota`, `mmlsquota`, `beegfs-ctl --getquota`.

Each returns QuotaUsage records; a line that doesn't have the documented shape is skipped (and the
caller reports "no quota lines" when nothing parsed), never guessed at. Limits of 0 mean unlimited
in every one of these tools and are stored as None.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from trainguard.core.text import linear
from trainguard.core.units import decimal, parse_size

KIB = 1024
_DIGITS = linear(r"\d+")
_HUMAN_SIZE = linear(r"[\d.]+[KMGTPE]", ignore_case=True)
_COUNT = linear(r"([\d.]+)([kmgt]?)", ignore_case=True)
_CELLS = linear(r"\|\|?")


@dataclass(frozen=True)
class QuotaUsage:
    filesystem: str
    kind: str  # user, group, project, fileset, dir
    owner: str
    bytes_used: int | None = None
    bytes_soft: int | None = None  # None: no limit
    bytes_hard: int | None = None
    inodes_used: int | None = None
    inodes_soft: int | None = None
    inodes_hard: int | None = None
    bytes_grace: float | None = None  # seconds left over the soft limit; 0: expired; None: not in grace
    inodes_grace: float | None = None
    measured_at: float | None = None  # when the figure was taken (directory budgets measure slowly)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)


class QuotaParseError(ValueError):
    """The tool's output has no line of the expected shape."""


# numbers -----------------------------------------------------------------------------------
def _strip(token: str) -> tuple[str, bool]:
    """A value without the `*` some tools append when a limit is exceeded."""
    return token.rstrip("*"), token.endswith("*")


def _size(token: str, unit: int) -> int | None:
    """`4194308` (in `unit` bytes) or human `4.001G` / `100M` / `10.00 GiB`; None for `-`."""
    value, _ = _strip(token.strip())
    if value in ("", "-"):
        return None
    if _DIGITS.fullmatch(value):
        return int(decimal(value)) * unit
    text = value.replace(",", ".")
    if _HUMAN_SIZE.fullmatch(text):
        text += "iB"  # the quota tools' K/M/G are binary
    return parse_size(text)


def _count(token: str) -> int | None:
    value, _ = _strip(token.strip())
    if value in ("", "-"):
        return None
    m = _COUNT.fullmatch(value)
    if not m:
        raise ValueError(f"not a file count: {token[:40]!r}")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}[m.group(2).lower()]
    return round(decimal(m.group(1)) * scale)


def _limit(value: int | None) -> int | None:
    return value if value else None  # 0 means no limit


_DURATION = linear(r"(\d+)\s*(weeks?|w|days?|d|hours?|h|minutes?|min|m|seconds?|sec|s)", ignore_case=True)
_EPOCH = linear(r"\d{9,}")
_CLOCK = linear(r"\d+:\d\d")
_UNIT_S = {"w": 604800, "d": 86400, "h": 3600, "m": 60, "s": 1}


def grace_seconds(token: str, now: float | None = None) -> float | None:
    """Grace left: `6days`, `6d23h59m59s`, `23:59`, `6 days`, an epoch (`quota -p`); None when not in grace."""
    text = token.strip().lower()
    if text in ("", "-", "none", "0"):
        return None
    if text == "expired":
        return 0.0
    if _EPOCH.fullmatch(text):  # quota -p: the epoch second the grace ends
        return max(0.0, decimal(text) - (time.time() if now is None else now))
    if _CLOCK.fullmatch(text):
        hours, minutes = text.split(":")
        return decimal(hours) * 3600.0 + decimal(minutes) * 60.0
    parts = _DURATION.findall(text)
    if not parts:
        raise ValueError(f"not a grace period: {token[:40]!r}")
    return sum(decimal(n) * _UNIT_S[u[0]] for n, u in parts)


# quota (Linux quota tools) -------------------------------------------------------------------
_QUOTA_HEAD = linear(r"^Disk quotas for (user|group|project) (\S+)(?: \((?:uid|gid|pid|project) (\d+)\))?:?",
                     ignore_case=True)


def parse_quota(text: str, now: float | None = None) -> list[QuotaUsage]:
    """`quota -w [-p] [-s] -u|-g USER`: one line per filesystem, grace columns only when over a soft limit
    (always with -p), human sizes with -s. Block counts are KiB."""
    out: list[QuotaUsage] = []
    kind, owner = "user", ""
    for line in text.splitlines():
        head = _QUOTA_HEAD.match(line.strip())
        if head:
            kind, owner = head.group(1).lower(), head.group(2)
            continue
        tokens = line.split()
        if len(tokens) < 7 or tokens[0] == "Filesystem" or not (tokens[0].startswith("/") or ":/" in tokens[0]):
            continue
        fs, rest = tokens[0], tokens[1:]
        try:
            b_used, b_over = _strip(rest[0])
            b_grace = None
            idx = 3
            if len(rest) == 8 or (len(rest) == 7 and b_over):
                b_grace, idx = grace_seconds(rest[3], now), 4
            f_used = rest[idx]
            f_grace = grace_seconds(rest[idx + 3], now) if len(rest) > idx + 3 else None
            out.append(QuotaUsage(fs, kind, owner, _size(b_used, KIB), _limit(_size(rest[1], KIB)),
                                  _limit(_size(rest[2], KIB)), _count(f_used), _limit(_count(rest[idx + 1])),
                                  _limit(_count(rest[idx + 2])), b_grace, f_grace))
        except (ValueError, IndexError):
            continue
    return out


# lfs quota (Lustre) ---------------------------------------------------------------------------
_LFS_HEAD = linear(r"^Disk quotas for (usr|grp|prj|user|group|project) (\S+)", ignore_case=True)
_LFS_KIND = {"usr": "user", "grp": "group", "prj": "project"}


def parse_lfs(text: str, now: float | None = None) -> list[QuotaUsage]:
    """`lfs quota [-h] [-v] -u|-g|-p ID MOUNT`: the filesystem total, and with -v one line per MDT/OST.
    Sizes are KiB (or human with -h); a long name sits alone on its line and the numbers follow."""
    out: list[QuotaUsage] = []
    targets: list[dict[str, Any]] = []
    kind, owner, pending = "user", "", None
    for line in text.splitlines():
        head = _LFS_HEAD.match(line.strip())
        if head:
            kind, owner = _LFS_KIND.get(head.group(1).lower(), head.group(1).lower()), head.group(2)
            continue
        tokens = line.split()
        if not tokens or tokens[0] == "Filesystem":
            continue
        if len(tokens) == 1:
            pending = tokens[0]
            continue
        if len(tokens) == 8 and pending is not None:
            tokens = [pending, *tokens]
        pending = None
        if len(tokens) != 9:
            continue
        name, rest = tokens[0], tokens[1:]
        try:
            record = QuotaUsage(name, kind, owner, _size(rest[0], KIB), _limit(_size(rest[1], KIB)),
                                _limit(_size(rest[2], KIB)), _count(rest[4]), _limit(_count(rest[5])),
                                _limit(_count(rest[6])), grace_seconds(rest[3], now), grace_seconds(rest[7], now))
        except ValueError:
            continue
        if name.endswith("_UUID"):
            targets.append({"target": name, "bytes_used": record.bytes_used, "bytes_hard": record.bytes_hard,
                            "inodes_used": record.inodes_used, "inodes_hard": record.inodes_hard})
        else:
            out.append(record)
    if targets and out:
        out[-1] = replace(out[-1], extra={"targets": targets})
    return out


# mmlsquota (IBM Storage Scale / GPFS) -----------------------------------------------------------
_MM_KIND = {"usr": "user", "grp": "group", "fileset": "fileset"}


def _mm_grace(tokens: list[str], now: float | None) -> float | None:
    """The grace column, possibly two words (`6 days`), possibly followed by Remarks."""
    if not tokens:
        return None
    if tokens[0].isdigit() and len(tokens) > 1:
        return grace_seconds(f"{tokens[0]} {tokens[1]}", now)
    return grace_seconds(tokens[0], now)


def parse_mmlsquota(text: str, owner: str = "", now: float | None = None) -> list[QuotaUsage]:
    """`mmlsquota [-u USER | -g GROUP | -j FILESET DEVICE] [--block-size auto]`: block and file limits split by `|`.
    KB columns are KiB; grace is `none`, `expired` or `N days`/`N hours`/`N minutes`."""
    out: list[QuotaUsage] = []
    for line in text.splitlines():
        if "|" not in line:
            continue
        block, _, files = line.partition("|")
        b, f = block.split(), files.split()
        if len(b) < 6 or b[1].lower() not in _MM_KIND or len(f) < 4:
            continue
        try:
            b_grace, f_grace = _mm_grace(b[6:], now), _mm_grace(f[4:], now)
            out.append(QuotaUsage(b[0], _MM_KIND[b[1].lower()], owner, _size(b[2], KIB), _limit(_size(b[3], KIB)),
                                  _limit(_size(b[4], KIB)), _count(f[0]), _limit(_count(f[1])), _limit(_count(f[2])),
                                  b_grace, f_grace, extra={"in_doubt_kib": _count(b[5])}))
        except ValueError:
            continue
    return out


# beegfs-ctl --getquota ----------------------------------------------------------------------------
def parse_beegfs(text: str, filesystem: str, kind: str = "user") -> list[QuotaUsage]:
    """`beegfs-ctl --getquota --uid|--gid ID`: `name| id|| used| hard|| used| hard` rows; no soft limits."""
    out: list[QuotaUsage] = []
    for line in text.splitlines():
        if "||" not in line:
            continue
        cells = [c.strip() for c in _CELLS.split(line)]
        cells = [c for c in cells if c != ""]
        if len(cells) != 6 or not cells[1].isdigit():
            continue
        name, _, used, hard, f_used, f_hard = cells
        try:
            hard_bytes = None if hard.lower() == "unlimited" else _limit(_size(hard.replace(" ", ""), 1))
            hard_files = None if f_hard.lower() == "unlimited" else _limit(_count(f_hard))
            out.append(QuotaUsage(filesystem, kind, name, _size(used.replace(" ", ""), 1), None, hard_bytes,
                                  _count(f_used), None, hard_files))
        except ValueError:
            continue
    return out
