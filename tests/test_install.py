"""Installing as a service: the unit passes systemd's own gates, install/uninstall do what they say, the shipped
config is valid, and the configuration reference is the code's."""

from __future__ import annotations

import grp
import json
import os
import pwd
import re
import stat
import subprocess
import sys
import typing
from pathlib import Path

from trainguard.agent.configfile import load_config
from trainguard.cli import main
from trainguard.install import DEFAULT_CONFIG, UNIT_SOURCE, Installer, dropins
from trainguard.reference import markdown

from .conftest import REPO, require, require_root, require_tool

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
    stop = tmp_path / "etc/trainguard/stop"  # the operator's kill switches, the default jobs.stop_dir
    assert stat.S_IMODE(stop.stat().st_mode) == 0o750 and f"created {stop} (mode 0750" in out
    assert load_config(str(config)).jobs.stop_dir == Path("/") / stop.relative_to(tmp_path)
    assert f"(`trainguard` below is {sys.executable} -m trainguard)" in out  # how to call it, not a bare name
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


def test_a_failed_step_says_what_was_and_was_not_done(tmp_path: Path, capsys: object) -> None:
    """The unit is written first, so a later failure leaves a unit `systemctl enable` finds; the failure is one line."""
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/trainguard").write_text("")  # a file where the config directory goes
    assert main(["install", "--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err  # type: ignore[attr-defined]
    unit = tmp_path / "etc/systemd/system/trainguard.service"
    config = tmp_path / "etc/trainguard/trainguard.toml"
    assert unit.exists() and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"trainguard install: {config}: [Errno 17] File exists") and \
        f"; done: wrote {unit} (ExecStart=" in err and err.rstrip().endswith(
            f"; not done: {config}, systemctl daemon-reload"), err


def test_the_service_user_joins_a_group_that_outlived_a_purge() -> None:
    """userdel keeps a group that still has members (an operator added for the control socket): the next install
    makes the user in that group instead of failing with `useradd exited 9: group exists`."""
    require_root()
    require_tool("useradd")
    name = "tg-install-test"  # a throwaway name: the host's own trainguard user is not touched
    cleanup = (["userdel", name], ["groupdel", name])
    for argv in cleanup:
        subprocess.run(argv, capture_output=True, timeout=30)
    try:
        subprocess.run(["groupadd", "--system", name], check=True, capture_output=True, timeout=30)
        installer = Installer(user=name)
        installer.ensure_user()
        assert installer.done == [f"created system user {name} in the existing group {name}"]
        assert pwd.getpwnam(name).pw_gid == grp.getgrnam(name).gr_gid
        installer.ensure_user()  # installing twice changes nothing
        assert installer.done[-1] == f"user {name} exists"
    finally:
        for argv in cleanup:
            subprocess.run(argv, capture_output=True, timeout=30)


def test_install_and_purge_through_the_path_link(tmp_path: Path) -> None:
    """Called through /usr/local/bin/trainguard (the link install.md makes), install writes the script itself into
    ExecStart, not the link; uninstall keeps the link (it still runs `uninstall --purge`), a purge removes it, and a
    second purge finds nothing to disable and says so quietly."""
    script = Path(sys.executable).parent / "trainguard"
    require(script.is_file() and not script.is_symlink(), f"needs the trainguard script at {script}")
    link = tmp_path / "usr/local/bin/trainguard"
    link.parent.mkdir(parents=True)
    link.symlink_to(script)

    def run(program: Path, *args: str) -> str:
        proc = subprocess.run([str(program), *args, "--root", str(tmp_path)], capture_output=True, text=True,
                              timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert proc.returncode == 0 and proc.stderr == "", proc.stdout + proc.stderr
        return proc.stdout

    out = run(link, "install", "--dropin", "switch-files")
    unit = tmp_path / "etc/systemd/system/trainguard.service"
    assert f"ExecStart={script} run --config" in unit.read_text() and f"(ExecStart={script})" in out
    assert f"(`trainguard` below is {script}" in out
    run(link, "uninstall")
    assert link.is_symlink() and not unit.exists()
    out = run(link, "uninstall", "--purge")
    assert f"{unit} is not installed" in out and "systemctl" not in out
    assert f"removed {link} (the link to {script})" in out and not link.is_symlink()
    link.symlink_to("/bin/true")  # not this trainguard: kept, and said
    assert f"kept {link}: it links to /bin/true, not to this trainguard ({script})" in run(script, "uninstall",
                                                                                         "--purge")
    assert link.is_symlink()


def test_an_unknown_dropin_is_refused_before_anything_is_written(tmp_path: Path, capsys: object) -> None:
    assert main(["install", "--root", str(tmp_path), "--dropin", "ptrace"]) == 1
    err = capsys.readouterr().err  # type: ignore[attr-defined]
    assert "no drop-in named ptrace (shipped: native-stacks, run-as-root, switch-files)" in err
    assert list(tmp_path.iterdir()) == []


def test_shipped_default_config_is_valid() -> None:
    config = load_config(str(DEFAULT_CONFIG))
    assert set(config.checks) == {"disk", "memory", "gpu", "nvlink", "pcie", "gpu_config", "fabric", "infiniband", "xid",
                                  "kernel", "hang", "training_log", "job_pace", "job_memory", "job_timelimit", "node_drain",
                                  "job_switch"}
    assert list(config.notifiers) == ["console"]


def test_configuration_reference_matches_the_code() -> None:
    doc = REPO / "docs" / "configuration.md"
    assert doc.read_text() == markdown(), "docs/configuration.md drifted: run `trainguard config-reference > " \
                                          "docs/configuration.md`"
    for kind in ("disk", "hang", "training_log", "slack", "requeue"):  # every registered type is documented
        assert f'type = "{kind}"' in doc.read_text()


def _documented_defaults(doc: str) -> dict[str, dict[str, str]]:
    """{table title: {key: default cell}} from the generated reference's tables."""
    tables: dict[str, dict[str, str]] = {}
    title = ""
    for line in doc.splitlines():
        if line.startswith("### `"):
            title = line.removeprefix("### `").removesuffix("`")
            tables[title] = {}
        elif title and line.startswith("| `"):
            cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            tables[title][cells[0].strip("`")] = cells[2]
    return tables


def test_configuration_reference_shows_each_types_effective_defaults() -> None:
    """For every registered check, action and notifier type, the default a reader finds (the type's own row, else
    the common table's) is what that type really uses: read back through the type's own field, so "30s" must
    validate to the value Slack's group_window defaults to, and so on."""
    from pydantic import TypeAdapter
    from pydantic_core import PydanticUndefined

    from trainguard.registry import DEFAULT_REGISTRY as R

    tables = _documented_defaults((REPO / "docs" / "configuration.md").read_text())
    checked = 0
    for section, kinds, lookup in (("checks", R.checks, R.check_class), ("actions", R.actions, R.action_class),
                                   ("notifiers", R.notifiers, R.notifier_class)):
        for kind in kinds:
            own, common = tables[f'{section}.NAME (type = "{kind}")'], tables[f"{section}.NAME"]
            for name, info in lookup(kind).Settings.model_fields.items():
                key = info.alias or name
                cell = own.get(key, common.get(key))
                assert cell is not None, f"{section} type {kind}: key {key} is not documented"
                extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
                if cell in ("required", "") or "default_doc" in extra or (info.default is PydanticUndefined \
                        and info.default_factory is None):
                    continue
                annotation = typing.Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
                documented = TypeAdapter(annotation).validate_python(json.loads(cell.strip("`")))
                assert documented == info.get_default(call_default_factory=True), \
                    f"{section} type {kind}: {key} documented as {cell}, really {info.get_default()!r}"
                checked += 1
    assert checked > 200
    assert tables['notifiers.NAME (type = "slack")']["group_window"] == '`"30s"`'
    assert tables['actions.NAME (type = "requeue")']["timeout"] == '`"330s"`'
