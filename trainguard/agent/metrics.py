"""/metrics: the engine's in-memory snapshot in Prometheus's text format (no I/O at scrape time).

The agent's own metrics are declared here; each check declares its own beside its code (`Check.metrics`).
`trainguard metrics-reference` lists them all (docs/metrics.md).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from trainguard import __version__
from trainguard.core.events import jobs_of
from trainguard.core.model import Metric, Sample, Status
from trainguard.pipeline.engine import CheckState, Snapshot
from trainguard.pipeline.lemon import LemonCheck
from trainguard.pipeline.runner import RunReport
from trainguard.pipeline.selfcheck import AgentCheck

BUILD_INFO = Metric("trainguard_build_info", "trainguard version running on this node.", ("version", "node"))
CHECK_STATUS = Metric("trainguard_check_status",
                      "Latest status per check and subject: 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN.",
                      ("check", "subject", "type"))
CHECK_DURATION = Metric("trainguard_check_duration_seconds", "Duration of the latest run of a check.", ("check",))
CHECK_LAST_RUN = Metric("trainguard_check_last_run_timestamp_seconds", "Unix time the latest run of a check started.",
                        ("check",))
CHECK_SUCCESS = Metric("trainguard_check_success",
                       "1 if the latest run of a check completed, 0 if it failed, timed out or was skipped.", ("check",))
CHECK_IDLE = Metric("trainguard_check_idle",
                    "1 while a check is idle: what it watches (NVML, InfiniBand devices) is absent from this node, so it "
                    "reports nothing and alerts on nothing.", ("check",))
CHECK_RUNS = Metric("trainguard_check_runs_total", "Runs of a check, by outcome.", ("check", "outcome"), counter=True)
CHECK_TIMEOUTS = Metric("trainguard_check_timeouts_total", "Runs of a check that exceeded their timeout.", ("check",),
                        counter=True)
INCIDENTS_FIRING = Metric("trainguard_incidents_firing", "Incidents currently firing, by severity.", ("severity",))
QUEUED = Metric("trainguard_notifications_queued", "Notifications waiting in the outbox.", ("channel",))
OLDEST_QUEUED = Metric("trainguard_notifications_oldest_queued_age_seconds",
                       "Age of the oldest queued notification (0 when none).", ("channel",))
SENT = Metric("trainguard_notifications_sent_total", "Notifications delivered.", ("channel",), counter=True)
FAILED = Metric("trainguard_notifications_failed_total", "Failed delivery attempts.", ("channel",), counter=True)
DROPPED = Metric("trainguard_notifications_dropped_total", "Notifications dropped (rejected permanently or too old).",
                 ("channel",), counter=True)
NOT_ROUTED = Metric("trainguard_notifications_not_routed_total",
                    "Events a channel's routing kept from it, by the rule that did (min_severity, send_resolved, "
                    "checks, exclude_checks, match, exclude_match).", ("channel", "rule"), counter=True)
INCIDENT_FIRING = Metric("trainguard_incident_firing",
                         "1 for each incident firing now (after the check's fire_after): what the alert rules follow.",
                         ("check", "subject", "type", "severity", "job_id", "layer", "cluster"))
INCIDENT_ACKED = Metric("trainguard_incident_acknowledged", "1 for each incident an operator acknowledged.",
                        ("check", "subject"))
INCIDENT_SILENCED = Metric("trainguard_incident_silenced",
                           "1 for each incident under an operator's silence (no notification, no action).",
                           ("check", "subject"))
START_TIME = Metric("trainguard_agent_start_time_seconds", "Unix time the agent started.")
RSS = Metric("trainguard_agent_resident_memory_bytes", "Resident memory of the agent.")
CPU = Metric("trainguard_agent_cpu_seconds_total", "CPU time used by the agent (user + system).", counter=True)
OPEN_FDS = Metric("trainguard_agent_open_fds",
                  "File descriptors the agent has open (connections, logs, children's pipes).")
MAX_FDS = Metric("trainguard_agent_max_fds", "The agent's limit on open file descriptors (RLIMIT_NOFILE, the unit's "
                 "LimitNOFILE).")
THREADS = Metric("trainguard_agent_threads", "Threads of the agent.")
MAX_TASKS = Metric("trainguard_agent_max_tasks", "The agent's service's limit on tasks, its threads and children "
                   "together (cgroup pids.max, the unit's TasksMax); absent where none is set.")
AGENT_METRICS = (BUILD_INFO, CHECK_STATUS, CHECK_DURATION, CHECK_LAST_RUN, CHECK_SUCCESS, CHECK_IDLE, CHECK_RUNS,
                 CHECK_TIMEOUTS, INCIDENTS_FIRING, INCIDENT_FIRING, INCIDENT_ACKED, INCIDENT_SILENCED, QUEUED,
                 OLDEST_QUEUED, SENT, FAILED, DROPPED, NOT_ROUTED, START_TIME, RSS, CPU, OPEN_FDS, MAX_FDS,
                 THREADS, MAX_TASKS, *AgentCheck.metrics, *LemonCheck.metrics)


# The text format every Prometheus reads (0.0.4); what is rendered below is exactly that format: declared
# `trainguard_` names, so none of the newer format's quoted UTF-8 names.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Family:
    """One declared metric and its samples' label values, in the metric's declared label order."""

    metric: Metric
    samples: tuple[tuple[tuple[str, ...], float], ...] = ()


def family(metric: Metric, samples: Sequence[Sample] = ()) -> Family:
    """The family of a declared metric, holding `samples` (the first of any duplicate label set)."""
    out: dict[tuple[str, ...], float] = {}
    for s in samples:
        key = tuple(s.labels[k] for k in metric.labels)
        out.setdefault(key, s.value)  # two checks of one type on the same subject: keep the first
    return Family(metric, tuple(out.items()))


def _value(v: float) -> str:
    v = float(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(v)


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _label(v: str) -> str:
    # Label values come from jobs and file systems (subjects, job names): escaped, so no value can end the line. A
    # path whose bytes are not UTF-8 (os.fsdecode's surrogates) is shown as its escapes, never an error.
    if v.isascii() and "\\" not in v and "\n" not in v and '"' not in v:
        return v  # most values (check names, subjects): nothing to escape, and a scrape renders thousands
    if not v.isascii():
        v = v.encode("utf-8", "backslashreplace").decode()
    return _escape(v).replace('"', '\\"')


Series = tuple[str, str]  # one sample rendered: its label set as text (what makes it one series) and its line


@dataclass(frozen=True)
class Rendered:
    """One declared metric whose samples are rendered already, in order (duplicates still among them)."""

    metric: Metric
    series: tuple[Series, ...] = ()


def _series(m: Metric, samples: Iterable[tuple[tuple[str, ...], float]]) -> Iterator[Series]:
    order = sorted(range(len(m.labels)), key=m.labels.__getitem__)  # labels by name: one text for one state
    for key, value in samples:
        labels = "{" + ",".join(f'{m.labels[i]}="{_label(key[i])}"' for i in order) + "}" if key else ""
        yield labels, f"{m.name}{labels} {_value(value)}"


def render(families: Iterable[Family | Rendered]) -> bytes:
    """The families in Prometheus's text exposition format, HELP and TYPE before each (also when it has no sample)."""
    lines: list[str] = []
    for fam in families:
        m = fam.metric
        lines.append(f"# HELP {m.name} {_escape(m.help)}")
        lines.append(f"# TYPE {m.name} {'counter' if m.counter else 'gauge'}")
        shown: set[str] = set()
        for labels, line in fam.series if isinstance(fam, Rendered) else _series(m, fam.samples):
            if labels in shown:  # two values that escape alike (a path's undecodable byte, its escape typed out)
                continue
            shown.add(labels)
            lines.append(line)
    lines.append("")
    return "\n".join(lines).encode()


RunSeries = Mapping[Metric, Sequence[Series]]


def run_series(report: RunReport) -> dict[Metric, list[Series]]:
    """The samples of one check run, rendered, by metric, in the order the run reported them."""
    samples: dict[Metric, list[tuple[tuple[str, ...], float]]] = {}
    for result in report.results:
        for sample in result.samples:
            m = sample.metric
            samples.setdefault(m, []).append((tuple(sample.labels[k] for k in m.labels), sample.value))
    return {m: list(_series(m, keyed)) for m, keyed in samples.items()}


CHECK_METRICS = (CHECK_STATUS, CHECK_DURATION, CHECK_LAST_RUN, CHECK_SUCCESS, CHECK_IDLE, CHECK_RUNS, CHECK_TIMEOUTS)


def check_series(name: str, st: CheckState) -> dict[Metric, list[Series]]:
    """The agent's own series of one check (its runs, the latest run's status per subject), rendered, then those of
    its latest run. Built from label values directly: a scrape renders every check's, and samples made one by one
    were half its time."""
    check = (name,)
    ok = st.runs - st.timeouts - st.errors - st.skipped - st.idle
    own: dict[Metric, list[tuple[tuple[str, ...], float]]] = {
        CHECK_RUNS: [((name, outcome), count) for outcome, count in (
            ("ok", ok), ("idle", st.idle), ("error", st.errors), ("timeout", st.timeouts), ("skipped", st.skipped))],
        CHECK_TIMEOUTS: [(check, st.timeouts)]}
    last = st.last
    if last is not None:
        own[CHECK_STATUS] = [((name, result.subject, st.kind), int(result.status)) for result in last.results]
        own[CHECK_DURATION] = [(check, last.duration)]
        own[CHECK_LAST_RUN] = [(check, last.started)]
        own[CHECK_SUCCESS] = [(check, 1 if last.complete else 0)]
        own[CHECK_IDLE] = [(check, 1 if last.outcome == "idle" else 0)]
    out = {m: list(_series(m, keyed)) for m, keyed in own.items()}
    if last is not None:
        out.update(run_series(last))
    return out


class Exposition:
    """What GET /metrics answers: the snapshot taken at the moment of the scrape, rendered. A check's series change
    only when it runs, so each check's are rendered once and kept while its state is the same: a scrape renders what
    changed since the one before (a check that runs every minute, scraped every 15 s, is rendered once in four), and
    holds the text of the latest runs only."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot
        self._lock = threading.Lock()  # one scrape at a time renders (the endpoint has two workers)
        self._checks: dict[str, tuple[RunReport | None, tuple[object, ...], RunSeries]] = {}

    def __call__(self) -> bytes:
        snap = self._snapshot()
        with self._lock:
            kept: dict[str, tuple[RunReport | None, tuple[object, ...], RunSeries]] = {}

            def series(name: str, st: CheckState) -> RunSeries:
                # `st` is the snapshot's copy; its latest run is the same object for as long as it is the latest
                counts = (st.kind, st.runs, st.timeouts, st.errors, st.skipped, st.idle)
                last = self._checks.get(name)
                kept[name] = last if last is not None and last[0] is st.last and last[1] == counts else \
                    (st.last, counts, check_series(name, st))
                return kept[name][2]

            body = render(collect(snap, series))
            self._checks = kept  # checks gone from the snapshot are dropped with their text
            return body


def exposition(snapshot: Callable[[], Snapshot]) -> Callable[[], bytes]:
    return Exposition(snapshot)


def collect(snap: Snapshot,
            series: Callable[[str, CheckState], RunSeries] | None = None,
            ) -> Iterator[Family | Rendered]:
    """Every family of the agent's /metrics: its own, then those the checks declared, from one snapshot (`series`:
    the rendered series of one check, `check_series`'s)."""
    yield family(BUILD_INFO, [BUILD_INFO(1, {"version": __version__, "node": snap.node})])
    by_metric: dict[Metric, list[Series]] = {m: [] for m in CHECK_METRICS}
    for name, st in sorted(snap.checks.items()):
        for metric, lines in (series or check_series)(name, st).items():  # checks in name order: the first of a series wins
            by_metric.setdefault(metric, []).extend(lines)
    yield from (Rendered(m, tuple(by_metric.pop(m))) for m in CHECK_METRICS)
    yield family(INCIDENTS_FIRING, [INCIDENTS_FIRING(snap.firing.get(sev, 0), {"severity": sev.label})
                                    for sev in (Status.UNKNOWN, Status.WARNING, Status.CRITICAL)])
    yield from incident_families(snap)

    delivery: dict[Metric, list[Sample]] = {m: [] for m in (QUEUED, OLDEST_QUEUED, SENT, FAILED, DROPPED)}
    now = snap.agent.get("now", 0.0)
    for channel, (n_sent, n_failed, n_dropped) in sorted(snap.delivery.items()):
        count, first = snap.outbox.get(channel, (0, None))
        ch = {"channel": channel}
        delivery[QUEUED].append(QUEUED(count, ch))
        delivery[OLDEST_QUEUED].append(OLDEST_QUEUED(max(0.0, now - first) if first is not None and now else 0.0, ch))
        delivery[SENT].append(SENT(n_sent, ch))
        delivery[FAILED].append(FAILED(n_failed, ch))
        delivery[DROPPED].append(DROPPED(n_dropped, ch))
    yield from (family(m, samples) for m, samples in delivery.items())
    yield family(NOT_ROUTED, [NOT_ROUTED(n, {"channel": channel, "rule": rule})
                              for channel, rules in sorted(snap.not_routed.items())
                              for rule, n in sorted(rules.items())])

    yield family(START_TIME, [START_TIME(snap.started)])
    if "rss" in snap.agent:
        yield family(RSS, [RSS(snap.agent["rss"])])
        yield family(CPU, [CPU(snap.agent["cpu"])])
        yield family(THREADS, [THREADS(snap.agent["threads"])])
    for metric, key in ((OPEN_FDS, "fds"), (MAX_FDS, "max_fds"), (MAX_TASKS, "max_tasks")):
        if key in snap.agent:
            yield family(metric, [metric(snap.agent[key])])
    for metric, lines in sorted(by_metric.items(), key=lambda item: item[0].name):
        yield Rendered(metric, tuple(lines))


def incident_families(snap: Snapshot) -> Iterator[Family]:
    """One series per firing, acknowledged or silenced incident: the agent's own hysteresis, for the rules."""
    firing, acked, silenced = [], [], []
    now = snap.agent.get("now", 0.0)
    for i in snap.incidents:
        where = {"check": i.check, "subject": i.subject}
        if i.firing:
            kind = snap.checks[i.check].kind if i.check in snap.checks else i.check
            labels = {**where, "type": kind, "severity": i.status.label, "layer": str(i.details.get("layer") or "node"),
                      "cluster": str(i.details.get("cluster") or "")}
            for job_id in jobs_of(i.details) or [""]:  # one series per job, as the Alertmanager notifier's alerts
                firing.append(INCIDENT_FIRING(1, {**labels, "job_id": job_id}))
        if i.acked:
            acked.append(INCIDENT_ACKED(1, where))
        if any(s.until > now and s.matches(i.check, i.subject) for s in snap.silences):
            silenced.append(INCIDENT_SILENCED(1, where))
    yield from (family(INCIDENT_FIRING, firing), family(INCIDENT_ACKED, acked), family(INCIDENT_SILENCED, silenced))

