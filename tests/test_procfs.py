"""The agent's own usage (trainguard_agent_resident_memory_bytes, _cpu_seconds_total), read from /proc/self/stat,
against psutil's reading of the same process."""

from __future__ import annotations

import threading

import psutil
import pytest

from trainguard.node import procfs
from trainguard.node.procfs import own_usage


def test_own_usage_reads_what_psutil_reads() -> None:
    release = threading.Event()
    extra = threading.Thread(target=release.wait, args=(10,))
    extra.start()
    try:
        bulk = bytearray(32 << 20)  # 32 MiB touched: resident, so the reading has something to agree on
        bulk[::4096] = b"x" * len(bulk[::4096])
        me = psutil.Process()
        before, threads_before = me.cpu_times(), me.num_threads()
        usage = own_usage()
        after, threads_after, rss = me.cpu_times(), me.num_threads(), me.memory_info().rss
    finally:
        release.set()
        extra.join()
    assert usage["threads"] >= 2  # this one and the extra one (another test's may be ending meanwhile)
    assert min(threads_before, threads_after) <= usage["threads"] <= max(threads_before, threads_after)
    assert abs(usage["rss"] - rss) < 4 << 20 and usage["rss"] > 32 << 20
    assert before.user + before.system - 0.02 <= usage["cpu"] <= after.user + after.system + 0.02
    del bulk


def test_an_unreadable_or_garbled_stat_is_no_usage(monkeypatch: pytest.MonkeyPatch) -> None:
    for text in (None, "", "1234 (trainguard", "1234 (a) b) S 1"):
        monkeypatch.setattr(procfs.ProcFS, "read_text", lambda self, *parts, t=text: t)
        assert own_usage() == {}, text
