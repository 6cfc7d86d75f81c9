"""The agent's process holds its config as plain classes, validated by a child in pydantic's mode
(trainguard.core.settings, trainguard.agent.plainconfig): the same config, value for value, and no pydantic."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.conftest import REPO, AgentProcess, free_port
from tests.helpers.settings_tree import built, tree
from trainguard.agent.configfile import load_config
from trainguard.agent.plainconfig import _Unpickler
from trainguard.core.settings import Built, PlainSettings, Secret, _plain_field
from trainguard.install import DEFAULT_CONFIG
from trainguard.pipeline.engine import Engine

RICH = """
[agent]
node_name = "gpu-node-17"
cluster = "lab"
state_dir = "{state}"
listen = "127.0.0.1:0"

[checks.scratch]
type = "disk"
paths = ["/", "{state}"]
free_warning = "20GiB"
inodes_free_critical = "2%"
forecast_horizon = "2h"
actions = {{ critical = ["page"] }}

[checks.memory]
available_critical = "1GiB"
fire_after_runs = 3

[checks.quota]
provider = "budget"
mounts = ["{state}"]
bytes_budget = "10GiB"

[checks.training_log]
logs = ["{state}/*.log"]
[checks.training_log.signatures.ecc]
needle = "uncorrectable ECC"
pattern = 'GPU (\\d+)'
status = "critical"

[checks.alive]
type = "job_liveness"
names = ["pretrain"]

[notifiers.slack]
webhook_url_env = "PLAIN_TEST_SLACK"
min_severity = "critical"
exclude_checks = ["memory"]

[notifiers.email]
host = "127.0.0.1"
from = "trainguard@example.org"
to = ["oncall@example.org"]
username = "tg"
password_file = "{secret}"

[notifiers.hook]
type = "webhook"
url = "https://hooks.example.org/x"
secret_env = "PLAIN_TEST_SECRET"

[jobs]
sources = []
[jobs.processes.toy]
cmdline = 'train_toy\\.py'
user = "nobody"

[actions.page]
type = "exec"
command = ["/bin/true", "{{check}}"]
"""


def with_agent(text: str, keys: str) -> str:
    """A config file's text with these keys first in its [agent] table (which it has)."""
    assert "\n[agent]\n" in text
    return text.replace("\n[agent]\n", f"\n[agent]\n{keys}\n", 1)


def _agent_side(config: Path | None, env: dict[str, str]) -> dict[str, Any]:
    """The config as `trainguard run`'s own process holds it: loaded there through the validating child."""
    done = subprocess.run([sys.executable, "-m", "tests.helpers.settings_tree", *([str(config)] if config else [])],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _configs(tmp_path: Path) -> dict[str, Path | None]:
    state = tmp_path / "state"
    state.mkdir()
    secret = tmp_path / "smtp-password"
    secret.write_text("s3cret\n")
    rich = tmp_path / "rich.toml"
    rich.write_text(RICH.format(state=state, secret=secret))
    installed = tmp_path / "installed.toml"
    installed.write_text(with_agent(DEFAULT_CONFIG.read_text(), f'state_dir = "{state}"\nlisten = ""'))
    example = tmp_path / "example.toml"
    example.write_text(with_agent((REPO / "examples" / "trainguard.toml").read_text(), f'state_dir = "{state}"'))
    return {"installed": installed, "example": example, "rich": rich, "built-in default": None}


@pytest.mark.parametrize("which", ["installed", "example", "rich", "built-in default"])
def test_the_agent_holds_the_config_it_validated_and_no_pydantic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 which: str) -> None:
    env = {"PLAIN_TEST_SLACK": "https://hooks.slack.example/T0/B0/xyz", "PLAIN_TEST_SECRET": "hmac-key",
           "STATE_DIRECTORY": str(tmp_path / "state"), "TRAINGUARD_CONFIG": ""}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    config_path = _configs(tmp_path)[which]
    expected = load_config(str(config_path) if config_path else None)
    if which != "built-in default":
        assert expected.source == config_path
    engine = Engine(expected, self_check=True)

    agent = _agent_side(config_path, env)

    assert agent["plain"] is True
    assert agent["pydantic"] == []  # neither pydantic nor pydantic_core, nor their imports through ours
    assert agent["tree"] == json.loads(json.dumps(tree(expected)))
    assert agent["checks"] == built(engine)
    if which == "rich":  # secrets from a file and the environment reached the agent, as secrets
        notifiers = agent["tree"]["notifiers"]["dict"]
        assert notifiers["email"]["password"] == {"secret": "s3cret"}
        assert notifiers["hook"]["secret"] == {"secret": "hmac-key"}


def test_run_refuses_a_bad_config_with_the_validators_own_words(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[checks.disk]\ninterval = '10x'\nbogus = 1\n[notifiers.slack]\n")

    def command(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "trainguard", *args, "--config", str(bad)], capture_output=True,
                              text=True, timeout=60, cwd=REPO, env={**os.environ, "STATE_DIRECTORY": str(tmp_path)})

    run, validate = command("run"), command("validate")
    assert run.returncode == validate.returncode == 2
    problems = [line for line in validate.stderr.splitlines() if "config error in" in line]
    assert len(problems) == 3, validate.stderr  # interval, bogus, the slack notifier's missing webhook
    assert [line for line in run.stderr.splitlines() if "config error in" in line] == problems


def test_a_running_agent_maps_no_pydantic(tmp_path: Path, agent_process: Callable[..., AgentProcess]) -> None:
    """The installed config over scripted GPUs, as the footprint benchmark runs it: every check built and run in a
    process whose memory holds no pydantic (its core library never mapped)."""
    port = free_port()
    config = tmp_path / "trainguard.toml"
    config.write_text(with_agent(DEFAULT_CONFIG.read_text(), f'state_dir = "{tmp_path}/state"\nlisten = "127.0.0.1:{port}"'))
    agent = agent_process(config, module="tests.helpers.fake_gpu_agent")
    agent.wait_for("first round done", timeout=60)
    assert agent.proc is not None
    maps = Path(f"/proc/{agent.proc.pid}/maps").read_text()
    assert "/site-packages/" in maps or ".so" in maps  # the maps were read, not an empty file
    assert "pydantic" not in maps
    checks = requests.get(f"http://127.0.0.1:{port}/status", timeout=5).json()["checks"]
    assert {"gpu", "nvlink", "xid", "disk", "job_switch"} <= set(checks)  # the installed config's, over 8 GPUs
    assert {name: c["outcome"] for name, c in checks.items() if c["outcome"] not in ("ok", "idle")} == {}


def test_plain_settings_take_defaults_copy_mutables_and_stay_frozen() -> None:
    class Inner(PlainSettings):
        depth: int = 1

    class Example(PlainSettings):
        required: str
        count: int = 3
        paths: list[str] = _plain_field(["/"])
        made: list[int] = _plain_field(default_factory=lambda: [len("made")])
        inner: Inner = _plain_field(default_factory=Inner)
        _private: int = 0

    one, two = Example(required="x"), Example(required="x", count=4)
    assert (one.count, one.paths, one.made, one.inner) == (3, ["/"], [4], Inner(depth=1))
    assert one.paths is not two.paths  # a default is each instance's own, as pydantic copies it
    assert one != two and one == Example(required="x") and hash(Inner()) == hash(Inner(depth=1))
    with pytest.raises(AttributeError, match="frozen"):
        one.count = 5  # type: ignore[misc]
    with pytest.raises(TypeError, match="required is required"):
        Example()
    with pytest.raises(TypeError, match=r"unknown field.*colour"):
        Example(required="x", colour="red")
    assert "s3cret" not in repr(Secret("s3cret")) and Secret("s3cret").get_secret_value() == "s3cret"


def test_what_the_child_sends_builds_only_trainguards_classes() -> None:
    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, ("true",))

    payload = pickle.dumps(("ok", {"agent": Built("trainguard.pipeline.config", "AgentSettings", {"x": Evil()})}))
    with pytest.raises(pickle.UnpicklingError, match="system"):
        _Unpickler(io.BytesIO(payload)).load()
    fine = pickle.dumps(("ok", Built("trainguard.checks.disk", "DiskSettings", {"paths": [Path("/")]})))
    assert _Unpickler(io.BytesIO(fine)).load()[1].fields == {"paths": [Path("/")]}


def test_only_the_validating_modules_import_pydantic() -> None:
    """A settings module takes `Field` and the rest from core/settings.py: one `from pydantic import Field` in a
    check would load pydantic into the agent again (the process test above would see it; this names the file)."""
    package = REPO / "trainguard"
    importing = sorted(str(path.relative_to(package)) for path in package.rglob("*.py")
                       if any(line.startswith(("from pydantic", "import pydantic"))
                              for line in path.read_text().splitlines()))
    # core/settings.py imports it indented, in its pydantic mode only; the CLI's reference and the validator at top.
    assert importing == ["agent/configfile.py", "reference.py"]
