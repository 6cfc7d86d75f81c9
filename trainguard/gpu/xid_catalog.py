"""NVIDIA's XID catalog and trainguard's response to each code, as package data.

`nvidia_xid_catalog.tsv` and `nvidia_xid_nvlink5_decode.tsv` are NVIDIA's tables verbatim; `xid_policy.toml` maps
each immediate-resolution bucket to a response and lists, with the reason, every code where trainguard differs.
Everything here is read once and cached; `describe()` never raises.
"""

from __future__ import annotations

import csv
import io
import sys
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from trainguard.core.model import Status
from trainguard.core.text import linear

CATALOG_FILE = "nvidia_xid_catalog.tsv"
NVLINK5_FILE = "nvidia_xid_nvlink5_decode.tsv"
POLICY_FILE = "xid_policy.toml"
NVLINK5_XIDS = range(144, 151)


@dataclass(frozen=True)
class Response:
    """What trainguard does about an XID: its status, whether it lasts until reboot, and the alert's advice."""

    name: str
    status: Status
    sticky: bool
    todo: str


@dataclass(frozen=True)
class XidInfo:
    xid: int
    mnemonic: str  # NVIDIA's, verbatim
    description: str
    immediate: str  # NVIDIA's immediate resolution bucket ("" where the catalog gives none)
    investigatory: str
    response: str  # trainguard's response (a key of Policy.responses)
    why: str = ""  # why trainguard reads the bucket this way, or differs from it; "" when it simply follows it
    known: bool = True

    @property
    def name(self) -> str:
        """The mnemonic as a person reads it: NVIDIA lists alternatives separated by ' / '."""
        return self.mnemonic.split(" /")[0].strip() or self.mnemonic


@dataclass(frozen=True)
class Policy:
    responses: dict[str, Response]
    buckets: dict[str, tuple[str, str]]  # bucket -> (response, why)
    overrides: dict[int, tuple[str, str]]  # xid -> (response, why)
    nvlink5: dict[str, tuple[str, str]]  # decode resolution (or undecoded_fatal / _nonfatal) -> (response, why)


def _read(name: str) -> str:
    return resources.files("trainguard.gpu").joinpath(name).read_text(encoding="utf-8")


def _rows(name: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(_read(name)), delimiter="\t"))


def _pair(table: dict[str, Any]) -> tuple[str, str]:
    return str(table["response"]), " ".join(str(table.get("why", "")).split())


@cache
def policy() -> Policy:
    raw = tomllib.loads(_read(POLICY_FILE))
    responses = {name: Response(name, Status.parse(t["status"]), bool(t.get("sticky", False)), str(t["todo"]))
                 for name, t in raw["responses"].items()}
    return Policy(responses, {b: _pair(t) for b, t in raw["buckets"].items()},
                  {int(x): _pair(t) for x, t in raw["xid"].items()}, {k: _pair(t) for k, t in raw["nvlink5"].items()})


@cache
def catalog() -> dict[int, XidInfo]:
    """All of NVIDIA's codes, each with trainguard's response: a per-code override, else its bucket's."""
    p = policy()
    out = {}
    for row in _rows(CATALOG_FILE):
        xid, immediate = int(row["xid"]), row["immediate_resolution"].strip()
        response, why = p.overrides.get(xid) or p.buckets.get(immediate) or ("investigate", "")
        out[xid] = XidInfo(xid, row["mnemonic"].strip(), row["description"].strip(), immediate,
                           row["investigatory_resolution"].strip(), response, why)
    return out


def describe(xid: int) -> XidInfo:
    known = catalog().get(xid)
    if known is not None:
        return known
    return XidInfo(xid, "UNKNOWN_XID", "not in NVIDIA's catalog", "", "", "investigate",
                   "a code newer than the catalog trainguard ships", known=False)


# NVLink5 (XIDs 144-150) ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NvlinkRule:
    xid: int
    unit: str
    patterns: tuple[tuple[int, int], ...]  # (mask, value) of the v1 and v2 intrinfo patterns
    error_status: int
    resolution: str  # RESET_GPU | IGNORE | XID_154_EVAL
    investigatory: str
    severity: str

    def matches(self, intrinfo: int) -> bool:
        return any(intrinfo & mask == value for mask, value in self.patterns)


def _pattern(text: str) -> tuple[int, int]:
    """`------000000----------0000100001`, most significant bit first, `-` any: as (mask, value)."""
    mask = value = 0
    for i, ch in enumerate(text.strip()[:32]):
        if ch in "01":
            bit = 1 << (31 - i)
            mask |= bit
            value |= bit if ch == "1" else 0
    return mask, value


@cache
def nvlink5_rules() -> dict[int, tuple[NvlinkRule, ...]]:
    rules: dict[int, list[NvlinkRule]] = {}
    for row in _rows(NVLINK5_FILE):
        rule = NvlinkRule(int(row["xid"]), row["unit"].strip(),
                          (_pattern(row["intrinfo_pattern_v1"]), _pattern(row["intrinfo_pattern_v2"])),
                          int(row["error_status"], 16), row["resolution"].strip(), row["investigatory"].strip(),
                          row["severity"].strip())
        rules.setdefault(rule.xid, []).append(rule)
    return {xid: tuple(r) for xid, r in rules.items()}


@dataclass(frozen=True)
class Nvlink5Event:
    """An XID 144-150 message: `SAW_MVB Nonfatal XC0 i0 Link 0 (0x00000001 0x00000008 0x00000000 ...)`."""

    unit: str
    fatal: bool | None  # the driver's own Fatal / Nonfatal word; None when absent
    link: int | None
    intrinfo: int | None
    error_status: int | None


_HEX = linear(r"0x[0-9a-fA-F]{1,8}")


def parse_nvlink5(text: str) -> Nvlink5Event:
    """Split on whitespace and parentheses, never backtracking: the words before `(`, the registers inside it."""
    head, _, tail = text.partition("(")
    words = head.replace(",", " ").split()
    fatal = None
    for word in words[1:4]:
        low = word.lower()
        if low in ("fatal", "nonfatal", "non-fatal"):
            fatal = low == "fatal"
            break
    link = None
    if "Link" in words:
        after = words[words.index("Link") + 1:words.index("Link") + 2]
        link = int(after[0]) if after and after[0].lstrip("-").isdigit() else None
    registers = [int(t, 16) for t in tail.partition(")")[0].split() if _HEX.fullmatch(t)]
    return Nvlink5Event(words[0] if words else "", fatal, link, registers[0] if registers else None,
                        registers[1] if len(registers) > 1 else None)


_RESOLUTION_RANK = {"IGNORE": 0, "XID_154_EVAL": 1, "RESET_GPU": 2}


def decode_nvlink5(xid: int, event: Nvlink5Event) -> NvlinkRule | None:
    """The decode table row for this event: its intrinfo selects the unit, its error status the row; a status with
    several bits set takes the most severe of their rows. None when nothing matches (a newer driver's unit)."""
    if event.intrinfo is None or event.error_status is None:
        return None
    rows = [r for r in nvlink5_rules().get(xid, ()) if r.matches(event.intrinfo)]
    exact = [r for r in rows if r.error_status == event.error_status]
    chosen = exact or [r for r in rows if r.error_status and event.error_status & r.error_status == r.error_status]
    return max(chosen, key=lambda r: _RESOLUTION_RANK.get(r.resolution, 2), default=None)


def nvlink5_verdict(xid: int, text: str) -> tuple[str, NvlinkRule | None, Nvlink5Event]:
    """The key into the policy's nvlink5 table (a decode resolution, or undecoded_fatal / undecoded_nonfatal)."""
    event = parse_nvlink5(text)
    rule = decode_nvlink5(xid, event)
    if rule is not None and rule.resolution in policy().nvlink5:
        return rule.resolution, rule, event
    return ("undecoded_nonfatal" if event.fatal is False else "undecoded_fatal"), rule, event


# NVSwitch SXids -----------------------------------------------------------------------------------------------------
SXID_FILE = "sxid_catalog.toml"


@dataclass(frozen=True)
class SxidInfo:
    sxid: int
    name: str
    klass: str  # corrected | benign | non_fatal | stall | fatal | always_fatal
    response: Response
    known: bool = True


@cache
def sxid_catalog() -> tuple[dict[str, Response], dict[int, tuple[str, str]]]:
    """(class -> response, code -> (name, class)) from the small SXid table."""
    raw = tomllib.loads(_read(SXID_FILE))
    classes = {name: Response(name, Status.parse(t["status"]), bool(t.get("sticky", False)), str(t["todo"]))
               for name, t in raw["classes"].items()}
    return classes, {int(code): (str(t["name"]), str(t["class"])) for code, t in raw["sxid"].items()}


def describe_sxid(sxid: int, fatal: bool) -> SxidInfo:
    """A listed code by its class, at least `fatal` when the driver says Fatal; an unlisted one by the driver's word."""
    classes, codes = sxid_catalog()
    name, klass = codes.get(sxid, ("", "fatal" if fatal else "non_fatal"))
    if fatal and classes[klass].status.severity < Status.CRITICAL.severity:
        klass = "fatal"
    return SxidInfo(sxid, name or "not in the SXid table", klass, classes[klass], known=bool(name))
