"""Installing as a service: the unit passes systemd's own gates, install/uninstall do what they say, the shipped
config is valid, and the configuration reference is the code's."""

from __future__ import annotations

import re
import stat
import subprocess
from pathlib import Path

from trainguard.agent.configfile import load_config
from trainguard.cli import main
from trainguard.install import DEFAULT_CONFIG, UNIT_SOURCE, Installer, dropins
from trainguard.reference import markdown

from .conftest import REPO, require_tool

MAX_EXPOSURE = 2.5


def test_unit_as_installed_verifies_clean(tmp_path: Path) -> None:
    analyze = require_tool("systemd-analyze")
    Installer(tmp_path).install()
    unit = tmp_path / "etc/systemd/system/trainguard.service"
    proc = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr.strip() == "", proc.stderr
    assert set(dropins()) == {"switch-files", "native-stacks", "run-as-root"}
    for name, dropin in dropins().items():  # each drop-in merged into the unit verifies too
        merged = tmp_path / f"merged-{name}.service"
        merged.write_text(unit.read_text() + "\n" + dropin.read_text())
        proc = subprocess.run([analyze, "verify", str(merged)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and proc.stderr.strip() == "", f"{name}: {proc.stderr}"


def test_the_package_carries_the_checkouts_systemd_files() -> None:
    """One source per file: trainguard/systemd is the top-level systemd/ folder, not a copy that could drift."""
    assert (REPO / "trainguard" / "systemd").resolve() == (REPO / "systemd").resolve()
    assert sorted(p.name for p in (REPO / "systemd").iterdir()) == sorted([UNIT_SOURCE.name, *(f"{n}.conf" for n in
                                                                                                dropins())])


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
    assert stat.S_IMODE(config.parent.stat().st_mode) == 0o750  # the unit's ConfigurationDirectoryMode
    assert config.read_text() == DEFAULT_CONFIG.read_text()
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert f"created {config.parent} (mode 0750)" in out and f"wrote {unit} (ExecStart=" in out
    assert "Next steps" in out and "--dropin NAME, for NAME in: native-stacks, run-as-root, switch-files" in out
    config.write_text(config.read_text() + "\n# edited by the operator\n")
    config.parent.chmod(0o755)  # as installed by earlier versions: set right, and said
    assert main(["install", "--root", str(tmp_path), "--dropin", "switch-files"]) == 0  # the edit is kept
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "up to date" in out and "kept the existing" in out and "was 0755" in out
    assert stat.S_IMODE(config.parent.stat().st_mode) == 0o750
    assert config.read_text().endswith("# edited by the operator\n")
    dropin = tmp_path / "etc/systemd/system/trainguard.service.d/switch-files.conf"
    assert dropin.read_text() == dropins()["switch-files"].read_text()
    dropin.write_text(dropin.read_text().replace("-/scratch", "-/scratch -/data"))  # where this site's jobs run
    assert main(["install", "--root", str(tmp_path), "--dropin", "switch-files"]) == 0
    assert f"kept the existing {dropin}" in capsys.readouterr().out  # type: ignore[attr-defined]
    assert "-/data" in dropin.read_text()
    (dropin.parent / "site.conf").write_text("[Service]\nNice=5\n")  # not ours: uninstall leaves it
    assert main(["uninstall", "--root", str(tmp_path)]) == 0
    assert not unit.exists() and not dropin.exists() and (dropin.parent / "site.conf").exists() and config.exists()
    assert main(["uninstall", "--root", str(tmp_path), "--purge"]) == 0
    assert not config.parent.exists()


def test_an_unknown_dropin_is_refused_before_anything_is_written(tmp_path: Path, capsys: object) -> None:
    assert main(["install", "--root", str(tmp_path), "--dropin", "ptrace"]) == 1
    err = capsys.readouterr().err  # type: ignore[attr-defined]
    assert "no drop-in named ptrace (shipped: native-stacks, run-as-root, switch-files)" in err
    assert list(tmp_path.iterdir()) == []


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
