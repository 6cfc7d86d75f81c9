"""The wheel is all a node needs: built from the checkout (sdist, then the wheel from the sdist, as `python -m build`
does), it carries the unit, its drop-ins, the default config and the XID catalog, and `trainguard install` runs from
it without the source tree. The version is said in one place."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from tests.packaging import Dists, build, copy_checkout
from trainguard import __version__
from trainguard.install import DEFAULT_CONFIG, dropins

from .conftest import REPO, require_tool


def package_files() -> list[str]:
    """Every file of the package in the checkout, as the wheel names it (through the systemd/ link)."""
    found = []
    for top, dirs, files in os.walk(REPO / "trainguard", followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        found += [Path(top, f).relative_to(REPO).as_posix() for f in files]
    return sorted(found)


def test_the_wheel_carries_everything_install_needs(dists: Dists) -> None:
    with zipfile.ZipFile(dists.wheel) as whl:
        names = set(whl.namelist())
        assert set(package_files()) <= names, set(package_files()) - names
        shipped = sorted(n for n in names if n.startswith("trainguard/systemd/"))
        assert shipped == sorted(f"trainguard/systemd/{p.name}" for p in (REPO / "systemd").iterdir())
        for name in shipped:  # byte for byte the checkout's top-level systemd/ files
            assert whl.read(name) == (REPO / "systemd" / Path(name).name).read_bytes(), name
        assert whl.read("trainguard/default.toml") == DEFAULT_CONFIG.read_bytes()
        for data in ("nvidia_xid_catalog.tsv", "nvidia_xid_nvlink5_decode.tsv", "xid_policy.toml", "sxid_catalog.toml"):
            assert whl.read(f"trainguard/gpu/{data}") == (REPO / "trainguard/gpu" / data).read_bytes(), data
        info = f"trainguard-{__version__}.dist-info"
        metadata = Parser().parsestr(whl.read(f"{info}/METADATA").decode())
        assert metadata["Version"] == __version__  # trainguard/__init__.py is the one place
        assert "trainguard = trainguard.cli:main" in whl.read(f"{info}/entry_points.txt").decode()


def test_the_sdist_builds_the_same_wheel(dists: Dists, tmp_path: Path) -> None:
    [direct] = build(copy_checkout(tmp_path / "src"), tmp_path / "direct", "--wheel")
    with zipfile.ZipFile(direct) as a, zipfile.ZipFile(dists.wheel) as b:
        assert sorted(a.namelist()) == sorted(b.namelist())
        different = [n for n in a.namelist() if a.read(n) != b.read(n)]
        assert different == [], different


def test_install_runs_from_the_wheel_alone(dists: Dists, tmp_path: Path) -> None:
    """The wheel unpacked somewhere else and imported from there (not from the checkout): install stages the unit,
    the drop-ins asked for and the config, all from the package data."""
    site = tmp_path / "site"
    with zipfile.ZipFile(dists.wheel) as whl:
        whl.extractall(site)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import trainguard, trainguard.cli\n"
            "assert trainguard.__file__.startswith(sys.argv[1]), trainguard.__file__\n"
            "sys.exit(trainguard.cli.main(sys.argv[2:]))")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", code, str(site), *args], capture_output=True, text=True,
                              timeout=60, cwd=tmp_path)

    version = cli("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"trainguard {__version__}", version.stderr
    staged = tmp_path / "root"
    proc = cli("install", "--root", str(staged), "--dropin", "switch-files", "--dropin", "native-stacks")
    assert proc.returncode == 0, proc.stderr
    etc = staged / "etc"
    assert "ExecStart=" in (etc / "systemd/system/trainguard.service").read_text()
    for name in ("switch-files", "native-stacks"):
        assert (etc / f"systemd/system/trainguard.service.d/{name}.conf").read_bytes() == dropins()[name].read_bytes()
    assert (etc / "trainguard/trainguard.toml").read_bytes() == DEFAULT_CONFIG.read_bytes()
    assert f"wrote {etc}/systemd/system/trainguard.service.d/switch-files.conf" in proc.stdout  # what it did
    assert "Next steps" in proc.stdout and "trainguard install --dropin NAME" in proc.stdout  # and what comes next


@pytest.mark.slow
def test_make_wheelhouse_installs_with_no_index(tmp_path: Path) -> None:
    """Air-gapped nodes (docs/install.md): `make wheelhouse` puts trainguard's wheel and its runtime dependencies (not
    the test extra) in one directory, and a fresh virtualenv installs from that directory alone, with pip's index
    and its configuration off, as install.md writes it; the installed trainguard then runs from its own package data.
    Making the wheelhouse needs the index (CI has it); installing from it does not."""
    make = require_tool("make")
    src = copy_checkout(tmp_path / "src")
    proc = subprocess.run([make, "-C", str(src), "wheelhouse", f"VENV={Path(sys.executable).parent.parent}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wheels = sorted(p.name for p in (src / "wheelhouse").iterdir())
    assert f"trainguard-{__version__}-py3-none-any.whl" in wheels
    assert {"psutil", "pydantic", "google_re2", "py_spy"} <= {w.split("-")[0] for w in wheels}, wheels
    assert not any(w.startswith(("pytest", "torch", "ruff", "build-")) for w in wheels), wheels  # runtime deps only
    venv = tmp_path / "opt-trainguard"
    offline = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {"PIP_CONFIG_FILE": os.devnull}
    for argv in ([sys.executable, "-m", "venv", str(venv)],
                 [str(venv / "bin/pip"), "install", "--quiet", "--no-index", "--find-links", str(src / "wheelhouse"),
                  "trainguard"],
                 [str(venv / "bin/trainguard"), "install", "--root", str(tmp_path / "stage")],
                 [str(venv / "bin/trainguard"), "validate", "--config", str(tmp_path / "stage/etc/trainguard/trainguard.toml")]):
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=offline, cwd=tmp_path)
        assert proc.returncode == 0, f"{' '.join(argv)}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    assert "config OK" in proc.stdout + proc.stderr
