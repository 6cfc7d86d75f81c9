"""The end-to-end stack: the real `trainguard run` process on the test SLURM cluster, notifying a Slack emulator,
an SMTP server and Alertmanager, scraped by Prometheus; and the timeline of what happened when."""

from __future__ import annotations

import contextlib
import json
import shlex
import time
from calendar import timegm
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
import tomli_w
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import AgentProcess, free_port, wait_until
from tests.peers import SMTP_PASSWORD, SMTP_USER, Mailbox, SlackEmulator, alertmanager_alerts, prometheus_query, prometheus_server
from tests.slurm_cluster import SlurmCluster, sh
from trainguard.core.state import scoped_key
from trainguard.node.kmsg import CURSOR_KEY, cursor_at_end
from trainguard.pipeline.store import Store

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "trainguard-rules.yml"
FAST = {"interval": "1s", "jitter": "0s"}
# Agent log lines worth a row in the timeline, besides every warning and error.
_TIMELINE_MESSAGES = {"ready", "incident event", "stopped", "shutdown requested"}


def parse_log_line(line: str) -> dict[str, str]:
    """One `key=value` agent log line as a dict (values in double quotes may hold spaces)."""
    try:
        words = shlex.split(line)
    except ValueError:
        return {}
    return dict(w.split("=", 1) for w in words if "=" in w)


def log_time(ts: str) -> float:
    """`2026-11-22T19:09:59.123Z` as a Unix time."""
    whole, _, frac = ts.rstrip("Z").partition(".")
    return timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S")) + float(f"0.{frac or 0}")


@dataclass
class Timeline:
    """What happened when, from the test's observations and the agent's own log lines."""

    title: str
    t0: float = field(default_factory=time.time)
    rows: list[tuple[float, str, str]] = field(default_factory=list)

    def mark(self, source: str, what: str, at: float | None = None) -> float:
        at = time.time() if at is None else at
        self.rows.append((at, source, what))
        return at

    def agent_log(self, text: str, name: str = "agent") -> None:
        for line in text.splitlines():
            f = parse_log_line(line)
            if "ts" not in f or (f.get("level") not in ("warning", "error") and f.get("msg") not in _TIMELINE_MESSAGES):
                continue
            detail = " ".join(f"{k}={v}" for k, v in f.items() if k not in ("ts", "level", "logger", "msg", "exc"))
            self.mark(name, f"{f['msg']}: {detail}"[:220], log_time(f["ts"]))

    def render(self) -> str:
        lines = [f"--- timeline: {self.title} ---"]
        lines += [f"{at - self.t0:+9.3f}s  {source:<12} {what}" for at, source, what in sorted(self.rows, key=lambda r: r[0])]
        return "\n".join(lines)


@dataclass
class Stack:
    tmp_path: Path
    slurm: SlurmCluster
    slack: SlackEmulator
    mailbox: Mailbox
    smtp: tuple[int, Path]
    alertmanager: str
    timeline: Timeline
    exits: contextlib.ExitStack
    port: int = field(default_factory=free_port)
    prometheus: str = ""
    agents: list[AgentProcess] = field(default_factory=list)
    jobs: list[str] = field(default_factory=list)

    @property
    def state_dir(self) -> Path:
        return self.tmp_path / "state"

    def config(self, checks: dict[str, Any], actions: dict[str, Any] | None = None,
               notifiers: dict[str, dict[str, Any]] | None = None) -> Path:
        """The agent's config: these checks, and every channel pointed at the stack's peers."""
        port, ca = self.smtp
        channels: dict[str, dict[str, Any]] = {
            "console": {},
            "slack": {"webhook_url": self.slack.url, "group_window": "1s", "retry_max": "1s"},
            "email": {"host": "localhost", "port": port, "security": "starttls", "ca_file": str(ca),
                      "username": SMTP_USER, "password": SMTP_PASSWORD, "from": "trainguard@" + self.slurm.node,
                      "to": ["ml-oncall@example.org"], "group_window": "1s", "retry_max": "1s"},
            "alertmanager": {"urls": [self.alertmanager]},
        }
        for name, extra in (notifiers or {}).items():
            channels[name] = {**channels[name], **extra}
        raw = {"agent": {"node_name": self.slurm.node, "state_dir": str(self.state_dir),
                         "listen": f"127.0.0.1:{self.port}"},
               "jobs": {"sources": ["slurm"], "refresh": "0s"},
               "checks": checks, "notifiers": channels, "actions": actions or {}}
        path = self.tmp_path / "trainguard.toml"
        path.write_text(tomli_w.dumps(raw))
        path.chmod(0o600)  # it holds the SMTP password and the webhook URL
        return path

    def start_agent(self, config: Path, log_name: str = "agent.log") -> AgentProcess:
        """`trainguard run` as a subprocess; the first one also starts Prometheus scraping it."""
        if not self.agents:  # kernel records of earlier tests are not this scenario's; a running agent is past them
            store = Store(self.state_dir)
            store.put(scoped_key("check/xid", CURSOR_KEY), cursor_at_end())
            store.close()
        agent = AgentProcess(config, self.tmp_path / log_name).start()
        self.agents.append(agent)
        agent.wait_for('msg=ready', timeout=30)
        self.timeline.mark("agent", f"process started ({log_name})")
        if not self.prometheus:
            self.prometheus = self.exits.enter_context(prometheus_server(self.tmp_path, self.port, RULES))
        return agent

    def submit(self, command: str, *sbatch_args: str, workdir: Path | None = None, name: str | None = None) -> str:
        job_id = self.slurm.submit(command, *sbatch_args, workdir=workdir, name=name)
        self.jobs.append(job_id)
        self.timeline.mark("slurm", f"job {job_id} submitted ({name or 'unnamed'})")
        return job_id

    def toy(self, workdir: Path, *args: str) -> str:
        return self.slurm.toy_command("--steps", "100000", "--step-time", "0.1", "--ckpt-dir", f"{workdir}/ckpt", *args)

    def wait_mark(self, source: str, what: str, predicate: Callable[[], object], timeout: float,
                  interval: float = 0.05) -> float:
        """Wait until the predicate holds; its time goes on the timeline."""
        wait_until(predicate, timeout, interval, what=what)
        return self.timeline.mark(source, what)

    def audit(self, **match: str) -> list[dict[str, str]]:
        """The action audit lines of every agent whose fields equal `match` (e.g. check=, subject=), as dicts."""
        return [f for agent in self.agents for f in map(parse_log_line, agent.output().splitlines())
                if f.get("msg") == "action" and all(f.get(k) == v for k, v in match.items())]

    def metric(self, name: str, **labels: str) -> float | None:
        """One sample of the agent's /metrics, read with prometheus_client's own parser."""
        for family in text_string_to_metric_families(self.metrics()):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return None

    # what the peers received ------------------------------------------------------------------
    def slack_posts(self, text: str) -> list[dict[str, Any]]:
        return [p for p in self.slack.posts if text in json.dumps(p["json"], ensure_ascii=False)]

    def emails(self, text: str) -> list[Any]:
        return [m for m in self.mailbox.messages if text in m["Subject"] + m.get_body(("plain",)).get_content()]

    def alerts(self, subject: str) -> list[dict[str, Any]]:
        return [a for a in alertmanager_alerts(self.alertmanager) if a["labels"]["subject"] == subject]

    def query(self, expr: str) -> list[Any]:
        return prometheus_query(self.prometheus, expr)

    def metrics(self, timeout: float = 5.0) -> str:
        return requests.get(f"http://127.0.0.1:{self.port}/metrics", timeout=timeout).text

    def mark_deliveries(self, text: str) -> None:
        for p in self.slack_posts(text):
            self.timeline.mark("slack", "message: " + p["json"].get("text", "")[:160], p["at"])
        wanted = self.emails(text)
        for m, at in zip(self.mailbox.messages, self.mailbox.arrived, strict=True):
            if m in wanted:
                self.timeline.mark("email", "message: " + str(m["Subject"])[:160], at)

    def close(self) -> None:
        for agent in self.agents:
            agent.stop()
            self.timeline.agent_log(agent.output(), agent.log.stem)
        for job_id in self.jobs:
            sh("scancel", job_id, check=False)
        if "trainguard" in self.slurm.node_info()["Reason"]:
            self.slurm.resume_node()
