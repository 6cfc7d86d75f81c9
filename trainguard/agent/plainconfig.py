"""The agent's config without pydantic in the agent's process.

`trainguard run` validates its config in a short-lived child (`child` below, settings in their pydantic mode: the
same `load_config` as `trainguard validate`, the same errors and warnings on stderr) and takes the result
back as plain values: each settings object as its class's import path and its validated field values, pickled on
the child's stdout. The agent (settings in their plain mode, trainguard.core.settings) builds the same classes from
them. What the child sends is read with an unpickler that builds nothing but trainguard's own value types and paths:
the child is our own code reading the root-owned config, and this keeps it that way.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import pickle
import subprocess
import sys
from collections.abc import Mapping
from enum import Enum
from importlib import import_module
from pathlib import Path, PurePath
from typing import Any

import trainguard
from trainguard import PLAIN_SETTINGS_ENV
from trainguard.core.settings import Built, Member, PlainSettings, Secret
from trainguard.pipeline.config import Config, ConfigError, resolve_config_path
from trainguard.registry import DEFAULT_REGISTRY

# The child runs with the agent's interpreter flags and imports the agent's own trainguard, from where this process
# has it, and nothing from its working directory (which `-c` puts first on its path unless -P).
_CHILD = ("import sys; sys.path[:1] = [{root!r}] if sys.path[:1] == [''] else [{root!r}, *sys.path[:1]]; "
          "from trainguard.agent.plainconfig import child; sys.exit(child(sys.argv[1:]))")
# Under systemd's default TimeoutStartSec (90 s, the unit keeps it): a few hundred ms normally, never this long.
CHILD_TIMEOUT_S = 60.0


class ValidatorError(RuntimeError):
    """The validating child did not answer (not started, killed, timed out, garbled): not the config's fault."""


def _allowed(obj: Any) -> bool:
    """What a validated config holds: settings and enum members on their way (`Built`, `Member`), secrets, paths,
    and trainguard's own dataclasses (Limit), which unpickle without running their code."""
    return obj in (Built, Member, Secret, set, frozenset) or (isinstance(obj, type) and (
        issubclass(obj, PurePath) or dataclasses.is_dataclass(obj)))


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # A dotted name would reach any global of an allowed module (pickle protocol 4): refused outright.
        if "." not in name and (module.startswith("trainguard.") or module in ("pathlib", "builtins")):
            found = super().find_class(module, name)
            if _allowed(found):
                return found
        raise pickle.UnpicklingError(f"the validated config holds a {module}.{name}: not a settings value")


def _class(module: str, qualname: str) -> Any:
    if not module.startswith("trainguard."):
        raise TypeError(f"{module}.{qualname} is not one of trainguard's classes")
    target: Any = import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _rebuild(value: Any) -> Any:
    if isinstance(value, Built):
        cls = _class(value.module, value.qualname)
        if not (isinstance(cls, type) and issubclass(cls, PlainSettings)):
            raise TypeError(f"{value.module}.{value.qualname} is not a settings class in this process")
        return cls(**{name: _rebuild(v) for name, v in value.fields.items()})
    if isinstance(value, Member):
        cls = _class(value.module, value.qualname)
        if not (isinstance(cls, type) and issubclass(cls, Enum)):
            raise TypeError(f"{value.module}.{value.qualname} is not an enum")
        return cls[value.name]
    if type(value) is dict:
        return {k: _rebuild(v) for k, v in value.items()}
    if type(value) in (list, tuple, set, frozenset):
        return type(value)(_rebuild(v) for v in value)
    return value


def load_plain_config(cli_path: str | None, log_level: str) -> Config:
    """The config as `load_config` would return it, validated in a child; ConfigError as it would raise it;
    ValidatorError when the child gave no answer."""
    env = {k: v for k, v in os.environ.items() if k != PLAIN_SETTINGS_ENV}
    root = str(Path(trainguard.__file__).resolve().parent.parent)
    argv = [sys.executable, *subprocess._args_from_interpreter_flags(), "-c", _CHILD.format(root=root),
            f"--log-level={log_level}"] + ([f"--config={cli_path}"] if cli_path else [])
    path, explicit = resolve_config_path(cli_path)
    if not explicit and not path.exists() and "gpu" in DEFAULT_REGISTRY.checks:
        # The built-in default has GPU checks when NVML loads: in this process, the one that will use it.
        from trainguard.gpu import nvml

        reason = nvml.probe()
        argv.append(f"--nvml-off={reason}" if reason is not None else "--nvml-on")
    try:
        # stderr is the agent's: the child's config warnings reach the journal as the agent's own would.
        done = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              timeout=CHILD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise ValidatorError(f"validating {path} took over {CHILD_TIMEOUT_S:g}s") from None
    except OSError as exc:
        raise ValidatorError(f"cannot start {sys.executable} to validate {path}: {exc.strerror or exc}") from None
    if done.returncode != 0:
        raise ValidatorError(f"the process validating {path} exited with status {done.returncode} "
                              "(its error, if it said one, is on stderr above)")
    try:
        kind, *payload = _Unpickler(io.BytesIO(done.stdout)).load()
        if kind == "error":
            error_source, problems = payload
            raise ConfigError(str(error_source), [str(p) for p in problems])
        return Config(**_rebuild(payload[0]))
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError, IndexError,
            KeyError, RecursionError) as exc:
        raise ValidatorError(f"cannot read what the process validating {path} sent: {exc}") from None


def _plain(value: Any) -> Any:
    """The child's side: pydantic settings as `Built`s, secrets as `Secret`s (the agent has no pydantic to load),
    enum members as `Member`s."""
    from pydantic import BaseModel, SecretStr

    if isinstance(value, BaseModel):
        cls = type(value)
        return Built(cls.__module__, cls.__qualname__, {name: _plain(getattr(value, name)) for name in cls.model_fields})
    if isinstance(value, SecretStr):
        return Secret(value.get_secret_value())
    if isinstance(value, Enum):
        return Member(type(value).__module__, type(value).__qualname__, value.name)
    if isinstance(value, Mapping):  # Config's tables, as a dict
        return {k: _plain(v) for k, v in value.items()}
    if type(value) in (list, tuple, set, frozenset):
        return type(value)(_plain(v) for v in value)
    return value


def child(argv: list[str]) -> int:
    """The validating process: the config's `load_config`, pickled on stdout for `load_plain_config`."""
    # What anything imported here might print goes to stderr: stdout carries the pickle alone.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    from trainguard.agent.configfile import load_config
    from trainguard.core.logs import setup_logging

    parser = argparse.ArgumentParser(prog="trainguard (config child)")
    parser.add_argument("--config")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--nvml-off", metavar="REASON", help="the agent's NVML did not load, for this reason")
    parser.add_argument("--nvml-on", action="store_true", help="the agent's NVML loaded")
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    probe = (lambda: None) if args.nvml_on else (lambda: args.nvml_off) if args.nvml_off is not None else None
    try:
        config = load_config(args.config, nvml_probe=probe)
    except ConfigError as exc:
        answer: tuple[Any, ...] = ("error", exc.source, exc.problems)
    else:
        answer = ("ok", {f.name: _plain(getattr(config, f.name)) for f in dataclasses.fields(config)})
    with out:
        out.write(pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL))
    return 0
