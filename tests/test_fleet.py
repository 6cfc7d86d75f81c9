"""A job that spans nodes, seen by one agent per node: three real agent processes with distinct node names on this
machine, one multi-node job (the same job id on each, as a run launched without a scheduler declares it), a real
Alertmanager running the shipped deploy/alertmanager config and the Slack emulator. A GPU that falls off the bus on
node 2 while the job hangs on nodes 1 and 3 is one Slack message, about node 2."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from .conftest import REPO, AgentProcess, wait_until, xid79
from .peers import SlackEmulator, alertmanager_alerts, alertmanager_server, slack_emulator

DEPLOY = REPO / "deploy" / "alertmanager"


def shipped_alertmanager(tmp_path: Path, slack: SlackEmulator) -> Path:
    """The shipped config as an operator installs it, with the test's paths and a short group_wait."""
    config = yaml.safe_load((DEPLOY / "alertmanager.yml").read_text())
    url_file = tmp_path / "slack-webhook-url"
    url_file.write_text(slack.url)
    url_file.chmod(0o600)
    config["receivers"][0]["slack_configs"][0]["api_url_file"] = str(url_file)
    config["templates"] = [str(DEPLOY / "trainguard.tmpl")]
    config["route"]["group_wait"] = "6s"  # 30s shipped: the same wait for the other nodes, scaled down
    path = tmp_path / "alertmanager.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def agent_config(tmp_path: Path, node: str, am: str, marker: str, log: Path, checks: dict[str, str]) -> Path:
    state = tmp_path / node
    state.mkdir()
    path = state / "trainguard.toml"
    path.write_text(f"""
[agent]
node_name = "{node}"
cluster = "c1"
state_dir = "{state}"
listen = ""
[jobs]
sources = []
refresh = "0s"
[jobs.processes.llm]
cmdline = "{marker}"
user = "root"
job_id = "7001"
logs = ["{log}"]
{''.join(f"[checks.{name}]{chr(10)}{body}{chr(10)}" for name, body in checks.items())}
[notifiers.am]
type = "alertmanager"
urls = ["{am}"]
resend_interval = "2s"
""")
    return path


def test_a_gpu_lost_on_one_node_of_a_job_is_one_slack_message_naming_that_node(
        tmp_path: Path, kmsg: Any, agent_process: Callable[..., AgentProcess], children: list[subprocess.Popen[str]],
) -> None:
    marker = f"fleet-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "train.log"
    # The job's rank on every node: one step logged, then stuck (as ranks waiting on a collective that never ends).
    children.append(subprocess.Popen([sys.executable, "-c", f"import time\nopen({str(log)!r}, 'a').write('step 1\\n')\n"
                                      "time.sleep(600)", marker], text=True))
    hang = 'interval = "1s"\njitter = "0s"\nstale_after = "4s"\nstacks = false\nflight_recorder = false\n'
    xid = 'actions = { critical = [], warning = [] }'
    with slack_emulator() as slack, alertmanager_server(tmp_path, shipped_alertmanager(tmp_path, slack)) as am:
        agents = {node: agent_process(agent_config(tmp_path, node, am, marker, log, checks), log_name=f"{node}.log",
                                      module="tests.helpers.fake_gpu_agent")
                  for node, checks in (("gpu-01", {"hang": hang}), ("gpu-02", {"xid": xid, "hang": hang}),
                                       ("gpu-03", {"hang": hang}))}
        for agent in agents.values():
            agent.wait_for("msg=ready", timeout=30)
        kmsg.write(xid79("0000:1a:00"))  # GPU 2 of node gpu-02 (the scripted board's bus ids start at 18)
        gpu2 = "GPU-00000002-0000-4000-8000-000000000000"  # the check names a GPU NVML knows by its uuid
        agents["gpu-02"].wait_for(f"event=fired check=xid subject={gpu2}", timeout=30)
        for node in ("gpu-01", "gpu-03"):
            agents[node].wait_for("event=fired check=hang", timeout=30)

        def job_alerts() -> list[dict[str, Any]]:
            return [a for a in alertmanager_alerts(am) if a["labels"].get("job_id") == "7001"]

        # Alertmanager holds all of them: the fault, and the hangs it inhibits.
        alerts = wait_until(lambda: (a := job_alerts()) and {x["labels"]["node"] for x in a} >= {"gpu-01", "gpu-03"}
                            and a, 20, what="the job's alerts from three nodes in Alertmanager")
        inhibited = {a["labels"]["node"] for a in alerts if a["status"]["inhibitedBy"]}
        assert {"gpu-01", "gpu-03"} <= inhibited, alerts
        xid_alert = next(a for a in alerts if a["labels"]["subject"] == gpu2)
        assert xid_alert["labels"].items() >= {"node": "gpu-02", "cluster": "c1", "layer": "hardware",
                                                "severity": "critical", "job_id": "7001"}.items(), xid_alert
        [post] = wait_until(lambda: [p for p in slack.posts if "7001" in p["raw"].decode()], 30,
                            what="the job's Slack message")  # type: ignore[misc]
        time.sleep(8)  # a group_wait more: no second message for the job
        posts = [p for p in slack.posts if "7001" in p["raw"].decode()]
        assert len(posts) == 1, [p["json"] for p in posts]
        [attachment] = post["json"]["attachments"]
        assert "job 7001 on c1" in attachment["title"]
        text = attachment["text"]
        assert text.startswith("Node at fault: gpu-02 (critical)"), text
        # Critical hardware lines come first (the ring buffer may hold older, lesser XIDs of other tests).
        critical = [line for line in text.splitlines() if line.startswith("Node at fault: gpu-02 (critical)")]
        assert any("GPU 2 (0000:1a:00) fell off the bus" in line for line in critical), text
        assert text.splitlines()[:len(critical)] == critical, text
        assert "gpu-01" not in text and "gpu-03" not in text, text  # their hangs are the fault's consequence
