"""Active diagnostics (issue 50): each tool's reader on its real pass and fail output (tests/data/diag/, cited there),
a level run by scripted tools that print that output and exit as the real ones do (a hang killed with its process
group, absent tools, the budget, a job on the GPUs), `trainguard diag` end to end, and the `resume` action that lifts
a drain only after a pass."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tests.slurm_cluster import SlurmCluster, sh
from tests.test_slurm_jobs import engine_for, event, run_action
from trainguard.actions.base import ActionContext, ActionError, ActionSkippedError
from trainguard.actions.diag import DiagAction, DiagSettings, run_level
from trainguard.actions.slurmctl import ResumeAction, ResumeSettings
from trainguard.core.events import Event, EventKind
from trainguard.core.model import Status
from trainguard.gpu import diagtools
from trainguard.jobs.slurm import SlurmError
from trainguard.pipeline.engine import Engine

DATA = Path(__file__).parent / "data" / "diag"
REPO = Path(__file__).resolve().parent.parent


def text(name: str) -> str:
    return (DATA / name).read_text()


# the readers, on real output -----------------------------------------------------------------------------------------

def test_dcgmi_failure_names_the_test_the_gpu_and_dcgms_reason() -> None:
    r = diagtools.read_dcgmi(1, 226, text("dcgmi-r1-fail-gb10.json"))
    assert r.status is Status.CRITICAL
    assert r.details["failed"] == ["software"]
    assert "GPU 0: Persistence Mode" in r.summary and "DCGM error 29" in r.summary
    # The GPU it failed on, for the ledger: GPU id 0; the GB10's `serial_num` is DCGM's <<<NOT_SUPPORTED>>> blank.
    [gpu] = r.details["failed_gpus"]
    assert (gpu["index"], gpu["serial"]) == (0, "")
    assert gpu["reasons"][0].startswith("software: Persistence Mode: Persistence mode for GPU 0 is disabled")


def test_dcgmi_pass_lists_the_tests_that_passed() -> None:
    r = diagtools.read_dcgmi(3, 0, text("dcgmi-r3-pass-8gpu.json"))
    assert r.status is Status.OK
    assert r.details["passed"] == ["diagnostic"] and r.summary == "dcgmi diag -r 3: passed diagnostic"
    assert r.details["failed_gpus"] == []  # eight GPUs named, none failed


def test_dcgmi_without_a_document_is_unknown_never_a_pass() -> None:
    said = "Error: unable to establish a connection to the specified host: localhost\n"
    r = diagtools.read_dcgmi(2, 255, said)
    assert r.status is Status.UNKNOWN and "unable to establish a connection" in r.summary
    assert diagtools.read_dcgmi(2, 0, '{"DCGM Diagnostic": {"test_categories": []}}').status is Status.UNKNOWN


def test_nvidia_smi_clean_h100_and_the_count_it_must_have() -> None:
    q = text("nvidia-smi-q-h100-pass.txt")
    ok = diagtools.read_nvidia_smi(0, q, expected_gpus=1)
    assert ok.status is Status.OK and ok.details["gpus"] == 1
    short = diagtools.read_nvidia_smi(0, q, expected_gpus=8)
    assert short.status is Status.CRITICAL and "1 of 8 GPUs attached" in short.summary


def test_nvidia_smi_pending_row_remap_is_critical() -> None:
    r = diagtools.read_nvidia_smi(0, text("nvidia-smi-q-a100-remap-pending.txt"), expected_gpus=8)
    assert r.status is Status.CRITICAL
    assert r.summary == "nvidia-smi: GPU 00000000:10:1C.0: row remap pending (reset the GPU)"
    # The GPU by its bus id as NVML's (the ledger's slots); this quote elides its serial and UUID.
    assert r.details["failed_gpus"] == [{"bus_id": "0000:10:1c", "serial": "", "uuid": "",
                                         "reasons": ["row remap pending (reset the GPU)"]}]


def test_nvidia_smi_names_a_failed_gpu_by_its_serial_and_uuid() -> None:
    pending = text("nvidia-smi-q-h100-pass.txt").replace("Pending                           : No",
                                                         "Pending                           : Yes")
    r = diagtools.read_nvidia_smi(0, pending, expected_gpus=1)
    assert r.status is Status.CRITICAL
    assert r.details["failed_gpus"] == [{"bus_id": "0000:19:00", "serial": "1654123038646",
                                         "uuid": "GPU-10f35015-e921-bfab-2eb8-4e9b6664d5f1",
                                         "reasons": ["row remap pending (reset the GPU)"]}]
    assert diagtools.read_nvidia_smi(0, text("nvidia-smi-q-h100-pass.txt"), 1).details["failed_gpus"] == []


def test_nvidia_smi_persistence_off_warns_and_a_lost_driver_is_critical() -> None:
    q = text("nvidia-smi-q-h100-pass.txt").replace("Persistence Mode                      : Enabled",
                                                    "Persistence Mode                      : Disabled")
    assert diagtools.read_nvidia_smi(0, q).status is Status.WARNING
    lost = diagtools.read_nvidia_smi(9, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA "
                                        "driver. Make sure that the latest NVIDIA driver is installed and running.\n")
    assert lost.status is Status.CRITICAL and "driver is not loaded" in lost.summary


def test_all_reduce_perf_bandwidth_against_expected() -> None:
    out = text("all_reduce_perf-8xA100-pass.txt")
    rows, avg, failures = diagtools.parse_nccl_table(out)
    assert len(rows) == 30 and avg == pytest.approx(66.2058) and not failures
    ok = diagtools.read_all_reduce(0, out, expected_busbw=200)
    assert ok.status is Status.OK and ok.details["busbw"] == 232.44 and ok.details["size"] == 4294967296
    slow = diagtools.read_all_reduce(0, out, expected_busbw=480)
    assert slow.status is Status.CRITICAL and "232.44 GB/s" in slow.summary and "expected 480" in slow.summary


def test_all_reduce_perf_nccl_failure_is_critical() -> None:
    r = diagtools.read_all_reduce(3, text("all_reduce_perf-nccl-failure.txt"), expected_busbw=200)
    assert r.status is Status.CRITICAL and "unhandled cuda error" in r.summary


def test_all_reduce_perf_wrong_results_are_critical() -> None:
    out = text("all_reduce_perf-8xA100-pass.txt").replace(
        "32336  132.82  232.44      0", "32336  132.82  232.44      3")
    r = diagtools.read_all_reduce(0, out)
    assert r.status is Status.CRITICAL and r.details["wrong"] == 3


def test_ib_write_bw_table_with_perftests_own_warning_inside() -> None:
    out = text("ib_write_bw-ndr.txt")
    ok = diagtools.read_perftest("ib_write_bw", "mlx5_0", 0, out, expected=380)
    assert ok.status is Status.OK and ok.details["gbits"] == 392.34
    slow = diagtools.read_perftest("ib_write_bw", "mlx5_0", 0, out, expected=395)
    assert slow.status is Status.CRITICAL
    failed = diagtools.read_perftest("ib_write_bw", "mlx5_0", 1, "Couldn't connect to localhost:18515\n")
    assert failed.status is Status.CRITICAL and "18515" in failed.summary


def test_perftest_latency_and_mib_tables() -> None:
    lat = diagtools.read_perftest("ib_read_lat", "mlx5_0", 0, text("ib_send_lat-ndr.txt"), expected=2.0)
    assert lat.status is Status.OK and lat.details["latency_us"] == 1.27
    assert diagtools.read_perftest("ib_read_lat", "mlx5_0", 0, text("ib_send_lat-ndr.txt"), 1.0).status is \
        Status.CRITICAL
    mib = diagtools.read_perftest("ib_send_bw", "mlx5_0", 0, text("ib_send_bw-mib.txt"))
    assert mib.details["gbits"] == pytest.approx(46557.03 * 8 * 1.048576 / 1000)  # ~390.6 Gb/s


def test_ibstat_port_states() -> None:
    ok = diagtools.read_ibstat(0, text("ibstat-active.txt"), ("mlx5_0",), min_rate=200)
    assert ok.status is Status.OK
    assert diagtools.read_ibstat(0, text("ibstat-active.txt"), ("mlx5_0",), 400).status is Status.CRITICAL
    no_sm = diagtools.read_ibstat(0, text("ibstat-initializing.txt"), ("mlx5_0",))
    assert no_sm.status is Status.CRITICAL and "mlx5_0 port 1 Initializing/LinkUp" in no_sm.summary
    # Not one of the HCAs jobs use: a warning only.
    assert diagtools.read_ibstat(0, text("ibstat-initializing.txt")).status is Status.WARNING
    assert "mlx5_3 missing" in diagtools.read_ibstat(0, text("ibstat-active.txt"), ("mlx5_3",)).summary


def test_site_command_nagios_codes() -> None:
    assert diagtools.read_site_command("check_x", 2, "CRITICAL - fan 3 stopped|rpm=0\nmore\n").summary == \
        "check_x: CRITICAL - fan 3 stopped"
    assert diagtools.read_site_command("check_x", 0, "OK\n").status is Status.OK
    assert diagtools.read_site_command("check_x", 127, "").status is Status.UNKNOWN


# scripted tools -----------------------------------------------------------------------------------------------------

def script(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)


def cat(bin_dir: Path, name: str, data: str, rc: int = 0) -> None:
    """A tool that prints its real output and exits as the real one did; it notes each run in `ran`."""
    script(bin_dir, name, f'echo "{name} $*" >> "{bin_dir}/ran"\ncat "{DATA / data}"\nexit {rc}')


@pytest.fixture
def tools(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cat(bin_dir, "nvidia-smi", "nvidia-smi-q-h100-pass.txt")
    cat(bin_dir, "dcgmi", "dcgmi-r3-pass-8gpu.json")
    cat(bin_dir, "ibstat", "ibstat-active.txt")
    return bin_dir


def ran(bin_dir: Path) -> list[str]:
    path = bin_dir / "ran"
    return [line.strip() for line in path.read_text().splitlines()] if path.exists() else []


def free() -> list[str]:
    return []


def test_quick_level_passes_with_real_passing_output(tools: Path) -> None:
    report = run_level(DiagSettings(tool_dir=str(tools), gpus=1, ib_devices=["mlx5_0"]), "quick", free)
    assert report.passed, report.summary()
    assert [r.subject for r in report.results] == ["nvidia-smi", "dcgmi diag -r 1", "ibstat"]
    assert ran(tools) == ["nvidia-smi -q", "dcgmi diag -r 1 -j", "ibstat"]
    assert report.absent == []


def test_standard_level_runs_nccl_on_the_gpus_seen_and_the_ib_loopback(tools: Path) -> None:
    cat(tools, "all_reduce_perf", "all_reduce_perf-8xA100-pass.txt")
    cat(tools, "nvidia-smi", "nvidia-smi-q-a100-remap-pending.txt")
    # perftest's server (no host argument) waits for its client; the client prints the table.
    script(tools, "ib_write_bw", f'case "$*" in *localhost*) cat "{DATA / "ib_write_bw-ndr.txt"}";; '
                                 f'*) echo "server $*" >> "{tools}/ran"; sleep 0.2;; esac')
    settings = DiagSettings(tool_dir=str(tools), ib_devices=["mlx5_0"], ib_gbits=380, nccl_busbw=200)
    report = run_level(settings, "standard", free)
    by = {r.subject: r for r in report.results}
    assert by["all_reduce_perf"].status is Status.OK
    assert "all_reduce_perf -b 1G -e 4G -f 2 -g 8" in ran(tools)  # 8: what nvidia-smi -q counted
    assert by["ib_write_bw mlx5_0"].details["gbits"] == 392.34
    assert "server -d mlx5_0 --report_gbits -F" in ran(tools)
    assert not report.passed and report.failed == [by["nvidia-smi"]]  # the pending remap
    assert "dcgmi diag -r 2 -j" in ran(tools)


def test_absent_tools_are_said_once_and_nothing_is_asked(tmp_path: Path) -> None:
    def never() -> list[str]:
        raise AssertionError("no tool here: the GPUs need not be free")

    empty = tmp_path / "empty"
    empty.mkdir()
    report = run_level(DiagSettings(tool_dir=str(empty), ib_devices=["mlx5_0"]), "long", never)
    assert report.passed and report.results == []
    assert report.absent == ["nvidia-smi", "dcgmi", "ibstat", "all_reduce_perf", "ib_write_bw", "ib_read_lat"]
    assert report.summary() == ("diag long: no diagnostic tool on this node; absent: nvidia-smi, dcgmi, ibstat, "
                                "all_reduce_perf, ib_write_bw, ib_read_lat")


def test_a_hung_tool_is_killed_with_its_children_and_the_rest_still_runs(tools: Path) -> None:
    # dcgmi's work is done by a child (nvvs): both hang; the child's pid is written down.
    script(tools, "dcgmi", f'sleep 300 & echo $! > "{tools}/child"\nwait')
    started = time.monotonic()
    report = run_level(DiagSettings(tool_dir=str(tools), dcgmi_timeout=1), "quick", free)
    assert time.monotonic() - started < 30  # generous: a 2-core CI VM
    by = {r.subject: r for r in report.results}
    assert by["dcgmi diag -r 1"].status is Status.UNKNOWN and "killed after" in by["dcgmi diag -r 1"].summary
    assert by["ibstat"].status is Status.OK  # the next test ran
    assert not report.passed and "dcgmi diag -r 1 killed" in report.summary()
    child = int((tools / "child").read_text())
    wait_until(lambda: gone(child), what="the hung tool's child killed with its group")


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_tool_that_exits_leaving_a_child_on_its_output_is_its_result_and_the_child_is_killed(tools: Path) -> None:
    """Review item 14: its pass is a pass, not "killed after its timeout" waiting for the pipe to close, and what it
    left behind does not stay to hold the GPUs for the next test."""
    script(tools, "nvidia-smi", f'cat "{DATA / "nvidia-smi-q-h100-pass.txt"}"\n'
                                f'sleep 300 & echo $! > "{tools}/child"\nexit 0')
    report = run_level(DiagSettings(tool_dir=str(tools), tool_timeout=5, gpus=1), "quick", free)
    by = {r.subject: r for r in report.results}
    assert by["nvidia-smi"].status is Status.OK, by["nvidia-smi"].summary
    assert report.passed, report.summary()
    child = int((tools / "child").read_text())
    wait_until(lambda: gone(child), what="the child it left behind killed with its group")


# A perftest pair on a TCP port: the server (no host argument) listens only after a while, as a loaded node's does;
# the client is refused until it does, and fails as perftest fails then.
PERFTEST = """import socket, sys, time
port = int(sys.argv[1])
if sys.argv[-1] != "localhost":
    time.sleep(2)
    with socket.create_server(("127.0.0.1", port)) as srv:
        srv.accept()[0].close()
    sys.exit(0)
try:
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
except OSError:
    print(f"Couldn't connect to localhost:{port}")
    sys.exit(1)
print(open(sys.argv[2]).read())
"""


def test_the_loopback_client_waits_for_its_server_to_listen(tools: Path) -> None:
    with socket.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (tools / "perftest.py").write_text(PERFTEST)
    # not exec'd: the server listening is the shell's child, in its group
    script(tools, "ib_write_bw", f'"{sys.executable}" "{tools}/perftest.py" {port} "{DATA / "ib_write_bw-ndr.txt"}" '
                                 '"$@"')
    settings = DiagSettings(tool_dir=str(tools), ib_devices=["mlx5_0"], ib_gbits=380, tool_timeout=30)
    report = run_level(settings, "standard", free)
    by = {r.subject: r for r in report.results}
    assert by["ib_write_bw mlx5_0"].status is Status.OK, by["ib_write_bw mlx5_0"].summary
    assert by["ib_write_bw mlx5_0"].details["gbits"] == 392.34


def test_the_budget_caps_a_hang_and_leaves_the_rest_not_run(tools: Path) -> None:
    script(tools, "dcgmi", "exec sleep 300")
    settings = DiagSettings(tool_dir=str(tools), budget_quick=1.5, dcgmi_timeout=600)
    started = time.monotonic()
    report = run_level(settings, "quick", free)
    assert time.monotonic() - started < 30
    assert [r.status for r in report.results] == [Status.OK, Status.UNKNOWN, Status.UNKNOWN]
    assert report.results[2].summary == "ibstat not run: the quick level's budget (1.5s) was spent"
    assert "ibstat" not in ran(tools)


def test_refused_while_a_job_holds_the_gpus(tools: Path) -> None:
    report = run_level(DiagSettings(tool_dir=str(tools)), "quick", lambda: ["SLURM job 7", "pid 4242 on GPU 0"])
    assert not report.passed and report.status is Status.UNKNOWN and report.results == []
    assert "SLURM job 7" in report.refused and ran(tools) == []


def test_a_job_that_starts_between_tests_stops_the_rest(tools: Path) -> None:
    answers = iter([[], ["SLURM job 9"]])
    report = run_level(DiagSettings(tool_dir=str(tools)), "quick", lambda: next(answers))
    assert ran(tools) == ["nvidia-smi -q"]
    assert report.results[-1].summary == "stopped before dcgmi: the GPUs are in use (SLURM job 9)"
    assert not report.passed


def test_the_level_must_fit_the_actions_timeout() -> None:
    with pytest.raises(ValueError, match="long level's budget"):
        DiagSettings(level="long")
    with pytest.raises(ValueError, match="standard level's budget"):
        ResumeSettings(validation="standard")
    assert ResumeSettings(validation="standard", timeout=1000).validation == "standard"


def test_trainguard_diag_end_to_end(tools: Path, tmp_path: Path) -> None:
    cat(tools, "dcgmi", "dcgmi-r1-fail-gb10.json", rc=226)
    no_slurm = tmp_path / "no-slurm"
    no_slurm.mkdir()
    config = tmp_path / "trainguard.toml"
    config.write_text(f'[agent]\nstate_dir = "{tmp_path}/state"\n[jobs]\nslurm_bin_dir = "{no_slurm}"\n'
                      f'[actions.diag]\ntool_dir = "{tools}"\ngpus = 1\nib_devices = ["mlx5_0"]\n')
    proc = subprocess.run([sys.executable, "-m", "trainguard", "diag", "-c", str(config), "--json"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    out = json.loads(proc.stdout)
    assert out["level"] == "quick" and out["passed"] is False
    assert [(r["subject"], r["status"]) for r in out["results"]] == [
        ("nvidia-smi", "OK"), ("dcgmi diag -r 1", "CRITICAL"), ("ibstat", "OK")]
    assert out["results"][1]["details"]["failed"] == ["software"]
    assert "not recorded in the ledger: no state database" in proc.stderr  # no agent ran here: said, no more
    plain = subprocess.run([sys.executable, "-m", "trainguard", "diag", "-c", str(config), "--level", "quick"],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 2 and "diag quick failed: dcgmi diag -r 1: failed software" in plain.stdout


# the resume gate ----------------------------------------------------------------------------------------------------

class StubSlurm:
    """The node drained by trainguard; records drains and resumes; `jobs`: what `scontrol listpids` shows."""

    def __init__(self, jobs: dict[str, list[int]] | None = None) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.jobs = jobs or {}
        self.reason = "trainguard: xid: GPU 0 XID 79 fell off the bus"

    def node_state(self, node: str) -> tuple[str, str]:
        return "IDLE+DRAIN", self.reason

    def local_pids(self, node: str = "") -> dict[str, list[int]]:
        return self.jobs

    def drain(self, node: str, reason: str) -> None:
        self.calls.append(("drain", node, reason))
        self.reason = reason

    def resume(self, node: str) -> None:
        self.calls.append(("resume", node))


def resume(settings: ResumeSettings, slurm: StubSlurm) -> str:
    event = Event(EventKind.RESOLVED, "i1", "xid", "GPU 0", Status.OK, "resolved", "n1", time.time(), time.time())
    ctx = ActionContext(event, (), "n1", slurm, time.time)  # type: ignore[arg-type]
    return ResumeAction("resume", settings).run(ctx)


def test_resume_after_a_passing_validation(tools: Path) -> None:
    slurm = StubSlurm()
    assert resume(ResumeSettings(tool_dir=str(tools), gpus=1), slurm).startswith("resumed n1")
    assert slurm.calls == [("resume", "n1")]
    assert "dcgmi diag -r 1 -j" in ran(tools)


def test_a_failing_validation_keeps_the_node_drained_with_the_failed_test(tools: Path) -> None:
    cat(tools, "dcgmi", "dcgmi-r1-fail-gb10.json", rc=226)
    slurm = StubSlurm()
    with pytest.raises(ActionError) as failed:
        resume(ResumeSettings(tool_dir=str(tools), gpus=1), slurm)
    assert [c[0] for c in slurm.calls] == ["drain"]  # never resumed
    reason = slurm.calls[0][2]
    assert reason.startswith("trainguard: quick diag failed: dcgmi diag -r 1: failed software: GPU 0: Persistence")
    assert len(reason) <= 200 and "left drained" in str(failed.value)


def test_resume_waits_while_a_job_holds_the_gpus(tools: Path) -> None:
    slurm = StubSlurm(jobs={"77": [1234]})
    with pytest.raises(ActionSkippedError, match="SLURM job 77"):
        resume(ResumeSettings(tool_dir=str(tools)), slurm)
    assert slurm.calls == [] and ran(tools) == []


def test_a_slurm_that_does_not_answer_is_no_proof_the_gpus_are_free(tools: Path) -> None:
    class Silent(StubSlurm):
        def local_pids(self, node: str = "") -> dict[str, list[int]]:
            raise SlurmError("scontrol listpids timed out after 10s (slurmctld not answering?)")

    with pytest.raises(ActionSkippedError, match="SLURM did not say"):
        resume(ResumeSettings(tool_dir=str(tools)), Silent())


def test_resume_without_validation_or_without_tools_is_todays_resume(tmp_path: Path, tools: Path) -> None:
    slurm = StubSlurm()
    cat(tools, "dcgmi", "dcgmi-r1-fail-gb10.json", rc=226)
    assert resume(ResumeSettings(tool_dir=str(tools), validation="none"), slurm).startswith("resumed")
    assert ran(tools) == []
    empty = tmp_path / "none"
    empty.mkdir()
    assert resume(ResumeSettings(tool_dir=str(empty)), slurm).startswith("resumed")
    assert slurm.calls == [("resume", "n1"), ("resume", "n1")]


def test_diag_action(tools: Path) -> None:
    event = Event(EventKind.FIRED, "i1", "xid", "GPU 0", Status.CRITICAL, "XID 79", "n1", time.time(), time.time())
    ctx = ActionContext(event, (), "n1", StubSlurm(), time.time)  # type: ignore[arg-type]
    assert DiagAction("diag", DiagSettings(tool_dir=str(tools), gpus=1)).run(ctx).startswith("diag quick passed")
    cat(tools, "nvidia-smi", "nvidia-smi-q-a100-remap-pending.txt")
    with pytest.raises(ActionError, match="row remap pending"):
        DiagAction("diag", DiagSettings(tool_dir=str(tools))).run(ctx)


def test_ibstat_on_a_node_without_hca() -> None:
    said = "ibpanic: [2137592] main: stat of IB device 'mthca0' failed: No such file or directory\n"
    assert diagtools.read_ibstat(255, said).status is Status.OK
    assert diagtools.read_ibstat(255, said, ("mlx5_0",)).status is Status.CRITICAL


def test_a_bad_repair_on_real_slurm_keeps_the_node_drained_and_the_job_pending(
        slurm: SlurmCluster, tmp_path: Path, tools: Path) -> None:
    """The real controller: a resume whose diagnostics fail leaves the node drained with the failed test in its
    reason, and a job submitted meanwhile waits; a running job's steps (`scontrol listpids`) refuse the run; once
    the diagnostics pass, the resume lifts the drain and the job starts."""
    cat(tools, "dcgmi", "dcgmi-r1-fail-gb10.json", rc=226)
    engine: Engine = engine_for(slurm, tmp_path, {}, actions={"resume": {"tool_dir": str(tools), "gpus": 1}})
    job = None
    try:
        # the node to itself: a job an earlier test of the session left running would refuse every diagnostics run
        sh("scancel", "--state=RUNNING", check=False)
        sh("scancel", "--state=PENDING", check=False)
        wait_until(lambda: not sh("scontrol", "listpids", check=False).strip().splitlines()[1:], 30,
                   what="no job's steps on the node")
        busy = slurm.submit("sleep 300", name="tg-diag-busy")
        slurm.wait_state(busy, ("RUNNING",))
        sh("scontrol", "update", f"nodename={slurm.node}", "state=drain", "reason=trainguard: GPU 0 XID 79")
        wait_until(lambda: slurm.job(busy).get("JobState") == "RUNNING" and busy in sh("scontrol", "listpids"),
                   what="the job's steps listed on this node")
        record = run_action(engine, "resume", event(), ())
        assert record["outcome"] == "skipped" and f"SLURM job {busy}" in record["detail"], record
        assert ran(tools) == [] and "DRAIN" in slurm.node_info()["State"]
        sh("scancel", busy)
        wait_until(lambda: not sh("scontrol", "listpids", check=False).strip().splitlines()[1:], 30,
                   what=f"the job's steps gone: {sh('scontrol', 'listpids', check=False).strip()}")

        record = run_action(engine, "resume", event(), ())
        assert record["outcome"] == "failed", record
        node = slurm.node_info()
        assert "DRAIN" in node["State"]
        assert node["Reason"].startswith("trainguard: quick diag failed: dcgmi diag -r 1: failed software"), node
        job = slurm.submit("true", name="tg-diag-waits")
        slurm.wait_state(job, ("PENDING",))
        time.sleep(3)  # a scheduling pass or two: the drained node takes nothing
        assert slurm.job(job)["JobState"] == "PENDING"

        cat(tools, "dcgmi", "dcgmi-r3-pass-8gpu.json")
        record = run_action(engine, "resume", event(), ())
        assert record["outcome"] == "ok", record
        slurm.wait_state(job, ("RUNNING", "COMPLETING", "COMPLETED"), timeout=60)
    finally:
        engine.stop()
        if job:
            sh("scancel", job, check=False)
        slurm.resume_node()
