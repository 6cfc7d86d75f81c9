"""The docs a newcomer follows do what they say: every TOML block validates as `trainguard validate` would, every
`trainguard ...` command of a shell block runs (against a test agent, with the paths the docs name mapped into a
staged install), every repo path they name exists or `trainguard install` creates it, and the generated tables are
the code's.

A block that only illustrates (a fragment, output, a command for another machine) carries the marker
`<!-- illustrative: why -->` on the line before it. On the pages a newcomer follows (README, install.md,
operations.md, slurm.md) every other shell line runs in the suite (tests/docblocks.py says where): a doc that
drifts from the product fails.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import requests

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from tests.conftest import REPO, AgentProcess, free_port, http_get, require_tool, wait_until
from tests.docblocks import DOCS, MAKE, PAGES, SHELLS, blocks, commands, node_walk, runner, shell_lines
from tests.peers import slack_emulator
from trainguard.agent.configfile import parse_config
from trainguard.cli import main
from trainguard.install import Installer
from trainguard.reference import XID_BEGIN, XID_END, xid_markdown


def test_the_docs_have_blocks_of_each_kind() -> None:
    """The scan itself works: the blocks this test is about are found (a broken pattern would pass everything)."""
    found = list(blocks())
    assert sum(b.lang == "toml" for b in found) >= 14
    assert len(list(commands())) >= 6
    assert any(b.illustrative for b in found)


def test_every_shell_line_of_the_pages_runs_or_says_why_not() -> None:
    """Each command line of a shell block on README, install.md, operations.md and slurm.md is run by the suite
    (tests/docblocks.py's `runner`: the systemd container, a test agent, a make dry run); a block that cannot run
    (another machine's hardware, a package index, a destructive step) is marked illustrative with its reason."""
    unrun = [f"{b.where}: {line}" for b, line in shell_lines(PAGES) if runner(b, line) is None]
    assert not unrun, "shell lines no test runs: run them, or mark the block <!-- illustrative: why -->\n" + \
        "\n".join(unrun)
    unexplained = [b.where for b in blocks(PAGES) if b.illustrative and b.lang in SHELLS and not b.reason]
    assert not unexplained, f"illustrative without a reason: {unexplained}"
    kinds = [runner(b, line) for b, line in shell_lines(PAGES)]
    install, walk = node_walk()
    assert install.page == "docs/install.md" and len(walk) >= 9 and kinds.count("trainguard") >= 3, (kinds, walk)


def test_the_documented_make_targets_exist() -> None:
    """`make run`, `make test`, `make wheelhouse` as the docs write them: each target exists and its recipe expands
    (a dry run: `make test` is this suite, `make run` an agent in the foreground; tests/test_packaging.py runs
    `make wheelhouse` for real)."""
    make = require_tool("make")
    targets = [m[1] for b, line in shell_lines(PAGES) if (m := MAKE.match(line))]
    assert {"run", "test", "wheelhouse"} <= set(targets), targets
    for target in targets:
        proc = subprocess.run([make, "-n", "-C", str(REPO), target], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"make {target}: {proc.stderr}"


def _stand_ins(body: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Secrets an example names by file or variable exist on the node it is for: stand-ins here, so that the
    example's own keys are what is validated."""
    for i, m in enumerate(re.finditer(r'^(\w+)_file\s*=\s*"([^"]+)"', body, re.M)):
        stand_in = tmp_path / f"secret-{i}"
        stand_in.write_text("https://hooks.example.org/stand-in\n")
        stand_in.chmod(0o600)
        body = body.replace(f'"{m[2]}"', f'"{stand_in}"', 1)
    for m in re.finditer(r'^\w+_env\s*=\s*"([^"]+)"', body, re.M):
        monkeypatch.setenv(m[1], "https://hooks.example.org/stand-in")
    return body


def test_every_toml_block_validates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    problems = []
    checked = 0
    for block in blocks():
        if block.lang != "toml" or block.illustrative:
            continue
        try:
            parse_config(tomllib.loads(_stand_ins(block.body, tmp_path, monkeypatch)), block.where)
            checked += 1
        except Exception as exc:  # noqa: BLE001 - every broken block is reported, not only the first
            problems.append(f"{block.where}: {exc}")
    assert not problems, "\n".join(problems)
    assert checked >= 14


@pytest.fixture
def staged(tmp_path: Path) -> Path:
    """What `trainguard install` writes, under a staging root: the docs' absolute paths are looked up here."""
    root = tmp_path / "root"
    Installer(root, with_dropins=("switch-files", "native-stacks", "run-as-root")).install()
    # The configs the docs show by their path (`# /etc/trainguard/prolog.toml`), with a state dir of the test's own.
    for block in blocks():
        named = re.match(r"# (/etc/trainguard/[\w-]+\.toml)\n", block.body)
        if block.lang == "toml" and named and not block.illustrative:
            body = block.body if "\n[agent]\n" in block.body else f"{block.body}\n[agent]\n"
            state = tmp_path / "state" / Path(named[1]).stem
            (root / named[1].lstrip("/")).write_text(body.replace("\n[agent]\n", f'\n[agent]\nstate_dir = "{state}"\n', 1))
    return root


def _mapped(argv: list[str], root: Path) -> list[str]:
    """The command as the docs write it, run here: their /etc/trainguard is the staged one, install is staged."""
    argv = argv[1:] if argv[0] == "exec" else argv
    args = [a.replace("/etc/trainguard/", f"{root}/etc/trainguard/") for a in argv[1:]]
    if args and args[0] in ("install", "uninstall"):
        args += ["--root", str(root)]
    return args


def _serving(url: str) -> bool:
    try:
        return http_get(url).status_code == 200
    except requests.RequestException:  # not listening yet
        return False


def test_every_documented_trainguard_command_runs(tmp_path: Path, staged: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Each command against a running test agent: a config error, a usage error or an unreachable agent fails it.
    `check` may exit with any status code (that is its answer), every other command must exit 0."""
    port = free_port()
    with slack_emulator() as slack:
        config = tmp_path / "agent.toml"
        config.write_text(f'[agent]\nstate_dir = "{tmp_path}/state"\nlisten = "127.0.0.1:{port}"\n'
                          f'control_socket = "{tmp_path}/state/control.sock"\n[jobs]\nsources = []\n'
                          '[checks.memory]\n[notifiers.console]\n'
                          f'[notifiers.slack]\nwebhook_url = "{slack.url}"\ngroup_window = "0s"\n')  # selftest waits for it
        config.chmod(0o600)
        # The staged install's config is the one the docs validate; the agent the docs talk to runs on `config`.
        monkeypatch.setenv("TRAINGUARD_CONFIG", str(config))
        agent = AgentProcess(config, tmp_path / "agent.log").start()
        try:
            wait_until(lambda: _serving(f"http://127.0.0.1:{port}/healthz"), 20, what="the test agent")
            failures = []
            for block, argv in commands():
                args = _mapped(argv, staged)
                try:
                    code = main(args)
                except SystemExit as exc:  # argparse: a usage error
                    code = exc.code if isinstance(exc.code, int) else 2
                allowed = {0, 1, 2, 3} if args[0] == "check" else {0}
                if code not in allowed:
                    failures.append(f"{block.where}: {shlex.join(argv)} exited {code}: {capsys.readouterr().err}")
        finally:
            agent.stop()
    assert not failures, "\n".join(failures)


# Files the docs name that the operator creates (secrets, extra configs), not the repository or `trainguard install`.
OPERATOR_FILES = re.compile(r"^/etc/trainguard/(\S+-(url|password|hmac|webhook)|healthcheck\.toml|prolog\.toml)$"
                            r"|^/etc/systemd/system/trainguard\.service\.d/no-ptrace\.conf$")
REPO_PATH = re.compile(r"`((?:docs|deploy|systemd|examples|trainguard|tests|benchmarks)/[\w./-]+)`")
INSTALLED_PATH = re.compile(r"(?<![\w.])(/etc/trainguard(?:/[\w.-]+)*|/etc/systemd/system/trainguard[\w./-]*)")
LINK = re.compile(r"\]\((?!https?://|#|mailto:)([^)#\s]+)")


def test_every_path_the_docs_name_exists_or_is_installed(staged: Path) -> None:
    missing = []
    for path in DOCS:
        text = path.read_text()
        for m in LINK.finditer(text):
            if not (path.parent / m[1]).exists():
                missing.append(f"{path.relative_to(REPO)}: link {m[1]}")
        for m in REPO_PATH.finditer(text):
            if "NAME" not in m[1] and not (REPO / m[1].rstrip(".")).exists():
                missing.append(f"{path.relative_to(REPO)}: {m[1]}")
        for m in INSTALLED_PATH.finditer(text):
            name = m[1].rstrip(".")
            if "NAME" in name or OPERATOR_FILES.match(name):
                continue
            if not (staged / name.lstrip("/")).exists():
                missing.append(f"{path.relative_to(REPO)}: {name} (not created by `trainguard install`)")
    assert not missing, "\n".join(missing)


def test_the_xid_runbook_table_is_the_catalogs() -> None:
    """runbooks/gpu-xid.md grades each XID as the default xid check does: its table is generated."""
    text = (REPO / "docs/runbooks/gpu-xid.md").read_text()
    assert XID_BEGIN in text and XID_END in text
    table = text[text.index(XID_BEGIN):text.index(XID_END) + len(XID_END)] + "\n"
    assert table == xid_markdown(), "docs/runbooks/gpu-xid.md's XID table drifted: paste `trainguard xid --markdown`"
    row = next(line for line in table.splitlines() if line.startswith("| `restart_app`")).split(" | ")
    codes = {code for part in row[3].strip(" |").split(", ")
             for lo, _, hi in [part.partition("-")] for code in range(int(lo), int(hi or lo) + 1)}
    assert row[1].startswith("WARNING") and {13, 31, 69, 94} <= codes and not {43, 63, 79} & codes  # issue 27's


def test_the_readme_lists_every_command() -> None:
    """README's command table names each command of `trainguard --help`, and no other."""
    import argparse

    from trainguard.cli import _parser

    [sub] = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    table = (REPO / "README.md").read_text().split("\n## Commands\n", 1)[1].strip().split("\n\n", 1)[0]
    cells = [row.split(" | ", 1)[0] for row in table.splitlines() if row.startswith("| `")]
    listed = {name for cell in cells for name in re.findall(r"`(?:trainguard )?([a-z][\w-]*)", cell)}
    assert listed == set(sub.choices), listed ^ set(sub.choices)


def test_the_documented_prolog_config_calls_no_slurm_command(tmp_path: Path) -> None:
    """A prolog that calls SLURM can deadlock slurmd (docs/slurm.md says so): the prolog gate with the config it
    recommends runs without a single scontrol, squeue, sinfo or sacct, on a node where they are installed."""
    text = (REPO / "docs" / "slurm.md").read_text()
    block = re.search(r"```toml\n(# /etc/trainguard/prolog\.toml\n.*?)```", text, re.S)
    assert block is not None, "the prolog config block in docs/slurm.md"
    calls, bin_dir = tmp_path / "calls", tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("scontrol", "squeue", "sinfo", "sacct", "scancel"):
        fake = bin_dir / tool
        fake.write_text(f'#!/bin/sh\necho "{tool} $*" >> {calls}\nexit 1\n')
        fake.chmod(0o755)
    config = tmp_path / "prolog.toml"
    config.write_text(block.group(1).replace('[agent]\n', f'[agent]\nstate_dir = "{tmp_path / "state"}"\n', 1))
    proc = subprocess.run([sys.executable, "-m", "trainguard", "slurm-prolog", "--check", "--config", str(config),
                           "--dir", str(tmp_path / "jobs"), "--gate-dir", str(tmp_path / "gates")],
                          capture_output=True, text=True, timeout=60, cwd=REPO,
                          env={**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}", "SLURM_JOB_ID": "7"})
    assert proc.returncode in (0, 2), proc.stderr[-2000:]
    assert (tmp_path / "jobs" / "7.json").exists() and (tmp_path / "gates" / "prolog.json").exists(), proc.stderr
    assert not calls.exists(), calls.read_text()
