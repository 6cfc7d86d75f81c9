"""What operators deploy next to the agent: Prometheus alert rules (promtool's own checks and unit tests) and the
Grafana dashboard, every panel query run through a real Prometheus scraping a real agent."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from trainguard.reference import declared_metrics
from trainguard.registry import DEFAULT_REGISTRY

from .conftest import REPO, AgentProcess, free_port, require_tool, unique_bus, wait_until
from .peers import prometheus_query, prometheus_server
from .slurm_cluster import SlurmCluster

RULES = REPO / "deploy" / "prometheus" / "trainguard-rules.yml"
RULE_TESTS = REPO / "deploy" / "prometheus" / "trainguard-rules.test.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "trainguard.json"
IB_TREE = REPO / "tests" / "data" / "infiniband" / "sys-class-infiniband-h100"  # a real tree, read-only


def alerts() -> list[dict[str, Any]]:
    """The alerting rules (the recording rules beside them feed the straggler alert)."""
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


def test_rules_pass_promtool_check_and_unit_tests() -> None:
    promtool = require_tool("promtool")
    for args in (["check", "rules", str(RULES)], ["test", "rules", str(RULE_TESTS)]):
        proc = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=120, cwd=RULES.parent)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_alert_is_unit_tested_and_has_its_runbook() -> None:
    tested = {case["alertname"] for group in yaml.safe_load(RULE_TESTS.read_text())["tests"]
              for case in group["alert_rule_test"] if case.get("exp_alerts")}
    for rule in alerts():
        assert rule["alert"] in tested, f"{rule['alert']} has no promtool test that fires it"
        notes = rule["annotations"]
        assert notes["summary"] and notes["description"], rule["alert"]
        page = re.fullmatch(r"https://github\.com/trainguard/trainguard/blob/main/(docs/runbooks/[\w-]+\.md)",
                            notes["runbook_url"])
        assert page and (REPO / page.group(1)).is_file(), f"{rule['alert']}: runbook {notes['runbook_url']} missing"


def test_incident_alerts_follow_the_agents_incidents_for_every_check_type() -> None:
    """No second hysteresis in Prometheus: an incident rule reads trainguard_incident_firing and has no `for:`;
    every check type has a rule, so nothing the agent fires is missing from the fleet view."""
    covered: set[str] = set()
    for rule in alerts():
        if "trainguard_check_status" in rule["expr"]:
            pytest.fail(f"{rule['alert']} re-derives incidents from trainguard_check_status: {rule['expr']}")
        if "trainguard_incident_firing" in rule["expr"]:
            assert "for" not in rule, f"{rule['alert']} adds its own `for:` to the agent's incident"
            sel = re.search(r'type=~?"([^"]+)"', rule["expr"])
            covered |= set(sel.group(1).split("|")) if sel else set(DEFAULT_REGISTRY.checks)
    assert set(DEFAULT_REGISTRY.checks) <= covered, f"no alert rule for {set(DEFAULT_REGISTRY.checks) - covered}"


def panel_queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] if p["type"] != "row" for t in p["targets"]]


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[int], str]]:
    with contextlib.ExitStack() as stack:
        yield lambda target_port: stack.enter_context(prometheus_server(tmp_path, target_port, RULES))


query = prometheus_query


def test_every_dashboard_panel_returns_data_from_a_real_prometheus(
        slurm: SlurmCluster, tmp_path: Path, kmsg: Any, prometheus: Callable[[int], str],
        agent_process: Callable[..., AgentProcess]) -> None:
    name = f"tg-dash-{uuid.uuid4().hex[:6]}"
    workdir = slurm.workdir()
    job_id = slurm.submit(slurm.toy_command("--steps", "100000", "--step-time", "0.2", "--ckpt-dir",
                                            f"{workdir}/ckpt"), "--time=30", workdir=workdir, name=name)
    slurm.wait_state(job_id, ("RUNNING",))
    port = free_port()
    fast = 'interval = "1s"\njitter = "0s"\n'
    config = tmp_path / "trainguard.toml"
    config.write_text(f"""
[agent]
state_dir = "{tmp_path / 'state'}"
listen = "127.0.0.1:{port}"
[jobs]
sources = ["slurm"]
refresh = "0s"
[checks.disk]
{fast}paths = ["/", "{tmp_path}"]
forecast_min_span = "3s"
[checks.memory]
{fast}[checks.gpu]
{fast}[checks.gpu_memory]
{fast}min_span = "3s"
[checks.xid]
actions = {{ critical = [], warning = [] }}
[checks.kernel]
{fast}actions = {{ critical = [] }}
[checks.nvlink]
{fast}[checks.pcie]
{fast}[checks.gpu_config]
{fast}[checks.fabric]
{fast}[checks.infiniband]
{fast}sysfs_root = "{IB_TREE}"
actions = {{ critical = [] }}
[checks.alive]
{fast}type = "job_liveness"
names = ["{name}"]
[checks.hang]
{fast}[checks.job_memory]
{fast}min_span = "3s"
[checks.job_timelimit]
{fast}[checks.training_log]
{fast}[notifiers.console]
""")
    agent = agent_process(config, module="tests.helpers.fake_gpu_agent")
    agent.wait_for("check=xid", timeout=30)
    kmsg.write("NVRM: Xid (PCI:0000:18:00): 31, pid=4242, name=python, Ch 00000010, intr 10000000. MMU Fault "
               "[trainguard-test]")
    kmsg.write(f"nvidia-nvswitch0: SXid (PCI:{unique_bus()}.0): 20001, Non-fatal, Link 7 TX Replay Error [trainguard-test]")
    server = f"tg-dash-{uuid.uuid4().hex[:8]}"  # the kernel events row: an event, then its clear (nothing left active)
    kmsg.write(f"nfs: server {server} not responding, still trying")
    kmsg.write(f"nfs: server {server} OK")
    url = prometheus(port)
    wait_until(lambda: query(url, 'trainguard_check_status{type="hang"}'), 30, what="a scrape with job results")
    try:
        wait_until(lambda: all(query(url, e.replace("$node", ".*").replace("$job", ".*")
                                     .replace("$__rate_interval", "30s")) for _, e in panel_queries()), 40,
                   interval=1, what="data for every panel")
    except AssertionError:
        pass  # the loop below names the panels without data
    empty = [f"{title!r}: {concrete}" for title, expr in panel_queries()
             if not query(url, concrete := expr.replace("$node", ".*").replace("$job", ".*")
                          .replace("$__rate_interval", "30s"))]
    assert not empty, "panels without data:\n" + "\n".join(empty) + "\n" + agent.output()[-3000:]
    dash = json.loads(DASHBOARD.read_text())
    for var in dash["templating"]["list"]:
        if var["type"] == "query":  # label_values(metric, label): the variables list something
            m = re.fullmatch(r"label_values\((.+), (\w+)\)", var["query"]["query"])
            assert m, var
            values = {s["metric"].get(m.group(2)) for s in query(url, m.group(1).replace("$node", ".*"))}
            assert values - {None}, f"variable {var['name']} lists nothing"
    assert job_id in {s["metric"].get("job_id") for s in query(url, "trainguard_job_hung")}
    exported = {s["metric"]["__name__"] for s in query(url, '{__name__=~"trainguard_.+"}')}
    declared = {m.name for metrics in declared_metrics().values() for m in metrics}
    assert exported - declared == set(), f"exported but not declared (docs/metrics.md): {sorted(exported - declared)}"
