"""Trainer-side helper for trainguard. Standard library only: import it from any training script.

    from trainguard import trainer

    trainer.install()                      # SIGUSR1: save and exit; SIGUSR2: save; SIGTERM: stop
    start = resume()                       # your code: the step after the last checkpoint
    if trainer.should_stop():              # before the first step: a stopped run's queued tasks exit at once,
        sys.exit(0)                        # with nothing trained there is nothing to save
    for step in range(start, steps):
        loss = train_step()
        trainer.heartbeat(step, loss=loss)
        if trainer.should_stop():          # first: a stop asks for a save too, and one checkpoint is enough
            save_checkpoint(step)
            trainer.saved()
            break
        if trainer.should_save():
            save_checkpoint(step)
            trainer.saved()

Switch files live in the switch dir ($TRAINGUARD_SWITCH_DIR, else ./.trainguard): `save` asks for one
checkpoint (removed by `saved()`), `stop` asks the run to checkpoint and exit. A switch counts when it is a regular
file (not a link) of this user, root, or a member of the switch group ($TRAINGUARD_SWITCH_GROUP, `switch_group=`): the
teammates who may stop the run. The heartbeat file
(`heartbeat.json` there, or $TRAINGUARD_HEARTBEAT) tells the agent the run is making progress.

A distributed job calls `trainer.flight_recorder()` before `torch.distributed.init_process_group`: PyTorch then
records every collective, and the agent can name the rank that never entered the one the others wait in.

Restart in place: the batch script runs its ranks under the relaunch loop, and the agent's `restart` action (a NaN
streak, a hung rank, a leak) has them save, exit and start again inside the job's allocation, without a requeue:

    python3 -m trainguard.trainer relaunch [--max-restarts 10] -- srun python train.py

The loop runs the command again when it ends after a new request for this job (`restart.<job id>` in the switch
dir, which the agent writes before it signals the ranks) appeared, at most --max-restarts times; otherwise it exits
with the command's status.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import grp
import json
import math
import os
import pwd
import re
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["Trainer", "flight_recorder", "heartbeat", "install", "relaunch", "restart_requested", "saved",
           "should_save", "should_stop"]

FLIGHT_RECORDER_ENTRIES = 2000  # collectives kept per process: hours of a typical job's recent history


HOLD_ARRAY_ENV = "TRAINGUARD_HOLD_ARRAY"  # "0": a stop switch lets the array's waiting tasks start (and exit at once)
SLURM_TIMEOUT_S = 10.0


def hold_own_array() -> str:
    """A stop switch stays where it is, so each pending task of this job's array would start, see it and end: hold
    them (a user hold, which the job's owner lifts with `scontrol release` after removing the switch) before this
    task exits, so that none starts in the moment between its exit and the agent's `hold-array`, which a task that
    stops within milliseconds of the switch otherwise loses. Global rank 0 of an array task only; the tasks held
    ("" when none, outside an array, or when SLURM did not answer). Only for the switch file: a stop by signal (the
    agent's time-limit save, a requeue) is not the run's end. $TRAINGUARD_HOLD_ARRAY=0 keeps the waiting tasks free."""
    array = os.environ.get("SLURM_ARRAY_JOB_ID", "")
    if (not array.isdigit() or os.environ.get(HOLD_ARRAY_ENV, "1") == "0"
            or os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) != "0"):
        return ""
    try:  # the same two calls as the agent's hold-array (trainguard.jobs.slurm: this module imports none of it)
        listed = subprocess.run(["squeue", "--noheader", f"--jobs={array}", "--states=PENDING", "--format=%K"],
                                capture_output=True, text=True, timeout=SLURM_TIMEOUT_S, check=False).stdout
        tasks = ",".join(line.strip().split("%")[0] for line in listed.splitlines() if line.strip())
        if tasks:
            subprocess.run(["scontrol", "uhold", f"{array}_[{tasks}]"], capture_output=True, timeout=SLURM_TIMEOUT_S,
                           check=False)
    except (OSError, subprocess.SubprocessError) as exc:  # the agent's hold-array is still bound: it does it then
        print(f"trainguard.trainer: could not hold array {array}'s pending tasks: {exc}", file=sys.stderr)
        return ""
    if tasks:
        print(f"trainguard.trainer: stop switch: held {array}_[{tasks}] (to go on: remove the switch, then "
              f"scontrol release {array}_[{tasks}])", file=sys.stderr, flush=True)
    return tasks


def _signals(names: Iterable[str]) -> list[signal.Signals]:
    return [signal.Signals["SIG" + n.upper().removeprefix("SIG")] for n in names]


class Trainer:
    def __init__(self, switch_dir: str | os.PathLike[str] | None = None,
                 heartbeat_path: str | os.PathLike[str] | None = None, switch_group: str | None = None) -> None:
        self.switch_dir = Path(switch_dir or os.environ.get("TRAINGUARD_SWITCH_DIR") or Path.cwd() / ".trainguard")
        self.heartbeat_path = Path(heartbeat_path or os.environ.get("TRAINGUARD_HEARTBEAT")
                                   or self.switch_dir / "heartbeat.json")
        self.switch_group = switch_group or os.environ.get("TRAINGUARD_SWITCH_GROUP") or None
        self._save = threading.Event()
        self._stop = threading.Event()
        self.last_signal: str | None = None
        self._restart_seen = self.restart_request()  # a request older than this process is not for it
        self._signalled_seen = self._request(self.signalled_name)
        self._answering = False  # the stop under way was decided while the agent asked for a report
        self._array_held = False  # this process held its array's pending tasks for a stop switch (once)
        self._last_beat: tuple[int, float] | None = None  # (step, time) of this process's previous heartbeat

    def install(self, save_and_stop: Iterable[str] = ("USR1",), save: Iterable[str] = ("USR2",),
                stop: Iterable[str] = ("TERM",)) -> Trainer:
        """Install signal handlers (main thread only). Handlers only set flags: the loop decides when to act."""
        def handler(flags: tuple[threading.Event, ...]) -> Any:
            def on_signal(signum: int, _frame: Any) -> None:
                self.last_signal = signal.Signals(signum).name
                for flag in flags:
                    flag.set()
            return on_signal

        for sig in _signals(save_and_stop):
            signal.signal(sig, handler((self._save, self._stop)))
        for sig in _signals(save):
            signal.signal(sig, handler((self._save,)))
        for sig in _signals(stop):
            signal.signal(sig, handler((self._stop,)))
        return self

    def _switch(self, name: str) -> os.stat_result | None:
        """A switch counts only as a regular file of this user, root or a member of the switch group: nobody else
        can stop the run (the agent applies the same rule)."""
        try:
            st = os.lstat(self.switch_dir / name)
        except OSError:
            return None
        ok = stat.S_ISREG(st.st_mode) and (st.st_uid in (os.getuid(), 0) or _member(st.st_uid, self.switch_group))
        return st if ok else None

    @property
    def restart_name(self) -> str:
        """This job's request file: jobs submitted from one directory (an array's tasks) share its switch dir."""
        return f"restart.{os.environ.get('SLURM_JOB_ID', '')}".rstrip(".")

    def restart_request(self) -> tuple[int, int, int] | None:
        """Which restart request for this job the switch dir holds now (None: none)."""
        return self._request(self.restart_name)

    def _request(self, name: str) -> tuple[int, int, int] | None:
        """Which request of the agent's named `name` the switch dir holds now (None: none). Each request is a new
        file (the agent writes it under a temporary name and renames it), so a new one differs from an old one."""
        st = self._switch(name)
        return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns) if st else None

    def restart_requested(self) -> bool:
        """A restart in place of this job was asked (the agent's `restart` action) since this process started: the
        stop it asks for is a restart (a rank may skip its end-of-run work)."""
        now = self.restart_request()
        return now is not None and now != self._restart_seen

    def should_save(self) -> bool:
        stop = self.should_stop()  # first: a save for a stop is the one that may answer the agent (saved())
        return self._save.is_set() or self._switch("save") is not None or stop

    def should_stop(self) -> bool:
        switched = self._switch("stop") is not None
        if switched and not self._array_held:
            self._array_held = True
            hold_own_array()
        stop = self._stop.is_set() or switched
        if stop and not self._answering:
            # The checkpoint this stop takes answers the agent (saved()) only if a request was there as the stop was
            # decided: a checkpoint already under way then is not the one asked for, and the agent would end the job
            # while the stop's own one is being written.
            with contextlib.suppress(OSError):
                os.listdir(self.switch_dir)  # a fresh listing: NFS revalidates what it cached of the directory
            self._answering = self._asked()
        return stop

    @property
    def saved_name(self) -> str:
        """This job's report that the checkpoint the agent asked for is written (`saved.<job id>`)."""
        return f"saved.{os.environ.get('SLURM_JOB_ID', '')}".rstrip(".")

    @property
    def signalled_name(self) -> str:
        """The agent's request for that report after its save signal (`signalled.<job id>`)."""
        return f"signalled.{os.environ.get('SLURM_JOB_ID', '')}".rstrip(".")

    def _asked(self) -> bool:
        """Whether the switch dir holds a request of the agent's for this job newer than this process: a restart, or
        its save signal (an action after it, `requeue`, waits for the ranks)."""
        restart, signalled = self.restart_request(), self._request(self.signalled_name)
        return ((restart is not None and restart != self._restart_seen)
                or (signalled is not None and signalled != self._signalled_seen))

    def saved(self) -> None:
        """A checkpoint was written (call it once the checkpoint is complete): clear the save request (signal flag
        and `save` switch file). On global rank 0 (RANK, else SLURM_PROCID, is 0 or unset), for a stop decided
        (should_stop() true) while the agent waited for the ranks (a restart, or a requeue after its save signal),
        also tell the agent: it then ends what still runs of the job (a rank hung in a collective, or whose GPU is
        gone) soon after, instead of waiting out its `wait_exit`. Rank 0's call must come after the whole checkpoint
        is written: after its own torch.save, or after a collective save returns."""
        answering, self._answering = self._answering, False
        self._save.clear()
        if not self._stop.is_set():  # the signal was answered: a later stop must not be reported as its doing
            self.last_signal = None
        try:
            (self.switch_dir / "save").unlink()
        except FileNotFoundError:
            pass
        # Any request there now: two agents (a fault seen on two nodes) or a restart beside a save signal each write
        # theirs, and this stop's checkpoint answers them all; none there (withdrawn, a failed signal): no report
        if answering and os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0" and self._asked():
            path = self.switch_dir / self.saved_name
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            try:  # renamed into place: a new inode the agent tells from the last report, and never seen half written
                tmp.write_text(json.dumps({"pid": os.getpid(), "time": time.time()}) + "\n")
                os.replace(tmp, path)
            except OSError:  # the report only shortens the agent's wait: training goes on without it
                with contextlib.suppress(OSError):
                    tmp.unlink()

    def heartbeat(self, step: int, **metrics: float) -> None:
        """Atomically write {step, time, pid, step_time, metrics} so the agent can tell progress from a hang, and a
        slow run from its own pace (`step_time`: seconds per step since the previous heartbeat of this process)."""
        clean = {k: (v if isinstance(v, (int, float)) and math.isfinite(v) else str(v)) for k, v in metrics.items()}
        now, before = time.time(), self._last_beat
        self._last_beat = (int(step), now)
        beat: dict[str, Any] = {"step": int(step), "time": now, "pid": os.getpid(), "metrics": clean}
        if before is not None and int(step) > before[0] and now >= before[1]:
            beat["step_time"] = (now - before[1]) / (int(step) - before[0])
        payload = json.dumps(beat)
        self.heartbeat_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.heartbeat_path.with_name(f".{self.heartbeat_path.name}.{os.getpid()}.tmp")
        tmp.write_text(payload + "\n")
        os.replace(tmp, self.heartbeat_path)


    def flight_recorder(self, entries: int = FLIGHT_RECORDER_ENTRIES, dumps: bool = True,
                        rank: int | None = None) -> str | None:
        """Turn on PyTorch's flight recorder and serve it to the agent. Call before init_process_group.

        Sets, unless already set: TORCH_FR_BUFFER_SIZE to `entries` (before PyTorch 2.7:
        TORCH_NCCL_TRACE_BUFFER_SIZE); with `dumps`, TORCH_NCCL_DUMP_ON_TIMEOUT=1 and TORCH_FR_DUMP_TEMP_FILE (before
        2.7: TORCH_NCCL_DEBUG_INFO_TEMP_FILE) to `<switch dir>/flight-recorder/rank_`, so the NCCL watchdog leaves
        each rank's buffer there when a collective times out. Then starts PyTorch's worker server
        (torch.distributed.elastic.control_plane.worker_main, which answers while the rank is blocked in a
        collective) on `$TMPDIR/trainguard-fr-<pid>/worker.sock`, where the agent looks for it: a variable set
        now is not in /proc/PID/environ. The directory is this user's alone (0700); the socket is writable by all
        (0666) so that the agent, crossing the directory with CAP_DAC_READ_SEARCH, can connect under its own user.
        `rank` (default: $RANK, $SLURM_PROCID) is written beside it for launchers that pass it as an argument.

        Returns the socket's path, or None when PyTorch (2.4 or later) can't be imported or the directory is
        taken: the variables are set all the same. PyTorch is imported only here, from the job's own environment.
        """
        env = os.environ
        try:
            import torch  # the job's own torch, imported late: this module stays standard-library only
            from torch.distributed.elastic.control_plane import worker_main
        except ImportError:
            torch = worker_main = None
        version = tuple(int(v) for v in re.findall(r"\d+", getattr(torch, "__version__", "0.0"))[:2])
        legacy = version < (2, 7)  # the variables' names before the flight recorder left ProcessGroupNCCL
        env.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE" if legacy else "TORCH_FR_BUFFER_SIZE", str(entries))
        if dumps:
            dump_dir = self.switch_dir / "flight-recorder"
            dump_dir.mkdir(parents=True, exist_ok=True)
            env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
            env.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE" if legacy else "TORCH_FR_DUMP_TEMP_FILE", f"{dump_dir}/rank_")
        if worker_main is None:
            return None
        _remove_stale_servers(Path(tempfile.gettempdir()))
        run_dir = Path(tempfile.gettempdir()) / f"trainguard-fr-{os.getpid()}"
        try:
            run_dir.mkdir(mode=0o700)
        except FileExistsError:  # left by an earlier process of this pid, or planted: reuse only our own
            st = os.lstat(run_dir)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                return None
            os.chmod(run_dir, 0o700)
        path = run_dir / "worker.sock"
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        rank = rank if rank is not None else next(
            (int(v) for v in (env.get("RANK"), env.get("SLURM_PROCID")) if v and v.isdigit()), None)
        if rank is not None:
            (run_dir / "rank").write_text(f"{rank}\n")
        env["TORCH_WORKER_SERVER_SOCKET"] = str(path)
        server = worker_main()
        server.__enter__()
        path.chmod(0o666)
        atexit.register(self._stop_server, server, run_dir)
        _wait_serving(path)
        return str(path)

    @staticmethod
    def _stop_server(server: Any, run_dir: Path) -> None:
        with contextlib.suppress(Exception):  # at exit, whatever torch's state: the socket file must go
            server.__exit__(None, None, None)
        for name in ("worker.sock", "rank"):
            with contextlib.suppress(OSError):
                (run_dir / name).unlink()
        with contextlib.suppress(OSError):
            run_dir.rmdir()


def _wait_serving(path: Path, timeout: float = 5.0) -> None:
    """Until the worker server answers one request. Stopped before its thread began serving (a script that ends, or
    crashes, right after flight_recorder()), PyTorch's server (cpp-httplib) misses the stop and the process hangs at
    exit joining its thread: the job would hold its nodes until its time limit. Seen in this project's tests."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(max(0.1, deadline - time.monotonic()))
                conn.connect(str(path))
                conn.sendall(b"GET / HTTP/1.0\r\nHost: localhost\r\n\r\n")
                if conn.recv(1):
                    return
        except OSError:
            pass
        time.sleep(0.05)


def _member(uid: int, group: str | None) -> bool:
    """Whether `uid` belongs to `group` by name, as its primary or a supplementary group (NSS asked, as `id` does).
    Never the file's own group: in a setgid directory anyone who may write gets that group."""
    if not group:
        return False
    try:
        gid = grp.getgrnam(group).gr_gid
        user = pwd.getpwuid(uid)
        return gid in os.getgrouplist(user.pw_name, user.pw_gid)
    except (KeyError, OSError):  # an unknown group or user: no teammate
        return False


def _remove_stale_servers(tmp: Path) -> None:
    """Remove this user's socket directories of processes that are gone: a rank killed with SIGKILL (SLURM after
    KillWait) never runs its atexit."""
    try:
        entries = list(os.scandir(tmp))
    except OSError:
        return
    for entry in entries:
        pid = entry.name.removeprefix("trainguard-fr-")
        if pid == entry.name or not pid.isdigit():
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.getuid() or not entry.is_dir(follow_symlinks=False):
                continue
            os.kill(int(pid), 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except OSError:
            continue  # alive under another user, or unreadable
        for name in ("worker.sock", "rank"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(entry.path, name))
        with contextlib.suppress(OSError):
            os.rmdir(entry.path)


_default: Trainer | None = None


def _trainer() -> Trainer:
    global _default  # noqa: PLW0603 - one helper per training process, by design of this module-level API
    if _default is None:
        _default = Trainer()
    return _default


def install(**kwargs: Any) -> Trainer:
    return _trainer().install(**kwargs)


def should_save() -> bool:
    return _trainer().should_save()


def should_stop() -> bool:
    return _trainer().should_stop()


def saved() -> None:
    _trainer().saved()


def heartbeat(step: int, **metrics: float) -> None:
    _trainer().heartbeat(step, **metrics)


def flight_recorder(entries: int = FLIGHT_RECORDER_ENTRIES, dumps: bool = True, rank: int | None = None) -> str | None:
    return _trainer().flight_recorder(entries, dumps, rank)


def restart_requested() -> bool:
    return _trainer().restart_requested()


def relaunch(command: list[str], max_restarts: int = 10, switch_dir: str | os.PathLike[str] | None = None,
             settle: float = 3.0) -> int:
    """Run `command` (the job's `srun ...`) and run it again each time it ends after a new restart request for this
    job (`restart.<SLURM_JOB_ID>`) appeared in the switch dir, at most `max_restarts` times; return its exit status
    (128+N for signal N), as a shell would. The command sees TRAINGUARD_RESTARTS (how many times it was started
    again) and TRAINGUARD_MAX_RESTARTS.

    SIGTERM, SIGINT and SIGHUP (the time limit, scancel, a stop) end the loop after the command: they reach the
    command from whoever sent them (slurmd signals every process of the batch step). SIGUSR1 and SIGUSR2 are the
    ranks' (save and exit, save): the loop must outlive them when they reach the whole batch step.

    A request may name a node to leave (`"leave"`: the agent's `restart` with `leave_node`, after a fault of that
    node), and the agents record each node the job is to leave in a file of its own, named by the job's life
    (`left.<SLURM_JOB_ID>.<SLURM_RESTART_COUNT or 0>.<node>`: two nodes lost at once, or a lost spare the job ran
    nothing on): when the command is `srun` itself, the loop starts it with `--exclude=` every node this life left so
    far (from its first start: a spare lost while the batch script prepared counts), so the job goes on without
    them, on the spare its allocation holds. The command sees TRAINGUARD_LEFT (those nodes, comma-separated) exactly
    when the loop can do this. The loop removes the job's records when it returns (the life is over), and an earlier
    life's (a requeue: another allocation; a loop that was killed) when it starts.

    A request written by another node's agent on a network file system may show up here a moment late (NFS caches
    attributes and lookups): after a command that exited 0 the loop looks again for up to `settle` seconds."""
    watcher = Trainer(switch_dir)
    ending = threading.Event()

    def end(_signum: int, _frame: Any) -> None:
        ending.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, end)
    for sig in (signal.SIGUSR1, signal.SIGUSR2):  # a handler, not SIG_IGN: an ignored signal stays ignored in exec
        signal.signal(sig, lambda _signum, _frame: None)
    seen = watcher.restart_request()
    env = {**os.environ, "TRAINGUARD_MAX_RESTARTS": str(max_restarts)}  # the agent requeues a loop out of restarts
    env.pop("TRAINGUARD_LEFT", None)  # inherited (a job submitted from a rank): the agent must not trust it
    can_leave = _can_exclude(command)
    job_id = os.environ.get("SLURM_JOB_ID", "")
    life = _life(os.environ.get("SLURM_RESTART_COUNT", "0")) or "0"  # SLURM sets it once the job was requeued
    records = _left_records(watcher.switch_dir, job_id)
    _remove_records(path for (lived, _node), path in records.items() if lived != life)  # an earlier life's
    # nodes a record or a request asked the job to leave, in order; this life's records count from the first start
    left = _nodes_left(records, life) if can_leave else []
    restarts = 0
    try:
        while True:
            argv = [command[0], f"--exclude={','.join(left)}", *command[1:]] if left else command
            run_env = {**env, "TRAINGUARD_RESTARTS": str(restarts)}
            if can_leave:
                run_env["TRAINGUARD_LEFT"] = ",".join(left)
            try:
                code = subprocess.run(argv, env=run_env, check=False).returncode  # no timeout: the job, it runs for days
            except OSError as exc:
                print(f"trainguard relaunch: cannot run {command[0]!r}: {exc.strerror or exc}", file=sys.stderr,
                      flush=True)
                return 127
            status = 128 - code if code < 0 else code
            request = watcher.restart_request()
            deadline = time.monotonic() + settle
            while status == 0 and request in (None, seen) and not ending.is_set() and time.monotonic() < deadline:
                time.sleep(0.5)
                with contextlib.suppress(OSError):
                    os.listdir(watcher.switch_dir)  # a fresh listing: NFS revalidates the directory
                request = watcher.restart_request()
            if ending.is_set() or request is None or request == seen:
                return status
            if restarts >= max_restarts:
                print(f"trainguard relaunch: restart asked after {restarts} restarts (--max-restarts {max_restarts}): "
                      f"not starting {command[0]} again", file=sys.stderr, flush=True)
                return status
            seen, restarts = request, restarts + 1
            reason, leave = _request(watcher.switch_dir / watcher.restart_name)
            if can_leave:
                recorded = _nodes_left(_left_records(watcher.switch_dir, job_id), life)
                left += [node for node in dict.fromkeys([leave, *recorded]) if node and node not in left]
            print(f"trainguard relaunch: restart {restarts} of at most {max_restarts} asked ({reason}); {command[0]} "
                  f"exited {status}: starting it again" + (f" without {', '.join(left)}" if left else ""),
                  file=sys.stderr, flush=True)
            if ending.is_set():  # stopped while deciding: a job being stopped is never started again
                return status
    finally:  # the job's life ends with its loop: a later job given the same id must not find its records
        _remove_records(_left_records(watcher.switch_dir, job_id).values())
        if job_id:  # nor the ranks' last report of a checkpoint written, nor the agent's request for one
            _remove_records([watcher.switch_dir / watcher.saved_name, watcher.switch_dir / watcher.signalled_name])


_HOST_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def _host_name(text: str) -> bool:
    """One host name (no hostlist syntax, no option): 1-64 of letters, digits, `.`, `_`, `-`, a letter or digit first."""
    return 0 < len(text) <= 64 and text[0] not in "._-" and set(text) <= _HOST_CHARS


def _life(text: str) -> str:
    """A job's life (how many times SLURM requeued it) as one text for one number ("" when `text` is not one)."""
    return str(int(text)) if 0 < len(text) <= 9 and text.isascii() and text.isdigit() else ""


def _left_records(switch_dir: Path, job_id: str) -> dict[tuple[str, str], Path]:
    """The job's records of nodes left (`left.<job>.<life>.<node>`, written by the agents as this user): (life,
    node) -> path, for regular files of this user or root whose node is one host name. The whole directory is read
    (the user's own, at a restart only): a record is never missed because others are many."""
    if not job_id:
        return {}
    prefix, found = f"left.{job_id}.", {}
    try:
        with os.scandir(switch_dir) as entries:
            for entry in entries:
                life, _, node = entry.name[len(prefix):].partition(".")
                if not (entry.name.startswith(prefix) and _life(life) and _host_name(node)):
                    continue
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode) and st.st_uid in (os.getuid(), 0):
                        found[(_life(life), node)] = Path(entry.path)
    except OSError:  # no switch dir (yet): nothing recorded
        return {}
    return found


def _nodes_left(records: dict[tuple[str, str], Path], life: str) -> list[str]:
    """The nodes `life` recorded as left, sorted."""
    return sorted(node for lived, node in records if lived == life)


def _remove_records(paths: Iterable[Path]) -> None:
    """Remove those records that are this user's (root's stay: nobody here wrote them)."""
    for path in paths:
        with contextlib.suppress(OSError):
            if os.lstat(path).st_uid == os.getuid():
                os.unlink(path)


def _request(path: Path) -> tuple[str, str]:
    """What the request says about itself: its reason for the job's log (or that it has none), and the node it asks
    the job to leave ("" for none, or for anything that is not one host name)."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(64 << 10))
        reason = " ".join(str(data.get("reason", "no reason given")).split())[:200]
        leave = data.get("leave")
    except (OSError, ValueError, AttributeError):
        return "no reason given", ""
    return reason, leave if isinstance(leave, str) and _host_name(leave) else ""


_NODE_OPTIONS = ("exclude", "nodelist", "nodefile")  # srun's long options that name nodes (getopt takes prefixes)


def _can_exclude(command: list[str]) -> bool:
    """The loop leaves a node by adding `--exclude=` to srun's options: only when it runs srun itself and the command
    names no nodes of its own: an exclusion (two would not merge, the last one wins) or a node list or file (the step
    could not start without a node it must use). Judged on every argument, the program's too, in every spelling srun
    accepts (`-x n5`, `-lx n5`, `--exclu=n5`): a doubt means no leaving, and the agent requeues instead."""
    if os.path.basename(command[0]) != "srun":
        return False
    for arg in command[1:]:
        if arg.startswith("--"):
            name = arg[2:].split("=", 1)[0]
            if len(name) >= 3 and any(full.startswith(name) for full in _NODE_OPTIONS):
                return False
        elif arg.startswith("-") and any(letter in arg[1:] for letter in "xwF"):
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m trainguard.trainer", description="The trainer helper's "
                                     "commands for a job script.")
    sub = parser.add_subparsers(dest="command", required=True)
    loop = sub.add_parser("relaunch", help="run the job's ranks, and again after each restart the agent asks for",
                          description=relaunch.__doc__)
    loop.add_argument("--max-restarts", type=int, default=10, help="restarts in place at most (default 10)")
    loop.add_argument("--switch-dir", help="where the agent writes its request (default: $TRAINGUARD_SWITCH_DIR, "
                                           "else ./.trainguard)")
    loop.add_argument("argv", nargs=argparse.REMAINDER, help="-- the command, e.g. srun python train.py")
    args = parser.parse_args(argv)
    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        parser.error("relaunch: no command given (relaunch -- srun python train.py)")
    if args.max_restarts < 0:
        parser.error("relaunch: --max-restarts must be 0 or more")
    return relaunch(command, args.max_restarts, args.switch_dir)


if __name__ == "__main__":
    sys.exit(main())
