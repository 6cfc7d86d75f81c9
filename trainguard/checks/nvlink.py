"""NvlinkCheck: each GPU's NVLinks are up (as many as configured, or as the GPU had on this node), and their error
counters (replay, recovery, CRC) grow slower than their limits over a window.

A link down cuts the bandwidth NCCL was tuned for or breaks the collectives outright: CRITICAL. A link retransmitting
or retraining often is a marginal cable or connector before it fails: WARNING. Idle on a node whose GPUs have no
NVLink (PCIe cards without a bridge) or no NVML.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trainguard.checks.base import ActionBinding, CheckContext, CheckIdle, CheckSettings, NvmlCheck
from trainguard.core.counters import CounterWindow
from trainguard.core.model import Metric, Result, Sample, Status, worst
from trainguard.core.settings import Duration, Field, NonNegativeInt
from trainguard.core.units import format_duration
from trainguard.gpu.nvml import NVLINK_COUNTERS, NvLink, Reading

SEEN_KEY = "nvlink.max_up"  # uuid -> the most links it had up on this node
COUNTERS_KEY = "nvlink.counters"
TOTALS_KEY = "nvlink.totals"  # uuid -> counter -> the per-GPU total shown, carried across restarts

_GPU = ("gpu", "uuid")
LINKS_UP = Metric("trainguard_gpu_nvlink_links_up", "NVLinks of the GPU that are active.", _GPU)
LINKS_EXPECTED = Metric("trainguard_gpu_nvlink_links_expected",
                        "NVLinks the GPU should have up: configured, or the most it had up on this node.", _GPU)
# Per GPU, not per link: 18 links x 4 counters x 8 GPUs were 576 series a node (most of /metrics, and 576,000 series
# in a 1,000-node Prometheus) for what a dashboard sums by GPU anyway; which link grows is in the alert and details.
# Not the plain sum of NVML's values: a link missing from one read (inactive, NotSupported) or reset alone would make
# the sum fall, which Prometheus takes for a counter reset, counting the other links' whole history as new errors.
# The total is saved with the counters' last readings, so a restarted agent goes on from it (adding what grew while
# it was down) instead of starting again from NVML's sum, which is lower after a link's reset.
LINK_ERRORS = Metric("trainguard_gpu_nvlink_errors_total",
                     "NVLink errors (replay, recovery, crc_flit, crc_data) of all the GPU's links: their sum as NVML "
                     "reported it when the agent first read the GPU on this node, plus each link's growth since (a "
                     "link's reset or absence never makes it fall); the link that grows is named in the check's "
                     "result.",
                     (*_GPU, "counter"), counter=True)
METRICS = (LINKS_UP, LINKS_EXPECTED, LINK_ERRORS)


class NvlinkSettings(CheckSettings):
    expected_links: NonNegativeInt | None = Field(None, description="NVLinks each GPU should have up; unset: the most "
                                                  "that GPU had up on this node (remembered across restarts).")
    error_window: Duration = Field(3600.0, gt=0, description="The window the error counters' growth is summed over.")
    replay_max: NonNegativeInt = Field(1, description="WARNING when a link's replays grow by more than this within "
                                       "error_window (DCGM's limit for NVLink errors).")
    recovery_max: NonNegativeInt = Field(1, description="WARNING when a link's recoveries (retrainings) grow by more "
                                         "than this within error_window.")
    crc_max: NonNegativeInt = Field(360_000, description="WARNING when a link's CRC flit or data errors grow by more "
                                    "than this within error_window (100 a second for an hour: DCGM's rate below which "
                                    "they don't matter).")
    actions: ActionBinding = Field(default_factory=lambda: ActionBinding(critical=["signal", "drain", "requeue"]))


def limits(s: NvlinkSettings) -> dict[str, int]:
    return {"replay": s.replay_max, "recovery": s.recovery_max, "crc_flit": s.crc_max, "crc_data": s.crc_max}


def evaluate(index: int, links: Sequence[NvLink], expected: int, source: str, grown: dict[tuple[int, str], int],
             s: NvlinkSettings) -> tuple[Status, str]:
    """The links of one GPU against what it should have, and each link's error growth against its limit."""
    up = [x.link for x in links if x.active]
    down = [x.link for x in links if not x.active]
    findings: list[tuple[Status, str]] = []
    if len(up) < expected:
        where = f"links {', '.join(map(str, down))} down; " if down else ""
        findings.append((Status.CRITICAL, f"{len(up)} of {expected} NVLinks up ({where}{expected} {source}): "
                                          "collectives lose bandwidth or fail; drain, then reset the GPU"))
    window = format_duration(s.error_window)
    limit_of = limits(s)
    for (link, counter), increase in sorted(grown.items()):
        limit = limit_of[counter]
        if increase > limit:
            findings.append((Status.WARNING, f"link {link} {counter.replace('_', ' ')} errors +{increase} in {window} "
                                             f"(limit {limit}): a marginal link; check its cable or connector"))
    if findings:
        return worst(f[0] for f in findings), f"GPU {index}: " + "; ".join(t for _, t in findings)
    return Status.OK, f"GPU {index}: {len(up)} of {len(links)} NVLinks up" + (f" ({expected} {source})" if expected
                                                                               else "")


class NvlinkCheck(NvmlCheck):
    Settings = NvlinkSettings
    metrics = METRICS
    settings: NvlinkSettings

    def __init__(self, name: str, settings: CheckSettings, context: CheckContext) -> None:
        super().__init__(name, settings, context)
        self.window = CounterWindow(self.settings.error_window, interval=self.settings.interval)
        self.window.load_json(self.load_state(COUNTERS_KEY), decode=_decode_key)
        self.saved = self.window.version  # the window's version last saved
        self.seen: dict[str, int] = {k: int(v) for k, v in self.load_state(SEEN_KEY).items() if str(v).isdigit()}
        self.totals: dict[str, dict[str, int]] = {
            uuid: {c: v for c, v in counters.items() if c in NVLINK_COUNTERS and type(v) is int and v >= 0}
            for uuid, counters in self.load_state(TOTALS_KEY).items() if isinstance(counters, dict)}
        self.saved_totals = {uuid: dict(t) for uuid, t in self.totals.items()}

    def run(self) -> Sequence[Result]:
        readings = self.present(self.nvml_read(self.nvml.nvlinks))
        if self.settings.expected_links is None and not self.seen and all(not r.value for r in readings if r.error is None):
            raise CheckIdle("no GPU on this node has NVLink")
        now = self.context.clock()
        results = [self.unanswered(r) or self._one(r, now) for r in readings]
        if all(r.error is None for r in readings):  # a GPU gone: its counters and totals too (not one that failed to
            # answer, nor one whose read lacked its counters this once: a transient NotSupported would have taken the
            # hour of history its alerts are judged on; a GPU's links are few, so memory still follows the hardware)
            read = {r.gpu.uuid for r in readings}
            self.window.keep_where(lambda key: isinstance(key, tuple) and key[0] in read)
            self.totals = {uuid: t for uuid, t in self.totals.items() if uuid in read}
        if self.window.version != self.saved and self.save_state(COUNTERS_KEY, self.window.to_json(encode=_encode_key)):
            self.saved = self.window.version
        if self.totals != self.saved_totals and self.save_state(TOTALS_KEY, self.totals):
            self.saved_totals = {uuid: dict(t) for uuid, t in self.totals.items()}
        self.save_state(SEEN_KEY, self.seen)
        return results

    def _one(self, reading: Reading[tuple[NvLink, ...]], now: float) -> Result:
        gpu, links = reading.gpu, reading.value or ()
        up = sum(1 for x in links if x.active)
        if self.settings.expected_links is not None:
            expected, source = self.settings.expected_links, "configured"
        else:
            self.seen[gpu.uuid] = max(self.seen.get(gpu.uuid, 0), up)
            expected, source = self.seen[gpu.uuid], "seen on this node"
        labels = self.gpu_labels(reading)
        samples: list[Sample] = [LINKS_UP(up, labels), LINKS_EXPECTED(expected, labels)]
        grown: dict[tuple[int, str], int] = {}
        sums: dict[str, int] = {}
        growth: dict[str, int] = {}
        for link in links:
            for counter, value in link.errors.items():
                delta = self.window.update((gpu.uuid, link.link, counter), value, now)
                increase = self.window.increase((gpu.uuid, link.link, counter), now)
                if increase:  # nearly every counter never grows: those are no finding and no detail
                    grown[(link.link, counter)] = increase
                sums[counter] = sums.get(counter, 0) + value
                growth[counter] = growth.get(counter, 0) + delta
        totals = self.totals.setdefault(gpu.uuid, {})
        for counter, total in sums.items():
            totals[counter] = totals[counter] + growth[counter] if counter in totals else total
        samples.extend(LINK_ERRORS(value, {**labels, "counter": counter}) for counter, value in totals.items())
        status, summary = evaluate(gpu.index, links, expected, source, grown, self.settings)
        details: dict[str, Any] = {
            "index": gpu.index, "uuid": gpu.uuid, "bus_id": gpu.bus_id, "links_up": up, "links_expected": expected,
            "expected_source": source, "down": [x.link for x in links if not x.active],
            "errors_in_window": {f"{link}/{counter}": n for (link, counter), n in grown.items()},
            "error_window_s": self.settings.error_window}
        return self.result(gpu.uuid or f"gpu{gpu.index}", status, summary, details, samples)


def _encode_key(key: tuple[str, int, str]) -> str:
    return "/".join(map(str, key))


def _decode_key(text: str) -> tuple[str, int, str]:
    uuid, link, counter = text.rsplit("/", 2)
    if counter not in NVLINK_COUNTERS:
        raise ValueError(text)
    return uuid, int(link), counter
