"""What `[jobs]` configures: the job sources, SLURM's commands, switch dirs, and plain-process jobs."""

from __future__ import annotations

import shutil
from pathlib import Path

from trainguard.core.settings import Duration, Field, Regex, SettingsModel, field_validator, model_validator
from trainguard.registry import JOB_SOURCES

# Beside the config: root-owned and persistent (a stop holds across agent restarts and reboots until removed), and
# readable by the service through /etc/trainguard's group. Not under /run/trainguard, the unit's RuntimeDirectory,
# which belongs to the service user and is wiped at every restart.
STOP_DIR = Path("/etc/trainguard/stop")
MAX_LOG_FILES = 64  # per glob and job: the newest by mtime are read
MAX_LOG_ENTRIES = 10_000  # per glob and run: directory entries examined


class ProcessJobSettings(SettingsModel):
    cmdline: Regex | None = Field(None, description="Regex matched against the full command line.")
    pidfile: Path | None = Field(None, description="File holding the job's main pid.")
    user: str = Field(min_length=1, description="The job's user (required): only their processes are the job, and its "
                                                "pidfile, logs and heartbeat are read with their authority.")
    logs: list[str] = Field(default_factory=list, description="Log files (paths or globs) of the job.")
    switch_dir: str | None = Field(None, description="Directory the trainer polls for `stop` and `save` switches: the "
                                                     "job's $TRAINGUARD_SWITCH_DIR (the helper's default: .trainguard "
                                                     "in its working directory); none: no switch files for this job.")
    job_id: str = Field("", max_length=128, description="The job's id in alerts. A multi-node run launched without a "
                                                        "scheduler (torchrun on each host) gets the same id on every "
                                                        "node, so that its alerts from all nodes group as one job.")

    @model_validator(mode="after")
    def _one_selector(self) -> ProcessJobSettings:
        if (self.cmdline is None) == (self.pidfile is None):
            raise ValueError("give exactly one of cmdline or pidfile")
        return self


def _default_sources() -> list[str]:
    return ["slurm"] if shutil.which("squeue") else []


class JobsSettings(SettingsModel):
    sources: list[str] = Field(
        default_factory=_default_sources, description="Where jobs come from (" + ", ".join(JOB_SOURCES) + ").",
        json_schema_extra={"default_doc": "`[\"slurm\"]` when squeue is installed, else `[]`"})
    slurm_timeout: Duration = Field(10.0, gt=0, description="Timeout of every SLURM command.")
    slurm_bin_dir: str = Field("", description="Directory of the SLURM commands; empty: PATH.")
    slurm_node: str = Field("", description="This node's SLURM name; empty: the agent's node_name. Set it where one "
                                            "host runs several slurmd: it then names this node's steps to scontrol.")
    slurmd_spool_dir: str = Field("", description="This node's SlurmdSpoolDir, where a step's socket appears while it "
                                                  "runs; empty: from slurm.conf, else SLURM's default.")
    prolog_dir: str = Field("/run/trainguard/jobs", description="Where `trainguard slurm-prolog` and `slurm-epilog` "
                                                                "leave job records (docs/slurm.md); empty: not read.")
    switch_dir: str = Field("{workdir}/.trainguard",
                            description="Switch dir of a SLURM job; {workdir} {job_id} {array_job_id} {name} {user}.")
    stop_dir: Path = Field(STOP_DIR, description="The operator's kill switches: a file root creates here, named after a "
                                                 "job, stops it (`trainguard install` makes it: root-owned, 0750, group "
                                                 "trainguard, kept across restarts).")
    refresh: Duration = Field(5.0, ge=0, description="How long one listing of the node's jobs is reused when nothing "
                                                     "says it changed (a step's start or end, a prolog, a fetch).")
    slurm_refetch_min: Duration = Field(60.0, gt=0, description="A job's controller record (EndTime, StdOut, ...) is "
                                        "fetched again at most this often per job, whoever asks (`job_timelimit`, a "
                                        "job the controller says ended while its steps stay): what one job on this "
                                        "node can cost slurmctld at most.")
    processes: dict[str, ProcessJobSettings] = Field(default_factory=dict, description="Plain-process jobs by name.")
    max_log_files: int = Field(MAX_LOG_FILES, ge=1, description="A log glob of a job (its `logs`, a check's `logs`) "
                               "reads the newest this many matching files by mtime; the rest are counted and said "
                               "once (log line, the result's details).")
    max_log_entries: int = Field(MAX_LOG_ENTRIES, ge=1, description="A log glob examines at most this many directory "
                                 "entries per run, listed with the job user's authority: a directory filled with "
                                 "files costs its job, not the agent; entries past it are not seen that run.")

    @field_validator("sources")
    @classmethod
    def _known_sources(cls, sources: list[str]) -> list[str]:
        for name in sources:
            if name not in JOB_SOURCES:
                raise ValueError(f"unknown job source {name!r} (known: {', '.join(sorted(JOB_SOURCES))})")
        return sources
