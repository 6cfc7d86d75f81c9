"""TrainingLogCheck: read each job's log as it is written and turn known failures into diagnosed incidents.

Only appended bytes are read (positions kept in the store); findings are remembered per job, so an
OOM reported once stays the job's status until the job is gone, and its message already carries the
diagnosis and the lever to pull.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from pydantic import Field

from trainguard.checks.base import CheckContext, CheckSettings, JobCheck
from trainguard.core.logs import kv
from trainguard.core.model import Metric, Result, Status, worst
from trainguard.core.settings import Duration, Size
from trainguard.core.text import one_line
from trainguard.core.units import format_bytes, parse_size
from trainguard.jobs.model import Job
from trainguard.jobs.tree import heartbeat_path, job_fields, job_log_files, job_processes, read_heartbeat
from trainguard.logscan.context import finite_loss, last_step, oom_gpu
from trainguard.logscan.diagnose import diagnose_cuda, diagnose_nccl, diagnose_oom, rank_of
from trainguard.logscan.reader import LogTail, Position
from trainguard.logscan.signatures import BUILTIN, Hit, Scanner, SignatureSettings, custom, final_exception, last_exception

log = logging.getLogger("trainguard.checks.training_log")

POSITIONS_KEY = "logscan.positions"
FINDINGS_KEY = "logscan.findings"
FINDINGS = Metric("trainguard_log_findings", "Known failures found in the job's logs.", ("job_id", "name"))
MAX_FINDINGS = 20  # per job: the first ones explain, the rest repeat


class TrainingLogSettings(CheckSettings):
    interval: Duration = Field(15.0, gt=0)
    jitter: Duration = Field(0.0, ge=0)
    logs: list[str] = Field(default_factory=list, description="More log paths or globs per job (templates as hang).")
    signatures: dict[str, SignatureSettings] = Field(default_factory=dict, description="Site signatures, by name.")
    nan_limit: int = Field(3, ge=1, description="This many NaN/Inf losses in a row (no finite loss between): "
                                                "CRITICAL (fewer: WARNING).")
    overflow_burst: int = Field(20, ge=1, description="This many fp16 OVERFLOW skips: WARNING.")
    warmup_steps: int = Field(10, ge=0, description="An OOM at or before this step is a static sizing error.")
    max_line: Size = Field(parse_size("1MiB"), description="Longer lines are cut here.")
    read_limit: Size = Field(parse_size("256MiB"), description="At most this much of one log per run (catch up later).")


_CAUSE = {"cuda_oom": 5, "cuda_error": 4, "exit": 3.5, "traceback": 3, "loss_scale_min": 2, "nan_loss": 2, "nccl_timeout": 0}


class TrainingLogCheck(JobCheck):
    Settings = TrainingLogSettings
    metrics = (FINDINGS,)
    settings: TrainingLogSettings

    def __init__(self, name: str, settings: CheckSettings, context: CheckContext) -> None:
        super().__init__(name, settings, context)
        self.scanner = Scanner(BUILTIN + custom(self.settings.signatures))
        self.nvml = context.nvml
        self._positions: dict[str, Position] = {
            p: Position.from_list(v) for p, v in self.load_state(POSITIONS_KEY).items() if isinstance(v, list)}
        self._findings: dict[str, list[dict[str, Any]]] = self.load_state(FINDINGS_KEY)
        self._counts: dict[str, dict[str, int]] = {}
        self._pending_assert: dict[str, str] = {}
        self._steps: dict[str, int] = {}  # log path -> step of its last step line read
        self._nan_streaks: dict[str, dict[str, int]] = {}  # job -> "path|rank" (or "heartbeat") -> NaNs in a row
        self._beat_steps: dict[str, int] = {}  # job -> heartbeat step last looked at

    def run(self) -> Sequence[Result]:
        view = self.view()
        results = self.source_errors(view)
        live: set[str] = set()
        paths: set[str] = set()
        for job in view.jobs:
            if not job.on_this_node:
                continue
            live.add(job.key)
            logs = job_log_files(job, self.settings.logs)
            paths.update(logs)
            try:
                for path in logs:
                    self._read(job, path)
                self._heartbeat_loss(job)
                self._exit(job, logs)
                results.append(self._result(job))
            except Exception as exc:  # noqa: BLE001 - one job's hostile log never blinds this check for the others
                error = one_line(f"{type(exc).__name__}: {exc}", 200)
                log.warning("reading a job's logs failed; skipped past the bytes read", extra=kv(job=job.key,
                                                                                                 error=error))
                results.append(self.result(job.key, Status.UNKNOWN, f"{job.label()}: could not read its logs: {error}",
                                           {"job_key": job.key, "error": error}))
        if not view.errors:  # a source that failed this time says nothing about which jobs are gone
            for key in set(self._findings) - live:  # the job is gone: its story is told
                del self._findings[key]
            for table in (self._nan_streaks, self._beat_steps, self._counts):
                for key in set(table) - live:
                    del table[key]
            for path in set(self._positions) - paths:  # bounded state: only the logs of jobs still here
                del self._positions[path]
                self._steps.pop(path, None)
        self.save_state(POSITIONS_KEY, {p: pos.to_list() for p, pos in self._positions.items()})
        self.save_state(FINDINGS_KEY, self._findings)
        return results

    def clear(self, subject: str, at: float) -> None:
        """The job's findings so far are dealt with: only what its logs say from now on counts."""
        self._findings.pop(subject, None)
        self._nan_streaks.pop(subject, None)
        self._counts.pop(subject, None)
        self.save_state(FINDINGS_KEY, self._findings)

    def _read(self, job: Job, path: str) -> None:
        tail = LogTail(path, self.identity(job), self._positions.get(path), int(self.settings.max_line))
        streaks = self._nan_streaks.setdefault(job.key, {})
        try:
            self._scan(job, path, tail, streaks)
        finally:  # the reader moved past each chunk before handing it over: what failed is not read again
            if tail.position is not None:
                self._positions[path] = tail.position

    def _scan(self, job: Job, path: str, tail: LogTail, streaks: dict[str, int]) -> None:
        for chunk in tail.read(int(self.settings.read_limit)):
            since = 0  # end of the last NaN line in this chunk: a finite loss after it ends the streak
            for hit in self.scanner.scan(chunk):
                if hit.signature.name == "nan_loss":
                    self._end_streaks(streaks, path, chunk, since, hit.offset)
                    key = f"{path}|{rank_of(hit.line)[0]}"
                    streaks[key] = streaks.get(key, 0) + 1
                    since = hit.offset + 1
                self._record(job, path, hit, chunk)
            self._end_streaks(streaks, path, chunk, since, len(chunk))
            step = last_step(chunk)
            if step is not None:
                self._steps[path] = step

    @staticmethod
    def _end_streaks(streaks: dict[str, int], path: str, data: bytes, start: int, end: int) -> None:
        mine = [k for k in streaks if k.startswith(path + "|")]
        if mine and finite_loss(data, data.find(b"\n", start) + 1 if start else 0, end):
            for key in mine:
                del streaks[key]

    def _heartbeat_loss(self, job: Job) -> None:
        """A NaN/Inf loss in the trainer's heartbeat counts as a NaN line; each new step is one more in a row."""
        beat = heartbeat_path(job)
        step, metrics = read_heartbeat(beat, self.identity(job)) if beat else (None, {})
        loss = metrics.get("loss")
        if step is None or loss is None or self._beat_steps.get(job.key) == step:
            return
        self._beat_steps[job.key] = step
        streaks = self._nan_streaks.setdefault(job.key, {})
        if isinstance(loss, str) and loss.lower().lstrip("+-") in ("nan", "inf", "infinity"):
            streaks["heartbeat"] = streaks.get("heartbeat", 0) + 1
            nan = next(s for s in self.scanner.signatures if s.name == "nan_loss")
            self._record(job, str(beat), Hit(nan, f"heartbeat step {step}: loss={loss}", 0), b"")
        else:
            streaks.pop("heartbeat", None)

    def _exit(self, job: Job, logs: Sequence[str]) -> None:
        """A job that ended with a non-zero exit: one finding with the code and the final exception in its logs."""
        code = job.exit_code or ""
        kept = self._findings.setdefault(job.key, [])
        if job.active or not code or set(code.replace(":", "")) == {"0"} or any(f["signature"] == "exit" for f in kept):
            return
        crash = next((f for f in reversed(kept) if f["signature"] == "traceback"), None)
        exc = crash["exception"] if crash and crash.get("exception") else None
        for path in logs if exc is None else ():
            exc = last_exception(path, self.identity(job)) or exc
        title = f"the job ended {job.state} with exit code {code}" + (f": {exc}" if exc else "")
        kept.append({"signature": "exit", "rank": None, "path": None, "at": self.context.clock(), "line": exc or "",
                     "status": Status.CRITICAL.name, "title": title, "exit_code": code,
                     "advice": "read the end of the job's log; the final exception says what failed" if exc else
                     "no exception in the log: look for the OOM killer (dmesg), a signal, or the scheduler's reason"})

    def _record(self, job: Job, path: str, hit: Hit, data: bytes) -> None:
        name = hit.signature.name
        counts = self._counts.setdefault(job.key, {})
        counts[name] = counts.get(name, 0) + 1
        rank, text = rank_of(hit.line)
        now = self.context.clock()
        finding: dict[str, Any] = {"signature": name, "rank": rank, "path": path, "at": now,
                                   "line": text[:500], "status": hit.signature.status.name}
        if name == "device_assert":
            self._pending_assert[job.key] = text
            return
        if name == "fp16_overflow":
            if counts[name] != self.settings.overflow_burst:
                return
            finding.update(status=Status.WARNING.name, title=f"{counts[name]} fp16 overflow steps skipped",
                           advice="a long run of loss-scale overflows means divergence: lower the learning rate "
                                  "or use bf16")
        elif name == "cuda_oom":
            d = diagnose_oom(text)
            step = self._oom_step(job, path, hit, data)
            when = ("step unknown" if step is None else f"at step {step}: static sizing (first steps)"
                    if step <= self.settings.warmup_steps else f"mid-run at step {step}: a growing working set "
                    "or progressive fragmentation")
            title = f"{d.title}; {when}"
            gpu = oom_gpu(self.nvml, d.fields.get("gpu"), {p.pid for p in job_processes(job)}, self.context.proc)
            if gpu is not None:
                others = ", ".join(f"pid {p['pid']} ({p['command'] or '?'})"
                                   + (f" {format_bytes(p['bytes'])}" if p["bytes"] is not None else "")
                                   for p in gpu["other_processes"])
                title += f"; GPU {gpu['index']} also held by {others}" if others else ""
                title += f"; GPU {gpu['index']} faults: {', '.join(gpu['faults'])}" if gpu["faults"] else ""
            finding.update(title=title, advice=d.advice, fields=d.fields, step=step, gpu=gpu)
        elif name == "nccl_timeout":
            d = diagnose_nccl(text)
            finding.update(title=d.title, advice=d.advice, fields=d.fields)
        elif name == "cuda_error":
            d = diagnose_cuda(text, self._pending_assert.pop(job.key, None))
            finding.update(title=d.title, advice=d.advice, fields=d.fields, hardware=d.hardware)
        elif name == "nan_loss":
            row = max(self._nan_streaks.get(job.key, {}).values(), default=1)
            critical = row >= self.settings.nan_limit
            finding.update(status=(Status.CRITICAL if critical else Status.WARNING).name, in_a_row=row,
                           title=f"NaN/Inf loss, {row} in a row ({counts[name]} in all)", advice=hit.signature.advice)
        elif name == "traceback":
            exc = final_exception(data, hit.offset)
            finding.update(title=f"the job crashed: {exc or 'Python traceback'}", exception=exc,
                           advice="read the traceback in the log; the final exception says what failed")
        else:
            finding.update(title=f"{name}: {text[:200]}", advice=hit.signature.advice)
        xids = self._xids_near(now)
        if xids and name in ("cuda_error", "nccl_timeout", "cuda_oom"):
            finding["xids"] = xids
        kept = self._findings.setdefault(job.key, [])
        if name == "nan_loss":  # one running entry, not one per step
            kept[:] = [f for f in kept if f["signature"] != "nan_loss"]
        if len(kept) < MAX_FINDINGS:
            kept.append(finding)

    def _oom_step(self, job: Job, path: str, hit: Hit, data: bytes) -> int | None:
        """The step the OOM came at: the last step line before it, else the heartbeat's step."""
        step = last_step(data, hit.offset) if data else None
        if step is None:
            step = self._steps.get(path)
        if step is None and (beat := heartbeat_path(job)):
            step = read_heartbeat(beat, self.identity(job))[0]
        return step

    def _xids_near(self, when: float, window: float = 120.0) -> list[str]:
        """XIDs the kernel log reported on this node within `window` (as the xid check recorded them)."""
        return [f"XID {e.xid} on {e.bus_id}" for e in self.context.xid_history.entries() if abs(e.last - when) <= window]

    def _result(self, job: Job) -> Result:
        findings = self._findings.get(job.key, [])
        labels = {"job_id": job.job_id or job.name, "name": job.name}
        samples = [FINDINGS(len(findings), labels)]
        if not findings:
            return self.result(job.key, Status.OK, f"{job.label()}: no known failure in its logs",
                               {"job_key": job.key}, samples)
        status = worst(Status[f["status"]] for f in findings)
        # A collective timeout is the symptom; an OOM, a CUDA error or a crash on some rank is the cause.
        lead = max(findings, key=lambda f: (Status[f["status"]].severity, _CAUSE.get(f["signature"], 1)))
        rank = f" (rank {lead['rank']})" if lead.get("rank") is not None else ""
        text = f"{job.label()}{rank}: {lead['title']}"
        timeouts = sorted({str(f["fields"].get("rank")) for f in findings
                           if f["signature"] == "nccl_timeout" and f.get("fields")})
        if timeouts and lead["signature"] != "nccl_timeout":
            text += f"; then NCCL collectives timed out on rank {', '.join(timeouts)}"
        if lead.get("xids"):
            text += f"; on this node meanwhile: {', '.join(lead['xids'][:3])}"
        if lead.get("advice"):
            text += f" — {lead['advice']}"
        details = {"job_key": job.key, "findings": findings, "next_step": lead.get("advice") or None,
                   **{k: v for k, v in job_fields(job).items() if k in ("job_id", "name")}}
        return self.result(job.key, status, text, details, samples)

