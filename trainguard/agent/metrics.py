"""/metrics: a client_python collector over the engine's in-memory snapshot (no I/O at scrape time)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from trainguard import __version__
from trainguard.core.model import Sample, Status
from trainguard.pipeline.engine import Snapshot


class SnapshotCollector(Collector):
    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        info = GaugeMetricFamily("trainguard_build_info", "trainguard version running on this node.",
                                 labels=["version", "node"])
        info.add_metric([__version__, snap.node], 1)
        yield info

        status = GaugeMetricFamily("trainguard_check_status",
                                   "Latest status per check and subject: 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN.",
                                   labels=["check", "subject", "type"])
        duration = GaugeMetricFamily("trainguard_check_duration_seconds", "Duration of the latest run of a check.",
                                     labels=["check"])
        last_run = GaugeMetricFamily("trainguard_check_last_run_timestamp_seconds",
                                     "Unix time the latest run of a check started.", labels=["check"])
        success = GaugeMetricFamily("trainguard_check_success",
                                    "1 if the latest run of a check completed, 0 if it failed, timed out or was skipped.",
                                    labels=["check"])
        runs = CounterMetricFamily("trainguard_check_runs", "Runs of a check, by outcome.", labels=["check", "outcome"])
        timeouts = CounterMetricFamily("trainguard_check_timeouts", "Runs of a check that exceeded their timeout.",
                                       labels=["check"])
        samples: dict[str, list[Sample]] = {}
        for name, st in sorted(snap.checks.items()):
            timeouts.add_metric([name], st.timeouts)
            ok = st.runs - st.timeouts - st.errors - st.skipped
            for outcome, count in (("ok", ok), ("error", st.errors), ("timeout", st.timeouts), ("skipped", st.skipped)):
                runs.add_metric([name, outcome], count)
            if st.last is None:
                continue
            duration.add_metric([name], st.last.duration)
            last_run.add_metric([name], st.last.started)
            success.add_metric([name], 1 if st.last.complete else 0)
            for result in st.last.results:
                status.add_metric([name, result.subject, st.kind], int(result.status))
                for sample in result.samples:
                    samples.setdefault(sample.name, []).append(sample)
        yield from (status, duration, last_run, success, runs, timeouts)

        firing = GaugeMetricFamily("trainguard_incidents_firing", "Incidents currently firing, by severity.",
                                   labels=["severity"])
        for sev in (Status.UNKNOWN, Status.WARNING, Status.CRITICAL):
            firing.add_metric([sev.label], snap.firing.get(sev, 0))
        yield firing

        queued = GaugeMetricFamily("trainguard_notifications_queued", "Notifications waiting in the outbox.",
                                   labels=["channel"])
        oldest = GaugeMetricFamily("trainguard_notifications_oldest_queued_age_seconds",
                                   "Age of the oldest queued notification (0 when none).", labels=["channel"])
        sent = CounterMetricFamily("trainguard_notifications_sent", "Notifications delivered.", labels=["channel"])
        failed = CounterMetricFamily("trainguard_notifications_failed", "Failed delivery attempts.",
                                     labels=["channel"])
        dropped = CounterMetricFamily("trainguard_notifications_dropped",
                                      "Notifications dropped (rejected permanently or too old).", labels=["channel"])
        now = snap.agent.get("now", 0.0)
        for channel, (n_sent, n_failed, n_dropped) in sorted(snap.delivery.items()):
            count, first = snap.outbox.get(channel, (0, None))
            queued.add_metric([channel], count)
            oldest.add_metric([channel], max(0.0, now - first) if first is not None and now else 0.0)
            sent.add_metric([channel], n_sent)
            failed.add_metric([channel], n_failed)
            dropped.add_metric([channel], n_dropped)
        yield from (queued, oldest, sent, failed, dropped)

        start = GaugeMetricFamily("trainguard_agent_start_time_seconds", "Unix time the agent started.")
        start.add_metric([], snap.started)
        yield start
        if "rss" in snap.agent:
            rss = GaugeMetricFamily("trainguard_agent_resident_memory_bytes", "Resident memory of the agent.")
            rss.add_metric([], snap.agent["rss"])
            cpu = CounterMetricFamily("trainguard_agent_cpu_seconds", "CPU time used by the agent (user + system).")
            cpu.add_metric([], snap.agent["cpu"])
            yield from (rss, cpu)

        for name, group in sorted(samples.items()):
            yield _family(name, group)


def _family(name: str, group: list[Sample]) -> Metric:
    labels = sorted({k for s in group for k in s.labels})
    help_text = next((s.help for s in group if s.help), f"{name} as reported by a trainguard check.")
    family: Metric
    if group[0].counter:
        family = CounterMetricFamily(name.removesuffix("_total"), help_text, labels=labels)
    else:
        family = GaugeMetricFamily(name, help_text, labels=labels)
    seen = set()
    for s in group:
        key = tuple(s.labels.get(k, "") for k in labels)
        if key in seen:  # two checks of one type on the same subject: keep the first
            continue
        seen.add(key)
        family.add_metric(list(key), s.value)
    return family


def build_registry(snapshot: Callable[[], Snapshot]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshot))
    return registry
