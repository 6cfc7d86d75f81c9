"""The stack every end-to-end scenario runs on; each scenario prints its timeline."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.stack import Stack, Timeline
from tests.peers import alertmanager_server, slack_emulator, smtp_server
from tests.slurm_cluster import SlurmCluster


@pytest.fixture
def stack(slurm: SlurmCluster, tmp_path: Path, request: pytest.FixtureRequest,
          capsys: pytest.CaptureFixture[str]) -> Iterator[Stack]:
    with contextlib.ExitStack() as exits:
        slack = exits.enter_context(slack_emulator())
        mailbox, port, ca = exits.enter_context(smtp_server(tmp_path))
        alertmanager = exits.enter_context(alertmanager_server(tmp_path))
        timeline = Timeline(request.node.name)
        s = Stack(tmp_path, slurm, slack, mailbox, (port, ca), alertmanager, timeline, exits)
        try:
            yield s
        finally:
            s.close()
            (tmp_path / "timeline.txt").write_text(timeline.render() + "\n")
            with capsys.disabled():
                print("\n" + timeline.render())
