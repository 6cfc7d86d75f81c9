"""sd_notify without libsystemd: READY, WATCHDOG and STOPPING over the NOTIFY_SOCKET datagram socket."""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping

from trainguard.core.logs import kv

log = logging.getLogger("trainguard.systemd")


class SystemdNotifier:
    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        address = env.get("NOTIFY_SOCKET", "")
        # An abstract socket is written '@name' and addressed with a leading NUL byte.
        self._address = "\0" + address[1:] if address.startswith("@") else address
        self.watchdog_s: float | None = None
        usec, pid = env.get("WATCHDOG_USEC"), env.get("WATCHDOG_PID")
        if usec and (not pid or pid == str(os.getpid())):
            try:
                self.watchdog_s = int(usec) / 1e6 or None
            except ValueError:
                log.warning("ignoring malformed WATCHDOG_USEC", extra=kv(value=usec))

    @property
    def enabled(self) -> bool:
        return bool(self._address)

    def notify(self, *fields: str) -> bool:
        if not self._address:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.settimeout(1.0)
                sock.sendto("\n".join(fields).encode(), self._address)
            return True
        except OSError as exc:
            log.warning("sd_notify failed", extra=kv(error=exc))
            return False


class WatchdogPinger:
    """Pings at half the watchdog interval, but only while the engine makes progress, so that
    systemd restarts a wedged agent instead of a thread pinging on its behalf forever."""

    def __init__(self, notifier: SystemdNotifier, healthy: Callable[[], bool]) -> None:
        self._notifier = notifier
        self._healthy = healthy
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._thread: threading.Thread | None = None

    def pause(self, paused: bool) -> None:
        """While paused (a reload swapping the engine), neither ping nor say the engine is stuck: the watchdog still
        ends an agent whose reload takes longer than WatchdogSec."""
        if paused:
            self._paused.set()
        else:
            self._paused.clear()

    def start(self) -> None:
        if self._notifier.watchdog_s is None:
            return
        self._thread = threading.Thread(target=self._loop, name="watchdog", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        assert self._notifier.watchdog_s is not None
        period = self._notifier.watchdog_s / 2
        while not self._stop.wait(period):
            if self._paused.is_set():
                continue
            if self._healthy():
                self._notifier.notify("WATCHDOG=1")
            else:
                log.error("engine not making progress; withholding watchdog ping")

    def stop(self) -> None:
        self._stop.set()
