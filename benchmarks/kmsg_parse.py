"""Kernel log parse rate: how many /dev/kmsg records a second the XID path (record parser + XID parser) handles,
the same with the kernel event catalog behind it (the one reader's full path), the CPU a storm of 100,000 kernel
event lines costs the kernel check (AER corrected on three devices; Lustre `Skipped N`), and a read of the whole
kernel ring buffer next to `dmesg --raw | grep -c Xid`.

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
from trainguard.node.kernel_events import KernelEventParser
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


def rate(raws: list[bytes], kernel_events: bool = False) -> tuple[float, int]:
    parser = XidParser()
    events = KernelEventParser()
    found = 0
    start = time.perf_counter()
    for raw in raws:
        record = parse_kmsg(raw)
        if record is None:
            continue
        if parser.feed(record.message) is not None:
            found += 1
        if kernel_events:
            events.feed(record.message, record.usec, record.seq)
    return len(raws) / (time.perf_counter() - start), found


def storm_cpu(lines: list[str]) -> tuple[float, int]:
    """CPU seconds the kernel check spends on these records (parser, grading, counting), and its results."""
    import tempfile
    from pathlib import Path

    from trainguard.checks.base import CheckContext
    from trainguard.checks.kernel import KernelCheck, KernelSettings
    from trainguard.gpu.faults import XidLedger
    from trainguard.node.kmsg import KernelLog

    with tempfile.TemporaryDirectory() as tmp:
        empty = Path(tmp) / "kmsg-copy"
        empty.write_text("")
        context = CheckContext("bench", Path(tmp), xid_history=XidLedger(None), kernel_log=KernelLog())
        check = KernelCheck("kernel", KernelSettings(kmsg_path=str(empty)), context)
        usec = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)
        start = time.process_time()
        for seq, line in enumerate(lines):
            check._on_record(KernelRecord(seq, 4, 0, usec, line))
        cpu = time.process_time() - start
        return cpu, len([r for r in check.run() if r.subject != "kernel-log"])


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
    both, _ = rate(records(args.records, 100), kernel_events=True)
    print(f"| 1% XID lines, with the kernel event catalog | {both / 1000:.0f} k records/s | |")
    aer = [f"pcieport 0000:{b}:00.0: AER: Corrected error received: 0000:{b}:00.0" for b in ("17", "3b", "86")]
    skipped = ["LNet: 2431:0:(o2iblnd_cb.c:3174:kiblnd_check_conns()) Timed out tx for 172.31.126.87@o2ib: 403055 "
               "seconds"] + ["LNet: 2431:0:(o2iblnd_cb.c:3174:kiblnd_check_conns()) Skipped 24 previous similar "
                             "messages"] * 99_999
    print("\n| a storm of 100,000 lines through the kernel check | CPU | results |")
    print("|---|---|---|")
    for name, lines in (("AER corrected, 3 devices", [aer[i % 3] for i in range(100_000)]),
                        ("Lustre `Skipped N previous similar messages`", skipped)):
        cpu, results = storm_cpu(lines)
        print(f"| {name} | {cpu:.2f} s | {results} |")
    ours, count, theirs, grep_count = live()
    print(f"\n| the whole ring buffer of this node ({count} records) | time |")
    print("|---|---|")
    print(f"| trainguard: read /dev/kmsg, parse every record and its XIDs | {ours * 1000:.0f} ms |")
    print(f"| `dmesg --raw \\| grep -c Xid` ({grep_count} lines) | {theirs * 1000:.0f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
