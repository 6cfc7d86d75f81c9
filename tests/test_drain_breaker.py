"""The drain circuit breaker on the test SLURM cluster: its `fleet` partition holds this node and 19 declared nodes
that never register (they can be drained and undrained all the same). With 10% of 20, trainguard may hold two nodes
drained; a third drain is refused, says why, and stays an open CRITICAL fault until someone acts."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.actions.slurmctl import DrainSettings, partition_view
from trainguard.core.model import Status
from trainguard.pipeline.engine import Engine
from trainguard.pipeline.selfcheck import NAME as SELF_NAME

from .slurm_cluster import SlurmCluster, sh
from .test_slurm_jobs import engine_for, engines, event, run_action

__all__ = ["engines"]  # the fixture, imported for this module's tests
GHOSTS = [f"tg-ghost{i:02d}" for i in range(1, 20)]


def test_a_third_drain_of_the_partition_is_refused_and_stays_a_critical_fault(
        slurm: SlurmCluster, tmp_path: Path, engines: list[Engine]) -> None:
    engine = Engine(engine_for(slurm, tmp_path, {}).config, self_check=True)  # with the agent's own check
    engines.append(engine)
    try:
        for ghost in GHOSTS[:2]:
            sh("scontrol", "update", f"nodename={ghost}", "state=drain", "reason=trainguard: XID 79 earlier")
        sh("scontrol", "update", f"nodename={GHOSTS[2]}", "state=drain", "reason=admin: fan replacement")  # not ours
        fault = event(summary="GPU 3 fell off the bus (XID 79)")
        record = run_action(engine, "drain", fault, ())
        assert record["outcome"] == "refused", record
        assert record["detail"].startswith("drain refused: 2 of 20 nodes of partition debug,fleet already drained "
                                           "by trainguard (tg-ghost01, tg-ghost02; max_drained 10%)"), record
        assert "DRAIN" not in slurm.node_info()["State"]
        [refusal] = engine.responder.refused()
        assert refusal["incident"] == fault.incident_id and refusal["action"] == "drain"
        # The agent's own check turns it into a CRITICAL incident of its own.
        [result] = [r for r in engine.checks[SELF_NAME].run() if r.subject.startswith("refused:")]
        assert result.status is Status.CRITICAL and result.subject == "refused:drain:test/subject"
        assert result.summary == record["detail"]

        sh("scontrol", "update", f"nodename={GHOSTS[1]}", "state=undrain")  # one of ours back: room for this one
        record = run_action(engine, "drain", fault, ())
        assert record["outcome"] == "ok", record
        assert "DRAIN" in slurm.node_info()["State"]
        assert engine.responder.refused() == []  # done after all
        again = run_action(engine, "drain", event(summary="GPU 3 lost (gpu check)"), ())  # the same fault's 2nd
        assert again["outcome"] == "skipped" and "already drained by trainguard" in again["detail"], again
        assert "XID 79" in slurm.node_info()["Reason"]  # the first reason stands
    finally:
        for ghost in GHOSTS[:3]:
            sh("scontrol", "update", f"nodename={ghost}", "state=undrain", check=False)
        slurm.resume_node()


def test_partition_view_reads_sinfo_as_slurm_prints_it() -> None:
    # Captured from this cluster: `sinfo -h -N -o '%N|%P|%T|%E'` (SLURM 22.05.8) after draining tg-ghost01 with our
    # reason and tg-ghost03 with an administrator's; a reason is free text and may hold the separator.
    out = ("node1|debug*|idle|none\nnode1|fleet|idle|none\ntg-ghost01|fleet|drained*|trainguard: XID 79 | GPU 3\n"
           "tg-ghost02|fleet|down*|Not responding\ntg-ghost03|fleet|drained*|admin: fan replacement\n"
           "other|gpu|drained|trainguard: elsewhere\n")
    view = partition_view(out, "node1")
    assert view.nodes == 4 and view.drained == ("tg-ghost01",) and view.partitions == ("debug", "fleet")
    assert partition_view("garbage\n|||\n", "node1").nodes == 1  # nothing known: this node alone
    assert view.own == "" and partition_view(out, "tg-ghost01").own == "trainguard: XID 79 | GPU 3"
    assert partition_view(out, "tg-ghost03").own == ""  # an administrator's drain is theirs


@pytest.mark.parametrize(("limit", "nodes", "allowed"), [("10%", 20, 2), ("10%", 3, 1), ("4", 64, 4), ("0", 9, 0)])
def test_max_drained_is_a_count_or_a_share_of_at_least_one_node(limit: str, nodes: int, allowed: int) -> None:
    assert DrainSettings(max_drained=limit).limit(nodes) == allowed


def test_max_drained_rejects_what_is_neither() -> None:
    with pytest.raises(ValueError, match="max_drained '1/2': expected a count"):
        DrainSettings(max_drained="1/2")
