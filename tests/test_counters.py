"""Hardware counters as increases over a window: resets on driver reload, wraps of narrow counters, saturation."""

from __future__ import annotations

from trainguard.core.counters import CounterWindow, counter_delta, saturated


def test_delta_growth_reset_and_wrap() -> None:
    assert counter_delta(10, 25) == 15
    assert counter_delta(40_000, 7) == 7  # a 64-bit counter that fell: the driver reloaded, 7 counted since
    assert counter_delta(65_530, 4, bits=16) == 10  # a 16-bit counter wrapped: 5 to the top, 0..4 after
    assert counter_delta(20_000, 4, bits=16) == 4  # fell from the lower half: a reset, not a wrap
    assert counter_delta(255, 0, bits=8) == 0  # fell from the top, where it saturates: cleared or reloaded
    assert counter_delta(255, 3, bits=8) == 3
    assert counter_delta(254, 0, bits=8) == 2  # one below the top: a wrap
    assert counter_delta(250, 3, bits=8) == 9


def test_saturation() -> None:
    assert saturated(255, 8) and saturated(65535, 16)
    assert not saturated(254, 8) and not saturated(10**9, None)


def test_window_sums_increases_and_forgets_old_ones() -> None:
    w = CounterWindow(window=3600)
    assert w.update("symbol_error", 100, now=0) == 0  # the first reading is the baseline
    w.update("symbol_error", 160, now=600)
    w.update("symbol_error", 190, now=1200)
    assert w.increase("symbol_error", now=1200) == 90
    w.update("symbol_error", 5, now=1800)  # driver reload: counters back to zero, 5 new
    assert w.increase("symbol_error", now=1800) == 95
    assert w.increase("symbol_error", now=600 + 3601) == 35  # the +60 at t=600 left the window
    assert w.increase("unknown", now=0) == 0


def test_window_memory_is_bounded_and_follows_the_hardware() -> None:
    w = CounterWindow(window=10**9, max_events=8)
    for i in range(1, 1000):
        w.update("c", i * 2, now=float(i))
    assert w.increase("c", now=1000.0) == 1996  # folded, not lost
    assert len(w.to_json()["c"][1]) <= 8
    w.update("gone", 1, now=0)
    w.keep(["c"])
    assert w.last("gone") is None and w.last("c") == 1998


def test_window_survives_a_restart_through_its_json() -> None:
    w = CounterWindow(window=3600)
    w.update(("mlx5_0", 1, "link_downed"), 2, now=0)
    w.update(("mlx5_0", 1, "link_downed"), 3, now=10)
    saved = w.to_json(encode=lambda k: "/".join(map(str, k)))
    again = CounterWindow(window=3600)
    again.load_json(saved, decode=lambda t: (t.split("/")[0], int(t.split("/")[1]), t.split("/")[2]))
    assert again.update(("mlx5_0", 1, "link_downed"), 4, now=20) == 1  # an increase while the agent was down counts
    assert again.increase(("mlx5_0", 1, "link_downed"), now=20) == 2
    again.load_json({"bad": "not a list", "x/1/y": [1, [["t", 1]]]}, decode=lambda t: t)  # garbage is skipped
    assert again.last("bad") is None


def test_the_window_version_moves_only_when_what_it_saves_changes() -> None:
    w = CounterWindow(window=100)
    v = w.version
    w.update("c", 7, now=0)
    assert w.version > v  # a new counter
    v = w.version
    w.update("c", 7, now=10)
    w.increase("c", now=10)
    assert w.version == v and w.to_json() == {"c": [7, []]}  # the same reading: nothing to save
    w.update("c", 9, now=20)
    assert w.version > v  # grew
    v = w.version
    w.increase("c", now=200)
    assert w.version > v and w.to_json() == {"c": [9, []]}  # the increase left the window
    v = w.version
    w.update("c", 0, now=210)
    assert w.version > v  # a reset to zero counts nothing, but the reading changed
    v = w.version
    w.keep([])
    assert w.version > v and w.to_json() == {}  # the counter went away


def test_growth_across_a_gap_longer_than_the_window_is_returned_not_put_in_the_window() -> None:
    """A counter that did not answer for hours (a GPU's reads NotSupported, an unreadable sysfs file) comes back with
    hours of growth: as a burst at the moment it answered again it would cross a per-hour limit that the rate never
    did. The growth is still returned (the per-GPU totals count it)."""
    w = CounterWindow(window=3600, interval=30)
    w.update("crc", 0, now=0)
    assert w.update("crc", 90 * 3 * 3600, now=3 * 3600) == 972_000
    assert w.increase("crc", now=3 * 3600) == 0
    w.update("crc", 972_100, now=3 * 3600 + 30)  # read on schedule again: counted
    assert w.increase("crc", now=3 * 3600 + 30) == 100


def test_a_window_shorter_than_the_interval_still_counts_each_run_and_a_loaded_one_counts_the_downtime() -> None:
    w = CounterWindow(window=10, interval=30)
    w.update("replay", 0, now=0)
    w.update("replay", 2, now=30)
    assert w.increase("replay", now=30) == 2
    loaded = CounterWindow(window=3600, interval=30)
    loaded.load_json(w.to_json())
    loaded.update("replay", 5, now=5 * 3600)  # the agent was down for hours: what grew meanwhile counts, as before
    assert loaded.increase("replay", now=5 * 3600) == 3
