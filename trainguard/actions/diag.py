"""Active diagnostics: the site's tools run one after another under a level's total budget, never while a job holds
the node's GPUs. The `diag` action, `trainguard diag` and the `resume` action's validation (trainguard.actions.
slurmctl) all run a level through `run_level`; the tools' output is read by trainguard.gpu.diagtools."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from trainguard.actions.base import Action, ActionContext, ActionError, ActionSettings, ActionSkippedError
from trainguard.core.command import end_group, leader_exited, run_bounded
from trainguard.core.logs import kv
from trainguard.core.model import Result, Status, worst
from trainguard.core.settings import Duration, Field, model_validator
from trainguard.core.text import one_line
from trainguard.gpu import diagtools
from trainguard.gpu.nvml import Nvml, NvmlUnavailableError
from trainguard.jobs.slurm import SlurmClient, SlurmError
from trainguard.node.procfs import ProcFS

log = logging.getLogger(__name__)

Level = Literal["quick", "standard", "long"]
LEVELS: tuple[Level, ...] = ("quick", "standard", "long")
DCGM_RUN = {"quick": 1, "standard": 2, "long": 3}  # `dcgmi diag -r N` of each level
MAX_OUTPUT = 4 << 20  # a tool's output beyond this is cut: the readers need its table or its document, not more
SERVER_END_S = 2.0  # how long a loopback's server gets to end after its client did, before its group is killed


class DiagToolSettings(ActionSettings):
    """The tools, their timeouts and the figures they must reach: shared by `diag` and `resume`'s validation."""

    budget_quick: Duration = Field(120.0, gt=0, description="Total time of the quick level's tests.")
    budget_standard: Duration = Field(900.0, gt=0, description="Total time of the standard level's tests.")
    budget_long: Duration = Field(3600.0, gt=0, description="Total time of the long level's tests.")
    tool_dir: str = Field("", description="Directory of the diagnostic tools (dcgmi, nvidia-smi, all_reduce_perf, "
                                          "ib_write_bw, ib_read_lat, ibstat); empty: found on PATH. A tool not "
                                          "there is skipped and said once, never failed.")
    tool_timeout: Duration = Field(60.0, gt=0, description="Each tool but dcgmi and all_reduce_perf is killed (its "
                                                           "process group) after this, and reported UNKNOWN.")
    dcgmi_timeout: Duration = Field(1800.0, gt=0, description="`dcgmi diag` is killed after this (or when the "
                                                              "level's budget runs out, whichever is first).")
    nccl_timeout: Duration = Field(300.0, gt=0, description="`all_reduce_perf` is killed after this.")
    gpus: int = Field(0, ge=0, description="GPUs this node must have (nvidia-smi -q counts them); 0: not checked, "
                                           "and all_reduce_perf runs on as many as nvidia-smi saw.")
    nccl_args: list[str] = Field(default_factory=lambda: ["-b", "1G", "-e", "4G", "-f", "2"],
                                 description="Sizes all_reduce_perf runs (`-g` is added: the node's GPUs).")
    nccl_busbw: float = Field(0.0, ge=0, description="Bus bandwidth (GB/s) all_reduce_perf must reach at its "
                                                     "largest size; 0: reported, not judged. About 80% of the "
                                                     "NVLink figure: 8x H100 SXM reach ~480, 8x A100 SXM ~230.")
    ib_devices: list[str] = Field(default_factory=list, description="The HCAs jobs use (e.g. mlx5_0): their ports "
                                                                    "must be Active/LinkUp (ibstat), and each runs "
                                                                    "the perftest loopback at standard and long. "
                                                                    "Empty: ports are only warned about, no "
                                                                    "loopback runs.")
    ib_rate: float = Field(0.0, ge=0, description="Rate (Gb/s) ibstat must show on those ports; 0: not checked.")
    ib_gbits: float = Field(0.0, ge=0, description="Average bandwidth (Gb/s) the ib_write_bw loopback must reach; "
                                                   "0: reported, not judged.")
    ib_lat_us: float = Field(0.0, ge=0, description="Typical latency (usec) the ib_read_lat loopback must not "
                                                    "exceed; 0: reported, not judged.")
    command: list[str] = Field(default_factory=list, description="A site's own test (argv, no shell), run at every "
                                                                 "level under the Nagios conventions: exit 0/1/2/3, "
                                                                 "the first line the summary. Empty: none.")

    def budget(self, level: Level) -> float:
        return {"quick": self.budget_quick, "standard": self.budget_standard, "long": self.budget_long}[level]

    def fits(self, level: Level | None) -> None:
        """The action's own `timeout` must outlast the level it runs: cut short, it would report nothing."""
        if level is not None and self.budget(level) >= self.timeout:
            raise ValueError(f"the {level} level's budget ({self.budget(level):g}s) must be shorter than "
                             f"timeout ({self.timeout:g}s)")


LEVEL_HELP = ("`quick` (nvidia-smi -q, dcgmi diag -r 1, ibstat, the site command: about a minute), `standard` (adds "
              "dcgmi diag -r 2, all_reduce_perf, an ib_write_bw loopback: minutes), `long` (dcgmi diag -r 3, an "
              "ib_read_lat loopback besides: up to an hour)")


class DiagSettings(DiagToolSettings):
    timeout: Duration = Field(960.0, gt=0, description="An action still running after this is reported as failed; "
                                                       "longer than the level's budget.")
    level: Level = Field("quick", description=f"The tests this action runs: {LEVEL_HELP}.")

    @model_validator(mode="after")
    def _level_fits(self) -> DiagSettings:
        self.fits(self.level)
        return self


@dataclass(frozen=True)
class ToolRun:
    rc: int | None  # None: killed at its timeout
    out: str  # stdout and stderr, in order
    seconds: float


def run_group(argv: list[str], timeout: float) -> ToolRun:
    """Run `argv` through trainguard.core.command.run_bounded: in its own session, its output capped, done when it
    exits (a background child still holding its output is not waited for), and what is left of its process group
    (dcgmi's nvvs, nccl-tests' threads, a shell script's children) killed then, or at `timeout` with it."""
    try:
        done = run_bounded(argv, max(timeout, 0.1), MAX_OUTPUT, merge_stderr=True)
    except OSError as exc:
        return ToolRun(127, f"{os.path.basename(argv[0])} failed to start: {exc}", 0.0)
    return ToolRun(done.code, done.stdout.decode(errors="replace"), done.elapsed)


def until_listening(server: subprocess.Popen[Any], wait: float, proc: ProcFS) -> None:
    """Until a process of `server`'s group listens on a TCP socket (perftest's server, ready for its client: one
    that connects first is refused and fails the loopback), the server exits, or `wait` is up."""
    deadline = time.monotonic() + wait
    pause = 0.01
    while not leader_exited(server.pid) and not any(proc.listening(pid) for pid in proc.group(server.pid)):
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.2)


@dataclass
class DiagReport:
    level: Level
    results: list[Result] = field(default_factory=list)
    absent: list[str] = field(default_factory=list)  # tools not on this node: said once, not failed
    refused: str = ""  # why nothing ran (a job holds the GPUs)
    seconds: float = 0.0

    @property
    def status(self) -> Status:
        return Status.UNKNOWN if self.refused else worst(r.status for r in self.results)

    @property
    def passed(self) -> bool:
        """A pass: nothing refused, nothing CRITICAL, nothing that could not be judged (a tool killed at its
        timeout, a test the budget left out): a resume waits for a pass."""
        return not self.refused and all(r.status in (Status.OK, Status.WARNING) for r in self.results)

    @property
    def failed(self) -> list[Result]:
        return [r for r in self.results if r.status in (Status.CRITICAL, Status.UNKNOWN)]

    def summary(self) -> str:
        if self.refused:
            return f"diag {self.level} refused: {self.refused}"
        absent = f"; absent: {', '.join(self.absent)}" if self.absent else ""
        if not self.results:
            return f"diag {self.level}: no diagnostic tool on this node{absent}"
        if self.failed:
            return f"diag {self.level} failed: " + "; ".join(r.summary for r in self.failed) + absent
        return f"diag {self.level} passed ({len(self.results)} tests, {self.seconds:.0f}s){absent}"

    def to_dict(self) -> dict[str, object]:
        return {"level": self.level, "status": self.status.name, "passed": self.passed, "summary": self.summary(),
                "absent": self.absent, "refused": self.refused, "seconds": round(self.seconds, 1),
                "results": [r.to_dict() for r in self.results]}


Holders = Callable[[], list[str]]


def gpu_holders(slurm: SlurmClient | None, slurmd: str = "", nvml: Nvml | None = None) -> list[str]:
    """What holds this node's GPUs: SLURM jobs with steps here (`scontrol listpids`, answered by the local
    slurmstepds) and processes on the GPUs (NVML). A SLURM that does not answer is a holder too: a job may be
    there. No SLURM or no NVML on the node: that source says nothing."""
    holders = []
    if slurm is not None:
        try:
            holders += [f"SLURM job {job}" for job in sorted(slurm.local_pids(slurmd))]
        except SlurmError as exc:
            if "not installed" not in str(exc):
                holders.append(f"SLURM did not say which jobs run here ({exc})")
    try:
        gpus = (nvml or Nvml()).gpus()
    except (NvmlUnavailableError, ImportError):
        gpus = []
    holders += [f"pid {p.pid} on GPU {g.index}" for g in gpus for p in g.processes or ()]
    return holders


@dataclass
class _Plan:
    """One level's tests in order: (name for the budget message, tool, run it) each."""

    settings: DiagToolSettings
    level: Level
    report: DiagReport
    deadline: float

    def tool(self, name: str) -> str | None:
        found = shutil.which(name, path=self.settings.tool_dir or None)
        if found is None and name not in self.report.absent:
            self.report.absent.append(name)
        return os.path.abspath(found) if found else None  # the tools run in /

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, argv: list[str], own_timeout: float) -> ToolRun:
        return run_group(argv, min(own_timeout, self.left()))


def _timed_out(subject: str, run: ToolRun) -> Result:
    return Result(diagtools.CHECK, subject, Status.UNKNOWN,
                  f"{subject} killed after {run.seconds:.0f}s (its timeout or the level's budget): no result")


def _smi(plan: _Plan) -> None:
    tool = plan.tool("nvidia-smi")
    if tool:
        run = plan.run([tool, "-q"], plan.settings.tool_timeout)
        plan.report.results.append(_timed_out("nvidia-smi", run) if run.rc is None else
                                   diagtools.read_nvidia_smi(run.rc, run.out, plan.settings.gpus))


def _dcgmi(plan: _Plan) -> None:
    tool = plan.tool("dcgmi")
    if tool:
        level = DCGM_RUN[plan.level]
        run = plan.run([tool, "diag", "-r", str(level), "-j"], plan.settings.dcgmi_timeout)
        plan.report.results.append(_timed_out(f"dcgmi diag -r {level}", run) if run.rc is None else
                                   diagtools.read_dcgmi(level, run.rc, run.out))


def _ibstat(plan: _Plan) -> None:
    tool = plan.tool("ibstat")
    if tool:
        run = plan.run([tool], plan.settings.tool_timeout)
        plan.report.results.append(_timed_out("ibstat", run) if run.rc is None else diagtools.read_ibstat(
            run.rc, run.out, tuple(plan.settings.ib_devices), plan.settings.ib_rate))


def _nccl(plan: _Plan) -> None:
    tool = plan.tool("all_reduce_perf")
    if not tool:
        return
    seen = next((r.details.get("gpus") for r in plan.report.results if r.subject == "nvidia-smi"), None)
    gpus = plan.settings.gpus or (seen if isinstance(seen, int) else 0)
    if not gpus:
        plan.report.results.append(Result(diagtools.CHECK, "all_reduce_perf", Status.UNKNOWN,
                                          "all_reduce_perf not run: the GPU count is unknown (set `gpus`)"))
        return
    run = plan.run([tool, *plan.settings.nccl_args, "-g", str(gpus)], plan.settings.nccl_timeout)
    plan.report.results.append(_timed_out("all_reduce_perf", run) if run.rc is None else
                               diagtools.read_all_reduce(run.rc, run.out, plan.settings.nccl_busbw))


def _loopback(plan: _Plan, name: str, expected: float) -> None:
    """perftest between a server and a client on the same HCA (`localhost`), per device."""
    tool = plan.tool(name) if plan.settings.ib_devices else None
    for device in plan.settings.ib_devices if tool else []:
        argv = [tool or name, "-d", device, "--report_gbits", "-F"]
        server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  stdin=subprocess.DEVNULL, start_new_session=True, cwd="/")
        try:
            until_listening(server, min(plan.settings.tool_timeout, max(plan.left(), 0)), ProcFS())
            run = plan.run([*argv, "localhost"], plan.settings.tool_timeout)
        finally:  # it ends with its client; one that did not (a client that never connected) is killed, with its group
            end_group(server, time.monotonic() + SERVER_END_S)
        plan.report.results.append(_timed_out(f"{name} {device}", run) if run.rc is None else
                                   diagtools.read_perftest(name, device, run.rc, run.out, expected))


def _command(plan: _Plan) -> None:
    argv = plan.settings.command
    if argv:
        found = shutil.which(argv[0]) if os.sep not in argv[0] else os.path.abspath(argv[0])  # it runs in /
        if found is None or not os.path.exists(found):
            plan.report.absent.append(argv[0])
            return
        run = plan.run([found, *argv[1:]], plan.settings.tool_timeout)
        name = os.path.basename(argv[0])
        plan.report.results.append(_timed_out(name, run) if run.rc is None else
                                   diagtools.read_site_command(name, run.rc, run.out))


def _tests(level: Level) -> list[tuple[str, Callable[[_Plan], None]]]:
    tests: list[tuple[str, Callable[[_Plan], None]]] = [("nvidia-smi", _smi), ("dcgmi", _dcgmi), ("ibstat", _ibstat)]
    if level != "quick":
        tests += [("all_reduce_perf", _nccl),
                  ("ib_write_bw", lambda plan: _loopback(plan, "ib_write_bw", plan.settings.ib_gbits))]
    if level == "long":
        tests.append(("ib_read_lat", lambda plan: _loopback(plan, "ib_read_lat", plan.settings.ib_lat_us)))
    return [*tests, ("command", _command)]


def _applies(settings: DiagToolSettings, name: str) -> bool:
    """Whether the test would run anything here: its tool is present (and configured: a site command, the HCAs of a
    loopback)."""
    if name == "command":
        return bool(settings.command)
    if name in ("ib_write_bw", "ib_read_lat") and not settings.ib_devices:
        return False
    return shutil.which(name, path=settings.tool_dir or None) is not None


def run_level(settings: DiagToolSettings, level: Level, holders: Holders) -> DiagReport:
    """Run the level's tests one after another within its budget. Refused (nothing run) while anything holds the
    GPUs; a job that appears between two tests stops the rest. A tool killed at its timeout is UNKNOWN and the next
    test still runs; once the budget is spent, each test left is UNKNOWN ("not run")."""
    started = time.monotonic()
    report = DiagReport(level)
    plan = _Plan(settings, level, report, started + settings.budget(level))
    # A node without any diagnostic tool validates as today, without asking SLURM or NVML anything.
    if not any(_applies(settings, name) for name, _ in _tests(level)):
        for _name, test in _tests(level):
            test(plan)  # each only notes its tool absent
        return report
    busy = holders()
    if busy:
        report.refused = f"the GPUs are in use ({', '.join(busy[:5])}): diagnostics never run beside a job"
        return report
    first = True
    for name, test in _tests(level):
        if not _applies(settings, name):
            test(plan)  # notes its tool absent, runs nothing
        elif plan.left() <= 0:
            report.results.append(Result(diagtools.CHECK, name, Status.UNKNOWN, f"{name} not run: the {level} "
                                         f"level's budget ({settings.budget(level):g}s) was spent"))
        elif not first and (busy := holders()):
            report.results.append(Result(diagtools.CHECK, name, Status.UNKNOWN,
                                         f"stopped before {name}: the GPUs are in use ({', '.join(busy[:5])})"))
            break
        else:
            test(plan)
            first = False
    report.seconds = time.monotonic() - started
    log.info("diagnostics done", extra=kv(level=level, status=report.status.name, seconds=round(report.seconds, 1),
                                          absent=",".join(report.absent)))
    return report


class DiagAction(Action):
    """Runs a diagnostics level on this node (refused while a job holds its GPUs)."""

    needs_jobs = False
    Settings = DiagSettings
    settings: DiagSettings

    def plan(self, ctx: ActionContext) -> str:
        return f"run the {self.settings.level} diagnostics on {ctx.node} unless a job holds its GPUs"

    def run(self, ctx: ActionContext) -> str:
        report = run_for(ctx, self.settings, self.settings.level, "action")
        if report.refused:
            raise ActionSkippedError(report.summary())
        if not report.passed:
            raise ActionError(report.summary())
        return report.summary()


def run_for(ctx: ActionContext, settings: DiagToolSettings, level: Level, source: str) -> DiagReport:
    """An action's run of the level on this node, its report handed to the context (the node ledger)."""
    report = run_level(settings, level, lambda: gpu_holders(ctx.slurm, ctx.slurmd))
    if ctx.on_diag is not None:
        ctx.on_diag(report, source)
    return report


def validate_before_resume(settings: DiagToolSettings, level: Level, ctx: ActionContext) -> DiagReport:
    """The `resume` action's gate, in one call: the report of the level on this node."""
    return run_for(ctx, settings, level, "resume")


def reason_of(report: DiagReport) -> str:
    """The failed tests in a drain reason's few words."""
    return one_line("; ".join(r.summary for r in report.failed) or report.summary(), 150)
