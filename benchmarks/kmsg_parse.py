"""Kernel log parse rate: how many /dev/kmsg records a second the XID path (record parser + XID parser) handles,
and a read of the whole kernel ring buffer next to `dmesg --raw | grep -c Xid`.

In process: synthetic records in the /dev/kmsg wire format, 1% of them XID lines of the three formats the driver
writes, then all of them XIDs. Live: the real /dev/kmsg, as `trainguard check` reads it once (needs root to read
it where kernel.dmesg_restrict=1).

    python -m benchmarks.kmsg_parse --records 200000
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from benchmarks.common import heading
from trainguard.gpu.xid import XidParser
from trainguard.node.kmsg import KernelRecord, KmsgFollower, parse_kmsg

XIDS = [
    "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
    "NVRM: Xid (PCI:0000:18:00): 31, pid=4242, name=python, Ch 00000010, intr 10000000. MMU Fault: ENGINE GRAPHICS",
    "NVRM: Xid (PCI:0000:86:00): 94, pid=1234, name=python, Contained: SM (0x1). RST: No, D-RST: No",
]
OTHER = "EXT4-fs (nvme0n1p1): mounted filesystem with ordered data mode. Quota mode: none."


def records(n: int, xid_every: int) -> list[bytes]:
    out = []
    for seq in range(n):
        msg = XIDS[seq % len(XIDS)] if seq % xid_every == 0 else OTHER
        out.append(f"4,{seq},{seq * 1000},-;{msg}\n".encode())
    return out


def rate(raws: list[bytes]) -> tuple[float, int]:
    parser = XidParser()
    found = 0
    start = time.perf_counter()
    for raw in raws:
        record = parse_kmsg(raw)
        if record is not None and parser.feed(record.message) is not None:
            found += 1
    return len(raws) / (time.perf_counter() - start), found


def live() -> tuple[float, int, float, int]:
    """(seconds, records) for trainguard reading the whole ring buffer, and the same for dmesg | grep."""
    parser = XidParser()
    hits = [0]

    def on_record(record: KernelRecord) -> None:
        if parser.feed(record.message) is not None:
            hits[0] += 1

    follower = KmsgFollower(on_record)
    start = time.perf_counter()
    count = follower.read_once()
    ours = time.perf_counter() - start
    start = time.perf_counter()
    grep = subprocess.run("dmesg --raw | grep -c Xid", shell=True, capture_output=True, text=True, timeout=120)
    theirs = time.perf_counter() - start
    return ours, count, theirs, int(grep.stdout.strip() or 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200_000)
    args = parser.parse_args()
    mixed, mixed_found = rate(records(args.records, 100))
    flood, flood_found = rate(records(args.records, 1))
    print(heading(f"Kernel log parsing, {args.records} records"))
    print("| records | parse rate | XIDs found |")
    print("|---|---|---|")
    print(f"| 1% XID lines | {mixed / 1000:.0f} k records/s | {mixed_found} |")
    print(f"| all XID lines (a flood) | {flood / 1000:.0f} k records/s | {flood_found} |")
    ours, count, theirs, grep_count = live()
    print(f"\n| the whole ring buffer of this node ({count} records) | time |")
    print("|---|---|")
    print(f"| trainguard: read /dev/kmsg, parse every record and its XIDs | {ours * 1000:.0f} ms |")
    print(f"| `dmesg --raw \\| grep -c Xid` ({grep_count} lines) | {theirs * 1000:.0f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
