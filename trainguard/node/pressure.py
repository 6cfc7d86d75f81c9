"""What on the host can make a job's steps slower: CPU steal and I/O wait (/proc/stat), pressure stall information
(/proc/pressure/{cpu,io,memory}: the share of time some task waited), and swapping (/proc/vmstat). Read through
ProcFS; the rates are between two samples the caller keeps."""

from __future__ import annotations

from dataclasses import dataclass

from trainguard.node.procfs import ProcFS

PSI = ("cpu", "io", "memory")
# Above these, the host is a suspect (thresholds as data): PSI `some avg60` percent, steal and iowait shares of CPU
# time, pages swapped in a second.
LIMITS = {"cpu": 25.0, "io": 25.0, "memory": 10.0, "steal": 0.05, "iowait": 0.20, "swap_in": 100.0}


@dataclass(frozen=True)
class HostSample:
    when: float
    cpu: tuple[int, int, int] | None  # (total, iowait, steal) jiffies since boot
    swap_in: int | None  # pages swapped in since boot
    psi: dict[str, float]  # resource -> `some avg60` percent


def _psi(text: str | None) -> float | None:
    for line in (text or "").splitlines():
        if line.startswith("some "):
            for part in line.split():
                if part.startswith("avg60="):
                    try:
                        return float(part[6:])
                    except ValueError:
                        return None
    return None


def host_sample(proc: ProcFS, when: float) -> HostSample:
    cpu = None
    for line in (proc.read_text("stat") or "").splitlines()[:1]:
        fields = line.split()
        if fields[:1] == ["cpu"] and len(fields) >= 9 and all(f.isdigit() for f in fields[1:]):
            values = [int(f) for f in fields[1:]]
            cpu = (sum(values[:8]), values[4], values[7])  # user nice system idle iowait irq softirq steal
    swap_in = None
    for line in (proc.read_text("vmstat") or "").splitlines():
        name, _, value = line.partition(" ")
        if name == "pswpin" and value.strip().isdigit():
            swap_in = int(value)
    psi = {r: v for r in PSI if (v := _psi(proc.read_text("pressure", r))) is not None}
    return HostSample(when, cpu, swap_in, psi)


def host_evidence(before: HostSample | None, now: HostSample) -> tuple[list[str], dict[str, float]]:
    """The host's suspects in words, and its gauges (PSI as a ratio, steal and iowait shares, swap-ins a second)."""
    gauges = {r: v / 100 for r, v in now.psi.items()}
    if before is not None and before.cpu and now.cpu and now.cpu[0] > before.cpu[0]:
        total = now.cpu[0] - before.cpu[0]
        gauges["iowait"] = max(0, now.cpu[1] - before.cpu[1]) / total
        gauges["steal"] = max(0, now.cpu[2] - before.cpu[2]) / total
    if before is not None and before.swap_in is not None and now.swap_in is not None and now.when > before.when:
        gauges["swap_in"] = max(0, now.swap_in - before.swap_in) / (now.when - before.when)
    said = []
    for name, value in gauges.items():
        limit = LIMITS[name] / 100 if name in PSI else LIMITS[name]
        if value >= limit:
            said.append({"steal": f"CPU steal {value:.0%}", "iowait": f"I/O wait {value:.0%} of CPU time",
                         "swap_in": f"swapping in {value:.0f} pages/s"}.get(name, f"{name} pressure {value:.0%}"))
    return said, gauges
