"""A user outside root and the trainguard group, against an installed agent (config 0640 in a 0750 directory, control
socket in a 0750 state directory): what they may do works (status over TCP, validate a file they can read, the XID
catalog), the rest ends in one line saying who may, with exit code 77 (EX_NOPERM), never a traceback."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, AgentProcess, free_port, require_root, require_tool, wait_until
from tests.slurm_cluster import OTHER_USER, ensure_user
from trainguard.cli import EXIT_NOPERM


@pytest.fixture
def installed(agent_process: Callable[..., AgentProcess]) -> Iterator[tuple[Path, Path, int]]:
    """(the root-only config, a readable copy, the agent's TCP port), the agent running as root."""
    require_root()
    ensure_user(OTHER_USER)
    top = Path(tempfile.mkdtemp(prefix="tg-unpriv-"))
    top.chmod(0o755)
    etc, state = top / "etc", top / "state"
    port = free_port()
    for folder in (etc, state):
        folder.mkdir()
        shutil.chown(folder, "root", "trainguard")
        folder.chmod(0o750)
    text = (f'[agent]\nstate_dir = "{state}"\nnode_name = "n1"\nlisten = "127.0.0.1:{port}"\n'
            "[checks.memory]\n[notifiers.console]\n")
    config, readable = etc / "trainguard.toml", top / "readable.toml"
    config.write_text(text)
    shutil.chown(config, "root", "trainguard")
    config.chmod(0o640)
    readable.write_text(text)
    readable.chmod(0o644)
    agent = agent_process(config)  # as root, its control socket in the state directory: 0660, root's group
    wait_until((state / "control.sock").exists, 20, what="the control socket")
    agent.wait_for("first round done", 20)
    try:
        yield config, readable, port
    finally:
        shutil.rmtree(top, ignore_errors=True)


def as_other(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": pwd.getpwnam(OTHER_USER).pw_dir, "LANG": "C.UTF-8"}
    return subprocess.run([require_tool("setpriv"), f"--reuid={OTHER_USER}", f"--regid={OTHER_USER}", "--init-groups",
                           sys.executable, "-m", "trainguard", *argv], capture_output=True, text=True, timeout=60,
                          cwd=REPO, env=env)


def one_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def test_an_unprivileged_user_gets_what_they_may_and_one_line_for_the_rest(installed: tuple[Path, Path, int]) -> None:
    config, readable, port = installed
    socket = config.parent.parent / "state" / "control.sock"
    refused_config = f"({config}: permission denied)"
    for command in (["check"], ["ack", "memory"], ["silence", "memory", "--for", "1h", "--reason", "x"],
                    ["clear", "memory/host", "--reason", "x"], ["validate"], ["notify-test"], ["selftest"]):
        proc = as_other(*command, "--config", str(config))
        assert proc.returncode == EXIT_NOPERM, (command, proc.stderr)
        assert one_line(proc) == f"trainguard: {command[0]} needs root or the trainguard group {refused_config}"
    # a config they can read: the socket refuses them
    for command in (["ack", "memory"], ["silence", "memory", "--for", "1h", "--reason", "x"],
                    ["clear", "memory/host", "--reason", "x"], ["selftest"]):
        proc = as_other(*command, "--config", str(readable))
        assert proc.returncode == EXIT_NOPERM, (command, proc.stderr)
        assert one_line(proc) == f"trainguard: {command[0]} needs root or the trainguard group ({socket}: " \
                                 "permission denied)"
    status = as_other("status", "--config", str(readable))  # the socket refuses them: TCP, said in one line
    assert status.returncode == 0 and "node n1" in status.stdout and "memory" in status.stdout, status.stderr
    assert one_line(status).startswith(f"trainguard: the control socket ({socket}") and \
        f"asking http://127.0.0.1:{port} over TCP" in one_line(status)
    status = as_other("status", "--config", str(config), "--url", f"http://127.0.0.1:{port}")
    assert status.returncode == 0 and "node n1" in status.stdout, status.stderr
    assert one_line(status) == f"trainguard: {config}: permission denied: status goes on with --url " \
                               f"http://127.0.0.1:{port}"
    xid = as_other("xid", "79", "--config", str(config))
    assert xid.returncode == 0 and "XID 79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS" in xid.stdout, xid.stderr
    assert "xid goes on with the default responses" in one_line(xid)
    valid = as_other("validate", "--config", str(readable))
    assert valid.returncode == 0 and one_line(valid).startswith(f"config OK: {readable}; "), one_line(valid)


def test_a_socket_they_can_see_but_not_open_is_refused_the_same_way(installed: tuple[Path, Path, int]) -> None:
    """Where the socket's directory is searchable, the socket's own mode (0660) refuses them: connect(), not stat()."""
    config, readable, port = installed
    state = config.parent.parent / "state"
    state.chmod(0o755)
    ack = as_other("ack", "memory", "--config", str(readable))
    assert ack.returncode == EXIT_NOPERM, ack.stderr
    assert one_line(ack) == f"trainguard: ack needs root or the trainguard group ({state / 'control.sock'}: " \
                            "permission denied)"
    status = as_other("status", "--config", str(readable))
    assert status.returncode == 0 and "node n1" in status.stdout, status.stderr
    assert f"asking http://127.0.0.1:{port} over TCP" in one_line(status)
