from __future__ import annotations

import pytest

from trainguard.core.forecast import SeriesWindow, theil_sen_slope
from trainguard.core.model import Status, worst
from trainguard.core.units import (
    MAX_INT64,
    Limit,
    bounded_float,
    bounded_int,
    format_bytes,
    format_duration,
    parse_count,
    parse_count_limit,
    parse_duration,
    parse_size,
    parse_size_limit,
)


@pytest.mark.parametrize(("text", "seconds"), [
    ("90s", 90), ("15m", 900), ("2h", 7200), ("1h30m", 5400), ("250ms", 0.25), ("1d", 86400), (30, 30), (2.5, 2.5),
    (" 10S ", 10),
])
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["", "10", "10x", "h", "-5s", "5 s", "1h 30m", True, None, [1], -3, "10s5"])
def test_bad_durations_name_the_value(bad: object) -> None:
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration(bad)


@pytest.mark.parametrize(("text", "size"), [
    ("512MiB", 512 * 2**20), ("2TiB", 2 * 2**40), ("10GB", 10**10), ("4096", 4096), (4096, 4096), ("1.5KiB", 1536),
    ("7b", 7), ("3 gib", 3 * 2**30),
])
def test_sizes(text: object, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["", "12XB", "MiB", "-1MiB", -1, True, "5%", 1.5])
def test_bad_sizes(bad: object) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(bad)


def test_limits_absolute_and_percent() -> None:
    assert parse_size_limit("5%") == Limit(5.0, percent=True)
    assert parse_size_limit("5%").resolve(200) == 10
    assert parse_size_limit("1KiB") == Limit(1024.0)
    assert parse_count_limit("50k") == Limit(50000.0)
    assert parse_count("2M") == 2_000_000
    for bad in ("101%", "5 percent", "x%"):
        with pytest.raises(ValueError, match="invalid"):
            parse_size_limit(bad)
    with pytest.raises(ValueError, match="invalid count"):
        parse_count_limit("5GiB")


def test_formatting() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**30 + 2**29) == "3.5 GiB"
    assert format_duration(45) == "45s"
    assert format_duration(3725) == "1h02m"
    assert format_duration(90000) == "1d1h"


def test_numbers_from_a_jobs_files_are_bounded_and_never_raise() -> None:
    huge = 10**5000  # Python refuses to print or parse an int past 4300 digits: formatting it raises ValueError
    for value in (huge, -huge, "9" * 5000, b"9" * 10_000, MAX_INT64 + 1, -1, "-1", True, 1.0, None, "", "-", "1e3",
                  "\u0661", "12x", [1], b"\xff"):
        assert bounded_int(value) is None, value
    assert [bounded_int(v) for v in (0, 7, " 42\n", b"42", MAX_INT64, str(MAX_INT64))] == [0, 7, 42, 42, MAX_INT64,
                                                                                          MAX_INT64]
    assert bounded_int("-3", low=-5) == -3 and bounded_int(9, high=8) is None and bounded_int("9" * 21, high=huge) is None
    for value in (float("nan"), float("inf"), -float("inf"), huge, "1.5", True, None):
        assert bounded_float(value) is None, value
    assert bounded_float(1.5) == 1.5 and bounded_float(3) == 3.0 and bounded_float(2.0, high=1.0) is None


def test_severity_order_differs_from_exit_code() -> None:
    assert [s.name for s in sorted(Status, key=lambda s: s.severity)] == ["OK", "UNKNOWN", "WARNING", "CRITICAL"]
    assert worst([Status.UNKNOWN, Status.WARNING]) is Status.WARNING
    assert worst([Status.OK, Status.UNKNOWN]) is Status.UNKNOWN
    assert worst([]) is Status.OK


def test_theil_sen_ignores_an_outlier() -> None:
    points = [(float(t), 1000.0 - 10 * t) for t in range(10)]
    points[4] = (4.0, 5000.0)  # one wild sample (a checkpoint briefly freed and refilled)
    assert theil_sen_slope(points) == pytest.approx(-10.0)


def test_forecast_needs_enough_points_and_span() -> None:
    window = SeriesWindow(size=10, min_points=5, min_span_s=100)
    for t in range(4):
        window.add(t * 50.0, 1000 - t * 100.0)
    assert window.forecast_down_to(0) is None  # 4 points
    window.add(200.0, 600.0)
    fc = window.forecast_down_to(0)
    assert fc is not None
    assert fc.slope_per_s == pytest.approx(-2.0)
    assert fc.seconds_to_limit == pytest.approx(300.0)
    flat = SeriesWindow(min_points=3, min_span_s=0)
    for t in range(5):
        flat.add(float(t), 500.0)
    fc = flat.forecast_down_to(0)
    assert fc is not None
    assert fc.seconds_to_limit is None  # a large but flat series never fills
