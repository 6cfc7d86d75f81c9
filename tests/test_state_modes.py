"""Every file the agent writes in its state directory is 0600 whatever the umask it runs under: the database and its
WAL and shared memory, the XID marks, the stack dumps of a hung job (docs/security.md)."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from tests.conftest import AgentProcess, hang_config, require, require_root, wait_until
from trainguard.core.files import replace_file
from trainguard.node.stacks import ProcessStack, find_py_spy, write_dumps
from trainguard.pipeline.store import Store


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def modes(state: Path) -> dict[str, str]:
    """Every regular file under `state`, with its permission bits."""
    return {str(p.relative_to(state)): oct(stat.S_IMODE(p.lstat().st_mode)) for p in state.rglob("*")
            if stat.S_ISREG(p.lstat().st_mode)}


def test_each_writer_makes_its_file_0600_under_umask_022(tmp_path: Path) -> None:
    with umask(0o022):
        replace_file(tmp_path / "xid-marks.json", b"{}")
        write_dumps(tmp_path / "stacks", "job 7 (train)", [ProcessStack(1, "0", "S", "main (t.py:1)", "dump\n")],
                    time.time())
        store = Store(tmp_path)
        store.put("k", "v")
        try:
            files = modes(tmp_path)
        finally:
            store.close()
    assert {"xid-marks.json", "state.db", "state.db-wal", "state.db-shm"} <= set(files), files
    assert any(name.startswith("stacks/") for name in files), files
    assert set(files.values()) == {"0o600"}, files


def test_the_agent_under_umask_022_leaves_only_0600_files(tmp_path: Path,
                                                          agent_process: Callable[..., AgentProcess]) -> None:
    """The real agent: its store, the XID marks it publishes at start, and the stacks of a job that hangs."""
    require_root()  # the kernel log for the xid check
    require(find_py_spy() is not None, "needs py-spy (pip install py-spy)")
    marker = f"modes-{uuid.uuid4().hex[:8]}"
    # its output to /dev/null: a file it writes (pytest's capture) would be progress
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", marker], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    state = tmp_path / "state"
    # the xid check publishes its marks at start (and acts on no XID other tests write to the kernel log); the hang
    # check dumps the job's stacks when it hangs
    config = hang_config(tmp_path / "trainguard.toml", state, marker, "root",
                         "[checks.xid]\nactions = { critical = [] }\n[notifiers.console]\n")
    try:
        agent = agent_process(config, wrapper=["sh", "-c", 'umask 022; exec "$@"', "sh"])
        assert agent.proc is not None
        wait_until(lambda: "hung job stacks" in agent.output(), 40, what="the stack dump")
        agent.wait_for("logger=trainguard.alert", 10)
        status = Path(f"/proc/{agent.proc.pid}/status").read_text()
        assert "Umask:\t0022" in status
        files = modes(state)
    finally:
        job.kill()
        job.wait(10)
    assert {"xid-marks.json", "state.db", "state.db-wal", "state.db-shm"} <= set(files), files
    assert any(name.startswith("stacks/") for name in files), files
    assert set(files.values()) == {"0o600"}, files
