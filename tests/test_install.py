"""Installing as a service: the unit passes systemd's own gates, install/uninstall do what they say, the shipped
config is valid, and the configuration reference is the code's."""

from __future__ import annotations

import re
import stat
import subprocess
from pathlib import Path

from trainguard.agent.configfile import load_config
from trainguard.cli import main
from trainguard.install import DEFAULT_CONFIG, UNIT_SOURCE, Installer
from trainguard.reference import markdown

from .conftest import REPO, require_tool

MAX_EXPOSURE = 2.5


def test_unit_as_installed_verifies_clean(tmp_path: Path) -> None:
    analyze = require_tool("systemd-analyze")
    Installer(tmp_path).install()
    unit = tmp_path / "etc/systemd/system/trainguard.service"
    proc = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr.strip() == "", proc.stderr
    for dropin in ("switch-files.conf", "run-as-root.conf"):  # each drop-in merged into the unit verifies too
        merged = tmp_path / f"merged-{dropin}.service"
        merged.write_text(unit.read_text() + "\n" + (REPO / "systemd" / dropin).read_text())
        proc = subprocess.run([analyze, "verify", str(merged)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and proc.stderr.strip() == "", f"{dropin}: {proc.stderr}"


def test_unit_exposure_is_at_most_2_5() -> None:
    analyze = require_tool("systemd-analyze")
    proc = subprocess.run([analyze, "security", "--offline=true", str(UNIT_SOURCE)], capture_output=True, text=True,
                          timeout=60)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout + proc.stderr)
    assert m, proc.stdout + proc.stderr
    assert float(m.group(1)) <= MAX_EXPOSURE, proc.stdout


def test_install_and_uninstall_staged(tmp_path: Path, capsys: object) -> None:
    assert main(["install", "--root", str(tmp_path)]) == 0
    unit = tmp_path / "etc/systemd/system/trainguard.service"
    config = tmp_path / "etc/trainguard/trainguard.toml"
    text = unit.read_text()
    assert "ExecStart=/usr/local/bin/trainguard" not in text and " run --config /etc/trainguard/trainguard.toml" in text
    assert stat.S_IMODE(config.stat().st_mode) == 0o640
    assert config.read_text() == DEFAULT_CONFIG.read_text()
    config.write_text(config.read_text() + "\n# edited by the operator\n")
    assert main(["install", "--root", str(tmp_path)]) == 0  # twice: nothing changes, the edit is kept
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "up to date" in out and "kept the existing" in out and "Next steps" in out
    assert config.read_text().endswith("# edited by the operator\n")
    assert main(["uninstall", "--root", str(tmp_path)]) == 0
    assert not unit.exists() and config.exists()
    assert main(["uninstall", "--root", str(tmp_path), "--purge"]) == 0
    assert not config.parent.exists()


def test_shipped_default_config_is_valid() -> None:
    config = load_config(str(DEFAULT_CONFIG))
    assert set(config.checks) == {"disk", "memory", "gpu", "nvlink", "pcie", "gpu_config", "fabric", "infiniband", "xid",
                                  "hang", "training_log", "job_memory", "job_timelimit", "job_switch"}
    assert list(config.notifiers) == ["console"]


def test_configuration_reference_matches_the_code() -> None:
    doc = REPO / "docs" / "configuration.md"
    assert doc.read_text() == markdown(), "docs/configuration.md drifted: run `trainguard config-reference > " \
                                          "docs/configuration.md`"
    for kind in ("disk", "hang", "training_log", "slack", "requeue"):  # every registered type is documented
        assert f'type = "{kind}"' in doc.read_text()
