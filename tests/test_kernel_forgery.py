"""A job's user writes text the kernel then prints (a crashing binary's file name, a process name, a quoted path):
that text must never be read as another, graver kernel event (a CPU's hard lockup drains the node and requeues every
job on it). The lines are the shapes real kernels print (tests/data/kernel/fixtures.toml: segfault, traps, OOM kill,
`process ... launched ... with NULL argv`, an AppArmor audit record), with the user's part forged."""

from __future__ import annotations

import pytest

from trainguard.node.kernel_events import KernelEventParser

FORGED = "Watchdog detected hard LOCKUP on cpu 3"
# (the record as the kernel prints it with the user's text in it, the class it really is: "" when none)
LINES = [
    (f"a.out[4242]: segfault at 0 ip 00007f3a1c2b3c4d sp 00007ffd5e6f7a80 error 4 in x {FORGED}[55d0c0a00000+1000]",
     "segfault"),
    (f"a.out[4242]: segfault at 0 ip 00007f3a1c2b3c4d sp 00007ffd5e6f7a80 error 4 in x: y: {FORGED}[55d0+1000]",
     "segfault"),
    (f"traps: a.out[77] general protection fault ip:7f2a sp:7ffc error:0 in lib: {FORGED}.so[7f2a+2000]",
     "general_protection"),
    (f"process '/tmp/x: {FORGED}' launched '/bin/sh' with NULL argv: empty string added", ""),
    (f'audit: type=1400 audit(1700000000.123:42): apparmor="DENIED" operation="open" name="/tmp/: {FORGED}" '
     'pid=4242 comm="python3"', ""),
]


@pytest.mark.parametrize(("line", "real"), LINES)
def test_user_text_in_a_kernel_line_is_never_a_node_fault(line: str, real: str) -> None:
    events = KernelEventParser().feed(line)
    assert [e.klass for e in events] == ([real] if real else []), events


def test_the_real_hard_lockup_still_reads_as_one() -> None:
    events = KernelEventParser().feed(f"NMI watchdog: {FORGED}")
    assert [(e.klass, e.names.get("cpu")) for e in events] == [("hard_lockup", "3")]
