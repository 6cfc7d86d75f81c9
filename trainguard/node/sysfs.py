"""Devices as sysfs lists them: PCI functions (`/sys/bus/pci/devices`: is an NVSwitch here?) and InfiniBand/RoCE
ports (`/sys/class/infiniband`). Roots are parameters, as node_exporter's `--path.sysfs`, so tests and sites can
point them at another tree. Every read is small and bounded; a file that vanished or holds garbage is absent, never
an exception: devices come and go (driver reload, hot plug) while they are read."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from trainguard.core.text import linear

_MAX_READ = 4096


def read_small(path: str | Path) -> str | None:
    """A sysfs attribute's text (first 4 KiB), stripped; None when it can't be read. One open and one read: a port
    is a dozen attributes and a node has ten ports, so this is the whole cost of the infiniband check."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return os.read(fd, _MAX_READ).decode("utf-8", "replace").strip()
    except OSError:
        return None
    finally:
        os.close(fd)


def _entries(root: str | Path) -> list[str]:
    try:
        return sorted(e.name for e in os.scandir(root))
    except OSError:
        return []


def _int(text: str | None, base: int = 10) -> int | None:
    if text is None:
        return None
    try:
        return int(text, base)
    except ValueError:
        return None


# PCI -------------------------------------------------------------------------------------------------------------
NVIDIA = 0x10DE
BRIDGE_OTHER = 0x0680  # PCI class 06 (bridge), subclass 80 (other): what an NVSwitch reports (`lspci -nn`: [0680])


@dataclass(frozen=True)
class PciDevice:
    address: str  # 0000:86:00.0
    vendor: int
    device: int
    pci_class: int  # 24 bits: class, subclass, programming interface

    @property
    def is_nvswitch(self) -> bool:
        return self.vendor == NVIDIA and self.pci_class >> 8 == BRIDGE_OTHER


def pci_devices(root: str | Path) -> list[PciDevice]:
    out = []
    for name in _entries(root):
        base = os.path.join(root, name)
        vendor, klass = _int(read_small(os.path.join(base, "vendor")), 16), _int(read_small(os.path.join(base, "class")), 16)
        if vendor is None or klass is None:
            continue
        out.append(PciDevice(name, vendor, _int(read_small(os.path.join(base, "device")), 16) or 0, klass))
    return out


# InfiniBand ------------------------------------------------------------------------------------------------------
_STATE = linear(r"^(\d+)\s*:\s*(\S+)")
_RATE = linear(r"^(\d+(?:\.\d+)?)\s*Gb/sec(?:\s*\(([^)]*)\))?")


@dataclass(frozen=True)
class IbPort:
    device: str  # mlx5_0
    port: int
    state: str  # ACTIVE, DOWN, INIT, ARMED; "" unreadable
    phys_state: str  # LinkUp, Polling, Disabled, ...
    rate_gbps: float | None  # 400.0 from "400 Gb/sec (4X NDR)"
    rate_text: str
    link_layer: str  # InfiniBand | Ethernet (RoCE)
    counters: dict[str, int] = field(default_factory=dict)
    hca_type: str = ""
    fw_ver: str = ""
    node_guid: str = ""  # the HCA's identity (the node ledger's): a swapped card is a new one in the same slot

    @property
    def key(self) -> str:
        return f"{self.device}/{self.port}"

    @property
    def up(self) -> bool:
        return self.state == "ACTIVE" and self.phys_state == "LinkUp"


def parse_state(text: str | None) -> str:
    """`4: ACTIVE` -> ACTIVE; `5: LinkUp` -> LinkUp."""
    m = _STATE.match(text or "")
    return m.group(2) if m else (text or "").strip()


def parse_rate(text: str | None) -> float | None:
    m = _RATE.match(text or "")
    return float(m.group(1)) if m else None


def infiniband_ports(root: str | Path, counters: Iterable[str] = ()) -> list[IbPort]:
    """Every port of every HCA under `root`, with the named counters that can be read."""
    wanted = tuple(counters)
    out = []
    join = os.path.join  # plain strings: pathlib's joins cost more than the reads themselves
    for device in _entries(root):
        base = join(root, device)
        hca, fw = read_small(join(base, "hca_type")) or "", read_small(join(base, "fw_ver")) or ""
        guid = read_small(join(base, "node_guid")) or ""
        for port in _entries(join(base, "ports")):
            number = _int(port)
            if number is None:
                continue
            p = join(base, "ports", port)
            values = {}
            for name in wanted:
                value = _int(read_small(join(p, "counters", name)))
                if value is not None and value >= 0:
                    values[name] = value
            rate = read_small(join(p, "rate")) or ""
            out.append(IbPort(device, number, parse_state(read_small(join(p, "state"))),
                              parse_state(read_small(join(p, "phys_state"))), parse_rate(rate), rate,
                              read_small(join(p, "link_layer")) or "", values, hca, fw, guid))
    return out
