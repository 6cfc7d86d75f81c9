"""The agent itself dies mid-incident: what it owes the on-call arrives once, neither lost nor repeated."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

from tests.conftest import wait_until
from tests.e2e.stack import FAST, Stack


def test_sigkill_mid_incident_and_restart_loses_and_duplicates_no_alert(stack: Stack,
                                                                         tmpfs: Callable[..., Path]) -> None:
    mnt = tmpfs(size="16m", inodes=1000)
    # Group windows of 3s keep the fired event queued in the outbox when the agent is killed.
    config = stack.config({"disk": {**FAST, "paths": [str(mnt)], "free_warning": "25%", "free_critical": "10%",
                                    "forecast_horizon": "0s"}},
                          notifiers={"slack": {"group_window": "3s"}, "email": {"group_window": "3s"}})
    first = stack.start_agent(config, "agent-1.log")
    (mnt / "fill").write_bytes(b"\0" * (15 * 2**20))
    stack.timeline.mark("test", f"{mnt} filled to 94%")
    first.wait_for("event=fired", timeout=10)
    first.signal(signal.SIGKILL)
    first.wait()
    stack.timeline.mark("test", "agent SIGKILLed right after the incident fired")
    assert not stack.slack_posts(str(mnt)) and not stack.emails(str(mnt)), "should still have been queued"

    second = stack.start_agent(config, "agent-2.log")
    stack.wait_mark("slack", "queued alert delivered by the restarted agent", lambda: stack.slack_posts(str(mnt)), 15)
    stack.wait_mark("email", "queued alert delivered by the restarted agent", lambda: stack.emails(str(mnt)), 15)
    stack.wait_mark("alertmanager", "alert active", lambda: stack.alerts(str(mnt)), 15)
    # Killed once the agent recorded the deliveries (its outbox empty, read every 5 s): delivery is at least once, and
    # an agent killed between a peer's accepting a message and its own record of it sends the message again at its
    # next start (this test killed it 12 ms after the email arrived, once, on a loaded machine)
    stack.wait_mark("test", "deliveries recorded by the agent", lambda: all(
        stack.metric("trainguard_notifications_queued", channel=c) == 0 for c in ("slack", "email", "alertmanager")), 15)
    second.signal(signal.SIGKILL)
    second.wait()
    stack.timeline.mark("test", "agent SIGKILLed again, after delivering")
    third = stack.start_agent(config, "agent-3.log")
    time.sleep(5)  # longer than the group windows and several check runs: a repeat would have arrived
    assert len(stack.slack_posts(str(mnt))) == 1 and len(stack.emails(str(mnt))) == 1
    assert len(stack.alerts(str(mnt))) == 1

    (mnt / "fill").unlink()
    stack.timeline.mark("test", "disk emptied")
    stack.wait_mark("slack", "resolved delivered", lambda: len(stack.slack_posts(str(mnt))) == 2, 20)
    wait_until(lambda: len(stack.emails(str(mnt))) == 2 and not stack.alerts(str(mnt)), 15,
               what="resolved by email and in Alertmanager")
    time.sleep(4)
    stack.mark_deliveries(str(mnt))
    slack = [p["json"]["text"] for p in stack.slack_posts(str(mnt))]
    mails = [str(m["Subject"]) for m in stack.emails(str(mnt))]
    assert [t.split()[0] for t in slack] == ["CRITICAL", "RESOLVED"], slack
    assert [s.split()[1] for s in mails] == ["CRITICAL", "RESOLVED"], mails
    fired = sum(a.output().count("msg=\"incident event\" event=fired") for a in (first, second, third))
    assert fired == 1, "the restarted agents must carry on the incident, not fire it again"
