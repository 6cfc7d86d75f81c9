"""A full or failing state disk loses no alert: incidents and notifications carry on from memory, the agent says so
with an incident of its own, writes everything back when space returns, and restarts on the full disk."""

from __future__ import annotations

import os
import signal
import sqlite3
import stat
from collections.abc import Callable
from pathlib import Path

from tests.conftest import AgentProcess
from trainguard.pipeline.store import Store


def fill(mount: Path) -> Path:
    """Every byte of a tmpfs taken by one file (the last partial write fails with ENOSPC)."""
    filler = mount / "filler"
    with filler.open("wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    return filler


def test_the_store_carries_on_in_memory_and_writes_back(tmpfs: Callable[..., Path]) -> None:
    state = tmpfs(size="1m", inodes=100)
    store = Store(state)
    store.save(upserts=[{"check": "disk", "subject": "/", "n": 1}], outbox=[("slack", {"n": 1})], now=1.0)
    filler = fill(state)
    big = "x" * 300_000  # more than the disk has left: the write fails with SQLITE_FULL
    store.save(upserts=[{"check": "disk", "subject": "/big", "data": big}], outbox=[("slack", {"n": 2})], now=2.0)
    assert store.degraded and not store.persistent
    assert {i["subject"] for i in store.load_incidents()} == {"/", "/big"}  # nothing lost, nothing raised
    assert store.outbox_stats() == {"slack": (2, 1.0)}
    store.put("cursor", "7")
    assert not store.recover()  # still full
    filler.unlink()
    assert store.recover() and store.persistent and store.degraded is None
    store.close()
    again = Store(state)
    assert {i["subject"] for i in again.load_incidents()} == {"/", "/big"}
    assert again.outbox_stats() == {"slack": (2, 1.0)} and again.get("cursor") == "7"
    again.close()


def test_a_full_disk_is_not_corruption_and_files_are_private(tmpfs: Callable[..., Path]) -> None:
    state = tmpfs(size="1m", inodes=100)
    old = os.umask(0o022)
    try:
        store = Store(state)
        store.save(upserts=[{"check": "disk", "subject": "/", "n": 1}])
        for name in ("state.db", "state.db-wal", "state.db-shm"):
            assert stat.S_IMODE(os.stat(state / name).st_mode) == 0o600, name
        store.close()
    finally:
        os.umask(old)
    fill(state)
    restarted = Store(state)  # on the full disk: the file is fine, it is not moved aside
    assert not list(state.glob("state.db.corrupt-*"))
    assert [i["subject"] for i in restarted.load_incidents()] == ["/"]
    restarted.save(upserts=[{"check": "disk", "subject": "/x", "pad": "y" * 300_000}])
    assert {i["subject"] for i in restarted.load_incidents()} == {"/", "/x"}


def _config(tmp_path: Path, state: Path, watched: Path) -> Path:
    path = tmp_path / "trainguard.toml"
    path.write_text(f"""
[agent]
node_name = "fulldisk"
state_dir = "{state}"
listen = ""
[checks.scratch]
type = "disk"
paths = ["{watched}"]
interval = "1s"
jitter = 0
free_critical = "50%"
free_warning = "0%"
inodes_free_warning = "0%"
inodes_free_critical = "0%"
[notifiers.console]
""")
    return path


def test_the_real_agent_on_a_full_state_disk(tmp_path: Path, tmpfs: Callable[..., Path],
                                             agent_process: Callable[..., AgentProcess]) -> None:
    state = tmpfs(size="1m", inodes=200)
    watched = tmpfs(size="4m", inodes=100)
    config = _config(tmp_path, state, watched)
    agent = agent_process(config, log_name="first.log")
    agent.wait_for("msg=ready")
    filler = fill(state)
    (watched / "data").write_bytes(b"\0" * (3 << 20))  # 75% used: the scratch disk goes CRITICAL
    agent.wait_for("event=fired check=scratch", timeout=20)  # announced although nothing can be written
    agent.wait_for("event=fired check=agent subject=state", timeout=30)
    assert "not writable" in agent.output()
    filler.unlink()
    agent.wait_for("state dir writable again", timeout=30)
    agent.wait_for("event=resolved check=agent subject=state", timeout=30)
    db = sqlite3.connect(f"file:{state / 'state.db'}?mode=ro", uri=True)
    assert ("scratch", str(watched)) in db.execute("SELECT check_name, subject FROM incidents").fetchall()
    db.close()

    agent.signal(signal.SIGKILL)
    agent.wait()
    filler = fill(state)
    second = agent_process(config, log_name="second.log")  # restart on the full disk
    second.wait_for("msg=ready", timeout=30)
    second.wait_for("event=fired check=agent subject=state", timeout=30)  # running, and saying why it is at risk
    assert second.proc is not None and second.proc.poll() is None, second.output()
    assert "Traceback" not in second.output() and "event=fired check=scratch" not in second.output()
    assert not list(state.glob("state.db.corrupt-*"))
    filler.unlink()
