"""`trainguard run`: wire the engine, the HTTP endpoint and systemd together; shut down cleanly on SIGTERM."""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import threading
import time
from types import FrameType

from trainguard import __version__
from trainguard.agent.http import ControlSocket, HttpEndpoint
from trainguard.agent.systemd import SystemdNotifier, WatchdogPinger
from trainguard.core.logs import kv
from trainguard.node.procfs import ProcFS
from trainguard.pipeline.config import Config
from trainguard.pipeline.engine import ACTIONS_GRACE_S, Engine

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


def run_daemon(config: Config) -> int:
    fewer_malloc_arenas()
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("shutdown requested", extra=kv(signal=signal.Signals(signum).name))
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # The kernel may hand SIGTERM to any of the agent's threads; Python then runs the handler in the main thread only
    # once that thread runs bytecode, and a main thread blocked in a lock never does. The wakeup fd gets a byte
    # whichever thread the signal reached, so the main thread sleeps in select() on it: woken by every signal, and
    # by nothing else.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)  # set_wakeup_fd's requirement: a handler never blocks on a full pipe
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)

    log.info("starting", extra=kv(version=__version__, node=config.agent.node_name,
                                  config=config.source or "(built-in default)", state_dir=config.agent.state_dir))
    for warning in config.warnings():  # also a WARNING result of the agent's own check, so it reaches the channels
        log.warning("config warning", extra=kv(config=str(config.source or "(built-in default)"), warning=warning))
    hidden = ProcFS().hidden_processes()
    if hidden is not None:  # said once, at start: otherwise every job just looks ABSENT and nobody knows why
        log.warning("other users' processes are invisible to the agent: process jobs, job memory, hang signals and "
                    "signals to process jobs see only its own user's processes", extra=kv(
                        reason=hidden, fix="keep CAP_SYS_PTRACE, or set ProtectProc=default in a drop-in "
                                           "(docs/install.md, No ptrace)"))
    engine = Engine(config, self_check=True)
    if not engine.store.persistent:
        log.error("running without persistent state", extra=kv(state_dir=config.agent.state_dir))
    endpoint = None
    if config.agent.listen:
        host, port = config.agent.listen_address()
        try:
            endpoint = HttpEndpoint(engine, host, port)
            endpoint.start()
        except OSError as exc:
            # Checks and alerts matter more than the endpoint: keep running without it.
            log.error("cannot listen; HTTP endpoint off", extra=kv(address=config.agent.listen, error=exc))
    control = None
    try:
        control = ControlSocket(engine, config.agent.control_path())
        control.start()
    except OSError as exc:
        log.error("cannot open the control socket; local details off", extra=kv(path=config.agent.control_path(),
                                                                               error=exc.strerror or exc))
    systemd = SystemdNotifier()
    pinger = WatchdogPinger(systemd, engine.healthy)
    engine.start()
    # Ready as soon as the endpoint serves and the scheduler runs: the first round runs from here on, so a slow
    # check (squeue timing out) neither delays READY nor risks systemd's start timeout.
    pending = engine.pending()
    systemd.notify("READY=1", _status_line(len(engine.configured), pending))
    pinger.start()
    log.info("ready", extra=kv(checks=len(engine.configured), pending=",".join(pending) or None,
                               watchdog_s=systemd.watchdog_s))
    if not pending:  # each check's lane ran it before READY (fast checks do): the first round is done already
        log.info("first round done", extra=kv(checks=len(engine.configured)))
    # Once the first round is done the main thread only waits for a signal: no wake-up a second for nothing.
    while not stop.is_set():
        if select.select([wake_r], [], [], 1.0 if pending else None)[0]:
            os.read(wake_r, 512)  # the handler has run, or runs before the next bytecode: `stop` says
        if pending:
            now_pending = engine.pending()
            if now_pending != pending:  # `systemctl status` shows the first round completing
                pending = now_pending
                systemd.notify(_status_line(len(engine.configured), pending))
                if not pending:
                    log.info("first round done", extra=kv(checks=len(engine.configured)))
    t0 = time.monotonic()
    systemd.notify("STOPPING=1")
    pinger.stop()
    if endpoint is not None:
        endpoint.stop()
    if control is not None:
        control.stop()
    # The servers' stop comes out of the actions' grace: one budget inside the unit's TimeoutStopSec.
    engine.stop(grace=max(0.0, ACTIONS_GRACE_S - (time.monotonic() - t0)))
    signal.set_wakeup_fd(-1)
    os.close(wake_r)
    os.close(wake_w)
    log.info("stopped", extra=kv(shutdown_s=round(time.monotonic() - t0, 3)))
    return 0


def _status_line(checks: int, pending: list[str]) -> str:
    return (f"STATUS=watching {checks} checks" if not pending
            else f"STATUS=watching {checks} checks; first run pending: {', '.join(pending)}")
