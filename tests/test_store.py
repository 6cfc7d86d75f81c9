from __future__ import annotations

import logging
from pathlib import Path

import pytest

from trainguard.pipeline.store import Store


def test_corrupt_state_file_is_moved_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "state.db").write_bytes(b"this is not a database" * 100)
    with caplog.at_level(logging.ERROR):
        store = Store(tmp_path)
    assert store.persistent
    aside = list(tmp_path.glob("state.db.corrupt-*"))
    assert len(aside) == 1
    assert aside[0].read_bytes().startswith(b"this is not a database")
    assert any("moved aside" in rec.getMessage() for rec in caplog.records)
    store.put("k", "v")
    assert store.get("k") == "v"


def test_unusable_state_dir_falls_back_to_memory(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with caplog.at_level(logging.ERROR):
        store = Store(blocker / "state")  # a path under a regular file can never be created
    assert not store.persistent and store.degraded and "state dir unusable" in store.degraded
    store.put("k", "v")
    assert store.get("k") == "v"
    assert any("carry on in memory" in rec.getMessage() for rec in caplog.records)
    assert not store.recover()  # still impossible: stays in memory, keeps working
    assert store.get("k") == "v"


def test_outbox_is_ordered_per_channel_and_survives_reopen(tmp_path: Path) -> None:
    store = Store(tmp_path)
    store.save(outbox=[("slack", {"n": 1}), ("email", {"n": 1}), ("slack", {"n": 2})], now=100.0)
    store.close()
    store = Store(tmp_path)
    first = store.next_outbox("slack")
    assert first is not None and first.event == {"n": 1}
    store.outbox_retry(first.id, 200.0, "boom")
    again = store.next_outbox("slack")
    assert again is not None and again.attempts == 1 and again.next_attempt == 200.0 and again.last_error == "boom"
    store.outbox_done(first.id)
    second = store.next_outbox("slack")
    assert second is not None and second.event == {"n": 2}
    assert store.outbox_stats() == {"slack": (1, 100.0), "email": (1, 100.0)}


def test_wal_mode(tmp_path: Path) -> None:
    store = Store(tmp_path)
    with store.transaction() as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
