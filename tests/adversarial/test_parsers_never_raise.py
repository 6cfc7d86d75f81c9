"""Parsers never raise on hostile text (property-based): whatever a job's user, a tool or the kernel prints, a parser
returns a value or "nothing here"; a config parser raises only its own error, with a message.

Strategies mix random text with real captured lines (tests/data), cut and spliced, because that is where parsers
break: almost the right shape."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import tomllib
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainguard.agent.configfile import ConfigError, parse_config
from trainguard.core.units import parse_count, parse_count_limit, parse_duration, parse_size, parse_size_limit
from trainguard.jobs.hostlist import expand
from trainguard.jobs.prolog import parse_record
from trainguard.jobs.slurm import (
    expand_output_path,
    parse_history,
    parse_job_record,
    parse_listpids,
    parse_listpids_steps,
    parse_named,
    parse_steps,
    wait_status,
)
from trainguard.jobs.slurmnode import conf_value, spool_jobs
from trainguard.jobs.tree import read_heartbeat
from trainguard.logscan.collectives import observe
from trainguard.logscan.context import finite_loss, last_step
from trainguard.logscan.launcher import root_cause
from trainguard.logscan.lines import plain, timestamp, unwrap
from trainguard.logscan.nccl import diagnose_nccl_error
from trainguard.logscan.oom import parse_oom
from trainguard.logscan.reader import LogTail
from trainguard.logscan.signatures import BUILTIN, Scanner, final_exception
from trainguard.node.access import Identity
from trainguard.node.cgroup import _cgroup_paths, _mounts
from trainguard.node.flight import Collective, RankTrace, analyze, parse_dump
from trainguard.node.kmsg import parse_journal, parse_kmsg
from trainguard.node.mounts import parse_mountinfo
from trainguard.node.proctable import parse_stat
from trainguard.node.stacks import innermost
from trainguard.quota.parsers import grace_seconds, parse_beegfs, parse_lfs, parse_mmlsquota, parse_quota

DATA = Path(__file__).resolve().parent.parent / "data"
REAL = [line for f in sorted((DATA / "quota").glob("*.txt")) for line in f.read_text().splitlines()] + [
    "6,1234,5678901,-;NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
    "35 25 0:30 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory",
    "0::/slurm/uid_1000/job_42/step_0", "4:memory:/slurm/uid_1000/job_42/step_0",
    'Thread 0x7F (idle): "MainThread"', "    stuck_in_allreduce (train_toy.py:51)",
    "step 100 loss=1.25", "[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB",
    "Traceback (most recent call last):", "RuntimeError: CUDA error: an illegal memory access was encountered",
] + [line for entry in tomllib.loads((DATA / "logs" / "excerpts.toml").read_text())["log"]
     for line in entry["text"].splitlines()] + [
    entry["line"] for entry in tomllib.loads((DATA / "logs" / "prefixes.toml").read_text())["line"]]
# Digits, separators and units: the alphabet of numbers, where overflow and backtracking live.
NUMERIC = st.text(alphabet="0123456789.,:-+eE %*kKmMgGtTpPiIBbsdhw ", max_size=400)
FRAGMENT = st.one_of(st.sampled_from(REAL), st.text(max_size=80), NUMERIC,
                     st.sampled_from(REAL).map(lambda s: s[: len(s) // 2]))
HOSTILE_TEXT = st.lists(FRAGMENT, max_size=12).map("\n".join)
# TG_EXAMPLES=2000 for a deeper run by hand; 150 keeps the suite fast.
PROPERTY = settings(max_examples=int(os.environ.get("TG_EXAMPLES", "150")), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(HOSTILE_TEXT)
def test_quota_tool_parsers(text: str) -> None:
    for parse in (parse_quota, parse_lfs, parse_mmlsquota):
        assert isinstance(parse(text), list)
    assert isinstance(parse_beegfs(text, "/beegfs"), list)


@PROPERTY
@given(NUMERIC)
def test_grace_periods_and_units_raise_only_value_errors(text: str) -> None:
    for parse in (grace_seconds, parse_duration, parse_size, parse_count, parse_size_limit, parse_count_limit):
        try:
            parse(text)
        except ValueError as exc:
            assert str(exc) and len(str(exc)) < 300  # one readable line, however long the input


@PROPERTY
@given(st.binary(max_size=600) | st.sampled_from(REAL).map(str.encode))
def test_kernel_records(raw: bytes) -> None:
    record = parse_kmsg(raw)
    assert record is None or isinstance(record.message, str)


JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
                       lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                                     max_size=4), max_leaves=20)


@PROPERTY
@given(st.one_of(HOSTILE_TEXT, JSONISH.map(json.dumps),
                 st.dictionaries(st.sampled_from(["MESSAGE", "__CURSOR", "PRIORITY", "_SOURCE_MONOTONIC_TIMESTAMP"]),
                                 JSONISH).map(json.dumps)))
def test_journal_records(line: str) -> None:
    parsed = parse_journal(line)
    assert parsed is None or isinstance(parsed[1], str)


SLURM = sorted((DATA / "slurm").glob("*.txt"))
SLURM_TEXT = [f.read_text() for f in SLURM]
SLURM_LINES = [line for text in SLURM_TEXT for line in text.splitlines()]
ENVIRONS = [f.read_bytes() for f in sorted((DATA / "slurm").glob("*-environ-*"))]
# Real records and lines, cut, spliced and salted with the separators a job's name may hold.
SLURM_HOSTILE = st.one_of(
    st.sampled_from(SLURM_TEXT),
    st.tuples(st.sampled_from(SLURM_TEXT), st.integers(0, 3000), st.text(alphabet="|= ()\n\x00JobIdUser0123", max_size=60))
    .map(lambda t: t[0][: t[1]] + t[2] + t[0][t[1]:]),
    st.lists(st.one_of(st.sampled_from(SLURM_LINES), st.text(max_size=80)), max_size=8).map("\n".join))


@PROPERTY
@given(SLURM_HOSTILE, st.one_of(st.none(), st.integers(-5, 2**40)))
def test_slurm_job_records_listpids_and_squeue_lines(text: str, uid: int | None) -> None:
    record = parse_job_record(text, uid)
    assert record is None or (record.job_id.isdigit() and (uid is None or record.uid == uid))
    assert all(isinstance(pids, list) for pids in parse_listpids(text).values())
    assert all(step.isdigit() for steps in parse_listpids_steps(text).values() for step in steps)
    assert all(step.isdigit() for step in parse_steps(text, "1"))
    for line in text.splitlines():
        job = parse_named(line)
        assert job is None or job.key == f"slurm:{job.job_id}"
    assert wait_status(text[:12]) is None or ":" in wait_status(text[:12])  # type: ignore[operator]
    assert isinstance(spool_jobs(text.splitlines()), set)
    conf_value(text, "SlurmdSpoolDir")


@PROPERTY
@given(st.text(max_size=80), st.one_of(st.none(), st.text(max_size=20)))
def test_output_patterns(pattern: str, name: str | None) -> None:
    path = expand_output_path(pattern, job_id="12", name=name, user="u", array_job_id="10", array_task_id="2")
    assert path is None or isinstance(path, str)


@PROPERTY
@given(st.one_of(st.sampled_from(ENVIRONS), st.binary(max_size=400),
                 JSONISH.map(lambda v: json.dumps({"job_id": "12", "uid": v, "started": v, "stdout": v,
                                                   "array_job_id": v, "array_task_id": "3", "exit_code": v}).encode())))
def test_prolog_records(raw: bytes) -> None:
    env = dict(e.split("=", 1) for e in raw.decode(errors="replace").split("\0") if "=" in e)
    record = parse_record(json.dumps({"job_id": env.get("SLURM_JOB_ID", "7"), **env}).encode())
    assert record is None or record.job_id.isdigit()
    again = parse_record(raw)
    assert again is None or (again.uid is None or again.uid >= 0)


@PROPERTY
@given(st.integers(1, 2**22), HOSTILE_TEXT)
def test_proc_stat_lines(pid: int, comm: str) -> None:
    info = parse_stat(pid, f"{pid} ({comm}) S 1 2 3 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 123 4096 10 " + comm, 1e9)
    assert info is None or (info.pid == pid and info.rss >= 0)
    parse_stat(pid, comm, 0.0)


@PROPERTY
@given(HOSTILE_TEXT, st.text(alphabet="\x1f|abc0123456789_-T:", max_size=200))
def test_sacct_lines_and_hostlists(text: str, line: str) -> None:
    for candidate in (line, text):
        parse_history(candidate)
        try:
            assert isinstance(expand(candidate), list)
        except ValueError:
            pass


@PROPERTY
@given(HOSTILE_TEXT)
def test_mountinfo_cgroups_and_stacks(text: str) -> None:
    assert isinstance(parse_mountinfo(text), list)
    _mounts(text)
    _cgroup_paths(text)
    where = innermost(text)
    assert where is None or isinstance(where, str)


@PROPERTY
@given(st.lists(st.one_of(FRAGMENT.map(str.encode), st.binary(max_size=200)), max_size=12).map(b"\n".join))
def test_log_scanning(data: bytes) -> None:
    data = data + b"\n"
    for hit in Scanner(BUILTIN).scan(data):
        final_exception(data, hit.offset)
        p = plain(hit.line)
        assert isinstance(p.text, str) and (p.rank is None or p.rank.isdigit())
        assert timestamp(hit.line) is None or isinstance(timestamp(hit.line), float)
        diagnose_nccl_error(hit.line)
        root_cause(data[hit.offset:].decode("utf-8", errors="replace"))
        observe(hit.line)
        parse_oom(hit.line)
        end = data.find(b"\n", hit.offset)
        joined = unwrap(data, end, lambda t: "Timeout(ms)" in t)
        assert joined is None or joined[1] <= len(data)
    last_step(data)
    finite_loss(data, 0, len(data))


@PROPERTY
@given(st.binary(max_size=2000))
def test_log_tail_and_heartbeat_files(tmp_path_factory: pytest.TempPathFactory, data: bytes) -> None:
    path = tmp_path_factory.mktemp("hostile") / "file"
    path.write_bytes(data)
    me = Identity(os.getuid())
    assert b"".join(LogTail(str(path), me).read()) == data[: data.rfind(b"\n") + 1]  # complete lines, verbatim
    step, metrics = read_heartbeat(str(path), me)
    assert step is None or isinstance(step, int)
    assert isinstance(metrics, dict)


@PROPERTY
@given(st.dictionaries(st.sampled_from(["agent", "checks", "notifiers", "jobs", "actions", "x"]),
                       st.dictionaries(st.text(max_size=10), JSONISH, max_size=4), max_size=5))
def test_config_raises_only_config_errors(raw: dict[str, object]) -> None:
    try:
        parse_config(raw, "hostile.toml")
    except ConfigError as exc:
        assert exc.problems and all(p for p in exc.problems)


def test_numbers_past_pythons_digit_limit_are_no_numbers(tmp_path: Path) -> None:
    """int() and str() raise ValueError past 4300 digits; a job's number that long is refused, never formatted."""
    huge = 10**5000
    assert last_step(b"step " + b"9" * 10_000 + b" loss=1.0\n") is None
    assert last_step(b"step 12 loss=1.0\nstep " + b"9" * 10_000 + b"\n") is None  # the last step line is that one
    beat = tmp_path / "heartbeat.json"
    beat.write_text('{"step": ' + "9" * 4000 + ', "metrics": {"loss": NaN, "lr": Infinity, "n": 3}}')
    assert read_heartbeat(str(beat), Identity(os.getuid())) == (None, {"loss": "nan", "lr": "inf", "n": 3})
    entry = {"pg_id": 0, "process_group": ("0", "default_pg"), "profiling_name": "nccl:all_reduce", "state": "started"}
    dump = {"entries": [{**entry, "collective_seq_id": 4}, {**entry, "collective_seq_id": huge},
                        {**entry, "collective_seq_id": -1}, {"pg_id": huge, "collective_seq_id": 5}],
            "pg_status": {"0": {"last_enqueued_collective": huge}, huge: {"last_enqueued_collective": 9}},
            "pg_config": {huge: {"ranks": "[0, 1]"}}}
    trace = parse_dump(dump, 0)
    assert trace is not None and trace.malformed == 4
    assert [c.seq for c in trace.entered] == [4] and [c.seq for c in trace.in_flight] == [4]
    stall = analyze([trace, RankTrace(1, (Collective("0", 3),))])
    assert stall is not None and "rank 1 never entered all_reduce #4" in stall.describe()
    assert json.dumps(stall.fields())
