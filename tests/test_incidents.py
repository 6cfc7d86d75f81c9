from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.checks.base import Check, CheckContext, CheckSettings, PartialView
from trainguard.core.events import Event, EventKind
from trainguard.core.model import Result, Status
from trainguard.pipeline.incidents import DESCRIPTION_WRITE_INTERVAL, IncidentPolicy, IncidentTracker
from trainguard.pipeline.runner import CheckRunner
from trainguard.pipeline.store import Store


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def r(status: Status, subject: str = "/scratch", summary: str = "s") -> Result:
    return Result("disk", subject, status, summary)


class Harness:
    def __init__(self, store: Store, policy: IncidentPolicy | None = None) -> None:
        self.clock = Clock()
        self.store = store
        self.tracker = IncidentTracker(store, "node1", self.clock)
        self.policy = policy or IncidentPolicy()

    def feed(self, *results: Result, complete: bool = True, advance: float = 30.0) -> list[Event]:
        self.clock.now += advance
        return self.tracker.observe("disk", list(results), self.policy, complete, lambda e: ["console"])


@pytest.fixture
def h() -> Harness:
    return Harness(Store(None))


def kinds(events: list[Event]) -> list[str]:
    return [e.kind.value for e in events]


def test_fires_once_then_resolves(h: Harness) -> None:
    assert kinds(h.feed(r(Status.OK))) == []
    fired = h.feed(r(Status.WARNING, summary="3 GiB free"))
    assert kinds(fired) == ["fired"]
    assert fired[0].status is Status.WARNING
    assert fired[0].summary == "3 GiB free"
    assert kinds(h.feed(r(Status.WARNING))) == []
    resolved = h.feed(r(Status.OK, summary="40 GiB free"))
    assert kinds(resolved) == ["resolved"]
    assert resolved[0].incident_id == fired[0].incident_id
    assert resolved[0].status is Status.WARNING
    assert h.tracker.incidents() == []


def test_hysteresis_by_runs() -> None:
    h = Harness(Store(None), IncidentPolicy(fire_after_runs=3))
    assert kinds(h.feed(r(Status.CRITICAL))) == []
    assert kinds(h.feed(r(Status.CRITICAL))) == []
    assert kinds(h.feed(r(Status.CRITICAL))) == ["fired"]


def test_hysteresis_by_duration_and_flap_resets() -> None:
    h = Harness(Store(None), IncidentPolicy(fire_after=120))
    assert kinds(h.feed(r(Status.WARNING), advance=0)) == []
    assert kinds(h.feed(r(Status.WARNING), advance=60)) == []
    assert kinds(h.feed(r(Status.OK), advance=30)) == []  # pending incident dropped silently
    assert kinds(h.feed(r(Status.WARNING), advance=30)) == []
    assert kinds(h.feed(r(Status.WARNING), advance=119)) == []
    assert kinds(h.feed(r(Status.WARNING), advance=1)) == ["fired"]


def test_escalation_and_no_repeat_after_deescalation(h: Harness) -> None:
    assert kinds(h.feed(r(Status.WARNING))) == ["fired"]
    escalated = h.feed(r(Status.CRITICAL))
    assert kinds(escalated) == ["escalated"]
    assert escalated[0].previous is Status.WARNING
    assert kinds(h.feed(r(Status.WARNING))) == []  # calmer: no event
    assert kinds(h.feed(r(Status.CRITICAL))) == []  # back to what was already announced
    assert kinds(h.feed(r(Status.OK))) == ["resolved"]


def test_unknown_escalates_to_warning(h: Harness) -> None:
    assert kinds(h.feed(r(Status.UNKNOWN))) == ["fired"]
    assert kinds(h.feed(r(Status.WARNING))) == ["escalated"]


def test_unknown_can_be_ignored() -> None:
    h = Harness(Store(None), IncidentPolicy(alert_on_unknown=False))
    assert kinds(h.feed(r(Status.UNKNOWN))) == []
    assert h.tracker.incidents() == []


def test_reminder_after_repeat_interval() -> None:
    h = Harness(Store(None), IncidentPolicy(repeat_interval=3600))
    assert kinds(h.feed(r(Status.CRITICAL))) == ["fired"]
    assert kinds(h.feed(r(Status.CRITICAL), advance=3000)) == []
    assert kinds(h.feed(r(Status.CRITICAL), advance=600)) == ["reminder"]
    assert kinds(h.feed(r(Status.CRITICAL), advance=600)) == []


def test_subjects_are_independent(h: Harness) -> None:
    events = h.feed(r(Status.WARNING, "/a"), r(Status.CRITICAL, "/b"), r(Status.OK, "/c"))
    assert sorted((e.subject, e.kind.value) for e in events) == [("/a", "fired"), ("/b", "fired")]
    assert h.tracker.firing_by_status() == {Status.UNKNOWN: 0, Status.WARNING: 1, Status.CRITICAL: 1}


def test_vanished_subject_resolves_only_after_a_complete_run(h: Harness) -> None:
    h.feed(r(Status.WARNING, "/mnt/usb"))
    assert kinds(h.feed(Result("disk", "disk", Status.UNKNOWN, "timed out"), complete=False)) == ["fired"]
    assert [i.subject for i in h.tracker.incidents() if i.firing] == ["/mnt/usb", "disk"]
    resolved = h.feed(r(Status.OK, "/"))
    assert sorted(e.subject for e in resolved) == ["/mnt/usb", "disk"]
    assert all(e.kind is EventKind.RESOLVED for e in resolved)


def test_a_withheld_subject_is_neither_stepped_nor_resolved(h: Harness) -> None:
    """A job whose owner is not known yet this run (its record asked, not answered): its incident stays as it is,
    where a complete run without it would resolve it (and the next run fire it again, its actions run twice)."""
    assert kinds(h.feed(r(Status.CRITICAL, "slurm:1"))) == ["fired"]
    h.clock.now += 30
    events = h.tracker.observe("disk", [], h.policy, True, lambda e: ["console"], withheld=frozenset({"slurm:1"}))
    assert events == [] and [i.subject for i in h.tracker.incidents() if i.firing] == ["slurm:1"]
    assert kinds(h.feed(r(Status.CRITICAL, "slurm:1"))) == []  # the same incident, not a new one
    assert kinds(h.feed()) == ["resolved"]


def test_restart_keeps_firing_incident_without_refiring(tmp_path: Path) -> None:
    store = Store(tmp_path)
    first = Harness(store)
    fired = first.feed(r(Status.CRITICAL))
    store.close()

    store2 = Store(tmp_path)
    second = Harness(store2)
    second.clock.now = first.clock.now
    [incident] = second.tracker.incidents()
    assert incident.firing and incident.id == fired[0].incident_id
    assert kinds(second.feed(r(Status.CRITICAL))) == []
    resolved = second.feed(r(Status.OK))
    assert kinds(resolved) == ["resolved"]
    assert resolved[0].incident_id == fired[0].incident_id


def test_events_are_queued_with_the_state_change(tmp_path: Path) -> None:
    store = Store(tmp_path)
    h = Harness(store)
    h.feed(r(Status.WARNING))
    row = store.next_outbox("console")
    assert row is not None
    assert row.event["kind"] == "fired"
    assert Event.from_dict(row.event).status is Status.WARNING


# What a run of a check saw, as the runner hands it to the tracker: each subject's status, and whether the view was
# partial (the XID check while the kernel log is still being replayed, or with a ledger that had to drop entries).
_RUNS = st.lists(st.tuples(st.dictionaries(st.sampled_from("abcd"), st.sampled_from([Status.OK, Status.WARNING,
                                                                                     Status.CRITICAL])),
                           st.booleans()), min_size=1, max_size=25)


@settings(max_examples=300, deadline=None)
@given(_RUNS)
def test_a_subject_resolves_only_on_an_ok_result_or_a_complete_run_without_it(runs: list[tuple[dict[str, Status],
                                                                                               bool]]) -> None:
    """Issue 26: a fault fired, resolved as `no longer reported` by a run that saw only part of the ledger, and fired
    again. Through the real runner (a check returning a PartialView) into the tracker: a subject resolves only when
    a run reports it OK or a complete run leaves it out, so it never resolves and fires again between two real
    observations that it is gone."""
    script: list[Sequence[Result]] = []

    class Scripted(Check):
        def run(self) -> Sequence[Result]:
            return script.pop()

    check = Scripted("xid", CheckSettings(), CheckContext("n", Path("/nonexistent")))
    runner = CheckRunner(check)
    tracker = IncidentTracker(Store(None), "n", Clock())
    open_: set[str] = set()  # the model: subjects with an incident
    for seen, partial in runs:
        results = [Result("xid", s, status, status.name) for s, status in sorted(seen.items())]
        script.append(PartialView(results, "replaying") if partial else results)
        report = runner.run_once()
        assert report.complete is not partial
        events = tracker.observe("xid", report.results, IncidentPolicy(), report.complete, lambda e: ["console"])
        for e in events:
            if e.kind is EventKind.RESOLVED:
                assert seen.get(e.subject) is Status.OK or (not partial and e.subject not in seen), (e, seen, partial)
            if e.kind is EventKind.FIRED:
                assert e.subject not in open_, f"{e.subject} fired while its incident was open"
        for s, status in seen.items():
            (open_.add if status is not Status.OK else open_.discard)(s)
        if not partial:
            open_ &= set(seen)
        assert {i.subject for i in tracker.incidents()} == open_


def test_actions_that_finish_after_their_incident_resolved_are_kept_for_its_messages(h: Harness) -> None:
    """A stop switch the trainer obeys within the group window: the incident resolves while its actions run, and
    the grouped message sent after the window still says what was done (notifications.md's "Done:" line)."""
    [fired] = h.feed(r(Status.WARNING))
    h.tracker.record_action("disk", "/scratch", {"action": "signal", "outcome": "ok"}, fired.incident_id)
    assert kinds(h.feed(r(Status.OK))) == ["resolved"]
    h.tracker.record_action("disk", "/scratch", {"action": "hold-array", "outcome": "ok"}, fired.incident_id)
    assert [a["action"] for a in h.tracker.actions_of(fired.incident_id)] == ["signal", "hold-array"]
    [again] = h.feed(r(Status.WARNING))  # a new incident of the same subject owns nothing of the old one's
    h.tracker.record_action("disk", "/scratch", {"action": "late", "outcome": "ok"}, fired.incident_id)
    assert h.tracker.actions_of(again.incident_id) == []
    assert [a["action"] for a in h.tracker.actions_of(fired.incident_id)] == ["signal", "hold-array", "late"]


class CountingStore(Store):
    """A real SQLite store that counts the incident rows written and the transactions opened for them."""

    def __init__(self, state_dir: Path | None) -> None:
        super().__init__(state_dir)
        self.rows = 0
        self.saves = 0

    def save(self, upserts: Iterable[dict[str, Any]] = (), deletes: Iterable[tuple[str, str]] = (),
             outbox: Iterable[tuple[str, dict[str, Any]]] = (), now: float | None = None) -> None:
        rows = list(upserts)
        self.rows += len(rows)
        self.saves += 1
        super().save(rows, deletes, outbox, now)


def test_a_steady_incident_is_not_rewritten_at_every_run(tmp_path: Path) -> None:
    """A firing incident whose state does not change costs no write per run: its lifecycle is written when it
    changes, its description (summary, details, run count) at most once a DESCRIPTION_WRITE_INTERVAL, and a restart
    still finds it firing, unannounced again, with the description last written."""
    store = CountingStore(tmp_path)
    h = Harness(store)
    [fired] = h.feed(r(Status.WARNING, summary="3 GiB free"), advance=5)
    assert (store.rows, store.saves) == (1, 1)
    steady = int(DESCRIPTION_WRITE_INTERVAL // 5) - 1
    for _ in range(steady):  # the same result every 5 s: nothing stored changes
        assert h.feed(r(Status.WARNING, summary="3 GiB free"), advance=5) == []
    assert (store.rows, store.saves) == (1, 1)
    assert h.tracker.incidents()[0].bad_runs == 1 + steady  # counted in memory all the same
    assert h.feed(r(Status.WARNING, summary="2 GiB free"), advance=1) == []  # description: not yet
    assert store.rows == 1
    h.feed(r(Status.WARNING, summary="2 GiB free"), advance=5)  # the interval since the last write is up
    assert store.rows == 2
    for _ in range(steady):
        h.feed(r(Status.WARNING, summary="2 GiB free"), advance=5)
    assert store.rows == 2
    assert kinds(h.feed(r(Status.CRITICAL, summary="1 GiB free"), advance=5)) == ["escalated"]  # lifecycle: at once
    assert store.rows == 3
    assert h.feed(r(Status.CRITICAL, summary="0 GiB free"), advance=5) == []
    assert store.rows == 3
    store.close()

    store2 = CountingStore(tmp_path)
    again = Harness(store2)
    again.clock.now = h.clock.now
    [incident] = again.tracker.incidents()
    assert (incident.id, incident.firing, incident.status) == (fired.incident_id, True, Status.CRITICAL)
    assert incident.summary == "1 GiB free"  # the last description written, not the one kept in memory only
    assert again.feed(r(Status.CRITICAL, summary="0 GiB free"), advance=5) == []  # not announced again
    assert store2.rows == 1  # written once after the restart: a state disk that filled meanwhile shows at once
    for _ in range(steady):
        again.feed(r(Status.CRITICAL, summary="0 GiB free"), advance=5)
    assert (store2.rows, store2.saves) == (1, 1)
    assert kinds(again.feed(r(Status.OK), advance=5)) == ["resolved"]
    assert store2.load_incidents() == []
