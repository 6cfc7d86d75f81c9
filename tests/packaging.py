"""trainguard built as a packager builds it: `python -m build` makes the sdist from a copy of the checkout and then
the wheel from that sdist. Offline (--no-isolation: `build` and `setuptools` are test extras), so the tests need
no package index."""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Dists:
    sdist: Path
    wheel: Path  # built from the sdist


def copy_checkout(dst: Path) -> Path:
    """The checkout without what .gitignore ignores (a stale build/ would leak removed modules into a wheel);
    links stay links, as git keeps them."""
    ignored = [line.strip().rstrip("/") for line in (REPO / ".gitignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    shutil.copytree(REPO, dst, symlinks=True, ignore=shutil.ignore_patterns(".git", *ignored))
    return dst


def build(src: Path, out: Path, *only: str) -> list[Path]:
    """`python -m build` of `src` into `out` (`--wheel` or `--sdist` for one of them); the files it made."""
    proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", *only, "--outdir", str(out), str(src)],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"python -m build {' '.join(only)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return sorted(out.iterdir())


def build_dists(workdir: Path) -> Dists:
    made = build(copy_checkout(workdir / "src"), workdir / "dist")
    [sdist] = [p for p in made if p.name.endswith(".tar.gz")]
    [wheel] = [p for p in made if p.suffix == ".whl"]
    return Dists(sdist, wheel)
