"""`trainguard run`: wire the engine, the HTTP endpoint and systemd together; reload on SIGHUP, shut down cleanly on
SIGTERM."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import signal
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType

from trainguard import __version__
from trainguard.agent.http import ControlSocket, HttpEndpoint
from trainguard.agent.plainconfig import ValidatorError
from trainguard.agent.systemd import SystemdNotifier, WatchdogPinger
from trainguard.core.logs import kv
from trainguard.core.text import one_line
from trainguard.node.procfs import ProcFS
from trainguard.pipeline.config import Config, ConfigError
from trainguard.pipeline.engine import ACTIONS_GRACE_S, BrokenCheck, Engine
from trainguard.pipeline.store import SchemaTooNewError, Store, open_read_only

log = logging.getLogger("trainguard.daemon")


M_ARENA_MAX = -8  # glibc's malloc.h
MALLOC_ARENAS = 2


def fewer_malloc_arenas() -> bool:
    """glibc gives each thread that allocates an arena of its own (up to 8 per core), and each keeps what was freed in
    it. The agent's threads (a check's, kept between its runs; the servers') allocate little and seldom at once: two
    arenas hold the same in about 1 MiB less (docs/benchmarks-history.md). Set before any thread starts; `MALLOC_ARENA_MAX`
    in the environment wins. False where it was not set (not glibc, or the environment decided)."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt): its allocator, its business
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_ARENA_MAX, MALLOC_ARENAS))


class _Serving:
    """The engine and the endpoints that serve it: started together on one config, stopped together (at shutdown,
    and at a reload, which starts them again on the new config in the same process)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.engine = Engine(config, self_check=True, ledger=config.ledger.enabled)
        if not self.engine.store.persistent:
            log.error("running without persistent state", extra=kv(state_dir=config.agent.state_dir))
        self.endpoint: HttpEndpoint | None = None
        self.control: ControlSocket | None = None
        try:
            self._serve(config)
            self.engine.start()
        except BaseException:  # a reload falls back to the config before: nothing of this one may hold on
            self.stop(0.0)
            raise

    def _serve(self, config: Config) -> None:
        if config.agent.listen:
            host, port = config.agent.listen_address()
            try:
                self.endpoint = HttpEndpoint(self.engine, host, port)
                self.endpoint.start()
            except OSError as exc:
                # Checks and alerts matter more than the endpoint: keep running without it.
                self.endpoint = None
                log.error("cannot listen; HTTP endpoint off", extra=kv(address=config.agent.listen, error=exc))
        try:
            self.control = ControlSocket(self.engine, config.agent.control_path())
            self.control.start()
        except OSError as exc:
            self.control = None
            log.error("cannot open the control socket; local details off", extra=kv(
                path=config.agent.control_path(), error=exc.strerror or exc))

    def stop(self, grace: float) -> None:
        t0 = time.monotonic()
        if self.endpoint is not None:
            self.endpoint.stop()
        if self.control is not None:
            self.control.stop()
        # The servers' stop comes out of the actions' grace: one budget inside the unit's TimeoutStopSec.
        self.engine.stop(grace=max(0.0, grace - (time.monotonic() - t0)))


def _warn(config: Config) -> None:
    for warning in config.warnings():  # also a WARNING result of the agent's own check, so it reaches the channels
        log.warning("config warning", extra=kv(config=str(config.source or "(built-in default)"), warning=warning))


def changes(old: Config, new: Config) -> dict[str, str]:
    """What a reload changes, for its log line: checks, notifiers and actions added, removed or changed."""
    out = {}
    for part in ("checks", "notifiers", "actions"):
        before, after = getattr(old, part), getattr(new, part)
        for what, names in (("added", sorted(set(after) - set(before))), ("removed", sorted(set(before) - set(after))),
                            ("changed", sorted(n for n in set(before) & set(after) if before[n] != after[n]))):
            if names:
                out[f"{part}_{what}"] = ",".join(names)
    for part in ("agent", "jobs", "ledger"):
        if getattr(old, part) != getattr(new, part):
            out[f"{part}_changed"] = "yes"
    return out


def run_daemon(config: Config, reload: Callable[[], Config] | None = None) -> int:
    """`reload`: the config again, validated as at start (raising ConfigError or ValidatorError); SIGHUP calls it."""
    fewer_malloc_arenas()
    stop, hangup = threading.Event(), threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGHUP:
            hangup.set()
            return
        log.info("shutdown requested", extra=kv(signal=signal.Signals(signum).name))
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_signal if reload is not None else signal.SIG_IGN)
    # The kernel may hand SIGTERM to any of the agent's threads; Python then runs the handler in the main thread only
    # once that thread runs bytecode, and a main thread blocked in a lock never does. The wakeup fd gets a byte
    # whichever thread the signal reached, so the main thread sleeps in select() on it: woken by every signal, and
    # by nothing else.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)  # set_wakeup_fd's requirement: a handler never blocks on a full pipe
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)

    log.info("starting", extra=kv(version=__version__, node=config.agent.node_name,
                                  config=config.source or "(built-in default)", state_dir=config.agent.state_dir))
    _warn(config)
    hidden = ProcFS().hidden_processes()
    if hidden is not None:  # said once, at start: otherwise every job just looks ABSENT and nobody knows why
        log.warning("other users' processes are invisible to the agent: process jobs, job memory, hang signals and "
                    "signals to process jobs see only its own user's processes", extra=kv(
                        reason=hidden, fix="keep CAP_SYS_PTRACE, or set ProtectProc=default in a drop-in "
                                           "(docs/install.md, No ptrace)"))
    serving = _Serving(config)
    systemd = SystemdNotifier()
    pinger = WatchdogPinger(systemd, lambda: serving.engine.healthy())  # noqa: PLW0108 - the engine after a reload
    # Ready as soon as the endpoint serves and the scheduler runs: the first round runs from here on, so a slow
    # check (squeue timing out) neither delays READY nor risks systemd's start timeout.
    pending = serving.engine.pending()
    systemd.notify("READY=1", _status_line(len(serving.engine.configured), pending))
    pinger.start()
    log.info("ready", extra=kv(checks=len(serving.engine.configured), pending=",".join(pending) or None,
                               watchdog_s=systemd.watchdog_s))
    if not pending:  # each check's lane ran it before READY (fast checks do): the first round is done already
        log.info("first round done", extra=kv(checks=len(serving.engine.configured)))
    # Once the first round is done the main thread only waits for a signal: no wake-up a second for nothing.
    while not stop.is_set():
        if select.select([wake_r], [], [], 1.0 if pending else None)[0]:
            os.read(wake_r, 512)  # the handler has run, or runs before the next bytecode: `stop` says
        if hangup.is_set() and not stop.is_set() and reload is not None:
            hangup.clear()
            pinger.pause(True)
            try:
                serving = _reload(serving, reload, systemd)
            finally:
                pinger.pause(False)
            pending = serving.engine.pending()
        if pending:
            now_pending = serving.engine.pending()
            if now_pending != pending:  # `systemctl status` shows the first round completing
                pending = now_pending
                systemd.notify(_status_line(len(serving.engine.configured), pending))
                if not pending:
                    log.info("first round done", extra=kv(checks=len(serving.engine.configured)))
    t0 = time.monotonic()
    systemd.notify("STOPPING=1")
    pinger.stop()
    serving.stop(ACTIONS_GRACE_S)
    signal.set_wakeup_fd(-1)
    os.close(wake_r)
    os.close(wake_w)
    log.info("stopped", extra=kv(shutdown_s=round(time.monotonic() - t0, 3)))
    return 0


def refusal(config: Config) -> str | None:
    """Why a running agent would refuse `config` at a reload; None where it would take it. Asked before the running
    engine stops (and by `trainguard validate`): the engine built as the agent builds it, on a state kept in memory
    (the node's state is neither read nor written), each check built as configured (a check that cannot start would
    replace a working one with an UNKNOWN), and the state database the config names read for its schema (a newer
    release's is refused, as at start). What the trial's construction logs stays out of the journal: the refusal is
    its one line."""
    try:
        open_read_only(config.agent.state_dir).close()
    except SchemaTooNewError as exc:
        return f"state database: {one_line(str(exc), 500)}"
    except (OSError, sqlite3.Error) as exc:  # none yet (the agent creates it), not this user's to read (`validate` by
        # the trainguard group), or damaged (the agent moves it aside and starts over, as at start): no refusal
        log.debug("state database schema not checked", extra=kv(error=exc))
    with _quiet_here():
        try:
            engine = Engine(config, store=Store(None), self_check=True, ledger=config.ledger.enabled)
        except Exception as exc:  # noqa: BLE001 - whatever it is, the config cannot run: said, never raised
            return f"its engine cannot be built: {type(exc).__name__}: {one_line(str(exc), 500)}"
        try:
            broken = [f"check {name} cannot start: {check.error}" for name, check in engine.checks.items()
                      if isinstance(check, BrokenCheck)]
        finally:
            engine.stop(grace=0.0)
    return "; ".join(broken) or None


@contextlib.contextmanager
def _quiet_here() -> Iterator[None]:
    """Records logged by this thread go nowhere meanwhile (the engine's other threads still log)."""
    me = threading.get_ident()

    def elsewhere(record: logging.LogRecord) -> bool:
        return record.thread != me

    handlers = list(logging.getLogger().handlers)
    for handler in handlers:
        handler.addFilter(elsewhere)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(elsewhere)


def _reload(serving: _Serving, load: Callable[[], Config], systemd: SystemdNotifier) -> _Serving:
    """SIGHUP (`systemctl reload`): the config validated and its engine tried first (`refusal`); a bad one is refused
    in one line and the running one stays. A good one stops the engine as a shutdown does (actions under way get
    their grace) and starts it again on the new config in this process: incidents, silences, the outbox and what the
    checks remember are in the state database, as across a restart, and the endpoints are opened again (a changed
    address applies). Should the new one still fail to start, the config before starts again the same way."""
    systemd.notify("RELOADING=1", "STATUS=reloading the config")
    t0 = time.monotonic()
    try:
        config = load()
        why = refusal(config)
    except (ConfigError, ValidatorError) as exc:
        why = str(exc)
    if why is not None:
        return _refused(serving, why, systemd)
    changed = changes(serving.config, config)
    log.warning("reloading", extra=kv(config=config.source or "(built-in default)", **changed) if changed
                else kv(config=config.source or "(built-in default)", changes="none"))
    _warn(config)
    serving.stop(ACTIONS_GRACE_S)
    try:
        serving = _Serving(config)
    except Exception as exc:  # noqa: BLE001 - anything: the config before runs again, as it ran
        return _refused(_Serving(serving.config), f"it did not start: {type(exc).__name__}: {exc}", systemd)
    systemd.notify("READY=1", _status_line(len(serving.engine.configured), serving.engine.pending()))
    log.info("reloaded", extra=kv(checks=len(serving.engine.configured), took_s=round(time.monotonic() - t0, 3)))
    return serving


def _refused(serving: _Serving, why: str, systemd: SystemdNotifier) -> _Serving:
    log.error("reload refused; the running config stays", extra=kv(error=one_line(why, 2000)))
    systemd.notify("READY=1", _status_line(len(serving.engine.configured), serving.engine.pending())
                   + "; the last reload was refused: journalctl -u trainguard")
    return serving


def _status_line(checks: int, pending: list[str]) -> str:
    return (f"STATUS=watching {checks} checks" if not pending
            else f"STATUS=watching {checks} checks; first run pending: {', '.join(pending)}")
