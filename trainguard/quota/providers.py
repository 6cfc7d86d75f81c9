"""Quota providers: each answers, for one owner, the usage and limits its filesystem enforces.

Every command runs with a timeout; a tool that is missing, hangs, fails or prints nothing usable
raises QuotaError with what it said, which the check turns into that subject's UNKNOWN.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, ClassVar

from trainguard.core.text import linear
from trainguard.core.tools import run_tool
from trainguard.core.units import decimal, parse_size
from trainguard.quota.budget import BudgetWalker
from trainguard.quota.parsers import (
    QuotaUsage,
    parse_beegfs,
    parse_lfs,
    parse_mmlsquota,
    parse_quota,
)

# Each tool's own flag per owner kind: quota-tools' `-p` means raw grace times (its project flag is `-P`), lfs takes
# `-p` for a project id, mmlsquota `-j` for a fileset; BeeGFS 7 has user and group quotas only.
QUOTA_FLAGS = {"user": "-u", "group": "-g", "project": "-P"}
LFS_FLAGS = {"user": "-u", "group": "-g", "project": "-p"}
MMLSQUOTA_FLAGS = {"user": "-u", "group": "-g", "fileset": "-j"}
BEEGFS_FLAGS = {"user": "--uid", "group": "--gid"}


class QuotaError(Exception):
    """The provider could not say; the message names the command and its error."""


def run_quota_tool(argv: Sequence[str], timeout: float, ok_codes: tuple[int, ...] | None = (0,),
                   with_stderr: bool = False) -> str:
    # The C locale: the tools translate headers and grace units ("6Tage") and localise decimal separators.
    return run_tool(argv, timeout, QuotaError, ok_codes=ok_codes, env={**os.environ, "LC_ALL": "C"},
                    with_stderr=with_stderr)


def _nonempty(records: list[QuotaUsage], argv: Sequence[str], output: str) -> list[QuotaUsage]:
    if not records:
        first = output.strip().splitlines()[:1]
        raise QuotaError(f"{' '.join(argv)}: no quota lines in its output" + (f" (it said {first[0][:120]!r})"
                                                                              if first else ""))
    return records


class Provider:
    kinds: ClassVar[tuple[str, ...]] = ("user", "group")

    def __init__(self, settings: Any) -> None:
        self.settings = settings

    def query(self, kind: str, owner: str) -> list[QuotaUsage]:
        raise NotImplementedError


class QuotaToolProvider(Provider):
    """Linux quota tools: local ext4/XFS quotas, and NFS through rquotad."""

    kinds = ("user", "group", "project")

    def query(self, kind: str, owner: str) -> list[QuotaUsage]:
        argv = ["quota", "-w", "-p", "-v", QUOTA_FLAGS[kind], owner]  # -p: grace as the epoch second it ends
        out = run_quota_tool(argv, self.settings.command_timeout, ok_codes=(0, 1))  # 1: a limit is exceeded
        records = _nonempty(parse_quota(out), argv, out)
        # The header names the kind it reports (LC_ALL=C keeps it English): a wrong flag shows up here, not as
        # another owner's figures under this owner's name.
        wrong = [r.kind for r in records if r.kind != kind]
        if wrong:
            raise QuotaError(f"{' '.join(argv)}: asked for {kind} {owner}, it reported {wrong[0]} quotas")
        records = [replace(r, owner=owner) for r in records]
        mounts = self.settings.mounts
        wanted = [r for r in records if not mounts or r.filesystem in mounts]
        if not wanted:
            raise QuotaError(f"{' '.join(argv)}: no quota on {', '.join(mounts)} "
                             f"(it reports {', '.join(r.filesystem for r in records)})")
        return wanted


class LustreProvider(Provider):
    kinds = ("user", "group", "project")

    def query(self, kind: str, owner: str) -> list[QuotaUsage]:
        out_all = []
        for mount in self.settings.mounts:
            for pool in ["", *self.settings.pools]:
                argv = ["lfs", "quota", *(["-v"] if self.settings.breakdown else []),
                        *(["--pool", pool] if pool else []), LFS_FLAGS[kind], owner, mount]
                # lfs exits non-zero when a target did not answer, yet prints the figures it has (and says which
                # target failed on stderr): those are read, and the failure reported beside them.
                out = run_quota_tool(argv, self.settings.command_timeout, ok_codes=None, with_stderr=True)
                records = _nonempty(parse_lfs(out), argv, out)
                out_all.extend(replace(r, kind=kind, owner=owner, scope=f"pool:{pool}" if pool else r.scope)
                               for r in records)
        return out_all


class GpfsProvider(Provider):
    kinds = ("user", "group", "fileset")

    def query(self, kind: str, owner: str) -> list[QuotaUsage]:
        if kind == "fileset":
            out_all = []
            for device in self.settings.mounts:
                argv = ["mmlsquota", MMLSQUOTA_FLAGS[kind], owner, device]
                out = run_quota_tool(argv, self.settings.command_timeout)
                out_all.extend(_nonempty(parse_mmlsquota(out, owner), argv, out))
            return out_all
        argv = ["mmlsquota", MMLSQUOTA_FLAGS[kind], owner, *self.settings.mounts]
        out = run_quota_tool(argv, self.settings.command_timeout)
        return _nonempty(parse_mmlsquota(out, owner), argv, out)


class BeegfsProvider(Provider):
    def query(self, kind: str, owner: str) -> list[QuotaUsage]:
        out_all = []
        for mount in self.settings.mounts or [""]:
            argv = ["beegfs-ctl", "--getquota", BEEGFS_FLAGS[kind], owner,
                    *([f"--mount={mount}"] if mount else [])]
            out = run_quota_tool(argv, self.settings.command_timeout)
            out_all.extend(_nonempty(parse_beegfs(out, mount or "beegfs", kind), argv, out))
        return out_all


_NUMBER = linear(r"\s*[\d.]+\s*")
_FIELDS = ("bytes_used", "bytes_soft", "bytes_hard", "inodes_used", "inodes_soft", "inodes_hard")


def _pointer(doc: Any, pointer: str) -> Any:
    """RFC 6901 JSON pointer."""
    if pointer in ("", "/"):
        return doc
    for raw in pointer.lstrip("/").split("/"):
        part = raw.replace("~1", "/").replace("~0", "~")
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


class CommandProvider(Provider):
    """A site's own tool: `command` with {owner} {kind} {mount}, each field found by a regex group or a JSON pointer."""

    kinds = ("user", "group", "project", "fileset")

    def _number(self, field: str, value: Any) -> int | None:
        if value is None or (isinstance(value, str) and value.strip() in ("", "-", "none", "unlimited")):
            return None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if isinstance(value, float) or abs(value) < 2**63 else math.inf
        elif _NUMBER.fullmatch(str(value)):
            try:
                number = decimal(str(value).strip())
            except ValueError:
                raise QuotaError(f"field {field}: {str(value)[:40]!r} is not a number") from None
        elif field.startswith("bytes"):
            try:
                return parse_size(str(value).strip())
            except ValueError as exc:
                raise QuotaError(f"field {field}: {exc}") from None
        else:
            raise QuotaError(f"field {field}: {str(value)[:40]!r} is not a number")
        if not math.isfinite(number) or number < 0:
            raise QuotaError(f"field {field}: {str(value)[:40]!r} is not a usable number")
        value = round(number * (self.settings.size_unit if field.startswith("bytes") else 1))
        return value if value or field.endswith("_used") else None  # a limit of 0 means none

    def query(self, kind: str, owner: str) -> list[QuotaUsage]:
        s = self.settings
        argv = [a.format(owner=owner, kind=kind, mount=(s.mounts or [""])[0]) for a in s.command]
        out = run_quota_tool(argv, s.command_timeout)
        values: dict[str, Any] = {}
        if s.format == "json":
            try:
                doc = json.loads(out)
            except ValueError as exc:
                raise QuotaError(f"{' '.join(argv)} printed invalid JSON: {exc}") from None
            for name, pointer in s.fields.items():
                try:
                    values[name] = _pointer(doc, pointer)
                except (KeyError, IndexError, ValueError, TypeError):
                    raise QuotaError(f"{' '.join(argv)}: JSON pointer {pointer!r} ({name}) not found") from None
        else:
            for name, pattern in s.fields.items():
                m = linear("(?m)" + pattern).search(out)
                if m is None:
                    raise QuotaError(f"{' '.join(argv)}: regex for {name} ({pattern!r}) matched nothing")
                values[name] = m.group(1) if m.groups() else m.group(0)
        numbers = {name: self._number(name, values.get(name)) for name in _FIELDS}
        return [QuotaUsage((s.mounts or [s.command[0]])[0], kind, owner, **numbers)]


class BudgetProvider(Provider):
    """A directory with a byte and inode budget, measured incrementally by walking it."""

    kinds = ("dir",)

    def __init__(self, settings: Any) -> None:
        super().__init__(settings)
        self.walkers = {path: BudgetWalker(path) for path in settings.mounts}

    def query(self, kind: str, owner: str) -> list[QuotaUsage]:
        walker = self.walkers[owner]
        m = walker.advance(self.settings.walk_budget)
        return [QuotaUsage(owner, "dir", owner, m.bytes, None, self.settings.bytes_budget, m.inodes, None,
                           self.settings.inodes_budget, measured_at=m.measured_at,
                           extra={"complete": m.complete, "walks": m.walks, "errors": m.errors})]
