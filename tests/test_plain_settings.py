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
from trainguard import PLAIN_SETTINGS_ENV
from trainguard.agent import plainconfig
from trainguard.agent.configfile import load_config
from trainguard.agent.plainconfig import ValidatorError, _Unpickler, load_plain_config
from trainguard.core.model import Status
from trainguard.core.settings import Built, Member, PlainSettings, Secret, SecretStr, _plain_field
from trainguard.core.state import scoped_key
from trainguard.core.units import Limit
from trainguard.install import DEFAULT_CONFIG
from trainguard.node.kmsg import CURSOR_KEY, cursor_at_end
from trainguard.pipeline.engine import Engine
from trainguard.pipeline.store import Store

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
    # Not a node of the test cluster, and the kernel log read from its end: other tests' XIDs are not its news, and
    # its drain action must not drain the test node.
    config.write_text(with_agent(DEFAULT_CONFIG.read_text(), f'state_dir = "{tmp_path}/state"\n'
                                 f'listen = "127.0.0.1:{port}"\nnode_name = "tg-plain"')
                      .replace("[jobs]\n", "[jobs]\nsources = ['process']\n", 1))
    (tmp_path / "state").mkdir()
    store = Store(tmp_path / "state")
    store.put(scoped_key("check/xid", CURSOR_KEY), cursor_at_end())
    store.close()
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
    # as pydantic's SecretStr: an empty one is false (an empty webhook `secret` signs nothing)
    assert not Secret("") and bool(Secret("k")) and bool(SecretStr("")) is False


def test_what_the_child_sends_builds_only_trainguards_value_types() -> None:
    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, ("true",))

    def load(payload: bytes) -> Any:
        return _Unpickler(io.BytesIO(payload)).load()

    with pytest.raises(pickle.UnpicklingError, match="system"):
        load(pickle.dumps(("ok", {"agent": Built("trainguard.pipeline.config", "AgentSettings", {"x": Evil()})})))
    # protocol 4's dotted names reach any global of an allowed module: os.getcwd through pathlib
    dotted = (b"\x80\x04\x8c\x07pathlib\x94\x8c\tos.getcwd\x94\x93\x94)R\x94.")
    with pytest.raises(pickle.UnpicklingError, match=r"pathlib\.os\.getcwd"):
        load(dotted)
    with pytest.raises(pickle.UnpicklingError, match="Engine"):  # a class of ours, but no value type
        load(pickle.dumps(Engine))
    # getattr(cls, name) is how some Pythons pickle an enum member (3.11.2); it would reach any attribute
    with pytest.raises(pickle.UnpicklingError, match=r"builtins\.getattr"):
        load(b"\x80\x04\x8c\x08builtins\x94\x8c\x07getattr\x94\x93\x94.")
    fine = load(pickle.dumps(("ok", Built("trainguard.checks.disk", "DiskSettings", {
        "paths": [Path("/")], "free": Limit(5.0, percent=True),
        "status": Member("trainguard.core.model", "Status", "WARNING"),
        "k": Secret("x"), "s": frozenset({1})}))))
    assert fine[1].fields == {"paths": [Path("/")], "free": Limit(5.0, percent=True),
                              "status": Member("trainguard.core.model", "Status", "WARNING"), "k": Secret("x"),
                              "s": frozenset({1})}
    assert plainconfig._rebuild(fine[1].fields["status"]) is Status.WARNING


@pytest.mark.parametrize(("executable", "expected"), [
    ("/bin/false", "exited with status 1"),
    ("/bin/echo", "cannot read what the process validating"),
    ("/nonexistent/python", "cannot start /nonexistent/python"),
])
def test_a_validator_that_gives_no_answer_is_not_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                executable: str, expected: str) -> None:
    config = tmp_path / "trainguard.toml"
    config.write_text("[checks.memory]\n")
    monkeypatch.setattr(plainconfig.sys, "executable", executable)
    with pytest.raises(ValidatorError, match=expected) as info:
        load_plain_config(str(config), "warning")
    assert str(config) in str(info.value)


RUN_PROBE = """
import json, os, sys, types
from trainguard import cli
def run_daemon(config, reload=None):  # in place of the daemon: what `run` hands it, and in what process
    from trainguard.core.settings import PLAIN
    print(json.dumps({"plain": PLAIN, "switch": os.environ.get("TRAINGUARD_PLAIN_SETTINGS"),
                      "pydantic": "pydantic" in sys.modules, "checks": sorted(config.checks)}))
    return 0
sys.modules["trainguard.agent.daemon"] = types.SimpleNamespace(run_daemon=run_daemon)
sys.exit(cli.main(["run", "--config", sys.argv[1]]))
"""


def test_the_mode_switch_is_runs_own_and_reaches_no_other_process(tmp_path: Path) -> None:
    """Set only while `run` imports its settings: the agent's process then holds plain settings and no switch that
    a command it runs (an exec action) would inherit; a stray one does not make `validate` validate nothing."""
    config = tmp_path / "trainguard.toml"
    config.write_text(f'[agent]\nstate_dir = "{tmp_path}/state"\n[checks.memory]\n')
    env = {**os.environ, "STATE_DIRECTORY": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", RUN_PROBE, str(config)], capture_output=True, text=True,
                         timeout=60, cwd=REPO, env=env)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == {"plain": True, "switch": None, "pydantic": False, "checks": ["memory"]}

    config.write_text("[checks.disk]\ninterval = '10x'\n")
    stray = subprocess.run([sys.executable, "-m", "trainguard", "validate", "--config", str(config)],
                           capture_output=True, text=True, timeout=60, cwd=REPO, env={**env, PLAIN_SETTINGS_ENV: "1"})
    assert stray.returncode == 2 and "checks.disk.interval: invalid duration '10x'" in stray.stderr


def test_only_the_validating_modules_import_pydantic() -> None:
    """A settings module takes `Field` and the rest from core/settings.py: one `from pydantic import Field` in a
    check would load pydantic into the agent again (the process test above would see it; this names the file)."""
    package = REPO / "trainguard"
    importing = sorted(str(path.relative_to(package)) for path in package.rglob("*.py")
                       if any(line.startswith(("from pydantic", "import pydantic"))
                              for line in path.read_text().splitlines()))
    # core/settings.py imports it indented, in its pydantic mode only; the CLI's reference and the validator at top.
    assert importing == ["agent/configfile.py", "reference.py"]
