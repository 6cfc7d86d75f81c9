"""SLURM's commands and what they print. Every command runs with a timeout; a controller that doesn't answer is an
error, never a hang. What they print about a job holds that job's user's text (its name, its paths): the parsers
here are typed and bounded, and never raise."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from trainguard.core.text import linear
from trainguard.core.tools import run_tool
from trainguard.jobs.model import Job


class SlurmError(Exception):
    """A SLURM command failed, timed out, or is not installed."""


class SlurmMissingError(SlurmError):
    """The SLURM command is not on this node: there is no SLURM here to ask or to act on."""


@dataclass(frozen=True)
class SlurmClient:
    timeout: float = 10.0
    bin_dir: str = ""  # empty: find the commands on PATH

    def run(self, *args: str, timeout: float | None = None) -> str:
        cmd = [os.path.join(self.bin_dir, args[0]) if self.bin_dir else args[0], *args[1:]]
        return run_tool(cmd, timeout or self.timeout, SlurmError, label=" ".join(args[:2]),
                        hint=" (slurmctld not answering?)", missing=SlurmMissingError)

    # on this node: answered by the local slurmstepds, no RPC to slurmctld ------------------------------------------
    def local_pids(self, node: str = "") -> dict[str, list[int]]:
        """job id -> pids of every job step on this node (`scontrol listpids`, which reads the slurmd spool dir and
        asks each step's slurmstepd; `node` names this node's slurmd where a host runs several)."""
        return parse_listpids(self._listpids(node))

    def local_steps(self, job_id: str, node: str = "") -> dict[str, list[int]]:
        """The job's steps launched by srun on this node (step id -> pids), from the same local `scontrol listpids`:
        the batch script and the extern step are not among them."""
        return parse_listpids_steps(self._listpids(node)).get(job_id, {})

    def local_work_pids(self, job_id: str, node: str = "") -> list[int]:
        """The job's processes on this node that do its work: its batch script and its srun steps, not its extern
        step (the `sleep` SLURM keeps on every node of a job under `PrologFlags=Contain`, spares included)."""
        return parse_listpids_work(self._listpids(node)).get(job_id, [])

    def _listpids(self, node: str) -> str:
        try:
            return self.run("scontrol", "listpids", *(["*", node] if node else []))
        except SlurmError as exc:
            if "No job steps exist" in str(exc) or "no steps" in str(exc).lower():
                return ""
            raise

    # one job, by id: one REQUEST_JOB_INFO_SINGLE -------------------------------------------------------------------
    def show_job(self, job_id: str) -> str | None:
        """`scontrol show job ID --oneliner` as printed; None when the controller no longer knows the job."""
        try:
            return self.run("scontrol", "show", "job", job_id, "--oneliner")
        except SlurmError as exc:
            if "Invalid job id" in str(exc):
                return None
            raise

    # about the cluster: filtered queries, for the checks that are about the cluster ----------------------------
    def named(self, names: Sequence[str]) -> list[Job]:
        """The jobs of these exact names the controller knows (pending, running, and finished within MinJobAge):
        `squeue --name` (22.05 filters names on the client, but the text form is a small part of a JSON dump)."""
        if not names:
            return []
        out = self.run("squeue", "--noheader", "--states=all", "--name=" + ",".join(names), "--Format=" + NAMED_FORMAT)
        wanted = set(names)
        jobs = [parse_named(line) for line in out.splitlines()]
        return [j for j in jobs if j is not None and j.name in wanted]

    def history(self, names: Sequence[str], lookback: float) -> list[Job]:
        """Jobs of these names that accounting (slurmdbd) recorded within `lookback` seconds, newest last.

        The controller forgets finished jobs after MinJobAge; accounting still knows their final state and
        exit code. 22.05's `sacct --json` misreports exit codes, so the parsable form is read instead.
        """
        args = ["sacct", "--allusers", "--allocations", "--noheader", "--parsable2", f"--delimiter={_SEP}",
                f"--starttime=now-{max(1, int(lookback))}seconds", "--format=" + ",".join(HISTORY_FIELDS)]
        if names and not any("," in n for n in names):  # sacct splits --name on commas
            args.append("--name=" + ",".join(names))
        wanted = set(names)
        jobs = [parse_history(line) for line in self.run(*args).splitlines() if line.strip()]
        return sorted((j for j in jobs if j is not None and j.name in wanted), key=lambda j: (j.end_time or 0, j.key))

    # commands --------------------------------------------------------------------
    def signal(self, job_id: str, signal_name: str, mode: str = "full") -> None:
        """`mode`: "full" (every step and the batch script) or "batch" (the batch script); one step: `signal_step`."""
        self.run("scancel", f"--signal={signal_name}", f"--{mode}", job_id)

    def signal_step(self, job_id: str, step: str, signal_name: str) -> bool:
        """Signal one srun step's tasks on every node it spans (the batch script and other steps are spared). False
        when SLURM says "Invalid job id" and the step is no longer listed: it had ended, or ended at this signal.

        SLURM 22.05 exits 225 with "Invalid job id specified" when the job's allocation holds a node the step does not
        span (a spare), though every task of the step got the signal (captured: tests/data/slurm/README.md). So the
        error alone says nothing: a step the controller still lists was signalled."""
        try:
            self.run("scancel", f"--signal={signal_name}", f"{job_id}.{step}")
        except SlurmError as exc:
            if "Invalid job id" not in str(exc):
                raise
            return step in self.steps(job_id)
        return True

    def step_sruns(self, job_id: str) -> dict[str, tuple[str, int]]:
        """Which srun launched each of the job's steps: step -> (host, pid), from the controller (one
        REQUEST_JOB_STEP_INFO for this job)."""
        return parse_step_sruns(self.run("scontrol", "show", "step", job_id, "--oneliner"), job_id)

    def step_nodes(self, job_id: str) -> dict[str, str]:
        """The nodes each of the job's srun steps spans: step -> NodeList, from the controller (one
        REQUEST_JOB_STEP_INFO for this job)."""
        return parse_step_nodes(self.run("scontrol", "show", "step", job_id, "--oneliner"), job_id)

    def steps(self, job_id: str) -> list[str]:
        """The ids of the job's srun steps still known to the controller, on any node (`squeue --steps`, one
        REQUEST_JOB_STEP_INFO for this job)."""
        out = self.run("squeue", "--steps", f"--jobs={job_id}", "--noheader", "--format=%i")
        return parse_steps(out, job_id)

    def cancel_step(self, job_id: str, step: str) -> bool:
        """Cancel one srun step on every node (the batch script goes on). False when the step had already ended."""
        try:
            self.run("scancel", f"{job_id}.{step}")
        except SlurmError as exc:
            if "Invalid job id" in str(exc) or "already complet" in str(exc):
                return False
            raise
        return True

    def requeue(self, job_id: str) -> None:
        self.run("scontrol", "requeue", job_id)

    def pending_tasks(self, array_job_id: str) -> str:
        """The array's pending task ids as a range list (`2-5,7`), empty when none is pending."""
        out = self.run("squeue", "--noheader", f"--jobs={array_job_id}", "--states=PENDING", "--format=%K")
        return ",".join(line.strip().split("%")[0] for line in out.splitlines() if line.strip())

    def hold_pending(self, array_job_id: str, user_hold: bool = True) -> str:
        """Holds the pending tasks only: `scontrol hold ARRAY` also names the finished ones, and then exits 1.
        `user_hold`: `uhold`, which the job's owner may release; `hold` from root or an operator is an administrator's
        hold (JobHeldAdmin), which only an administrator may release."""
        tasks = self.pending_tasks(array_job_id)
        if tasks:
            self.run("scontrol", "uhold" if user_hold else "hold", f"{array_job_id}_[{tasks}]")
        return tasks

    def cancel_pending(self, array_job_id: str) -> None:
        self.run("scancel", "--state=PENDING", array_job_id)

    def node_state(self, node: str) -> tuple[str, str]:
        """(state flags, reason) of a node."""
        record = self.node(node)
        return record.state, record.reason

    def node(self, node: str) -> NodeRecord:
        """What slurmctld holds of one node: `sinfo --nodes=NODE`, the node's row alone (REQUEST_NODE_INFO_SINGLE) and
        the partitions. Not `scontrol show node NODE`: it fetches every node's row (REQUEST_NODE_INFO) and picks one
        itself, a cost that grows with the cluster (captured: tests/data/slurm/README.md)."""
        out = self.run("sinfo", "--all", "--noheader", "--Node", f"--nodes={node}", f"--Format={NODE_FORMAT}")
        record = parse_node(out, node)
        if record is None:  # sinfo exits 0 for a name it does not know
            raise SlurmError(f"sinfo: node {node} not listed (not a SLURM node name, or in no partition)")
        return record

    def drain(self, node: str, reason: str) -> None:
        self.run("scontrol", "update", f"nodename={node}", "state=drain", f"reason={reason}")

    def resume(self, node: str) -> None:
        self.run("scontrol", "update", f"nodename={node}", "state=resume")


_PATTERN = linear(r"%(%|[AajxuNn])")
# One node's row, from `sinfo --nodes=NODE` (one name: REQUEST_NODE_INFO_SINGLE). The reason, free text, is last, so
# a `|` in it is its own; no field before it holds anything but SLURM's and root's words.
NODE_FORMAT = "NodeList:|,StateComplete:|,User:|,TimeStamp:|,Reason:0"
DRAIN_TAG = "trainguard:"  # how a drain reason trainguard set begins: what it may lift, and what is its own


@dataclass(frozen=True)
class NodeRecord:
    """One node as slurmctld holds it: its state (`MIXED+DRAIN`), split into the base state and its
    flags (`DRAIN`, `REBOOT_REQUESTED`; a base state's `*`, not responding, dropped), and the reason with who set it
    and when (`maintenance: host reboot`, root, 22:00)."""

    state: str = ""
    reason: str = ""
    reason_by: str = ""
    reason_at: float | None = None

    @property
    def base(self) -> str:
        return self.state.split("+", 1)[0].rstrip("*~#!%$@^-")

    @property
    def flags(self) -> frozenset[str]:
        return frozenset(self.state.split("+")[1:])

    @property
    def drained(self) -> bool:
        """Drained or draining: no new job starts here, and whoever drained it means to take it away."""
        return "DRAIN" in self.flags or self.base in ("DRAINED", "DRAINING")

    @property
    def trainguards(self) -> bool:
        """The reason is one trainguard set (its own incident says why)."""
        return self.reason.startswith(DRAIN_TAG)


def parse_node(text: str, node: str) -> NodeRecord | None:
    """`node`'s row in `sinfo --Node --Format=NODE_FORMAT` (one per partition it is in: the first); None when it has
    none. The state as `scontrol` says it (`MIXED+DRAIN`); no reason, user or time where sinfo says `none`,
    `Unknown`. Never raises."""
    for line in text.splitlines():
        fields = line.split("|", 4)
        if len(fields) != 5 or fields[0].strip() != node:
            continue
        state, by, at, reason = (f.strip() for f in fields[1:])
        return NodeRecord(state.upper(), "" if reason == "none" else reason, "" if by in ("Unknown", "N/A") else by,
                          slurm_time(at))
    return None


def expand_output_path(pattern: str, *, job_id: str, name: str | None = None, user: str | None = None,
                       array_job_id: str | None = None, array_task_id: str | None = None, node: str = "") -> str | None:
    """A StdOut/StdErr pattern as submitted (`%x-%A_%a.out`, as a prolog sees it) expanded the way slurmstepd does;
    None when it names something unknown here (the job's name or user before the controller said them)."""
    values = {"%": "%", "j": job_id, "x": name, "u": user, "A": array_job_id or job_id,
              "a": array_task_id if array_job_id and array_task_id else "4294967294", "N": node, "n": "0"}
    if any(values[m.group(1)] is None for m in _PATTERN.finditer(pattern)):
        return None
    return _PATTERN.sub(lambda m: values[m.group(1)] or "", pattern)


def slurm_time(value: str) -> float | None:
    """A time as SLURM's commands print it (local time); None for Unknown, None, N/A, NONE and anything odd."""
    try:
        return time.mktime(time.strptime(value, "%Y-%m-%dT%H:%M:%S"))
    except (ValueError, OverflowError):
        return None


def wait_status(value: str) -> str | None:
    """A raw wait status (squeue's exit_code, an epilog's SLURM_JOB_EXIT_CODE) as SLURM's `code:signal`."""
    if not (value.isascii() and value.isdigit() and len(value) <= 10):
        return None
    code = int(value)
    return f"{(code >> 8) & 0xFF}:{code & 0x7F}"


def _small_id(text: str) -> bool:
    return text.isascii() and text.isdigit() and len(text) <= 10


def _listpids_rows(out: str) -> Iterator[tuple[int, str, str]]:
    """`scontrol listpids` (PID JOBID STEPID LOCALID GLOBALID, one line per process after the header): (pid, job
    id, step id) of each line with a numeric pid and job id; the step id is "" when the line has none."""
    for line in out.splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 2 and _small_id(fields[0]) and _small_id(fields[1]):
            yield int(fields[0]), fields[1], fields[2] if len(fields) >= 3 else ""


def parse_listpids(out: str) -> dict[str, list[int]]:
    """`scontrol listpids` as job id -> pids (every step)."""
    jobs: dict[str, list[int]] = {}
    for pid, job, _step in _listpids_rows(out):
        jobs.setdefault(job, []).append(pid)
    return jobs


def parse_listpids_steps(out: str) -> dict[str, dict[str, list[int]]]:
    """The same as job id -> srun step id -> pids: only numbered steps (not `batch`, `extern`, `interactive`)."""
    jobs: dict[str, dict[str, list[int]]] = {}
    for pid, job, step in _listpids_rows(out):
        if _small_id(step):
            jobs.setdefault(job, {}).setdefault(step, []).append(pid)
    return jobs


def parse_listpids_work(out: str) -> dict[str, list[int]]:
    """The same as job id -> pids of its batch step and numbered steps (no `extern`, no `interactive`)."""
    jobs: dict[str, list[int]] = {}
    for pid, job, step in _listpids_rows(out):
        if step == "batch" or _small_id(step):
            jobs.setdefault(job, []).append(pid)
    return jobs


def _numbered_step(step_id: str, job_id: str) -> str | None:
    """The step number of `JOB.STEP` (an array task's `ARRAY_TASK.STEP`) of the job asked for by id; None for
    `batch`, `extern` and anything else."""
    job, _, step = step_id.strip().rpartition(".")
    array, _, task = job.partition("_")
    return step if _small_id(step) and (job == job_id or (_small_id(array) and _small_id(task))) else None


def parse_steps(out: str, job_id: str) -> list[str]:
    """`squeue --steps --jobs=ID --noheader --format=%i` (`1.0`, `1.batch`; an array task's as `ARRAY_TASK.STEP`,
    `7_2.0`): the job's numbered step ids. The output holds this job's steps alone (asked by id)."""
    return [step for step in (_numbered_step(line, job_id) for line in out.splitlines()) if step is not None]


def parse_step_sruns(out: str, job_id: str) -> dict[str, tuple[str, int]]:
    """`scontrol show step ID --oneliner`: numbered step -> (host, pid) of the srun that launched it
    (`SrunHost:Pid=vm:26715`). The step's name, the job user's text, comes before that field on its line: the last
    occurrence is SLURM's."""
    sruns: dict[str, tuple[str, int]] = {}
    for line in out.splitlines():
        if not line.startswith("StepId="):
            continue
        step = _numbered_step(line[len("StepId="):].split(" ", 1)[0], job_id)
        host, _, pid = line.rpartition("SrunHost:Pid=")[2].split(" ", 1)[0].rpartition(":")
        if step is not None and host and _small_id(pid):
            sruns.setdefault(step, (host, int(pid)))  # a step's own line comes first; a name can hold a line break
    return sruns


def parse_step_nodes(out: str, job_id: str) -> dict[str, str]:
    """`scontrol show step ID --oneliner`: numbered step -> its NodeList (a hostlist, `n[2-3]`). The field comes
    before the step's name (the job user's text) on its line: the first occurrence is SLURM's."""
    nodes: dict[str, str] = {}
    for line in out.splitlines():
        if not line.startswith("StepId="):
            continue
        step = _numbered_step(line[len("StepId="):].split(" ", 1)[0], job_id)
        hostlist = line.partition(" NodeList=")[2].split(" ", 1)[0]
        if step is not None and hostlist:
            nodes.setdefault(step, hostlist)
    return nodes


# squeue --Format: every field but the last ends with "|" and is printed whole; the name is last and whole (`:0`).
NAMED_FIELDS = ("JobID", "ArrayJobID", "ArrayTaskID", "State", "Reason", "UserName", "StartTime", "EndTime",
                "exit_code", "Name")
NAMED_FORMAT = ",".join(f"{f}:|" for f in NAMED_FIELDS[:-1]) + ",Name:0"


def parse_named(line: str) -> Job | None:
    """One line of `squeue --Format=NAMED_FORMAT`; None when it does not have that shape. Only the name is the job
    user's text, and it is last: a `|` in it stays in the name. (A name with a line break never matches the names
    asked for, which may not hold one, so it can't forge a line.)"""
    fields = line.split("|", len(NAMED_FIELDS) - 1)
    if len(fields) != len(NAMED_FIELDS):
        return None
    job_id, array_job, task, state, reason, user, start, end, code, name = fields
    if not _small_id(job_id) or not state.isascii() or not state.replace("_", "").isalpha():
        return None
    is_task = _small_id(array_job) and _small_id(task)  # the last task run takes the array's own id
    return Job(key=f"slurm:{job_id}", source="slurm", name=name, state=state, job_id=job_id,
               array_job_id=array_job if is_task else None, array_task_id=task if is_task else None,
               user=user or None, reason=reason if reason not in ("", "None") else None,
               start_time=slurm_time(start), end_time=slurm_time(end), exit_code=wait_status(code),
               extra={"from": "controller"})


@dataclass(frozen=True)
class JobRecord:
    """What the controller says of one job (`scontrol show job ID --oneliner`), fields the agent uses."""

    job_id: str
    name: str
    state: str
    array_job_id: str | None = None
    array_task_id: str | None = None
    user: str | None = None
    uid: int | None = None
    reason: str | None = None
    requeue: bool = True
    exit_code: str | None = None
    start_time: float | None = None
    end_time: float | None = None
    workdir: str | None = None
    stdout: str | None = None
    stderr: str | None = None
    batch_host: str | None = None  # the node running the batch script: a multi-node job's owner node
    node_list: str | None = None  # the nodes allocated, as a hostlist expression (`n[1-3]`)
    restarts: int | None = None  # how often it was requeued: SLURM keeps the job id, this number is its life


RECORD_MAX = 64 << 10  # one job's record is 1-2 KiB; the rest of a longer one is a job user's text
# Everything up to JobName= is the controller's own numbers; the job's name follows, free text that may hold line
# breaks, `UserId=` or a whole forged record, so nothing after it is trusted by position alone.
_RECORD_HEAD = linear(r"\AJobId=(\d{1,10})(?: ArrayJobId=(\d{1,10}) ArrayTaskId=(\S{1,64})(?: ArrayTaskThrottle=\d+)?)?"
                      r"(?: HetJobId=\d+ HetJobOffset=\d+)?(?: HetJobIdSet=\S+)? JobName=")
_USER = linear(r" UserId=([^\s()]{0,64})\((\d{1,10})\) GroupId=")
_FIELD = {key: linear(rf" {key}=(\S*)") for key in ("JobState", "Reason", "Requeue", "ExitCode", "StartTime",
                                                     "EndTime", "NodeList", "BatchHost", "Restarts")}
_HOST_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-[],")


def _hosts(value: str) -> str | None:
    """A node name or hostlist expression as the controller prints it; None for "(null)" and "" (pending)."""
    return value if 0 < len(value) <= 4096 and value[0].isalnum() and set(value) <= _HOST_CHARS else None

_WORKDIR = linear(r"(?s) WorkDir=(.*?) (?:AdminComment|SystemComment|Comment|StdErr)=")
_STDERR = linear(r"(?s) StdErr=(.*?) StdIn=")
_STDOUT = linear(r"(?s) StdIn=\S* StdOut=(.*?) Power=")
_EXIT = linear(r"^\d{1,3}:\d{1,3}$")


def parse_job_record(text: str, uid: int | None = None) -> JobRecord | None:
    """The record `scontrol show job ID --oneliner` prints; None when it does not start like one.

    `uid` is the job's user as this node knows it without the controller (its processes, its cgroup, the prolog's
    environment): the record's own UserId is found as the first `UserId=...(uid)` after the name. Without it the
    first one is taken, and when the name holds another `UserId=` the user is left unknown rather than guessed.
    """
    text = text[:RECORD_MAX]
    head = _RECORD_HEAD.match(text)
    if head is None:
        return None
    rest = text[head.end():]
    owners = [m for m in _USER.finditer(rest) if uid is None or int(m.group(2)) == uid]
    if not owners:
        return None
    owner = owners[0]
    forged = uid is None and len(owners) > 1  # the name holds a `UserId=`: which one is the controller's is unknown
    # The job's name (before the controller's UserId) or its comment (after) holds a `UserId=` of its own user: the
    # fields read after the first may be the user's. Which nodes speak for the job and which life it is in are then
    # not taken from it: every node speaks (a duplicate, never a silence) and findings are not dropped by a rename.
    ambiguous = len(owners) > 1
    after = rest[owner.end():]
    fields = {key: (m.group(1) if (m := pattern.search(after)) else "") for key, pattern in _FIELD.items()}
    job_id, array_job, task = head.group(1), head.group(2), head.group(3)
    is_task = array_job is not None and task is not None and _small_id(task)  # JobId == ArrayJobId: the last task
    paths = {name: m.group(1) if (m := pattern.search(after)) and m.group(1) else None
             for name, pattern in (("workdir", _WORKDIR), ("stdout", _STDOUT), ("stderr", _STDERR))}
    state = fields["JobState"]
    return JobRecord(
        job_id=job_id, name=rest[:owner.start()], state=state if state.replace("_", "").isalpha() else "UNKNOWN",
        array_job_id=array_job if is_task else None, array_task_id=task if is_task else None,
        user=None if forged else owner.group(1) or None, uid=None if forged else int(owner.group(2)),
        reason=fields["Reason"] if fields["Reason"] not in ("", "None") else None, requeue=fields["Requeue"] != "0",
        exit_code=fields["ExitCode"] if _EXIT.match(fields["ExitCode"]) else None,
        start_time=slurm_time(fields["StartTime"]), end_time=slurm_time(fields["EndTime"]),
        batch_host=None if ambiguous else _hosts(fields["BatchHost"]),
        node_list=None if ambiguous else _hosts(fields["NodeList"]),
        restarts=int(fields["Restarts"]) if _small_id(fields["Restarts"]) and not ambiguous else None, **paths)


_SEP = "\x1f"  # ASCII unit separator: never part of a job name, unlike "|"
HISTORY_FIELDS = ("JobIDRaw", "JobID", "JobName", "State", "ExitCode", "Start", "End", "User", "Reason")


def _sacct_time(value: str) -> float | None:
    try:  # sacct prints local time; "Unknown" / "None" while a job has not started or ended
        return time.mktime(time.strptime(value, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def parse_history(line: str) -> Job | None:
    """One `sacct --parsable2` line (HISTORY_FIELDS) as a Job; None when it doesn't have the expected shape."""
    fields = line.split(_SEP)
    if len(fields) != len(HISTORY_FIELDS):
        return None
    raw_id, job_id, name, state, exit_code, start, end, user, reason = fields
    array_job, _, task = job_id.partition("_")
    is_task = bool(task) and task.isdigit()
    return Job(key=f"slurm:{raw_id}", source="slurm", name=name, state=state.split(" ")[0] or "UNKNOWN",
               job_id=raw_id, array_job_id=array_job if is_task else None, array_task_id=task if is_task else None,
               user=user or None, reason=reason if reason not in ("", "None") else None,
               start_time=_sacct_time(start), end_time=_sacct_time(end), exit_code=exit_code or None,
               extra={"from": "accounting"})
