"""Loading and validating the TOML config. Every error names the file and the key path."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from trainguard.actions.base import ActionSettings
from trainguard.checks.base import ActionBinding, CheckSettings
from trainguard.core.logs import kv
from trainguard.core.settings import is_secret, read_small_file
from trainguard.jobs.settings import JobsSettings
from trainguard.notifiers.base import NotifierSettings
from trainguard.pipeline.config import (
    AgentSettings,
    Config,
    ConfigError,
    resolve_config_path,
)
from trainguard.pipeline.ledger import LedgerSettings
from trainguard.pipeline.lemon import NAME as LEMON_NAME
from trainguard.pipeline.selfcheck import NAME as SELF_NAME
from trainguard.registry import BUILTIN_ACTIONS, DEFAULT_REGISTRY, Registry

log = logging.getLogger("trainguard.config")
M = TypeVar("M", bound=BaseModel)


def _format_validation_error(prefix: str, exc: ValidationError, model: type[BaseModel] | None = None) -> list[str]:
    problems = []
    fields = model.model_fields if model is not None else {}
    for err in exc.errors():
        path = ".".join([prefix] + [str(p) for p in err["loc"]]) if prefix or err["loc"] else "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif err["type"] == "missing":
            msg = "required key is missing"
            key = str(err["loc"][0]) if len(err["loc"]) == 1 else ""
            if key in fields and is_secret(fields[key].annotation):  # the forms a newcomer may not know of
                msg += f' (a secret: or give {key}_file = "/path/to/file" or {key}_env = "VARIABLE")'
        problems.append(f"{path.strip('.')}: {msg}")
    return problems


def _validate_table(section: str, raw: Any, base: type, lookup: Any, problems: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if not isinstance(raw, dict):
        problems.append(f"{section}: expected a table of named {section}, got {type(raw).__name__}")
        return out
    for name, entry in raw.items():
        where = f"{section}.{name}"
        if not isinstance(entry, dict):
            problems.append(f"{where}: expected a table, got {type(entry).__name__}")
            continue
        kind = entry.get("type", name)
        if not isinstance(kind, str):
            problems.append(f"{where}.type: expected a type name, got {type(kind).__name__}")
            continue
        try:
            cls = lookup(kind)
        except KeyError as exc:
            problems.append(f"{where}.type: {exc.args[0]}")
            continue
        try:
            out[name] = cls.Settings.model_validate(entry)
        except ValidationError as exc:
            problems.extend(_format_validation_error(where, exc, cls.Settings))
    return out


def _section(name: str, model: type[M], raw: dict[str, Any], problems: list[str]) -> M:
    """One section of plain settings (`[jobs]`, `[ledger]`): validated, or its defaults and the problems said."""
    try:
        return model.model_validate(raw.get(name, {}))
    except ValidationError as exc:
        problems.extend(_format_validation_error(name, exc))
        return model()


def _unknown_actions(bindings: dict[str, Any], defined: Iterable[str]) -> list[str]:
    """Each action a binding (`where`: its key) names that no `[actions.NAME]` (nor a built-in one) defines."""
    known = sorted(defined)
    return [f"{where}.{level}: unknown action {action!r} (defined: {', '.join(known)})"
            for where, binding in bindings.items() for level in ("warning", "critical", "resolved")
            for action in getattr(binding, level) if action not in known]


def parse_config(raw: dict[str, Any], source: str, registry: Registry = DEFAULT_REGISTRY) -> Config:
    problems: list[str] = []
    for key in raw:
        if key not in ("agent", "checks", "notifiers", "jobs", "actions", "ledger"):
            problems.append(f"{key}: unknown key (expected agent, checks, notifiers, jobs, actions, ledger)")
    agent = None
    try:
        agent = AgentSettings.model_validate(raw.get("agent", {}))
    except ValidationError as exc:
        problems.extend(_format_validation_error("agent", exc))
    checks = _validate_table("checks", raw.get("checks", {}), CheckSettings, registry.check_class, problems)
    for reserved, what in ((SELF_NAME, "the agent's own health check"), (LEMON_NAME, "the lemon policy's hold")):
        if reserved in checks:
            problems.append(f"checks.{reserved}: the name is reserved for {what}; choose another")
    notifiers = _validate_table("notifiers", raw.get("notifiers", {}), NotifierSettings,
                                registry.notifier_class, problems)
    jobs = _section("jobs", JobsSettings, raw, problems)
    ledger = _section("ledger", LedgerSettings, raw, problems)
    raw_actions = raw.get("actions", {})
    merged = {**{k: dict(v) for k, v in BUILTIN_ACTIONS.items()}, **raw_actions} if isinstance(raw_actions, dict) \
        else raw_actions
    actions = _validate_table("actions", merged, ActionSettings, registry.action_class, problems)
    bindings = {f"checks.{n}.{key}": binding for n, c in checks.items() for key in type(c).model_fields
                if isinstance(binding := getattr(c, key), ActionBinding)}  # `actions`, and a hang's `fs_actions`
    problems += _unknown_actions({**bindings, "ledger.actions": ledger.actions}, merged)
    if problems or agent is None:
        raise ConfigError(source, problems)
    return Config(agent=agent, checks=checks, notifiers=notifiers, source=Path(source), jobs=jobs, actions=actions,
                  ledger=ledger)


MAX_CONFIG_BYTES = 1 << 20  # a config file is a few KiB; more is not one


def read_config_file(path: Path) -> bytes:
    """The file's bytes, if it is a regular file of sane size: a FIFO or a device never blocks or floods us."""
    try:
        return read_small_file(path, MAX_CONFIG_BYTES)
    except PermissionError:  # not the file's fault: the command says who may read it (cli.main)
        raise
    except OSError as exc:
        raise ConfigError(str(path), [f"cannot read file: {exc.strerror or exc}"]) from None


def load_config(cli_path: str | None = None, registry: Registry = DEFAULT_REGISTRY,
                nvml_probe: Callable[[], str | None] | None = None) -> Config:
    path, explicit = resolve_config_path(cli_path)
    if not path.exists() and not explicit:
        return default_config(registry, nvml_probe)
    data = read_config_file(path)
    try:
        raw = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), [f"not UTF-8 text ({exc.reason} at byte {exc.start})"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), [f"invalid TOML: {exc}"]) from None
    except RecursionError:
        raise ConfigError(str(path), ["invalid TOML: arrays or tables nested too deeply"]) from None
    except ValueError as exc:  # e.g. an integer of thousands of digits
        raise ConfigError(str(path), [f"invalid TOML: {str(exc)[:200]}"]) from None
    config = parse_config(raw, str(path), registry)
    warn_inline_secrets(path, raw, registry)
    return config


def warn_inline_secrets(path: Path, raw: dict[str, Any], registry: Registry = DEFAULT_REGISTRY) -> list[str]:
    """A secret written inline in a file others can read: WARNING, naming the keys (never the values)."""
    try:
        if not path.stat().st_mode & 0o004:
            return []
    except OSError:
        return []
    inline = []
    for section, kind_of in (("notifiers", registry.notifier_class), ("actions", registry.action_class)):
        for name, table in (raw.get(section) or {}).items():
            if not isinstance(table, dict):
                continue
            try:
                fields = kind_of(str(table.get("type", name))).Settings.model_fields
            except (KeyError, AttributeError):
                continue
            inline += [f"{section}.{name}.{key}" for key, f in fields.items() if key in table and is_secret(f.annotation)]
    if inline:
        log.warning("secrets inline in a world-readable config file: use <key>_file or <key>_env, or chmod o-r",
                    extra=kv(path=str(path), keys=",".join(inline)))
    return inline


def default_config(registry: Registry = DEFAULT_REGISTRY, nvml_probe: Callable[[], str | None] | None = None) -> Config:
    """Useful on any Linux machine: root fs and state dir, host memory, InfiniBand ports (idle without them), GPUs
    when NVML loads (`nvml_probe`: why not, None when it does; default: load it here), console."""
    agent = AgentSettings()
    # The daemon creates the state dir before it loads the config; a one-shot `check` may run without it.
    paths = ["/"] + ([str(agent.state_dir)] if os.path.isdir(agent.state_dir) else [])  # False if not ours to see
    raw: dict[str, Any] = {
        "checks": {
            "disk": {"paths": paths},
            "memory": {},
            **({"infiniband": {}} if "infiniband" in registry.checks else {}),  # idle on a node without HCAs
        },
        "notifiers": {"console": {}},
    }
    if "gpu" in registry.checks:
        if nvml_probe is None:
            from trainguard.gpu import nvml

            nvml_probe = nvml.probe
        reason = nvml_probe()
        if reason is None:
            raw["checks"].update({kind: {} for kind in ("gpu", "nvlink", "pcie", "gpu_config", "fabric")
                                  if kind in registry.checks})
        else:
            log.info("GPU checks off", extra=kv(reason=reason))
    config = parse_config(raw, "(built-in default)", registry)
    return Config(agent=agent, checks=config.checks, notifiers=config.notifiers, source=None, jobs=config.jobs,
                  actions=config.actions, ledger=config.ledger)
