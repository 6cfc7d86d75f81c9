"""The `command` check: real scripts under the Nagios plugin conventions, their perfdata, their timeouts and output
bounded, and the real agent turning one into an incident and an action."""

from __future__ import annotations

import os
import pwd
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from tests.conftest import REPO, AgentProcess, free_port, require_root, wait_until
from tests.slurm_cluster import ensure_user
from tests.test_privileges import CAPS, SERVICE_USER, setpriv
from trainguard.checks.base import CheckContext
from trainguard.checks.command import CommandCheck, parse_output, parse_perfdata
from trainguard.core.model import Result, Status

# Real plugins' output lines, as their users quoted them:
# check_disk (nagios-plugins), serverfault.com/questions/289378 "Interpreting Nagios check_disk output"
CHECK_DISK = "DISK OK - free space: / 17887 MB (47% inode=93%);| /=19481MB;31495;35432;0;39369"
# check_load (nagios-plugins) through check_nrpe, as an NRPE setup guide shows it
CHECK_LOAD = ("LOAD OK - load average: 0.52, 0.58, 0.59|load1=0.520;15.000;30.000;0; load5=0.580;10.000;25.000;0; "
              "load15=0.590;5.000;20.000;0;")
# check_ping-style line quoted with the perfdata format in cnblogs.com/zhaobin022/p/5587805.html (a label with no
# thresholds and a trailing empty min/max, then a bare value)
GPING = "GPING OK - rtt min/avg/max/mdev = 0.897/0.897/0.897/0.000 ms|time=0.897ms;20;40;; ok=1"
# Nagios::Plugin::Performance's parse_perfstring example (libnagios-plugin-perl), two filesystems
PERL_EXAMPLE = "/=382MB;15264;15269;; /var=218MB;9443;9448"
# jelayeb/check_nvidia (check_nvidia.ps1): "Nvidia $model Memory:..% GPU:..% Temp:..°C | Memory=..;;;0; GPU=..;;;0;
# TEMP=..;;;0;", its values filled in
CHECK_NVIDIA = "Nvidia Quadro P4000 Memory:12% GPU:3% Temp:41°C | Memory=12;;;0; GPU=3;;;0; TEMP=41;;;0;"


def make(tmp: Path, body: str, name: str = "plugin.sh", **settings: Any) -> CommandCheck:
    script = tmp / name
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(0o755)
    s = CommandCheck.Settings.model_validate({"command": [str(script)], **settings})
    return CommandCheck("site", s, CheckContext("node1", tmp))


def one(check: CommandCheck) -> Result:
    results = check.run()
    assert len(results) == 1
    return results[0]


def sample(result: Result, name: str, **labels: str) -> float | None:
    for s in result.samples:
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    return None


@pytest.mark.parametrize(("code", "status"), [(0, Status.OK), (1, Status.WARNING), (2, Status.CRITICAL),
                                              (3, Status.UNKNOWN)])
def test_each_nagios_exit_code_is_its_status_and_the_first_line_the_summary(tmp_path: Path, code: int,
                                                                            status: Status) -> None:
    check = make(tmp_path, f"echo 'NHC: check_hw_gpu: {code} | x=1'\necho 'long line one'\nexit {code}")
    r = one(check)
    assert (r.status, r.summary, r.subject) == (status, f"NHC: check_hw_gpu: {code}", "site")
    assert r.details["exit_code"] == code and r.details["long_output"] == "long line one"
    assert sample(r, "trainguard_command_exit_code", check="site") == code


def test_another_exit_code_or_a_signal_is_unknown_with_the_code_said(tmp_path: Path) -> None:
    r = one(make(tmp_path, "echo 'something odd'\nexit 42"))
    assert r.status is Status.UNKNOWN and r.summary == "exited 42 (not a Nagios status): something odd"
    r = one(make(tmp_path, "kill -SEGV $$", name="segv.sh"))
    assert r.status is Status.UNKNOWN and r.summary == "killed by SIGSEGV"


def test_no_stdout_takes_the_summary_from_stderr_and_the_subject_is_configurable(tmp_path: Path) -> None:
    r = one(make(tmp_path, "echo 'CRITICAL: /scratch missing' >&2\nexit 2", subject="scratch"))
    assert (r.status, r.subject, r.summary) == (Status.CRITICAL, "scratch", "CRITICAL: /scratch missing")
    r = one(make(tmp_path, "exit 0", name="silent.sh"))
    assert (r.status, r.summary) == (Status.OK, "no output (exit 0)")


def test_a_script_not_found_or_not_executable_is_unknown_with_a_clear_summary(tmp_path: Path) -> None:
    s = CommandCheck.Settings.model_validate({"command": [str(tmp_path / "absent.sh")]})
    r = one(CommandCheck("site", s, CheckContext("node1", tmp_path)))
    assert r.status is Status.UNKNOWN and r.summary == f"{tmp_path}/absent.sh: not found"
    check = make(tmp_path, "exit 0", name="noexec.sh")
    (tmp_path / "noexec.sh").chmod(0o644)
    if os.geteuid() == 0:  # root may execute any file with an x bit: take every bit away
        (tmp_path / "noexec.sh").chmod(0o600)
    r = one(check)
    assert r.status is Status.UNKNOWN and r.summary == f"{tmp_path}/noexec.sh: not executable (Permission denied)"


def test_settings_refuse_a_relative_path_and_a_timeout_longer_than_the_checks(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="absolute path"):
        CommandCheck.Settings.model_validate({"command": ["check_disk"]})
    with pytest.raises(ValidationError, match="command_timeout"):
        CommandCheck.Settings.model_validate({"command": ["/bin/true"], "command_timeout": "20s"})
    # unset, the script's timeout leaves the check's last fifth to kill, reap and report: a shorter timeout alone is valid
    assert CommandCheck.Settings.model_validate({"command": ["/bin/true"], "timeout": "5s"}).kill_after == 4.0


def test_perfdata_of_real_plugins_parses() -> None:
    out = parse_output(CHECK_DISK)
    assert out.summary == "DISK OK - free space: / 17887 MB (47% inode=93%);" and out.bad == 0
    (disk,) = out.perfdata
    assert (disk.label, disk.value, disk.uom, disk.warn, disk.crit, disk.min, disk.max) == (
        "/", 19481.0, "MB", "31495", "35432", 0.0, 39369.0)
    out = parse_output(CHECK_LOAD)
    assert [(p.label, p.value, p.warn, p.crit, p.min) for p in out.perfdata] == [
        ("load1", 0.52, "15.000", "30.000", 0.0), ("load5", 0.58, "10.000", "25.000", 0.0),
        ("load15", 0.59, "5.000", "20.000", 0.0)]
    out = parse_output(GPING)
    assert [(p.label, p.value, p.uom, p.min) for p in out.perfdata] == [("time", 0.897, "ms", None), ("ok", 1.0, "", None)]
    items, bad = parse_perfdata(PERL_EXAMPLE)
    assert bad == 0
    assert [(p.label, p.value, p.uom, p.crit) for p in items] == [("/", 382.0, "MB", "15269"), ("/var", 218.0, "MB",
                                                                                                  "9448")]
    out = parse_output(CHECK_NVIDIA)
    assert out.summary == "Nvidia Quadro P4000 Memory:12% GPU:3% Temp:41°C"
    assert [(p.label, p.value, p.min) for p in out.perfdata] == [("Memory", 12.0, 0.0), ("GPU", 3.0, 0.0),
                                                                   ("TEMP", 41.0, 0.0)]


def test_quoted_labels_undetermined_values_long_output_perfdata_and_junk() -> None:
    # The guidelines: a label with spaces or = is quoted, '' is a quote; "U" is a value that could not be determined;
    # perfdata may follow a `|` in the long text and run over the following lines.
    text = ("OK - fine | 'gpu 0 temp'=41;80;90 'it''s'=2\nlong text\nmore | 'a=b'=5s\nlatency=U;1;2 =7 x=abc y=3XB"
            " 'unterminated=1")
    out = parse_output(text)
    assert out.summary == "OK - fine" and out.long_text == "long text\nmore"
    assert [(p.label, p.value, p.uom) for p in out.perfdata] == [("gpu 0 temp", 41.0, ""), ("it's", 2.0, ""),
                                                                   ("a=b", 5.0, "s")]
    assert out.bad == 4  # "=7", "x=abc", "y=3XB", the unterminated quote


def test_perfdata_is_exported_in_base_units_with_labels_capped_per_check(tmp_path: Path) -> None:
    check = make(tmp_path, f"echo '{CHECK_DISK}'\necho '|time=0.897ms \"evil\\\\\"=1 a=1 b=2 c=3'", max_labels=4)
    r = one(check)
    assert sample(r, "trainguard_command_perfdata", label="/", unit="bytes") == 19481 * 1024**2
    assert sample(r, "trainguard_command_perfdata", label="time", unit="seconds") == pytest.approx(0.000897)
    assert sample(r, "trainguard_command_perfdata", label='"evil\\"', unit="") == 1
    assert sample(r, "trainguard_command_perfdata", label="a") == 1
    assert sample(r, "trainguard_command_perfdata", label="b") is None  # past the 4 labels this check may have
    assert sample(r, "trainguard_command_perfdata_dropped", check="site") == 2
    # a later run with new labels: the cap is per check across runs, the known ones still export
    (tmp_path / "plugin.sh").write_text("#!/bin/sh\necho 'OK | z=9 a=5'\n")
    r = one(check)
    assert sample(r, "trainguard_command_perfdata", label="a") == 5 and sample(r, "trainguard_command_perfdata",
                                                                               label="z") is None


def _running_in_group(pgid: int) -> list[str]:
    """Processes of the group that are not dead: a killed child reparented to init is a zombie until init reaps it,
    which is init's business, not a leak of ours."""
    alive = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(entry.name)
    return alive


def test_a_hanging_script_is_killed_with_its_process_group_and_leaves_no_zombie(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    check = make(tmp_path, f"sleep 300 &\necho $$ $! > {pids}\necho 'still checking'\nwait", command_timeout="1s",
                 timeout="3s")
    t0 = time.monotonic()
    r = one(check)
    assert time.monotonic() - t0 < 2.5  # the timeout of 1s plus a generous margin; not the child's 300s
    assert r.status is Status.UNKNOWN and r.summary == "timed out after 1s: still checking"
    leader, child = (int(p) for p in pids.read_text().split())
    # the whole group, its background sleep included, is gone
    wait_until(lambda: _running_in_group(leader) == [], 5, what="the group killed")
    assert not Path(f"/proc/{leader}").exists()  # the leader reaped: no zombie of ours
    assert not Path(f"/proc/{child}").exists() or Path(f"/proc/{child}/stat").read_text().split()[3] != str(os.getpid())
    with pytest.raises(ChildProcessError):  # the leader was reaped by the check (not by anyone else: it was ours)
        os.waitpid(leader, os.WNOHANG)


def test_children_left_behind_by_a_script_that_exited_are_killed(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    r = one(make(tmp_path, f"sleep 300 &\necho $! > {pids}\necho 'OK - done'\nexit 0"))
    assert (r.status, r.summary) == (Status.OK, "OK - done")
    # SIGKILLed as the script exits: gone (or a zombie of init's) as soon as the kernel delivers it
    wait_until(lambda: _running_in_group(int(pids.read_text())) == [], 5, what="the left child killed")


def test_huge_output_is_bounded_and_counted(tmp_path: Path) -> None:
    r = one(make(tmp_path, "echo 'WARNING - chatty | n=1'\nhead -c 3000000 /dev/zero | tr '\\0' 'x'\nexit 1",
                 output_limit="4KiB"))
    assert (r.status, r.summary) == (Status.WARNING, "WARNING - chatty")
    assert r.details["output_discarded_bytes"] == 3000000 + len("WARNING - chatty | n=1\n") - 4096
    assert sample(r, "trainguard_command_output_discarded_bytes", check="site") == r.details["output_discarded_bytes"]
    r = one(make(tmp_path, "exec yes", name="yes.sh", output_limit="4KiB"))  # without end: killed, not read for 8s
    assert (r.status, r.summary) == (Status.UNKNOWN, "printed without end: killed: y")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory another user can reach (pytest's temp dirs are private to root)."""
    with tempfile.TemporaryDirectory(prefix="tg-command-") as name:
        os.chmod(name, 0o755)
        yield Path(name)


def test_it_runs_as_the_configured_user(shared_dir: Path) -> None:
    require_root()
    ensure_user("tgjob")
    check = make(shared_dir, "echo \"OK - $(id -un) $(id -u) $USER $HOME\"", user="tgjob")
    r = one(check)
    entry = pwd.getpwnam("tgjob")
    assert (r.status, r.summary) == (Status.OK, f"OK - tgjob {entry.pw_uid} tgjob {entry.pw_dir}")
    r = one(make(shared_dir, "exit 0", name="b.sh", user="no-such-user-tg"))
    assert (r.status, r.summary) == (Status.UNKNOWN, "no such user 'no-such-user-tg'")


def test_another_user_under_the_hardened_units_privileges_is_unknown_saying_so(shared_dir: Path) -> None:
    """The hardened unit runs the agent as `trainguard` with CAP_KILL, CAP_SYSLOG, CAP_DAC_READ_SEARCH and
    CAP_SYS_PTRACE only: no CAP_SETUID/CAP_SETGID, so a `user` other than its own can't be taken."""
    require_root()
    ensure_user("tgother")
    ensure_user(SERVICE_USER)
    script = shared_dir / "p.sh"
    script.write_text("#!/bin/sh\necho OK\n")
    script.chmod(0o755)
    code = ("from pathlib import Path; from trainguard.checks.base import CheckContext; "
            "from trainguard.checks.command import CommandCheck as C; "
            f"s = C.Settings.model_validate({{'command': ['{script}'], 'user': 'tgother'}}); "
            "r = C('site', s, CheckContext('n', Path('/tmp'))).run()[0]; print(r.status.name, r.summary)")
    out = subprocess.run([*setpriv(CAPS), sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=REPO)
    assert out.stdout.strip() == ("UNKNOWN cannot run as 'tgother': Operation not permitted (needs the agent to run "
                                  "as root)"), out.stderr


def test_the_agent_runs_a_command_check_to_an_incident_and_its_action(
        tmp_path: Path, agent_process: Callable[..., AgentProcess]) -> None:
    """An NHC-style script exits 2: the agent opens an incident, runs the bound action with the summary, and exports
    the script's perfdata on /metrics."""
    import requests

    port, acted = free_port(), tmp_path / "acted"
    script = tmp_path / "check_scratch.sh"
    script.write_text("#!/bin/sh\necho 'CRITICAL - /scratch read-only | writable=0;;1;0;1'\nexit 2\n")
    script.chmod(0o755)
    config = tmp_path / "trainguard.toml"
    config.write_text(f"""[agent]
node_name = "cmdnode"
state_dir = "{tmp_path}/state"
listen = "127.0.0.1:{port}"
[jobs]
sources = []
[checks.nhc]
type = "command"
command = ["{script}"]
subject = "scratch"
interval = "1s"
jitter = 0
actions = {{ critical = ["record"] }}
[notifiers.console]
[actions.record]
type = "exec"
command = ["sh", "-c", 'echo "$TRAINGUARD_CHECK $TRAINGUARD_SUBJECT $TRAINGUARD_SUMMARY" >> {acted}']
""")
    agent = agent_process(config)
    agent.wait_for("event=fired")
    wait_until(acted.exists, 15, what="the action")
    assert acted.read_text().splitlines()[0] == "nhc scratch CRITICAL - /scratch read-only"
    metrics = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    assert 'trainguard_command_perfdata{check="nhc",label="writable",unit=""} 0' in metrics, metrics
    assert stat.S_ISREG(script.stat().st_mode)
