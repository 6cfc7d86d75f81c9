"""SLURM: every command runs with a timeout; a controller that doesn't answer is an error, never a hang."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trainguard.core.logs import kv
from trainguard.core.text import linear
from trainguard.core.tools import run_tool
from trainguard.jobs.hostlist import expand
from trainguard.jobs.model import Job, ProcessRef
from trainguard.jobs.settings import JobsSettings

log = logging.getLogger("trainguard.slurm")


class SlurmError(Exception):
    """A SLURM command failed, timed out, or is not installed."""


@dataclass(frozen=True)
class SlurmClient:
    timeout: float = 10.0
    bin_dir: str = ""  # empty: find the commands on PATH

    def run(self, *args: str, timeout: float | None = None) -> str:
        cmd = [os.path.join(self.bin_dir, args[0]) if self.bin_dir else args[0], *args[1:]]
        return run_tool(cmd, timeout or self.timeout, SlurmError, label=" ".join(args[:2]),
                        hint=" (slurmctld not answering?)")

    # queries -------------------------------------------------------------------
    def queue(self) -> list[dict[str, Any]]:
        out = self.run("squeue", "--json")
        try:
            data = json.loads(out)
        except ValueError as exc:
            raise SlurmError(f"squeue --json printed invalid JSON: {exc}") from None
        return list(data.get("jobs", []))

    def listpids(self, job_id: str, node: str = "") -> list[int]:
        """The job's pids on `node`. Named, because on a host running several slurmd (`slurmd -N NAME`: front-end
        and multiple-slurmd setups) scontrol guesses the first NodeName of this hostname and lists only its steps."""
        try:
            out = self.run("scontrol", "listpids", job_id, *([node] if node else []))
        except SlurmError as exc:
            if "No job steps exist" in str(exc) or "does not exist" in str(exc):
                return []
            raise
        pids = []
        for line in out.splitlines()[1:]:
            fields = line.split()
            if fields and fields[0].isascii() and fields[0].isdigit() and len(fields[0]) <= 10:
                pids.append(int(fields[0]))
        return pids

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
        self.run("scancel", f"--signal={signal_name}", f"--{mode}", job_id)

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
        out = self.run("scontrol", "show", "node", node, "--oneliner")
        state = _NODE_STATE.search(out)
        reason = _NODE_REASON.search(out)
        return (state.group(1) if state else "", reason.group(1).strip() if reason else "")

    def drain(self, node: str, reason: str) -> None:
        self.run("scontrol", "update", f"nodename={node}", "state=drain", f"reason={reason}")

    def resume(self, node: str) -> None:
        self.run("scontrol", "update", f"nodename={node}", "state=resume")


_PATTERN = linear(r"%(%|[AajxuNn])")
_NODE_STATE = linear(r"\bState=(\S+)")
_NODE_REASON = linear(r"(?m)\bReason=(.*?)(?: \[|$| \w+=)")


def expand_output_path(pattern: str, job: dict[str, Any], node: str) -> str:
    """squeue --json gives StdOut as submitted (`slurm-%j.out`); expand what identifies the file."""
    values = {
        "%": "%", "j": str(job.get("job_id", "")), "x": _text(job, "name") or "", "u": _text(job, "user_name") or "",
        "A": str(_int(job.get("array_job_id")) or job.get("job_id", "")),
        "a": str(task if (task := _int(job.get("array_task_id"))) is not None else 4294967294),
        "N": node, "n": "0",
    }
    return _PATTERN.sub(lambda m: values[m.group(1)], pattern)


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


def _when(value: Any) -> float | None:
    number = _int(value)
    return float(number) if number is not None and 0 < number < 2**40 else None  # a Unix time, or nothing


def _exit_code(job: dict[str, Any]) -> str | None:
    code = job.get("exit_code")
    if isinstance(code, int) and not isinstance(code, bool) and 0 <= code < 2**32:  # 22.05: the raw wait status
        return f"{code >> 8}:{code & 0x7F}"
    if isinstance(code, dict):  # 23.02+: {"status": [...], "return_code": N, "signal": {...}}
        signal = code.get("signal")
        return f"{_int(code.get('return_code')) or 0}:{(_int(signal.get('id')) if isinstance(signal, dict) else 0) or 0}"
    return None


def _state(job: dict[str, Any]) -> str:
    state = job.get("job_state", "")
    return str(state[0] if isinstance(state, list) and state else state)


def _int(value: Any) -> int | None:
    if isinstance(value, dict):  # newer SLURM: {"set": true, "infinite": false, "number": N}
        value = value.get("number") if value.get("set", True) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text(raw: dict[str, Any], key: str) -> str | None:
    """A string field of squeue's JSON; None when absent, empty or not a string (the JSON is the controller's, the
    values in it are the job user's)."""
    value = raw.get(key)
    return value if isinstance(value, str) and value else None


def parse_job(raw: dict[str, Any], node: str, switch_template: str) -> Job:
    job_id = str(_int(raw.get("job_id")) if _int(raw.get("job_id")) is not None else _text(raw, "job_id") or "")
    array_job = str(_int(raw.get("array_job_id"))) if _int(raw.get("array_job_id")) else None
    task = _int(raw.get("array_task_id"))
    task_id = str(task) if array_job and task is not None else None
    try:
        hosts = expand(_text(raw, "nodes") or "")
    except ValueError:
        hosts = []
    name, user = _text(raw, "name") or "", _text(raw, "user_name")
    workdir = _text(raw, "current_working_directory")
    default_out = "slurm-%A_%a.out" if array_job and task_id else "slurm-%j.out"
    stdout = _text(raw, "standard_output") or (os.path.join(workdir, default_out) if workdir else None)
    stderr = _text(raw, "standard_error") or stdout
    fields = {"workdir": workdir or "", "job_id": job_id, "array_job_id": array_job or job_id, "name": name,
              "user": user or ""}
    reason = _text(raw, "state_reason")
    return Job(
        key=f"slurm:{job_id}", source="slurm", name=name, state=_state(raw), job_id=job_id,
        array_job_id=array_job, array_task_id=task_id, user=user, uid=_int(raw.get("user_id")),
        reason=reason if reason != "None" else None,
        start_time=_when(raw.get("start_time")), end_time=_when(raw.get("end_time")), exit_code=_exit_code(raw),
        workdir=workdir, stdout=expand_output_path(stdout, raw, node) if stdout else None,
        stderr=expand_output_path(stderr, raw, node) if stderr else None, on_this_node=node in hosts,
        switch_dir=switch_template.format(**fields) if switch_template and workdir else None,
        requeue=raw.get("requeue", True) is not False,
    )


class SlurmSource:
    """All jobs the controller knows; pids for the ones running on this node."""

    def __init__(self, settings: JobsSettings, node: str, client: SlurmClient) -> None:
        self.client = client
        self.node = node
        self.switch_template = settings.switch_dir

    def jobs(self) -> Sequence[Job]:
        jobs = []
        for raw in self.client.queue():
            job = parse_job(raw, self.node, self.switch_template)
            if not job.on_this_node:
                jobs.append(job)
                continue
            refs: tuple[ProcessRef, ...] = ()
            if job.running and job.job_id:
                try:
                    refs = tuple(r for r in (ProcessRef.of(p) for p in self.client.listpids(job.job_id, self.node)) if r)
                except SlurmError as exc:
                    log.warning("listpids failed", extra=kv(job=job.job_id, error=str(exc)))
            # an ended job's logs too: the crash it died of is written last, maybe after the last read
            log_paths = tuple(dict.fromkeys(p for p in (job.stdout, job.stderr) if p))
            job = Job(**{**vars(job), "processes": refs, "log_paths": log_paths})
            jobs.append(job)
        return jobs
