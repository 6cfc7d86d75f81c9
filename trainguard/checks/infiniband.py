"""InfinibandCheck: the node's InfiniBand and RoCE ports (`/sys/class/infiniband`) are up, at full speed, and clean.

Per HCA port: a port that was up (or is expected) and is not ACTIVE/LinkUp is CRITICAL, as is a `link_downed` that
grew (the job here just lost its fabric link, if only for a moment); a rate below what the port ran at on this node
(or below `expected_rate_gbps`) is a degraded link: WARNING; error counters (symbol errors, receive errors, link
recoveries, remote physical errors) growing faster than their limits over a window point at a bad cable or
transceiver: WARNING. The counters are IBTA port counters: 8 or 16 bits wide, they saturate (or wrap, on some
drivers) and reset when the driver reloads; all three are handled. Idle on a node without any such device.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainguard.checks.base import ActionBinding, Check, CheckContext, CheckIdle, CheckSettings
from trainguard.core.counters import CounterWindow, saturated
from trainguard.core.model import Metric, Result, Sample, Status, worst
from trainguard.core.settings import Duration, Field, NonNegativeInt, PositiveFloat
from trainguard.core.units import format_duration
from trainguard.node.sysfs import IbPort, infiniband_ports

PORTS_KEY = "infiniband.ports"  # port -> {"up": seen up, "rate": the highest rate seen}
COUNTERS_KEY = "infiniband.counters"

# IBTA PortCounters widths: they saturate at the top (some drivers wrap). Counters not listed are taken as 64-bit.
COUNTER_BITS = {"symbol_error": 16, "link_error_recovery": 8, "link_downed": 8, "port_rcv_errors": 16,
                "port_rcv_remote_physical_errors": 16, "port_rcv_switch_relay_errors": 16, "port_xmit_discards": 16,
                "port_xmit_constraint_errors": 8, "port_rcv_constraint_errors": 8, "local_link_integrity_errors": 4,
                "excessive_buffer_overrun_errors": 4, "VL15_dropped": 16}

_PORT = ("device", "port")
PORT_UP = Metric("trainguard_infiniband_port_up", "1 if the port is ACTIVE and its physical link LinkUp.",
                 (*_PORT, "link_layer"))
PORT_RATE = Metric("trainguard_infiniband_port_rate_bytes_per_second", "The port's link rate.", _PORT)
PORT_ERRORS = Metric("trainguard_infiniband_port_errors_total", "An IBTA port counter as sysfs reports it (link_downed, "
                     "symbol_error, port_rcv_errors, ...): it saturates at its width and resets on driver reload.",
                     (*_PORT, "counter"), counter=True)
PORTS_UP = Metric("trainguard_infiniband_ports_up", "InfiniBand/RoCE ports up on this node.")
PORTS_EXPECTED = Metric("trainguard_infiniband_ports_expected",
                        "Ports that should be up: configured, or every port seen up on this node.")
METRICS = (PORT_UP, PORT_RATE, PORT_ERRORS, PORTS_UP, PORTS_EXPECTED)


class InfinibandSettings(CheckSettings):
    sysfs_root: str = Field("/sys/class/infiniband", description="Where sysfs lists the HCAs (a copy of the tree for "
                            "tests, or another mount in a container).")
    expected_ports: list[str] = Field(default_factory=list, description="Ports that must be up, as DEVICE/PORT "
                                      "(`mlx5_0/1`). Unset: every port seen up on this node (remembered across "
                                      "restarts).")
    expected_port_count: NonNegativeInt | None = Field(None, description="How many ports must be up on this node.")
    expected_rate_gbps: PositiveFloat | None = Field(None, description="WARNING when an up port runs slower (Gb/s), "
                                                     "e.g. 400 for NDR. Unset: slower than the port ran on this node.")
    link_downed_for: Duration = Field(3600.0, gt=0, description="How long a port whose link_downed grew stays "
                                      "CRITICAL.")
    error_window: Duration = Field(3600.0, gt=0, description="The window error counters' growth is summed over.")
    error_limits: dict[str, NonNegativeInt] = Field(
        default_factory=lambda: {"symbol_error": 120, "port_rcv_errors": 100, "link_error_recovery": 1,
                                 "port_rcv_remote_physical_errors": 0},
        description="Counter -> the growth within error_window above which the port is WARNING (more than 120 "
                    "symbol errors an hour marks a bad cable or transceiver; any remote physical error burst too).")
    actions: ActionBinding = Field(default_factory=lambda: ActionBinding(critical=["signal", "drain", "requeue"]))


def _gbps(rate: float) -> str:
    return f"{rate:g} Gb/sec"


def evaluate(port: IbPort, known: dict[str, Any], required: str | None, downed: int, grown: dict[str, int],
             s: InfinibandSettings) -> tuple[Status, list[str]]:
    """One port: its state against whether it must be up (`required` says why, None: it need not), its rate, link
    drops and error growth."""
    findings: list[tuple[Status, str]] = []
    if not port.up:
        if required:
            why = required
            findings.append((Status.CRITICAL, f"{port.state or '?'} ({port.phys_state or '?'}), {why}: jobs on this "
                                              "node lost this fabric link; check the cable, the switch port, the HCA"))
    else:
        best = float(known.get("rate") or 0.0)
        if port.rate_gbps is not None and s.expected_rate_gbps and port.rate_gbps < s.expected_rate_gbps:
            findings.append((Status.WARNING, f"{port.rate_text}, expected {_gbps(s.expected_rate_gbps)}: a degraded "
                                             "link (lanes or speed lost); reseat or replace the cable"))
        elif port.rate_gbps is not None and port.rate_gbps < best:
            findings.append((Status.WARNING, f"{port.rate_text}, was {_gbps(best)} on this node: a degraded link "
                                             "(lanes or speed lost); reseat or replace the cable"))
    if downed:
        findings.append((Status.CRITICAL, f"link went down {downed}x in the last {format_duration(s.link_downed_for)} "
                                          "(link_downed): the job on this node lost its fabric connection"))
    for counter, increase in sorted(grown.items()):
        limit = s.error_limits[counter]
        if increase > limit:
            findings.append((Status.WARNING, f"{counter} +{increase} in {format_duration(s.error_window)} (limit "
                                             f"{limit}): a bad cable or transceiver"))
    if not findings:
        return Status.OK, []
    return worst(f[0] for f in findings), [text for _, text in sorted(findings, key=lambda f: -f[0].severity)]


class InfinibandCheck(Check):
    layer = "hardware"

    Settings = InfinibandSettings
    metrics = METRICS
    settings: InfinibandSettings

    def __init__(self, name: str, settings: CheckSettings, context: CheckContext) -> None:
        super().__init__(name, settings, context)
        self.window = CounterWindow(max(self.settings.error_window, self.settings.link_downed_for),
                                    interval=self.settings.interval)
        self.window.load_json(self.load_state(COUNTERS_KEY))
        self.saved = self.window.version  # the window's version last saved
        self.known: dict[str, dict[str, Any]] = {k: v for k, v in self.load_state(PORTS_KEY).items()
                                                 if isinstance(v, dict)}
        self.counters = ("link_downed", *self.settings.error_limits)

    def run(self) -> Sequence[Result]:
        s = self.settings
        ports = infiniband_ports(Path(s.sysfs_root), self.counters)
        seen_up = {k for k, v in self.known.items() if v.get("up")}
        if not ports and not s.expected_ports and not s.expected_port_count and not seen_up:
            raise CheckIdle(f"no InfiniBand or RoCE device under {s.sysfs_root}")
        now = self.context.clock()
        results = [self._port(port, now) for port in ports]
        present = {p.key for p in ports}
        for key in sorted(self._required(seen_up) - present):
            results.append(self.result(key, Status.CRITICAL, f"{key}: gone from {s.sysfs_root} (the HCA failed or its "
                                                            "driver is not loaded), yet it was up on this node"
                                       if key in seen_up else f"{key}: expected but not under {s.sysfs_root}",
                                       {"port": key, "present": False}))
        results.append(self._count(ports, self._required(seen_up | {p.key for p in ports if p.up})))
        # a port's counters go with the port (or the config), not with one read that lacked one (a counter file
        # that failed to read while the HCA resets would take the hour its limit is judged over)
        self.window.keep(f"{port}/{c}" for port in present for c in self.counters)
        if self.window.version != self.saved and self.save_state(COUNTERS_KEY, self.window.to_json()):
            self.saved = self.window.version
        self.save_state(PORTS_KEY, self.known)
        return results

    def _required(self, seen_up: set[str]) -> set[str]:
        """The ports that must be up: those configured, else every port seen up on this node."""
        return set(self.settings.expected_ports) if self.settings.expected_ports else seen_up

    def _port(self, port: IbPort, now: float) -> Result:
        s = self.settings
        known = self.known.setdefault(port.key, {})
        if s.expected_ports:
            required = "expected up" if port.key in s.expected_ports else None
        else:
            required = "was up on this node" if known.get("up") else None
        grown, notes, downed = {}, [], 0
        for counter, value in port.counters.items():
            key, bits = f"{port.key}/{counter}", COUNTER_BITS.get(counter)
            self.window.update(key, value, now, bits)
            if saturated(value, bits):
                notes.append(f"{counter} saturated at {value}: its growth is invisible until cleared (perfquery -R)")
            if counter == "link_downed":
                downed = self.window.increase(key, now, s.link_downed_for)
            else:
                grown[counter] = self.window.increase(key, now, s.error_window)
        status, findings = evaluate(port, known, required, downed, grown, s)
        if port.up:  # remember after judging: the first reading is the baseline
            known["up"] = True
            if port.rate_gbps is not None:
                known["rate"] = max(float(known.get("rate") or 0.0), port.rate_gbps)
        head = f"{port.key} {port.link_layer or 'port'}"
        state = f"{port.rate_text or 'rate ?'}" if port.up else f"{port.state} ({port.phys_state})"
        summary = f"{head}: " + "; ".join(findings or [state, *notes])
        labels = {"device": port.device, "port": port.port}
        samples: list[Sample] = [PORT_UP(1 if port.up else 0, {**labels, "link_layer": port.link_layer})]
        if port.rate_gbps is not None:
            samples.append(PORT_RATE(port.rate_gbps * 1e9 / 8, labels))
        samples += [PORT_ERRORS(v, {**labels, "counter": c}) for c, v in sorted(port.counters.items())]
        details: dict[str, Any] = {"device": port.device, "port": port.port, "state": port.state,
                                   "phys_state": port.phys_state, "rate": port.rate_text, "link_layer": port.link_layer,
                                   "hca_type": port.hca_type, "fw_ver": port.fw_ver, "node_guid": port.node_guid,
                                   "counters": port.counters,
                                   "link_downed_recent": downed, "errors_in_window": grown, "notes": notes}
        return self.result(port.key, status, summary, details, samples)

    def _count(self, ports: list[IbPort], required: set[str]) -> Result:
        up = sum(1 for p in ports if p.up)
        expected, source = self.settings.expected_port_count, "configured"
        if expected is None:
            expected, source = len(required), "configured" if self.settings.expected_ports else "seen up on this node"
        status = Status.CRITICAL if up < expected else Status.OK
        return self.result("ports", status, f"{up} of {expected} InfiniBand/RoCE ports up ({expected} {source})",
                           {"up": up, "expected": expected, "source": source}, [PORTS_UP(up), PORTS_EXPECTED(expected)])
