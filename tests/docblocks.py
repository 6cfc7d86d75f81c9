"""The fenced blocks of the docs, and how the suite runs each shell line of the pages a newcomer follows (PAGES):
tests/test_docs.py runs the `trainguard ...` commands and dry-runs the `make` targets; tests/test_systemd.py runs
the node's commands (systemctl, journalctl, curl, the venv, the link) in a real systemd with the wheel installed, in
the order a reader follows them. A block that only illustrates (a fragment, output, a command for another machine)
carries `<!-- illustrative: why -->` on the line before it; on PAGES the reason is required.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^<!-- illustrative(?::\s*(?P<reason>.+?))?\s*-->$")
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
PAGES = [REPO / "README.md", REPO / "docs/install.md", REPO / "docs/operations.md", REPO / "docs/slurm.md"]
FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<lang>[\w-]*)[ ]*\n(?P<body>.*?)^(?P=indent)```[ ]*$", re.M | re.S)
SHELLS = ("sh", "shell", "bash", "console")
CONTROL = ("||", "&&", "|", ";", ">", ">>", "2>&1")
# The spellings of the trainguard command in the docs: on PATH (install.md links it), in a checkout, in /opt.
COMMAND = re.compile(r"^(?:exec\s+)?(?:trainguard|\.venv/bin/trainguard|/opt/trainguard/bin/trainguard)(?:\s|$)")
# What the systemd container runs, of the pages about the installed node (the venv, the link, the unit, the journal,
# the endpoint, the operator's group, and `trainguard` through the link).
NODE_PAGES = ("docs/install.md", "docs/operations.md", "README.md")
NODE_COMMAND = re.compile(r"^(?:python3 -m venv /opt/trainguard\b|/opt/trainguard/bin/pip\s|ln -s /opt/trainguard/|"
                          r"/opt/trainguard/bin/trainguard install\b|(?:systemctl|journalctl|curl|usermod|useradd|trainguard)\s)")
MAKE = re.compile(r"^make ([\w-]+)$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    body: str
    illustrative: bool
    reason: str | None = None  # why an illustrative block does not run

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    @property
    def page(self) -> str:
        return self.path.relative_to(REPO).as_posix()


def blocks(paths: list[Path] | None = None) -> Iterator[Block]:
    for path in paths or DOCS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            before = text[:m.start()].rstrip().rsplit("\n", 1)[-1].strip()
            body = "\n".join(line[len(m["indent"]):] for line in m["body"].splitlines())
            marker = MARKER.match(before)
            yield Block(path, text.count("\n", 0, m.start()) + 1, m["lang"], body, marker is not None,
                        marker["reason"] if marker else None)


def shell_lines(paths: list[Path] | None = None) -> Iterator[tuple[Block, str]]:
    """Each command line of the shell blocks that are not illustrative, without its trailing comment."""
    for block in blocks(paths):
        if block.illustrative or block.lang not in SHELLS:
            continue
        for raw in block.body.splitlines():
            line = raw.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                yield block, line


def runner(block: Block, line: str) -> str | None:
    """Which part of the suite runs a shell line of PAGES: "systemd" (the container walk), "trainguard"
    (tests/test_docs.py against a test agent), "make" (a dry run of the target), or None: not run."""
    if block.page in NODE_PAGES and NODE_COMMAND.match(line):
        return "systemd"
    if COMMAND.match(line):
        return "trainguard"
    if MAKE.match(line):
        return "make"
    return None


def node_walk() -> tuple[Block, list[str]]:
    """install.md's install block (run as the node's first step), then every other line the container runs, in the
    order a reader meets them: install.md, operations.md, then README's (its quick start's agent answers as the
    service does)."""
    lines = [(b, line) for b, line in shell_lines([REPO / p for p in NODE_PAGES]) if runner(b, line) == "systemd"]
    install = next(b for b, line in lines if re.match(r"^/opt/trainguard/bin/trainguard install\b", line))
    return install, [line for b, line in lines if b != install]


def commands() -> Iterator[tuple[Block, list[str]]]:
    """Each `trainguard ...` command line of the shell blocks (a `$ ` prompt marks one in an output block)."""
    for block in blocks():
        if block.illustrative or block.lang not in (*SHELLS, ""):
            continue
        for line in block.body.splitlines():
            if block.lang == "" and not line.startswith("$ "):
                continue
            command = line.removeprefix("$ ").split(" #", 1)[0].strip()
            if COMMAND.match(command):
                argv = shlex.split(command)  # the trainguard command itself, up to a `|| true` or `&& ...` after it
                cut = next((i for i, word in enumerate(argv) if word in CONTROL), len(argv))
                yield block, argv[:cut]
