"""Trainer-side helper for trainguard. Standard library only: import it from any training script.

    from trainguard import trainer

    trainer.install()                      # SIGUSR1: save and exit; SIGUSR2: save; SIGTERM: stop
    for step in range(start, steps):
        loss = train_step()
        trainer.heartbeat(step, loss=loss)
        if trainer.should_save():
            save_checkpoint(step)
            trainer.saved()
        if trainer.should_stop():
            save_checkpoint(step)
            break

Switch files live in the switch dir ($TRAINGUARD_SWITCH_DIR, else ./.trainguard): `save` asks for one
checkpoint (removed by `saved()`), `stop` asks the run to checkpoint and exit. The heartbeat file
(`heartbeat.json` there, or $TRAINGUARD_HEARTBEAT) tells the agent the run is making progress.
"""

from __future__ import annotations

import json
import math
import os
import signal
import stat
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["Trainer", "heartbeat", "install", "saved", "should_save", "should_stop"]


def _signals(names: Iterable[str]) -> list[signal.Signals]:
    return [signal.Signals["SIG" + n.upper().removeprefix("SIG")] for n in names]


class Trainer:
    def __init__(self, switch_dir: str | os.PathLike[str] | None = None,
                 heartbeat_path: str | os.PathLike[str] | None = None) -> None:
        self.switch_dir = Path(switch_dir or os.environ.get("TRAINGUARD_SWITCH_DIR") or Path.cwd() / ".trainguard")
        self.heartbeat_path = Path(heartbeat_path or os.environ.get("TRAINGUARD_HEARTBEAT")
                                   or self.switch_dir / "heartbeat.json")
        self._save = threading.Event()
        self._stop = threading.Event()
        self.last_signal: str | None = None

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

    def _switch(self, name: str) -> bool:
        """A switch counts only as a regular file of this user or root: nobody else can stop the run."""
        try:
            st = os.lstat(self.switch_dir / name)
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_uid in (os.getuid(), 0)

    def should_save(self) -> bool:
        return self._save.is_set() or self._switch("save") or self.should_stop()

    def should_stop(self) -> bool:
        return self._stop.is_set() or self._switch("stop")

    def saved(self) -> None:
        """A checkpoint was written: clear the save request (signal flag and `save` switch file)."""
        self._save.clear()
        try:
            (self.switch_dir / "save").unlink()
        except FileNotFoundError:
            pass

    def heartbeat(self, step: int, **metrics: float) -> None:
        """Atomically write {step, time, pid, metrics} so the agent can tell progress from a hang."""
        clean = {k: (v if isinstance(v, (int, float)) and math.isfinite(v) else str(v)) for k, v in metrics.items()}
        payload = json.dumps({"step": int(step), "time": time.time(), "pid": os.getpid(), "metrics": clean})
        self.heartbeat_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.heartbeat_path.with_name(f".{self.heartbeat_path.name}.{os.getpid()}.tmp")
        tmp.write_text(payload + "\n")
        os.replace(tmp, self.heartbeat_path)


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
