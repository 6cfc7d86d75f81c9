"""Parsers for the output of the quota tools sites run: `quota`, `lfs quota`, `mmlsquota`, `beegfs-ctl --getquota`.

Built on what clusters really print (tests/data/quota/README.md cites each capture), across the tools' versions; the
variant is recognised from the output itself (a unit header, a Fileset column, a bare or `_UUID` target name, a
pool line), never from a version flag. Each returns QuotaUsage records; a line that has none of the known shapes is
skipped (and the caller reports "no quota lines" when nothing parsed), never guessed at, and nothing raises: the
output carries user-controlled names. Limits of 0 mean unlimited in every one of these tools and are stored as None.
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
    # Part of the subject: `pool:NAME` (a Lustre OST pool, a BeeGFS storage pool) or `fileset:NAME` (GPFS per-fileset
    # quotas); "" for the whole filesystem. Two pools' figures are two quotas, with their own forecasts.
    scope: str = ""
    inaccurate: tuple[str, ...] = ()  # fields the tool marked as not to be trusted (Lustre's `[n]`)
    problems: tuple[str, ...] = ()  # what the tool said went wrong while the figures were gathered (a target down)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)


class QuotaParseError(ValueError):
    """The tool's output has no line of the expected shape."""


# numbers -----------------------------------------------------------------------------------
def _strip(token: str) -> tuple[str, bool]:
    """A value without the `*` some tools append when a limit is exceeded."""
    return token.rstrip("*"), token.endswith("*")


def _bracketed(token: str) -> tuple[str, bool]:
    """Lustre prints a value it could not gather from every target in brackets (`[1041408]`, `[0]`): the value
    inside, and whether it was bracketed."""
    value = token.strip()
    if value.startswith("[") and "]" in value:
        inner, _, after = value[1:].partition("]")
        return inner + after, True
    return value, False


def _size(token: str, unit: int) -> int | None:
    """`4194308` (in `unit` bytes) or human `4.001G` / `100M` / `10.00 GiB` / `0 Byte`; None for `-`."""
    value, _ = _strip(token.strip())
    if value in ("", "-"):
        return None
    if _DIGITS.fullmatch(value):
        return int(decimal(value)) * unit
    text = value.replace(",", ".").replace(" ", "")
    if text.lower().endswith(("byte", "bytes")):  # BeeGFS: `0 Byte`, `1 Byte`
        text = text[: text.lower().rindex("byte")] + "B"
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
    """Grace left: `6days`, `6d23h59m59s`, `23:59`, `6 days`, an epoch (`quota -p`); None when not in grace.
    `none` is "not in grace" here, as GPFS means it; quota-tools and Lustre also print it once the grace has run
    out, which only the row can tell (`_grace_over`)."""
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


def _grace_over(token: str, over: bool, now: float | None) -> float | None:
    """quota-tools without `-p` and Lustre up to 2.15 print `none` in the grace column of a row over its soft
    limit once the grace has run out (Lustre 2.16 prints `expired`): then writes already fail."""
    if token.strip().lower() == "none":
        return 0.0 if over else None
    return grace_seconds(token, now)


def _over(used: int | None, soft: int | None, marked: bool) -> bool:
    return marked or (used is not None and soft is not None and used > soft)


# quota (Linux quota tools) -------------------------------------------------------------------
_QUOTA_HEAD = linear(r"^Disk quotas for (user|group|project) (\S+)(?: \((?:uid|gid|pid|project) (\d+)\))?:?",
                     ignore_case=True)


def _is_device(token: str) -> bool:
    return token.startswith("/") or ":/" in token


def parse_quota(text: str, now: float | None = None) -> list[QuotaUsage]:
    """`quota -w [-p] [-s] -u|-g|-P NAME`: one line per filesystem (a long name may sit alone on its line, the
    numbers on the next: `quota` without `-w`, as users paste it), grace columns only when over a soft limit
    (always with -p), human sizes with -s. Block counts are KiB. `kind` comes from the header."""
    out: list[QuotaUsage] = []
    kind, owner, pending = "user", "", None
    for line in text.splitlines():
        head = _QUOTA_HEAD.match(line.strip())
        if head:
            kind, owner, pending = head.group(1).lower(), head.group(2), None
            continue
        tokens = line.split()
        if len(tokens) == 1 and _is_device(tokens[0]):
            pending = tokens[0]
            continue
        if pending is not None and tokens and not _is_device(tokens[0]):
            tokens = [pending, *tokens]
        pending = None
        if len(tokens) < 7 or not _is_device(tokens[0]):
            continue
        try:
            out.append(_quota_row(tokens[0], tokens[1:], kind, owner, now))
        except (ValueError, IndexError):
            continue
    return out


def _quota_row(fs: str, rest: list[str], kind: str, owner: str, now: float | None) -> QuotaUsage:
    """used soft hard [grace] files soft hard [grace]: 6 to 8 tokens. With 7, the block grace is there when the
    4th token is not a file count (a grace is `6days`, `23:59`, `none`; an epoch only comes with -p, which prints
    both graces, so 8 tokens)."""
    if len(rest) not in (6, 7, 8):
        raise ValueError("not a quota row")
    b_used, b_marked = _strip(rest[0])
    has_b_grace = len(rest) == 8 or (len(rest) == 7 and _COUNT.fullmatch(_strip(rest[3])[0]) is None)
    idx = 4 if has_b_grace else 3
    f_used, f_marked = _strip(rest[idx])
    used, soft, hard = _size(b_used, KIB), _limit(_size(rest[1], KIB)), _limit(_size(rest[2], KIB))
    files, f_soft, f_hard = _count(f_used), _limit(_count(rest[idx + 1])), _limit(_count(rest[idx + 2]))
    b_grace = _grace_over(rest[3], _over(used, soft, b_marked), now) if has_b_grace else None
    f_grace = _grace_over(rest[idx + 3], _over(files, f_soft, f_marked), now) if len(rest) > idx + 3 else None
    return QuotaUsage(fs, kind, owner, used, soft, hard, files, f_soft, f_hard, b_grace, f_grace)


# lfs quota (Lustre) ---------------------------------------------------------------------------
_LFS_HEAD = linear(r"^Disk quotas for (usr|grp|prj|user|group|project) (\S+)", ignore_case=True)
_LFS_KIND = {"usr": "user", "grp": "group", "prj": "project"}
# An MDT or OST: `tfs1-OST0003` (Lustre 2.16+) or `tfs1-OST0003_UUID` (up to 2.15); the index is hex.
_LFS_TARGET = linear(r"[^\s/]+-(?:MDT|OST)[0-9A-Fa-f]{4}(?:_UUID)?")
_LFS_POOL = linear(r"^Quotas for pool:\s*(\S+)", ignore_case=True)
_LFS_FAILED = linear(r"^(?:\S+\s+)?quotactl (\S+) failed", ignore_case=True)
_LFS_ERRORS = "some errors happened when getting quota info"
_LFS_FIELDS = ("bytes_used", "bytes_soft", "bytes_hard", "bytes_grace", "inodes_used", "inodes_soft", "inodes_hard",
               "inodes_grace")


@dataclass
class _LfsBlock:
    """One `Disk quotas for ...` block: the filesystem total, its targets and what went wrong, in print order."""

    kind: str
    owner: str
    pool: str = ""
    total: QuotaUsage | None = None
    targets: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def record(self) -> QuotaUsage | None:
        if self.total is None:
            return None
        extra = {**self.total.extra, **({"targets": self.targets} if self.targets else {})}
        return replace(self.total, scope=f"pool:{self.pool}" if self.pool else "",
                       problems=(*self.total.problems, *self.problems), extra=extra)


def _lfs_row(name: str, rest: list[str], kind: str, owner: str, now: float | None) -> QuotaUsage:
    values, flagged = [], []
    for field_name, token in zip(_LFS_FIELDS, rest, strict=True):
        value, inaccurate = _bracketed(token)
        values.append(value)
        if inaccurate:
            flagged.append(field_name)
    b_used, b_marked = _strip(values[0])
    f_used, f_marked = _strip(values[4])
    used, soft, hard = _size(b_used, KIB), _limit(_size(values[1], KIB)), _limit(_size(values[2], KIB))
    files, f_soft, f_hard = _count(f_used), _limit(_count(values[5])), _limit(_count(values[6]))
    return QuotaUsage(name, kind, owner, used, soft, hard, files, f_soft, f_hard,
                      _grace_over(values[3], _over(used, soft, b_marked), now),
                      _grace_over(values[7], _over(files, f_soft, f_marked), now), inaccurate=tuple(flagged))


def parse_lfs(text: str, now: float | None = None) -> list[QuotaUsage]:
    """`lfs quota [-h] [-v] [--pool P] -u|-g|-p ID MOUNT...`: per block, the filesystem total and with -v one line
    per MDT/OST, attached to its own block. Sizes are KiB (or human with -h); a name longer than 15 characters sits
    alone on its line and the numbers follow. `[n]` values are kept and flagged as inaccurate; `quotactl ost0
    failed.` and the "Some errors happened" footer become that block's problems."""
    blocks: list[_LfsBlock] = []
    kind, owner, pending, pool_ahead = "user", "", None, ""
    for line in text.splitlines():
        stripped = line.strip()
        head = _LFS_HEAD.match(stripped)
        if head:
            kind, owner = _LFS_KIND.get(head.group(1).lower(), head.group(1).lower()), head.group(2)
            blocks.append(_LfsBlock(kind, owner, pool_ahead))
            pending, pool_ahead = None, ""
            continue
        pool = _LFS_POOL.match(stripped)
        if pool:
            if blocks and blocks[-1].total is None:
                blocks[-1].pool = pool.group(1)
            else:  # printed ahead of its block's header
                pool_ahead = pool.group(1)
            continue
        failed = _LFS_FAILED.match(stripped)
        if failed and blocks:
            blocks[-1].problems.append(f"{failed.group(1)} did not answer (lfs: quotactl {failed.group(1)} failed)")
            continue
        if stripped.lower().startswith(_LFS_ERRORS) and blocks:
            blocks[-1].problems.append("lfs: some targets did not answer or are deactivated; bracketed figures "
                                       "are inaccurate")
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
        if not blocks:  # `lfs quota -q`: no header
            blocks.append(_LfsBlock(kind, owner))
        block = blocks[-1]
        try:
            record = _lfs_row(tokens[0], tokens[1:], block.kind, block.owner, now)
        except ValueError:
            continue
        if _LFS_TARGET.fullmatch(tokens[0]):
            block.targets.append({"target": tokens[0], "bytes_used": record.bytes_used,
                                  "bytes_hard": record.bytes_hard, "inodes_used": record.inodes_used,
                                  "inodes_hard": record.inodes_hard, "inaccurate": list(record.inaccurate)})
            if record.inaccurate:
                block.problems.append(f"{tokens[0]} did not answer: its figures are inaccurate")
        elif block.total is None:
            block.total = record
    return [r for r in (b.record() for b in blocks) if r is not None]


# mmlsquota (IBM Storage Scale / GPFS) -----------------------------------------------------------
_MM_KIND = {"usr": "user", "grp": "group", "fileset": "fileset"}
_MM_UNITS = {"kb": KIB, "mb": KIB**2, "gb": KIB**3, "tb": KIB**4, "pb": KIB**5}
_MM_HEAD = linear(r"^Disk quotas for (user|group|fileset) (\S+)", ignore_case=True)


def _mm_grace(tokens: list[str], now: float | None) -> float | None:
    """The grace column, possibly two words (`6 days`), possibly followed by Remarks."""
    if not tokens:
        return None
    if tokens[0].isdigit() and len(tokens) > 1:
        return grace_seconds(f"{tokens[0]} {tokens[1]}", now)
    return grace_seconds(tokens[0], now)


def _mm_unit(header: list[str]) -> int:
    """The block column's unit from the header: `KB`/`MB`/`GB`/`TB` (--block-size K|M|G|T, binary), or `blocks`
    (--block-size auto: each value carries its own suffix; a bare number there is KiB, GPFS's own unit)."""
    for name in header:
        if name.lower() in _MM_UNITS:
            return _MM_UNITS[name.lower()]
    return KIB


def parse_mmlsquota(text: str, owner: str = "", now: float | None = None) -> list[QuotaUsage]:
    """`mmlsquota [-u USER | -g GROUP | -j FILESET DEVICE] [--block-size K|M|G|T|auto]`: block and file limits split
    by `|`. With per-fileset quotas each row names its fileset (`Filesystem Fileset type ...`), which becomes part of
    the subject; the unit comes from the header; `no limits` rows are quotas without limits."""
    out: list[QuotaUsage] = []
    unit = KIB
    for line in text.splitlines():
        words = line.split()
        head = _MM_HEAD.match(line.strip())
        if head:
            owner = head.group(2)
            continue
        if words[:1] == ["Filesystem"]:
            unit = _mm_unit(words)
            continue
        block, bar, files = line.partition("|")
        b, f = block.split(), files.split()
        at = 1 if len(b) > 1 and b[1].lower() in _MM_KIND else 2 if len(b) > 2 and b[2].lower() in _MM_KIND else 0
        if not at:
            continue
        fs, kind = b[0], _MM_KIND[b[at].lower()]
        scope = f"fileset:{b[1]}" if at == 2 else ""
        if not bar:
            if [w.lower() for w in b[at + 1:at + 3]] == ["no", "limits"]:
                out.append(QuotaUsage(fs, kind, owner, scope=scope, extra={"no_limits": True}))
            continue  # a placeholder row (`USR none`) says nothing
        if len(b) < at + 5 or len(f) < 4:
            continue
        try:
            out.append(QuotaUsage(
                fs, kind, owner, _size(b[at + 1], unit), _limit(_size(b[at + 2], unit)), _limit(_size(b[at + 3], unit)),
                _count(f[0]), _limit(_count(f[1])), _limit(_count(f[2])), _mm_grace(b[at + 5:], now),
                _mm_grace(f[4:], now), scope=scope, extra={"in_doubt_bytes": _size(b[at + 4], unit),
                                                           "in_doubt_inodes": _count(f[3])}))
        except ValueError:
            continue
    return out


# beegfs-ctl --getquota ----------------------------------------------------------------------------
_BEEGFS_POOL = linear(r"^Quota information for storage pool (.+?) \(ID: (\d+)\):?", ignore_case=True)


def _beegfs_row(cells: list[str], filesystem: str, kind: str, pool: str) -> QuotaUsage:
    name, _, used, hard, f_used, f_hard = cells
    hard_bytes = None if hard.lower() == "unlimited" else _limit(_size(hard, 1))
    hard_files = None if f_hard.lower() == "unlimited" else _limit(_count(f_hard))
    return QuotaUsage(filesystem, kind, name, _size(used, 1), None, hard_bytes, _count(f_used), None, hard_files,
                      scope=f"pool:{pool}" if pool else "")


def parse_beegfs(text: str, filesystem: str, kind: str = "user") -> list[QuotaUsage]:
    """`beegfs-ctl --getquota --uid|--gid ID [--csv]`: per storage pool (`Quota information for storage pool NAME
    (ID: N):`), `name| id|| used| hard|| used| hard` rows (or the CSV form); no soft limits. Sizes are `95.00 GiB`,
    `0 Byte`, or bytes in CSV."""
    out: list[QuotaUsage] = []
    pool = ""
    for line in text.splitlines():
        head = _BEEGFS_POOL.match(line.strip())
        if head:
            pool = head.group(1)
            continue
        if "||" in line:
            cells = [c.strip() for c in _CELLS.split(line)]
        elif line.count(",") == 5:
            cells = [c.strip() for c in line.split(",")]
        else:
            continue
        cells = [c for c in cells if c != ""]
        if len(cells) != 6 or not cells[1].isdigit():
            continue
        try:
            out.append(_beegfs_row(cells, filesystem, kind, pool))
        except ValueError:
            continue
    return out
