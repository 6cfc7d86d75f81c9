"""Channels against local peers: a Slack webhook emulator and a plain HTTP receiver; grouping through the real
outbox and dispatcher."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import free_port, wait_until
from tests.peers import SlackEmulator, slack_emulator
from trainguard.core.events import Event, EventKind
from trainguard.core.model import Status
from trainguard.notifiers.base import NotifierError
from trainguard.notifiers.slack import SlackNotifier, SlackSettings, slack_message
from trainguard.notifiers.text import headline
from trainguard.notifiers.webhook import SIGNATURE_HEADER, WebhookNotifier, WebhookSettings
from trainguard.pipeline.dispatch import Dispatcher
from trainguard.pipeline.store import Store

Receiver = SlackEmulator


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with slack_emulator() as r:
        yield r


def event(n: int = 0, status: Status = Status.CRITICAL, kind: EventKind = EventKind.FIRED, **details: Any) -> Event:
    return Event(kind, f"inc{n:04d}", "xid", f"pci:0000:{n:02x}:00", status,
                 f"GPU {n} fell off the bus (XID 79)", "gpu-node-17", 1000.0 + n, 990.0, details=details)


def slack(url: str, **settings: Any) -> SlackNotifier:
    return SlackNotifier("slack", SlackSettings.model_validate({"webhook_url": url, **settings}))


def test_headline_tells_the_story() -> None:
    done = [{"action": "signal", "outcome": "ok"}, {"action": "drain", "outcome": "ok"}]
    assert headline([event(3, actions_taken=done)]) == (
        "CRITICAL gpu-node-17: GPU 3 fell off the bus (XID 79) — job signalled, node drained")
    assert headline([event(1, Status.WARNING), event(2), event(3)]).endswith("(+2 more)")
    assert headline([event(1, kind=EventKind.RESOLVED)]).startswith("RESOLVED gpu-node-17: ")


def test_slack_message_blocks() -> None:
    msg = slack_message([event(i) for i in range(50)], mention="<!here>")
    assert msg["text"].startswith("<!here> CRITICAL gpu-node-17: GPU")
    [attachment] = msg["attachments"]
    assert attachment["color"] == "#d32f2f"
    blocks = attachment["blocks"]
    assert blocks[0]["type"] == "header" and len(blocks[0]["text"]["text"]) <= 150
    assert len(blocks) <= 50 and "and 30 more events" in json.dumps(blocks)
    resolved = slack_message([event(1, kind=EventKind.RESOLVED)])
    assert resolved["attachments"][0]["color"] == "#2e7d32" and "RESOLVED" in json.dumps(resolved)
    advised = slack_message([event(1, next_step="drain and reboot the node")])
    assert "Next: drain and reboot the node" in json.dumps(advised)


def test_slack_webhook_semantics(receiver: Receiver) -> None:
    notifier = slack(receiver.url)
    notifier.deliver([event(1)])
    assert receiver.posts[0]["json"]["attachments"][0]["blocks"][0]["type"] == "header"

    receiver.script = [(400, "invalid_payload", {})]
    with pytest.raises(NotifierError) as rejected:
        notifier.deliver([event(2)])
    assert rejected.value.permanent and "400 invalid_payload" in str(rejected.value)

    receiver.script = [(429, "rate_limited", {"Retry-After": "7"})]
    with pytest.raises(NotifierError) as limited:
        notifier.deliver([event(3)])
    assert not limited.value.permanent and limited.value.retry_after == 7.0

    receiver.script = [(500, "internal_error", {})]
    with pytest.raises(NotifierError) as failed:
        notifier.deliver([event(4)])
    assert not failed.value.permanent and failed.value.retry_after is None


def test_webhook_url_never_appears_in_errors() -> None:
    secret_url = f"http://127.0.0.1:{free_port()}/services/T000/B000/sEcReTtOkEn"
    with pytest.raises(NotifierError) as refused:
        slack(secret_url, timeout=2).deliver([event(1)])
    assert "sEcReTtOkEn" not in str(refused.value) and "ConnectionError" in str(refused.value)
    settings = SlackSettings.model_validate({"webhook_url": secret_url})
    assert "sEcReTtOkEn" not in repr(settings) and "sEcReTtOkEn" not in str(settings.model_dump())


def test_signed_webhook(receiver: Receiver) -> None:
    notifier = WebhookNotifier("hook", WebhookSettings.model_validate({"url": receiver.url, "secret": "k3y"}))
    notifier.deliver([event(1), event(2)])
    [post] = receiver.posts
    expected = "sha256=" + hmac.new(b"k3y", post["raw"], hashlib.sha256).hexdigest()
    assert post["headers"][SIGNATURE_HEADER] == expected
    assert [e["incident_id"] for e in post["json"]["events"]] == ["inc0001", "inc0002"]
    assert post["json"]["title"].endswith("(+1 more)")


def test_routing_by_check_and_labels() -> None:
    only_xid = slack("http://unused", checks=["xid"])
    no_xid = slack("http://unused", exclude_checks=["xid"])
    assert only_xid.accepts(event(1)) and not no_xid.accepts(event(1))
    team = slack("http://unused", match={"job": "4242"})
    assert team.accepts(event(1, job_id="4242")) and not team.accepts(event(1, job_id="7")) and not team.accepts(event(1))
    quiet = slack("http://unused", exclude_match={"check": "xid", "status": "warning"})
    assert quiet.accepts(event(1)) and not quiet.accepts(event(1, Status.WARNING))
    assert not slack("http://unused", min_severity="critical").accepts(event(1, Status.WARNING))


def queue(store: Store, channel: str, events: list[Event]) -> None:
    store.save(outbox=[(channel, e.to_dict()) for e in events])


def test_burst_of_50_events_is_one_message(tmp_path: Path, receiver: Receiver) -> None:
    store = Store(tmp_path)
    dispatcher = Dispatcher(store, {"slack": slack(receiver.url, group_window="1s")})
    queue(store, "slack", [event(i) for i in range(50)])
    dispatcher.start()
    try:
        wait_until(lambda: receiver.posts, 10, what="the grouped message")
        time.sleep(1.5)
        [post] = receiver.posts
        assert post["json"]["text"].endswith("(+49 more)")
        assert dispatcher.stats["slack"].sent == 50 and store.outbox_stats() == {}
    finally:
        dispatcher.stop()
        store.close()


def test_outage_then_recovery_delivers_all_in_order_without_duplicates(tmp_path: Path, receiver: Receiver) -> None:
    store = Store(tmp_path)
    dispatcher = Dispatcher(store, {"slack": slack(receiver.url, group_window="0s", retry_max="4s")})
    receiver.outage_until = time.monotonic() + 12  # 503s while three incidents fire: retries at about 2, 6 and 10 s
    dispatcher.start()
    try:
        for i in range(3):
            queue(store, "slack", [event(i)])
            dispatcher.wake()
            time.sleep(0.3)
        wait_until(lambda: len(receiver.posts) >= 3, 40, what="delivery after the outage")
        time.sleep(1)
        titles = [p["json"]["text"] for p in receiver.posts]
        assert titles == [f"CRITICAL gpu-node-17: GPU {i} fell off the bus (XID 79)" for i in range(3)]
        assert dispatcher.stats["slack"].failed >= 3  # retried, backing off, through the whole outage
    finally:
        dispatcher.stop()
        store.close()


def test_grouped_message_says_what_the_agent_already_did(tmp_path: Path, receiver: Receiver) -> None:
    from tests.test_engine import REGISTRY, Flaky
    from trainguard.agent.configfile import parse_config
    from trainguard.pipeline.engine import Engine

    raw = {"agent": {"state_dir": str(tmp_path / "state"), "node_name": "node1", "listen": ""},
           "jobs": {"sources": []},
           "checks": {"flaky": {"interval": "1h", "jitter": 0, "actions": {"critical": ["mark"]}}},
           "actions": {"mark": {"type": "exec", "command": ["true"]}},
           "notifiers": {"hook": {"type": "webhook", "url": receiver.url, "group_window": "1s"}}}
    engine = Engine(parse_config(raw, "test.toml", REGISTRY), REGISTRY)
    Flaky.status = Status.CRITICAL
    engine.start()
    try:
        [post] = wait_until(lambda: receiver.posts, 10, what="the webhook")  # type: ignore[misc]
        [sent] = post["json"]["events"]
        assert [(a["action"], a["outcome"]) for a in sent["details"]["actions_taken"]] == [("mark", "ok")]
        assert post["json"]["title"] == "CRITICAL node1: thing is CRITICAL — mark done"
    finally:
        Flaky.status = Status.OK
        engine.stop()


def test_notify_test_command(tmp_path: Path, receiver: Receiver, capsys: pytest.CaptureFixture[str]) -> None:
    from trainguard.cli import main

    url_file = tmp_path / "slack-url"
    url_file.write_text(receiver.url + "\n")
    config = tmp_path / "trainguard.toml"
    config.write_text(f'[agent]\nnode_name = "node1"\nstate_dir = "{tmp_path}/state"\n\n'
                      f'[notifiers.slack]\nwebhook_url_file = "{url_file}"\n\n'
                      f'[notifiers.broken]\ntype = "webhook"\nurl = "http://127.0.0.1:{free_port()}/hook/sEcReT"\n')
    assert main(["notify-test", "--config", str(config)]) == 1
    out = capsys.readouterr().out
    assert "slack: ok" in out and "broken: FAILED (transient): webhook: ConnectionError" in out
    assert "sEcReT" not in out
    assert receiver.posts[0]["json"]["text"] == "WARNING node1: trainguard test message: this channel works"
    assert main(["notify-test", "--config", str(config), "--channel", "slack"]) == 0
    assert main(["notify-test", "--config", str(config), "--channel", "nope"]) == 2


def test_inline_secret_in_a_world_readable_config_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from trainguard.agent.configfile import load_config

    config = tmp_path / "trainguard.toml"
    config.write_text(f'[agent]\nstate_dir = "{tmp_path}/state"\n\n[notifiers.slack]\n'
                      'webhook_url = "https://hooks.slack.com/services/T0/B0/sEcReT"\n')
    config.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="trainguard"):
        load_config(str(config))
    [record] = [r for r in caplog.records if "world-readable" in r.getMessage()]
    assert record.kv["keys"] == "notifiers.slack.webhook_url"  # type: ignore[attr-defined]
    assert "sEcReT" not in str(record.__dict__)
    caplog.clear()
    config.chmod(0o640)
    with caplog.at_level(logging.WARNING, logger="trainguard"):
        load_config(str(config))
    assert not [r for r in caplog.records if "world-readable" in r.getMessage()]


def test_agent_killed_with_5_queued_delivers_all_5_after_restart(
        tmp_path: Path, receiver: Receiver, agent_process: Any) -> None:
    names = [f"trainer-{i}" for i in range(5)]
    config = tmp_path / "trainguard.toml"
    processes = "".join(f'[jobs.processes.{n}]\ncmdline = "no-such-process-{uuid.uuid4().hex}"\nuser = "root"\n\n' for n in names)
    config.write_text(f"""
[agent]
node_name = "testnode"
state_dir = "{tmp_path}/state"
listen = "127.0.0.1:{free_port()}"

[jobs]
sources = ["process"]
refresh = "0s"

{processes}
[checks.alive]
type = "job_liveness"
names = {json.dumps(names)}
interval = "1s"
jitter = "0s"

[notifiers.slack]
webhook_url = "{receiver.url}"
group_window = "0s"
retry_max = "1s"
""")
    config.chmod(0o600)
    receiver.outage_until = time.monotonic() + 3600  # Slack is down
    first = agent_process(config, log_name="first.log")
    first.wait_for("notification failed, will retry", timeout=20)
    store = Store(tmp_path / "state")
    wait_until(lambda: store.outbox_stats().get("slack", (0, None))[0] == 5, 20, what="5 queued messages")
    store.close()
    first.signal(9)
    first.wait()
    receiver.outage_until = 0.0  # Slack is back
    second = agent_process(config, log_name="second.log")
    try:
        wait_until(lambda: len(receiver.posts) >= 5, 30, what="the 5 queued messages")
        time.sleep(2)
        texts = sorted(p["json"]["text"] for p in receiver.posts)
        assert len(texts) == 5 and len(set(texts)) == 5, texts
        assert all("no job running or pending" in t for t in texts)
    finally:
        second.stop()


def test_events_kept_out_by_routing_are_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    """The Slack example of notifications.md copied literally: a CRITICAL disk incident reaches no post, but now a
    metric and a log line say which rule kept it out."""
    from trainguard.agent.metrics import exposition
    from trainguard.pipeline.engine import Snapshot

    team = slack("http://unused", match={"job": "4242"}, exclude_checks=["disk"])
    everything = slack("http://unused")
    dispatcher = Dispatcher(Store(None), {"slack": team, "all": everything})
    disk = replace(event(1), check="disk", subject="/scratch")
    with caplog.at_level("INFO", logger="trainguard.dispatch"):
        assert dispatcher.route(disk) == ["all"]
        assert dispatcher.route(event(2, job_id="4242")) == ["slack", "all"]
        assert dispatcher.route(event(3, Status.UNKNOWN)) == []
    assert dispatcher.stats["slack"].not_routed == {"exclude_checks": 1, "match": 1}  # the first rule that refuses
    assert dispatcher.stats["all"].not_routed == {"min_severity": 1}
    [line, _] = [r for r in caplog.records if r.getMessage() == "not routed to channel"]  # disk; then no job
    fields = line.kv  # type: ignore[attr-defined]
    assert (fields["channel"], fields["rule"], fields["check"]) == ("slack", "exclude_checks", "disk")
    snap = Snapshot("n", 0.0, {}, {}, {}, {}, not_routed={n: s.not_routed for n, s in dispatcher.stats.items()})
    text = exposition(lambda: snap)().decode()
    assert sorted(line for line in text.splitlines() if line.startswith("trainguard_notifications_not_routed_total")) \
        == ['trainguard_notifications_not_routed_total{channel="all",rule="min_severity"} 1.0',
            'trainguard_notifications_not_routed_total{channel="slack",rule="exclude_checks"} 1.0',
            'trainguard_notifications_not_routed_total{channel="slack",rule="match"} 1.0']


def test_notify_test_says_it_bypasses_routing_and_what_to_fix(tmp_path: Path, receiver: Receiver,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from trainguard.cli import main

    config = tmp_path / "trainguard.toml"
    config.write_text(f'[agent]\nnode_name = "node1"\nstate_dir = "{tmp_path}/state"\n\n'
                      f'[notifiers.slack]\nwebhook_url = "{receiver.url}"\nmin_severity = "critical"\n'
                      'exclude_checks = ["disk"]\n\n[notifiers.mail]\ntype = "email"\nhost = "h"\nfrom = "a@b"\n'
                      'to = ["c@d"]\nenabled = false\n')
    config.chmod(0o600)
    assert main(["notify-test", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("test messages bypass each channel's routing")
    assert 'slack: ok (routing: min_severity = "critical", exclude_checks = ["disk"])' in out
    assert main(["notify-test", "--config", str(config), "--channel", "mail"]) == 2
    assert f"[notifiers.mail] in {config} has enabled = false" in capsys.readouterr().err
    assert main(["notify-test", "--config", str(config), "--channel", "pager"]) == 2
    assert f"no [notifiers.pager] table in {config} (enabled channels: slack)" in capsys.readouterr().err
    config.write_text(f'[agent]\nstate_dir = "{tmp_path}/state"\n')
    assert main(["notify-test", "--config", str(config)]) == 2
    assert "no enabled notification channel" in capsys.readouterr().err


def test_config_messages_say_what_to_do(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trainguard.cli import main

    config = tmp_path / "trainguard.toml"
    config.write_text(f'[agent]\nstate_dir = "{tmp_path}/state"\nlisten = "127.0.0.1:{free_port()}"\n'
                      '[checks.disk]\nfree_warning = "512MiB"\ninodes_free_warning = "10000000"\n'
                      '[notifiers.slack]\n')
    assert main(["validate", "--config", str(config)]) == 2
    assert 'notifiers.slack.webhook_url: required key is missing (a secret: or give webhook_url_file = ' \
           '"/path/to/file" or webhook_url_env = "VARIABLE")' in capsys.readouterr().err
    config.write_text(config.read_text().replace("[notifiers.slack]\n", ""))
    assert main(["validate", "--config", str(config)]) == 0
    disk = json.loads(capsys.readouterr().out)["checks"]["disk"]
    assert disk["free_warning"] == "512MiB" and disk["inodes_free_warning"] == "10000000"
    assert main(["status", "--config", str(config)]) == 3
    err = capsys.readouterr().err
    assert f"of {config}; pass the agent's config with --config PATH, or its address with --url" in err


def test_a_resolution_gets_its_own_green_message_without_a_next_step(tmp_path: Path, receiver: Receiver) -> None:
    """In one group window: a firing, then the resolution of another incident, then a firing. Three messages in
    order (red, green, red): the resolution neither rides in a firing's message nor hides one in a green one, and
    the fault it resolves is gone, so no "Next:" step."""
    store = Store(tmp_path)
    dispatcher = Dispatcher(store, {"slack": slack(receiver.url, group_window="1s")})
    queue(store, "slack", [event(1), event(2, kind=EventKind.RESOLVED, next_step="reset the GPU"), event(3)])
    dispatcher.start()
    try:
        wait_until(lambda: len(receiver.posts) == 3, 10, what="three messages")
        colours = [p["json"]["attachments"][0]["color"] for p in receiver.posts]
        assert colours == ["#d32f2f", "#2e7d32", "#d32f2f"]
        green = json.dumps(receiver.posts[1]["json"])
        assert "RESOLVED" in green and "Next:" not in green and "reset the GPU" not in green
        assert dispatcher.stats["slack"].sent == 3 and store.outbox_stats() == {}
    finally:
        dispatcher.stop()
        store.close()
    advised = slack_message([event(1, next_step="reset the GPU")])
    assert "Next: reset the GPU" in json.dumps(advised)
