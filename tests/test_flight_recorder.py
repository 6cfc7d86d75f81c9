"""The rank that hung a distributed job: PyTorch's flight recorder read from real ranks, and named in the incident.

The dumps in tests/data/flight_recorder come from real two-rank Gloo jobs of the CPU build of PyTorch 2.13
(tests/data/flight_recorder/capture.py). The end-to-end test runs examples/train_ddp.py for real: two ranks, one of
which stops before an all_reduce, under the real `trainguard run` process with Slack and email.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import tomli_w

from tests.conftest import REPO, AgentProcess, free_port, require, require_root, require_tool, wait_until
from tests.peers import SMTP_PASSWORD, SMTP_USER, Mailbox, SlackEmulator, slack_emulator, smtp_server
from tests.slurm_cluster import JOB_USER, ensure_user
from trainguard.install import Installer
from trainguard.node.flight import (
    HANDLERS,
    Collective,
    RankProcess,
    RankTrace,
    analyze,
    fetch_ranks,
    load_pickle,
    parse_dump,
    query_socket,
    ranges,
    read_dumps,
)

DATA = REPO / "tests" / "data" / "flight_recorder"


def test_a_real_gloo_hang_read_from_the_ranks_worker_servers() -> None:
    """rank 1 of train_ddp.py stood before its all_reduce; rank 0 waited in it (fr_trace_json answers)."""
    traces = [parse_dump(json.loads((DATA / "hang" / f"rank{r}.json").read_text()), r, 1000 + r, "gpu-07")
              for r in (0, 1)]
    assert all(t is not None for t in traces)
    stall = analyze([t for t in traces if t])
    assert stall is not None and stall.collective is not None
    assert stall.collective.op == "all_reduce" and [t.rank for t in stall.waiting] == [0]
    [lagging] = stall.missing
    assert lagging.rank == 1 and lagging.last("0") == Collective("0", stall.collective.seq - 1)
    assert stall.describe() == (f"rank 1 (node gpu-07, pid 1001) never entered all_reduce #{stall.collective.seq} "
                                f"(its last: all_reduce #{stall.collective.seq - 1}); rank 0 waiting")


def test_the_watchdogs_pickled_dumps_are_read_without_running_anything(tmp_path: Path) -> None:
    traces = read_dumps(DATA / "dumps", None, "gpu-01")
    assert [t.rank for t in traces] == [0, 1]
    stall = analyze(traces)
    assert stall is not None and stall.describe() == ("rank 1 (node gpu-01) never entered all_reduce #5 (its last: "
                                                      "barrier #4); rank 0 waiting")

    class Boom:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    hostile = tmp_path / "hostile"
    hostile.mkdir()
    (hostile / "rank_0").write_bytes(pickle.dumps({"entries": [Boom()]}))
    (hostile / "rank_1").write_bytes(b"\x80\x05garbage")
    (hostile / "rank_2").symlink_to(DATA / "dumps" / "rank_0")  # a link is not the rank's own file
    assert read_dumps(hostile, None) == [] and not (tmp_path / "ran").exists()
    assert load_pickle(pickle.dumps(Boom())) is None
    assert read_dumps(DATA / "dumps", os.getuid() + 1) == []  # not the job user's files


def test_a_dump_of_the_wrong_shape_yields_nothing() -> None:
    for junk in (None, [], "x", {"entries": "x"}, {"entries": [1, None, {"collective_seq_id": "9" * 40}]},
                 {"entries": [{"process_group": [["nested"]], "collective_seq_id": 3}], "pg_config": {"": 5}}):
        trace = parse_dump(junk, 0)
        assert trace is None or (trace.entered == () and trace.in_flight == ())


def test_the_rank_that_never_entered_is_named_across_eight_ranks_and_two_nodes() -> None:
    c = Collective("0", 18233, "all_reduce")
    before = Collective("0", 18232, "all_reduce")
    group = (("0", tuple(range(8))),)
    here = [RankTrace(r, (c,), (c,), group, pid=8800 + r, node="gpu-07") for r in (4, 6, 7)]
    here.append(RankTrace(5, (before,), (), group, pid=8812, node="gpu-07"))
    stall = analyze(here)
    assert stall is not None
    assert stall.describe() == ("rank 5 (node gpu-07, pid 8812) never entered all_reduce #18233 (its last: all_reduce "
                                "#18232); ranks 4,6-7 waiting; ranks 0-3 not on this node")
    # on the other node, every local rank waits: the culprit is elsewhere
    there = analyze([RankTrace(r, (c,), (c,), group, pid=700 + r, node="gpu-06") for r in range(4)])
    assert there is not None and there.describe() == ("ranks 0-3 waiting in all_reduce #18233 for a rank on another "
                                                      "node (ranks 4-7 are elsewhere)")
    idle = analyze([RankTrace(r, (before,), (), group) for r in range(8)])
    assert idle is not None and idle.collective is None and "outside communication" in idle.describe()
    assert ranges([0, 1, 2, 3, 4, 6, 7]) == "0-4,6-7" and ranges([]) == ""


@pytest.fixture
def serving(tmp_path: Path) -> Iterator[Callable[[Path], None]]:
    """Unix sockets answering HTTP like PyTorch's worker server, for the trust tests of the reader."""
    servers: list[socket.socket] = []

    def serve(path: Path) -> None:
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(str(path))
        srv.listen(4)
        servers.append(srv)

        def loop() -> None:
            while True:
                try:
                    conn, _ = srv.accept()
                except OSError:
                    return
                with conn:
                    conn.recv(4096)
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")

        threading.Thread(target=loop, daemon=True).start()

    yield serve
    for srv in servers:
        srv.close()


def test_a_hostile_worker_server_yields_nothing(tmp_path: Path) -> None:
    """Whatever a rank's socket answers (junk, JSON nested past the parser, more than MAX_ANSWER): no trace, no error."""
    answers = [b"HTTP/1.1 200 OK\r\n\r\n" + b"[" * 100_000, b"HTTP/1.1 200 OK\r\n\r\n{\"entries\": 5}",
               b"HTTP/1.1 404 Not Found\r\n\r\n{}", b"garbage", b"HTTP/1.1 200 OK\r\n\r\n" + b" " * (33 << 20)]
    for i, answer in enumerate(answers):
        path = tmp_path / f"w{i}.sock"
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(str(path))
        srv.listen(4)

        def reply(srv: socket.socket = srv, answer: bytes = answer) -> None:
            for _ in range(len(HANDLERS)):
                conn, _ = srv.accept()
                with conn:
                    conn.recv(4096)
                    with contextlib.suppress(OSError):
                        conn.sendall(answer)

        threading.Thread(target=reply, daemon=True).start()
        rank = RankProcess(os.getpid(), 0, os.getuid(), str(path))
        assert fetch_ranks([rank], "n1", 5.0) == []
        srv.close()


def test_only_a_socket_owned_by_the_ranks_user_is_spoken_to(tmp_path: Path, serving: Callable[[Path], None]) -> None:
    sock = tmp_path / "worker.sock"
    serving(sock)
    me = os.getpid()
    assert query_socket(str(sock), me, os.getuid(), "fr_trace_json", 2.0) == b"{}"
    assert query_socket(str(sock), me, os.getuid() + 1, "fr_trace_json", 2.0) is None  # someone else's socket
    link = tmp_path / "link.sock"
    link.symlink_to(sock)
    assert query_socket(str(link), me, os.getuid(), "fr_trace_json", 2.0) is None  # a planted link
    plain = tmp_path / "plain"
    plain.write_text("HTTP/1.1 200 OK\r\n\r\n{}")
    assert query_socket(str(plain), me, os.getuid(), "fr_trace_json", 2.0) is None  # not a socket
    assert query_socket("relative.sock", me, None, "fr_trace_json", 2.0) is None


# The real thing ------------------------------------------------------------------------------------------------------

def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def torch_or_skip() -> None:
    try:
        import torch.distributed.elastic.control_plane  # noqa: F401
    except ImportError:
        require(False, "needs the CPU build of PyTorch (pip install torch==2.13.0: in the test extras)")


def agent_config(tmp_path: Path, marker: str, slack: SlackEmulator, smtp: tuple[Mailbox, int, Path]) -> Path:
    _, port, cert = smtp
    raw = {"agent": {"node_name": "gpu-07", "state_dir": str(tmp_path / "state"), "listen": ""},
           "jobs": {"sources": ["process"], "refresh": "0s",
                    "processes": {"ddp": {"cmdline": marker, "user": "root", "logs": [str(tmp_path / "logs" / "*.log")],
                                          "switch_dir": str(tmp_path / "switch")}}},
           "checks": {"hang": {"stale_after": "4s", "interval": "2s", "jitter": "0s"}},
           "notifiers": {"console": {},
                         "slack": {"webhook_url": slack.url, "group_window": "1s", "retry_max": "1s"},
                         "email": {"host": "localhost", "port": port, "security": "starttls", "ca_file": str(cert),
                                   "username": SMTP_USER, "password": SMTP_PASSWORD, "from": "trainguard@gpu-07",
                                   "to": ["ml-oncall@example.org"], "group_window": "1s", "retry_max": "1s"}}}
    path = tmp_path / "trainguard.toml"
    path.write_text(tomli_w.dumps(raw))
    path.chmod(0o600)
    return path


def test_the_hang_check_names_the_rank_that_never_entered_the_collective(
        tmp_path: Path, children: list[subprocess.Popen[str]], agent_process: Callable[..., AgentProcess]) -> None:
    """Two real ranks (Gloo, CPU): rank 1 stops before its all_reduce at step 3, rank 0 waits in it. The agent's hang
    check fires and its incident, console line, Slack message and email all name rank 1 and the collective."""
    torch_or_skip()
    marker = f"ddp-{uuid.uuid4().hex[:8]}"
    with slack_emulator() as slack, smtp_server(tmp_path) as smtp:
        env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "TRAINGUARD_SWITCH_DIR": str(tmp_path / "switch"), "PYTHONWARNINGS": "ignore", "TMPDIR": str(tmp_path)}
        for rank in (0, 1):
            children.append(subprocess.Popen(
                [sys.executable, str(REPO / "examples" / "train_ddp.py"), "--hang-rank", "1", "--hang-at", "3",
                 "--log-dir", str(tmp_path / "logs"), "--run-name", marker], env={**env, "RANK": str(rank)},
                stderr=subprocess.DEVNULL, text=True))
        pids = [p.pid for p in children]
        # The agent starts once the ranks are past their rendezvous (rank 1 has reached its hang): on a loaded machine
        # the rendezvous alone can outlast stale_after, and that hang, outside any collective, is not this test's.
        wait_until(lambda: "stops before its all_reduce" in _read(tmp_path / "logs" / "rank1.log"), 120,
                   what="rank 1 to reach its hang")
        agent = agent_process(agent_config(tmp_path, marker, slack, smtp))
        agent.wait_for("logger=trainguard.alert event=fired", timeout=60)  # the console notifier's line
        line = next(x for x in agent.output().splitlines() if "logger=trainguard.alert event=fired" in x)
        assert "never entered all_reduce #" in line, line  # says which incident fired instead
        seq = int(line.split("never entered all_reduce #", 1)[1].split()[0])
        named = (f"rank 1 (node gpu-07, pid {pids[1]}) never entered all_reduce #{seq} (its last: all_reduce "
                 f"#{seq - 1}); rank 0 waiting")
        assert f'summary="process job ddp: {named}; no progress for' in line, line
        assert f"pid {pids[1]} rank 1: stuck_before_all_reduce (train_ddp.py:" in line  # and py-spy's stacks
        mailbox = smtp[0]
        post = wait_until(lambda: next((p for p in slack.posts if named in p["raw"].decode()), None), 15,
                          what="the Slack message")
        assert isinstance(post, dict)
        raw = post["raw"].decode()
        assert f"Next: rank 1 (node gpu-07, pid {pids[1]}) is stuck in stuck_before_all_reduce" in json.loads(raw)[
            "attachments"][0]["blocks"][1]["text"]["text"]
        mail = wait_until(lambda: next((m for m in mailbox.messages if named in m.get_body(("plain",)).get_content()),
                                       None), 15, what="the email")
        assert mail is not None and "next: rank 1 (node gpu-07" in mail.get_body(("plain",)).get_content()
        assert "never entered all_reduce" in str(mail["Subject"])  # the headline leads with the culprit


def test_trainer_flight_recorder_sets_the_variables_and_serves_the_socket(tmp_path: Path) -> None:
    """One call: the variables PyTorch reads, and a worker socket where the agent looks for it."""
    torch_or_skip()
    script = ("import os, sys, json\nsys.path.insert(0, sys.argv[1])\nfrom trainguard import trainer\n"
              "path = trainer.flight_recorder()\n"
              "print(json.dumps({'path': path, 'mode': oct(os.stat(path).st_mode & 0o777),"
              " 'dir': oct(os.stat(os.path.dirname(path)).st_mode & 0o777),"
              " 'env': {k: v for k, v in os.environ.items() if k.startswith('TORCH_')}}))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_")}
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"trainguard-fr-{dead.pid}"  # left by a rank SLURM killed with SIGKILL
    stale.mkdir()
    (stale / "worker.sock").write_text("")
    alive = tmp_path / f"trainguard-fr-{os.getpid()}"  # a running process's: kept
    alive.mkdir()
    out = subprocess.run([sys.executable, "-c", script, str(REPO)], capture_output=True, text=True, timeout=120,
                         env={**env, "TRAINGUARD_SWITCH_DIR": str(tmp_path / "sw"), "TMPDIR": str(tmp_path),
                              "PYTHONWARNINGS": "ignore"})
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["path"].startswith(str(tmp_path / "trainguard-fr-")) and got["path"].endswith("/worker.sock")
    assert got["mode"] == "0o666" and got["dir"] == "0o700"
    assert got["env"]["TORCH_FR_BUFFER_SIZE"] == "2000" and got["env"]["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert got["env"]["TORCH_FR_DUMP_TEMP_FILE"] == f"{tmp_path / 'sw'}/flight-recorder/rank_"
    assert got["env"]["TORCH_WORKER_SERVER_SOCKET"] == got["path"]
    assert not Path(got["path"]).exists() and list(tmp_path.glob("trainguard-fr-*")) == [alive]  # removed at exit


def test_the_service_user_with_the_units_capabilities_reads_another_users_ranks(
        children: list[subprocess.Popen[str]]) -> None:
    """The installed unit runs the agent as `trainguard` with CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH: enough to find a
    job user's ranks, cross their private socket directories and ask them; without CAP_DAC_READ_SEARCH, nothing."""
    require_root()
    torch_or_skip()
    setpriv = require_tool("setpriv")
    Installer().ensure_user()
    ensure_user(JOB_USER)
    shared = Path(tempfile.mkdtemp(prefix="trainguard-frtest-", dir="/tmp"))
    shared.chmod(0o1777)  # the job user's TMPDIR, logs and switch dir
    marker = f"svc-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "TRAINGUARD_SWITCH_DIR": str(shared / "switch"), "PYTHONWARNINGS": "ignore", "TMPDIR": str(shared)}
    try:
        for rank in (0, 1):
            children.append(subprocess.Popen(
                [setpriv, f"--reuid={JOB_USER}", f"--regid={JOB_USER}", "--init-groups", sys.executable,
                 str(REPO / "examples" / "train_ddp.py"), "--hang-rank", "1", "--hang-at", "3", "--log-dir",
                 str(shared / "logs"), "--run-name", marker], env={**env, "RANK": str(rank)},
                stderr=subprocess.DEVNULL, text=True))
        rank1 = shared / "logs" / "rank1.log"
        wait_until(lambda: rank1.exists() and "stops before" in rank1.read_text(), 60, what="rank 1's hang")
        time.sleep(1)  # rank 0 is in its all_reduce by now
        probe = (f"import sys, psutil\nsys.path.insert(0, {str(REPO)!r})\n"
                 "from trainguard.node.flight import analyze, fetch\n"
                 f"procs = [p for p in psutil.process_iter(['cmdline']) if {marker!r} in ' '.join(p.info['cmdline'] or [])]\n"
                 "stall = analyze(fetch(procs, 'gpu-07'))\nprint(stall.describe() if stall else 'nothing')\n")

        def as_service(caps: str) -> str:
            keep = f"-all,{caps}"
            return subprocess.run([setpriv, "--reuid=trainguard", "--regid=trainguard", "--init-groups",
                                   f"--inh-caps={keep}", f"--ambient-caps={keep}", f"--bounding-set={keep}",
                                   "--no-new-privs", sys.executable, "-c", probe], capture_output=True, text=True,
                                  timeout=60).stdout.strip()

        named = as_service("+kill,+syslog,+dac_read_search,+sys_ptrace")
        assert named.startswith(f"rank 1 (node gpu-07, pid {children[-1].pid}) never entered all_reduce #"), named
        assert named.endswith("; rank 0 waiting")
        assert as_service("+kill,+syslog,+sys_ptrace") == "nothing"
    finally:
        for child in children:
            child.kill()
            child.wait()
        shutil.rmtree(shared, ignore_errors=True)
