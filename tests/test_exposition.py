"""/metrics as Prometheus reads it: what the agent renders is parsed back by prometheus_client's parser (a second,
independent reading of the format), whatever a job put in a label value."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from trainguard.agent.metrics import BUILD_INFO, CHECK_RUNS, CONTENT_TYPE, collect, exposition, family, render
from trainguard.core.model import Metric, Result, Sample, Status
from trainguard.pipeline.engine import CheckState, Snapshot
from trainguard.pipeline.runner import RunReport

PATH = Metric("trainguard_test_free_bytes", 'Free bytes\\of a "path",\nper path.', ("path", "kind"))
COUNT = Metric("trainguard_test_events_total", "Events.", ("path",), counter=True)
PLAIN = Metric("trainguard_test_up", "Up.")


def parsed(text: bytes) -> dict[str, tuple[str, str, list[tuple[dict[str, str], float]]]]:
    return {f.name: (f.type, f.documentation, [(dict(s.labels), s.value) for s in f.samples])
            for f in text_string_to_metric_families(text.decode())}


def test_families_render_as_the_text_format_prometheus_parses() -> None:
    text = render([family(PATH, [PATH(1.5, {"path": "/scratch", "kind": "fs"}), PATH(2, {"path": "/", "kind": "fs"})]),
                   family(COUNT, [COUNT(3, {"path": "/"})]), family(PLAIN, [PLAIN(1)]), family(BUILD_INFO)])
    lines = text.decode().splitlines()
    assert lines[:4] == ['# HELP trainguard_test_free_bytes Free bytes\\\\of a "path",\\nper path.',
                         "# TYPE trainguard_test_free_bytes gauge",
                         'trainguard_test_free_bytes{kind="fs",path="/scratch"} 1.5',  # labels by name
                         'trainguard_test_free_bytes{kind="fs",path="/"} 2.0']
    assert "trainguard_test_up 1.0" in lines
    assert "# TYPE trainguard_build_info gauge" in lines
    got = parsed(text)
    assert got["trainguard_test_free_bytes"] == ("gauge", 'Free bytes\\of a "path",\nper path.',
                                                 [({"path": "/scratch", "kind": "fs"}, 1.5),
                                                  ({"path": "/", "kind": "fs"}, 2.0)])
    assert got["trainguard_test_events"] == ("counter", "Events.", [({"path": "/"}, 3.0)])
    assert got["trainguard_build_info"][2] == []  # declared, no sample yet: HELP and TYPE only


def test_the_first_of_two_samples_with_one_label_set_is_kept() -> None:
    fam = family(PLAIN, [PLAIN(1), PLAIN(0)])
    assert fam.samples == (((), 1),)


def test_special_values_and_bytes_that_are_not_utf8() -> None:
    odd = "/data/\udcff\udcfejob"  # os.fsdecode of a directory name a job chose, not UTF-8
    text = render([family(PATH, [PATH(math.inf, {"path": odd, "kind": "a"}), PATH(-math.inf, {"path": "b", "kind": "b"}),
                                 PATH(math.nan, {"path": "c", "kind": "c"})])])
    values = [v for _, v in parsed(text)["trainguard_test_free_bytes"][2]]
    assert values[0] == math.inf and values[1] == -math.inf and math.isnan(values[2])
    assert b'path="/data/\\\\udcff\\\\udcfejob"' in text  # shown as its escapes, their backslashes escaped


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(), min_size=1, max_size=5, unique=True),
       st.floats(allow_nan=False, allow_infinity=True))
def test_any_label_value_a_job_chooses_reads_back_unchanged(values: list[str], value: float) -> None:
    samples = [PATH(value, {"path": v, "kind": "k"}) for v in values]
    got = parsed(render([family(PATH, samples)]))["trainguard_test_free_bytes"][2]
    assert [labels["path"] for labels, _ in got] == [v.encode("utf-8", "backslashreplace").decode() for v in values]
    assert all(v == value for _, v in got)


def test_an_empty_snapshot_renders_every_agent_family_and_the_content_type_names_the_format() -> None:
    snap = Snapshot("node1", 0.0, {}, {}, {}, {})
    text = exposition(lambda: snap)()
    names = {f.name for f in text_string_to_metric_families(text.decode())}
    assert {"trainguard_build_info", "trainguard_check_runs", "trainguard_incident_firing"} <= names
    assert len(names) == len(list(collect(snap)))
    assert CHECK_RUNS.name.removesuffix("_total") in names
    assert CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"


def test_two_values_that_render_alike_are_one_series() -> None:
    """A directory name with an undecodable byte and one a user typed as its escape would be two identical series:
    Prometheus would keep one at random. The first is kept, as for equal values."""
    text = render([family(PATH, [PATH(2, {"path": "/data/\udcff", "kind": "a"}),
                                 PATH(1, {"path": "/data/\\udcff", "kind": "a"})])]).decode()
    assert [line for line in text.splitlines() if not line.startswith("#")] == \
        ['trainguard_test_free_bytes{kind="a",path="/data/\\\\udcff"} 2.0']


def _run(check: str, started: float, *samples: Sample) -> CheckState:
    report = RunReport(check, started, 0.1, "ok", (Result(check, "/", Status.OK, "fine", samples=samples),))
    return CheckState("disk", 60.0, last=report, runs=1)


def test_a_check_run_is_rendered_once_while_it_is_the_latest_and_the_first_check_of_a_series_wins(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A scrape renders only the checks that ran since the one before; what it answers is the same as rendering
    everything afresh. Two checks of one type reporting one series: the first by check name wins, as before."""
    from trainguard.agent import metrics

    rendered: list[str] = []
    real = metrics.run_series
    monkeypatch.setattr(metrics, "run_series", lambda report: rendered.append(report.check) or real(report))
    checks = {"disk_b": _run("disk_b", 1.0, PATH(2, {"path": "/", "kind": "fs"}), PATH(7, {"path": "/b", "kind": "fs"})),
              "disk_a": _run("disk_a", 1.0, PATH(1, {"path": "/", "kind": "fs"}), COUNT(3, {"path": "/"}))}
    snap = Snapshot("n1", 0.0, checks, {}, {}, {})
    scrape = exposition(lambda: snap)
    first = scrape()
    assert sorted(rendered) == ["disk_a", "disk_b"]
    got = parsed(first)
    assert got["trainguard_test_free_bytes"][2] == [({"path": "/", "kind": "fs"}, 1.0),  # disk_a's, not disk_b's
                                                    ({"path": "/b", "kind": "fs"}, 7.0)]
    assert got["trainguard_test_events"][2] == [({"path": "/"}, 3.0)]
    assert scrape() == first and len(rendered) == 2  # nothing ran since: nothing rendered again

    snap = replace(snap, checks={**checks, "disk_b": _run("disk_b", 2.0, PATH(9, {"path": "/b", "kind": "fs"}))})
    second = scrape()
    assert rendered[2:] == ["disk_b"]  # disk_a's run is still the latest: its text is kept
    afresh = len(rendered)
    assert second == render(collect(snap))  # the same as rendered afresh
    del rendered[afresh:]
    assert parsed(second)["trainguard_test_free_bytes"][2] == [({"path": "/", "kind": "fs"}, 1.0),
                                                               ({"path": "/b", "kind": "fs"}, 9.0)]

    snap = replace(snap, checks={"disk_b": replace(snap.checks["disk_b"], runs=1)})  # disk_a gone (a reload): its
    # series too; disk_b's state copied afresh, as every snapshot does, and nothing ran: nothing rendered
    assert "trainguard_test_events{" not in scrape().decode() and rendered[3:] == []

    snap = replace(snap, checks={"disk_b": replace(snap.checks["disk_b"], runs=2, errors=1)})  # a failed run: the
    # latest run's samples stay, its counts change
    text = scrape().decode()
    assert 'trainguard_check_runs_total{check="disk_b",outcome="error"} 1.0' in text and rendered[3:] == ["disk_b"]
    assert text == render(collect(snap)).decode()
