"""The SLURM Prolog/Epilog hook: slurmd runs `trainguard slurm-prolog` as root when a job starts on this node and
`trainguard slurm-epilog` when it ends; each writes what its environment says of the job into one small file in the
agent's runtime directory, and the agent reads it: the job is known before its first process runs, with its user
and paths, without asking slurmctld.

A hook runs in every job's start path, so it is small: standard library only, no config read, no SLURM command (the
slurm.conf manual warns that a prolog calling SLURM commands can deadlock), and it always exits 0 (a failing prolog
drains the node). The environment's values are the job user's text (name, paths): they are written as JSON strings,
cut to a bound, and read back typed; a record that does not parse is ignored.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from trainguard.core.files import read_small, replace_file

RECORDS_DIR = "/run/trainguard/jobs"
GATE_DIR = "/run/trainguard/gates"  # the gates' verdicts and GPU memory baseline (trainguard.agent.gates)
RECORD_MAX = 64 << 10
FIELD_MAX = 4096
KEEP_ENDED_S = 3600.0  # an ended job's record is removed by a later hook after this
KEEP_ANY_S = 60 * 86400.0  # a record no epilog ended (the hook installed mid-job, a lost epilog)
_ENV = {  # record field -> the variable slurmd sets (SLURM 22.05 sets these for Prolog and Epilog)
    "job_id": "SLURM_JOB_ID", "uid": "SLURM_JOB_UID", "user": "SLURM_JOB_USER", "name": "SLURM_JOB_NAME",
    "array_job_id": "SLURM_ARRAY_JOB_ID", "array_task_id": "SLURM_ARRAY_TASK_ID", "workdir": "SLURM_JOB_WORK_DIR",
    "stdout": "SLURM_JOB_STDOUT", "stderr": "SLURM_JOB_STDERR", "partition": "SLURM_JOB_PARTITION",
    "nodelist": "SLURM_JOB_NODELIST", "node": "SLURMD_NODENAME", "restarts": "SLURM_JOB_RESTART_COUNT",
    "start_time": "SLURM_JOB_START_TIME", "end_time": "SLURM_JOB_END_TIME", "exit_code": "SLURM_JOB_EXIT_CODE2",
}


def _small_id(text: object) -> bool:
    return isinstance(text, str) and text.isascii() and text.isdigit() and len(text) <= 10


# writing (the hooks, as root) --------------------------------------------------------------------------------------
def write_record(directory: str, env: Mapping[str, str], ended: bool, now: float | None = None) -> Path | None:
    """Write (prolog) or complete (epilog) this job's record; None when the environment names no job. Raises
    OSError when the directory can't be written."""
    job_id = env.get("SLURM_JOB_ID", "")
    if not _small_id(job_id):
        return None
    now = time.time() if now is None else now
    folder = Path(directory)
    folder.mkdir(mode=0o755, parents=True, exist_ok=True)
    path = folder / f"{job_id}.json"
    record: dict[str, object] = {}
    if ended:  # keep what the prolog saw: the epilog's environment is the same, but may lack what it had
        with contextlib.suppress(OSError, ValueError):
            old = json.loads(_read_small(path))
            record = old if isinstance(old, dict) else {}
    record.update({key: env[var][:FIELD_MAX] for key, var in _ENV.items() if env.get(var)})
    record.setdefault("started", now)
    if ended:
        record["ended"] = now
    replace_file(path, json.dumps(record, ensure_ascii=True).encode(), 0o644)  # the agent's user reads it
    prune(folder, now)
    return path


def prune(folder: Path, now: float) -> None:
    """Remove records of jobs that ended an hour ago, any older than 60 days, and temporary files left behind."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries[:100000]:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        age = now - st.st_mtime
        stale_tmp = entry.name.endswith(".tmp") and age > 60
        if stale_tmp or (entry.name.endswith(".json") and (age > KEEP_ANY_S or (age > KEEP_ENDED_S and _ended(entry)))):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


def _ended(entry: os.DirEntry[str]) -> bool:
    try:
        return "ended" in json.loads(_read_small(Path(entry.path)))
    except (OSError, ValueError, TypeError):
        return False


def run_hook(directory: str, env: Mapping[str, str], ended: bool) -> int:
    """The `trainguard slurm-prolog` / `slurm-epilog` command: always 0, whatever happens (one line on stderr, which
    slurmd logs, when the record could not be written)."""
    try:
        write_record(directory, env, ended)
    except (OSError, ValueError) as exc:
        print(f"trainguard slurm-{'epilog' if ended else 'prolog'}: record not written in {directory}: {exc}",
              file=sys.stderr)
    return 0


# reading (the agent) -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrologRecord:
    job_id: str
    started: float
    node: str | None = None
    uid: int | None = None
    user: str | None = None
    name: str | None = None
    array_job_id: str | None = None
    array_task_id: str | None = None
    workdir: str | None = None
    stdout: str | None = None
    stderr: str | None = None
    end_time: float | None = None
    ended: float | None = None
    exit_code: str | None = None


def parse_record(raw: bytes) -> PrologRecord | None:
    """A record as the hook wrote it; None when it isn't one. Every field is checked for type and bounds."""
    try:
        data = json.loads(raw[:RECORD_MAX])
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or not _small_id(data.get("job_id")):
        return None

    def text(key: str) -> str | None:
        value = data.get(key)
        return value[:FIELD_MAX] if isinstance(value, str) and value and "\0" not in value else None

    def when(key: str) -> float | None:
        value = data.get(key)
        if isinstance(value, str) and _small_id(value):  # SLURM's own times are Unix seconds as text
            value = int(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 2**40:
            return float(value)
        return None

    started = when("started")
    uid = data.get("uid")
    array_job, task = text("array_job_id"), text("array_task_id")
    code = text("exit_code")
    return PrologRecord(
        job_id=data["job_id"], started=started or 0.0, node=text("node"),
        uid=int(uid) if _small_id(uid) else None, user=text("user"), name=text("name"),
        array_job_id=array_job if _small_id(array_job) and _small_id(task) else None,
        array_task_id=task if _small_id(array_job) and _small_id(task) else None,
        workdir=text("workdir"), stdout=text("stdout"), stderr=text("stderr"), end_time=when("end_time"),
        ended=when("ended"), exit_code=code if code and len(code) <= 8 and code.replace(":", "").isdigit() else None)


class RecordReader:
    """The records in the hook's directory, re-read only when a file changed. Only files the hooks could have
    written count: regular files of root (or of the agent itself, for tests) in a directory nobody else may write."""

    def __init__(self, directory: str, node: str = "") -> None:
        self.directory = directory
        self.node = node
        self._cache: dict[str, tuple[tuple[int, int], PrologRecord | None]] = {}
        self.problem: str | None = None  # why the directory is not read, once it was refused

    def signature(self) -> tuple[int, int] | None:
        """What changes when a record is written or removed: the directory's mtime and inode."""
        try:
            st = os.stat(self.directory)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_ino)

    def read(self) -> dict[str, PrologRecord]:
        trusted = (0, os.geteuid())
        try:
            st = os.lstat(self.directory)
        except OSError:
            self._cache.clear()
            return {}
        if not stat.S_ISDIR(st.st_mode) or st.st_uid not in trusted or st.st_mode & 0o022:
            self.problem = f"{self.directory} is not a directory of root's that only root may write: records ignored"
            return {}
        self.problem = None
        records: dict[str, PrologRecord] = {}
        seen = set()
        try:
            names = [n for n in os.listdir(self.directory) if n.endswith(".json") and _small_id(n[:-5])]
        except OSError:
            return {}
        for name in names[:4096]:
            seen.add(name)
            record = self._read_one(name, trusted)
            if record is not None and (not self.node or record.node in (None, self.node)):
                records[record.job_id] = record
        for name in set(self._cache) - seen:
            del self._cache[name]
        return records

    def _read_one(self, name: str, trusted: tuple[int, int]) -> PrologRecord | None:
        path = os.path.join(self.directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            key = (st.st_mtime_ns, st.st_size)
            cached = self._cache.get(name)
            if cached is not None and cached[0] == key:
                return cached[1]
            record = None
            if stat.S_ISREG(st.st_mode) and st.st_uid in trusted and st.st_size <= RECORD_MAX:
                record = parse_record(os.read(fd, RECORD_MAX + 1))
                if record is not None and record.job_id != name[:-5]:
                    record = None
            self._cache[name] = (key, record)
            return record
        except OSError:
            return None
        finally:
            os.close(fd)


def _read_small(path: Path) -> bytes:
    return read_small(path, RECORD_MAX)
