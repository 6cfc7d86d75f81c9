"""The agent's config without pydantic in the agent's process.

`trainguard run` validates its config in a short-lived child (`child` below, settings in their pydantic mode: the
same `load_config` as `trainguard validate`, the same errors and warnings on stderr) and takes the result
back as plain values: each settings object as its class's import path and its validated field values, pickled on
the child's stdout. The agent (settings in their plain mode, trainguard.core.settings) builds the same classes from
them. What the child sends is read with an unpickler that builds nothing but trainguard's own classes and paths: the
child is our own code reading the root-owned config, and this keeps it that way.
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import subprocess
import sys
from importlib import import_module
from pathlib import Path
from typing import Any

import trainguard
from trainguard import PLAIN_SETTINGS_ENV
from trainguard.core.settings import Built, PlainSettings, Secret
from trainguard.pipeline.config import Config, ConfigError, resolve_config_path
from trainguard.registry import DEFAULT_REGISTRY

# The child imports the agent's own trainguard, from where this process has it, and nothing from its working
# directory (which `-m` or `-c` would put first on its path).
_CHILD = ("import sys; sys.path[0] = {root!r}; from trainguard.agent.plainconfig import child; "
          "sys.exit(child(sys.argv[1:]))")
CHILD_TIMEOUT_S = 120.0  # a few hundred ms normally; a node swapping hard at boot is slower, never this slow
_ALLOWED_MODULES = ("trainguard.", "pathlib")
_ALLOWED_BUILTINS = frozenset({"set", "frozenset", "complex"})


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_ALLOWED_MODULES) or (module == "builtins" and name in _ALLOWED_BUILTINS):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"the validated config holds a {module}.{name}: not a settings value")


def _rebuild(value: Any) -> Any:
    if isinstance(value, Built):
        target: Any = import_module(value.module)
        for part in value.qualname.split("."):
            target = getattr(target, part)
        if not (isinstance(target, type) and issubclass(target, PlainSettings)):
            raise TypeError(f"{value.module}.{value.qualname} is not a settings class in this process")
        return target(**{name: _rebuild(v) for name, v in value.fields.items()})
    if type(value) is dict:
        return {k: _rebuild(v) for k, v in value.items()}
    if type(value) in (list, tuple, set, frozenset):
        return type(value)(_rebuild(v) for v in value)
    return value


def load_plain_config(cli_path: str | None, log_level: str) -> Config:
    """The config as `load_config` would return it, validated in a child; ConfigError as it would raise it."""
    env = {k: v for k, v in os.environ.items() if k != PLAIN_SETTINGS_ENV}
    argv = [sys.executable, "-c", _CHILD.format(root=str(Path(trainguard.__file__).resolve().parent.parent)),
            "--log-level", log_level] + (["--config", cli_path] if cli_path else [])
    path, explicit = resolve_config_path(cli_path)
    if not explicit and not path.exists() and "gpu" in DEFAULT_REGISTRY.checks:
        # The built-in default has GPU checks when NVML loads: in this process, the one that will use it.
        from trainguard.gpu import nvml

        reason = nvml.probe()
        argv += ["--nvml-off", reason] if reason is not None else ["--nvml-on"]
    source = cli_path or "(config)"
    try:
        # stderr is the agent's: the child's config warnings reach the journal as the agent's own would.
        done = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              timeout=CHILD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise ConfigError(source, [f"validating the config took over {CHILD_TIMEOUT_S:g}s"]) from None
    except OSError as exc:
        raise ConfigError(source, [f"cannot start the validating process {sys.executable}: "
                                   f"{exc.strerror or exc}"]) from None
    if done.returncode != 0:
        raise ConfigError(source, [f"the validating process exited with status {done.returncode} "
                                   "(its error is on stderr above)"])
    try:
        kind, *payload = _Unpickler(io.BytesIO(done.stdout)).load()
        if kind == "error":
            error_source, problems = payload
            raise ConfigError(error_source, list(problems))
        return Config(**_rebuild(payload[0]))
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError) as exc:
        raise ConfigError(source, [f"cannot read what the validating process sent: {exc}"]) from None


def _plain(value: Any) -> Any:
    """The child's side: pydantic settings as `Built`s, secrets as `Secret`s (the agent has no pydantic to load)."""
    from pydantic import BaseModel, SecretStr

    if isinstance(value, BaseModel):
        cls = type(value)
        return Built(cls.__module__, cls.__qualname__, {name: _plain(getattr(value, name)) for name in cls.model_fields})
    if isinstance(value, SecretStr):
        return Secret(value.get_secret_value())
    if type(value) is dict:
        return {k: _plain(v) for k, v in value.items()}
    if type(value) in (list, tuple, set, frozenset):
        return type(value)(_plain(v) for v in value)
    return value


def child(argv: list[str]) -> int:
    """The validating process: the config's `load_config`, pickled on stdout for `load_plain_config`."""
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
        out: tuple[Any, ...] = ("error", exc.source, exc.problems)
    else:
        out = ("ok", {"agent": _plain(config.agent), "checks": _plain(dict(config.checks)),
                      "notifiers": _plain(dict(config.notifiers)), "source": config.source,
                      "jobs": _plain(config.jobs), "actions": _plain(dict(config.actions))})
    sys.stdout.buffer.write(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))
    return 0
