"""Run a configured command with the incident in environment variables."""

from __future__ import annotations

import os
import subprocess

from trainguard.actions.base import Action, ActionContext, ActionError, ActionSettings
from trainguard.core.settings import Field
from trainguard.core.text import one_line


class ExecSettings(ActionSettings):
    command: list[str] = Field(min_length=1, description="argv of the command; no shell.")


class ExecAction(Action):
    Settings = ExecSettings
    settings: ExecSettings
    needs_jobs = False

    def plan(self, ctx: ActionContext) -> str:
        return "exec " + " ".join(self.settings.command)

    def environment(self, ctx: ActionContext) -> dict[str, str]:
        e = ctx.event
        ours = {"TRAINGUARD_EVENT": e.kind.value, "TRAINGUARD_INCIDENT": e.incident_id, "TRAINGUARD_CHECK": e.check,
                "TRAINGUARD_SUBJECT": e.subject, "TRAINGUARD_STATUS": e.status.name, "TRAINGUARD_SUMMARY": e.summary,
                "TRAINGUARD_NODE": e.node, "TRAINGUARD_JOB_IDS": " ".join(j.job_id or j.key for j in ctx.jobs)}
        # Values carry a job's text: one printable line each (a NUL would make exec() refuse the whole call).
        return {**os.environ, **{k: one_line(v) for k, v in ours.items()}}

    def run(self, ctx: ActionContext) -> str:
        try:
            proc = subprocess.run(self.settings.command, env=self.environment(ctx), capture_output=True, text=True,
                                  timeout=self.settings.timeout, stdin=subprocess.DEVNULL, errors="replace")
        except FileNotFoundError:
            raise ActionError(f"command not found: {self.settings.command[0]}") from None
        except subprocess.TimeoutExpired:
            raise ActionError(f"command timed out after {self.settings.timeout:g}s") from None
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()
            raise ActionError(f"exited {proc.returncode}: {tail[-1] if tail else 'no output'}")
        return f"exited 0{': ' + proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ''}"
