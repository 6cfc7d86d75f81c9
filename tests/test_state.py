"""Each check's corner of the state store: a value saved again unchanged costs no write; a failed write is retried."""

from __future__ import annotations

import pytest

from trainguard.core.state import ScopedState, scoped_key


class CountingStore:
    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.puts = 0
        self.fail = False
        self.generation = 0

    def get(self, key: str) -> str | None:
        return self.data.get(key)

    def put(self, key: str, value: str) -> None:
        self.puts += 1
        if self.fail:
            raise OSError(28, "No space left on device")
        self.data[key] = value


def test_an_unchanged_value_is_not_written_again() -> None:
    store = CountingStore()
    state = ScopedState(store, "check/nvlink")
    state.save_json("counters", {"a": 1})
    state.save_json("counters", {"a": 1})
    state.save_json("seen", {"a": 1})  # another key: its own write
    assert store.puts == 2
    state.save_json("counters", {"a": 2})
    assert store.puts == 3 and state.load_json("counters") == {"a": 2}
    assert store.data[scoped_key("check/nvlink", "counters")] == '{"a": 2}'


def test_a_failed_write_is_tried_again_with_the_same_value() -> None:
    store = CountingStore()
    state = ScopedState(store, "check/xid")
    state.put("cursor", "1")
    store.fail = True
    with pytest.raises(OSError):
        state.put("cursor", "2")
    state.save_json("positions", {"x": 1})  # save_json logs the failure, never raises
    store.fail = False
    state.put("cursor", "2")
    state.save_json("positions", {"x": 1})
    assert store.data == {"check/xid/cursor": "2", "check/xid/positions": '{"x": 1}'}
    assert store.puts == 5


def test_a_store_that_started_over_is_written_again() -> None:
    """A store whose copy into memory failed holds less than this scope wrote: unchanged values are written again."""
    store = CountingStore()
    state = ScopedState(store, "check/nvlink")
    state.save_json("counters", {"a": 1})
    store.data.clear()
    store.generation += 1
    assert state.save_json("counters", {"a": 1})
    assert store.data == {"check/nvlink/counters": '{"a": 1}'} and store.puts == 2
