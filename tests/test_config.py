from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError

from trainguard.agent.configfile import ConfigError, default_config, load_config, parse_config
from trainguard.checks.disk import DiskSettings
from trainguard.core.settings import SettingsModel
from trainguard.core.units import Limit
from trainguard.notifiers.base import NotifierSettings
from trainguard.registry import Registry

REPO = Path(__file__).resolve().parent.parent


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "trainguard.toml"
    path.write_text(text)
    return path


def problems(tmp_path: Path, text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(str(write(tmp_path, text)))
    return info.value.problems


def test_full_config_parses(tmp_path: Path) -> None:
    config = load_config(str(write(tmp_path, f"""
[agent]
node_name = "gpu-node-17"
state_dir = "{tmp_path}/state"
listen = "127.0.0.1:0"

[checks.scratch]
type = "disk"
paths = ["/"]
interval = "15s"
free_warning = "20GiB"
inodes_free_critical = "2%"
forecast_horizon = "2h"

[checks.memory]
available_critical = "1GiB"

[notifiers.console]
min_severity = "critical"
""")))
    scratch = config.checks["scratch"]
    assert isinstance(scratch, DiskSettings)
    assert config.kind_of_check("scratch") == "disk"
    assert scratch.interval == 15.0
    assert scratch.free_warning == Limit(20 * 2**30)
    assert scratch.inodes_free_critical == Limit(2.0, percent=True)
    assert scratch.forecast_horizon == 7200.0
    assert config.agent.node_name == "gpu-node-17"
    assert config.notifiers["console"].min_severity.name == "CRITICAL"


@pytest.mark.parametrize(("text", "expected"), [
    ("[agent]\nlisten_addr = '1'\n", "agent.listen_addr: unknown key"),
    ("[checks.disk]\ninterval = '10x'\n", "checks.disk.interval: invalid duration '10x'"),
    ("[checks.disk]\nfree_warning = '12XB'\n", "checks.disk.free_warning: invalid size '12XB'"),
    ("[checks.disk]\npaths = '/'\n", "checks.disk.paths: Input should be a valid list"),
    ("[checks.disk]\nbogus = 1\n", "checks.disk.bogus: unknown key"),
    ("[checks.gpu0]\ntype = 'nope'\n", "checks.gpu0.type: unknown check type 'nope' (known: command, disk, fabric, gpu, "),
    ("[checks.memory]\ntop = 'five'\n", "checks.memory.top: Input should be a valid integer"),
    ("[checks.disk]\ntimeout = '5s'\nmount_timeout = '10s'\n", "must be shorter than timeout"),
    ("[notifiers.console]\nmin_severity = 'loud'\n", "notifiers.console.min_severity: invalid status 'loud'"),
    ("[agent]\nlisten = 'localhost'\n", "agent.listen: invalid listen address"),
    ("[alerts]\n", "alerts: unknown key"),
    ("checks = 3\n", "checks: expected a table"),
])
def test_errors_name_the_key_path(tmp_path: Path, text: str, expected: str) -> None:
    found = problems(tmp_path, text)
    assert any(expected in p for p in found), found


def test_error_message_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[checks.disk]\ninterval = '1 fortnight'\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert str(info.value).startswith(f"config error in {path}: checks.disk.interval: invalid duration")


def test_all_problems_reported_at_once(tmp_path: Path) -> None:
    found = problems(tmp_path, "[checks.disk]\ninterval = 'x'\n[checks.memory]\ntop = -1\n")
    assert len(found) == 2


def test_invalid_toml_and_missing_file(tmp_path: Path) -> None:
    assert "invalid TOML" in problems(tmp_path, "[checks\n")[0]
    with pytest.raises(ConfigError, match="cannot read file"):
        load_config(str(tmp_path / "absent.toml"))


class _WebhookSettings(NotifierSettings):
    url: SecretStr


def test_secret_indirection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret_file = tmp_path / "url"
    secret_file.write_text("https://hooks.example/T000/secret\n")
    assert _WebhookSettings.model_validate({"url_file": str(secret_file)}).url.get_secret_value() == \
        "https://hooks.example/T000/secret"
    monkeypatch.setenv("HOOK_URL", "https://from-env")
    s = _WebhookSettings.model_validate({"url_env": "HOOK_URL"})
    assert s.url.get_secret_value() == "https://from-env"
    assert "from-env" not in json.dumps(s.model_dump(mode="json"))
    with pytest.raises(ValidationError, match="environment variable NOPE_UNSET is not set"):
        _WebhookSettings.model_validate({"url_env": "NOPE_UNSET"})
    with pytest.raises(ValidationError, match="url_file: cannot read"):
        _WebhookSettings.model_validate({"url_file": str(tmp_path / "missing")})
    with pytest.raises(ValidationError, match="give only one of url, url_env"):
        _WebhookSettings.model_validate({"url": "x", "url_env": "HOOK_URL"})


def test_secret_redacted_in_effective_config(tmp_path: Path) -> None:
    class Hook:
        Settings = _WebhookSettings

    registry = Registry(notifiers={"hook": Hook})
    config = parse_config({"notifiers": {"hook": {"url": "https://hooks.example/very-secret"}}}, "x.toml", registry)
    dumped = json.dumps(config.to_dict())
    assert "very-secret" not in dumped
    assert "**********" in dumped


def test_settings_models_are_strict() -> None:
    class M(SettingsModel):
        x: int = 1

    with pytest.raises(Exception, match="Extra inputs are not permitted"):
        M.model_validate({"y": 2})


def test_default_config_is_useful(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path))
    config = default_config()
    assert set(config.checks) >= {"disk", "memory"}
    assert config.checks["disk"].paths == ["/", str(tmp_path)]
    assert list(config.notifiers) == ["console"]
    assert config.agent.state_dir == tmp_path


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainguard", *args], capture_output=True, text=True, timeout=60,
                          cwd=REPO, env={**os.environ, **(env or {})})


def test_broken_config_refuses_to_start_with_exit_2(tmp_path: Path) -> None:
    path = write(tmp_path, "[checks.disk]\nfree_warning = '10 parsecs'\n")
    for command in ("run", "check", "validate"):
        proc = _cli(command, "--config", str(path))
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines() == [
            f"trainguard: config error in {path}: checks.disk.free_warning: invalid size '10 parsecs': "
            "expected a size such as '20GiB' or a percentage such as '5%'"]


def test_config_from_environment_variable(tmp_path: Path) -> None:
    path = write(tmp_path, "[checks.disk]\ninterval = 'never'\n")
    proc = _cli("validate", env={"TRAINGUARD_CONFIG": str(path)})
    assert proc.returncode == 2
    assert str(path) in proc.stderr


def test_validate_prints_effective_config(tmp_path: Path) -> None:
    path = write(tmp_path, f"[agent]\nstate_dir = '{tmp_path}'\n[checks.root]\ntype = 'disk'\npaths = ['/']\n")
    proc = _cli("validate", "--config", str(path))
    assert proc.returncode == 0, proc.stderr
    effective = json.loads(proc.stdout)
    assert effective["checks"]["root"]["type"] == "disk"
    assert effective["checks"]["root"]["interval"] == "30s"
    assert effective["checks"]["root"]["free_critical"] == "5%"
    assert effective["source"] == str(path)


def test_help_on_every_command() -> None:
    for command in ("run", "check", "status", "validate"):
        proc = _cli(command, "--help")
        assert proc.returncode == 0
        assert "--config" in proc.stdout


def test_example_config_is_valid() -> None:
    config = load_config(str(REPO / "examples" / "trainguard.toml"))
    assert config.kind_of_check("timelimit") == "job_timelimit"
    assert config.checks["stop-switch"].actions.warning == ["signal", "hold-array"]
    assert "page" in config.actions and "drain" in config.actions


def test_a_stale_after_shorter_than_the_interval_is_warned_about() -> None:
    """A hang is judged at a run: a `stale_after` under the check's `interval` fires late (20 s at 42 s), which
    `validate` says instead of leaving it to the first real hang."""
    late = parse_config({"jobs": {"sources": ["process"]}, "checks": {"hang": {"stale_after": "20s", "interval": "30s"}}},
                        "t.toml")
    assert late.warnings() == ["checks.hang: stale_after 20s is shorter than interval 30s: a hang may be reported up "
                               "to an interval late; set interval to stale_after / 2 or less"]
    by_name = parse_config({"jobs": {"sources": ["process"]}, "checks": {"hung": {
        "type": "hang", "interval": "1m", "stale_after_by_name": {"eval": "30s"}}}}, "t.toml")
    assert [w.split(":")[0] for w in by_name.warnings()] == ["checks.hung"]
    assert parse_config({"jobs": {"sources": ["process"]}, "checks": {"hang": {"stale_after": "5m"}}},
                        "t.toml").warnings() == []


def test_an_alternative_binding_can_be_set_back_to_the_checks_own_actions(tmp_path: Path) -> None:
    """TOML has no null: `"actions"` is the None of `fs_actions` and `batch_host_actions` (the check's `actions`)."""
    text = "[checks.hang]\nfs_actions = 'actions'\n[checks.node_drain]\nbatch_host_actions = 'actions'\n"
    config = load_config(str(write(tmp_path, text)))
    assert config.checks["hang"].fs_actions is None  # type: ignore[attr-defined]
    assert config.checks["node_drain"].batch_host_actions is None  # type: ignore[attr-defined]
    set_once = load_config(str(write(tmp_path, "[checks.node_drain]\nbatch_host_actions = {critical = ['signal']}\n")))
    assert set_once.checks["node_drain"].batch_host_actions.critical == ["signal"]  # type: ignore[attr-defined]
    assert any("checks.hang.fs_actions" in p for p in problems(tmp_path, "[checks.hang]\nfs_actions = 'action'\n"))
