"""A job's user writes text the kernel then prints (a crashing binary's file name, a process name, a quoted path):
that text must never be read as another, graver kernel event (a CPU's hard lockup drains the node and requeues every
job on it). The lines are the shapes real kernels print (tests/data/kernel/fixtures.toml: segfault, traps, OOM kill,
`process ... launched ... with NULL argv`, an AppArmor audit record), with the user's part forged."""

from __future__ import annotations

import pytest

from trainguard.checks.kernel import _MEMCG_JOB, _MEMCG_TASK, Entry, _victim
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
    # x86 do_trap: `traps: COMM[PID] trap int3 ip:... sp:... error:0 in FILE[...]`, its words holding colons
    (f"traps: x[5] trap int3 ip:7f3a1c2b3c4d sp:7ffd5e6f7a80 error:0 in a: {FORGED}[55d0c0a00000+1000]", ""),
    ("traps: x[5] trap int3 ip:7f3a1c2b3c4d sp:7ffd5e6f7a80 error:0 in a: INFO: task kworker:12 blocked for more "
     "than 120 seconds.[55d0c0a00000+1000]", ""),
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


def test_a_forged_oom_record_names_no_number_it_lacks() -> None:
    """`anon-rss:,kB` in a forged line made the check's whole run raise (every kernel fault unreported for an hour,
    and again after a restart: the entry is saved)."""
    line = "Out of memory: Killed process 5 (x) total-vm:1kB, anon-rss:,kB, file-rss:0kB"
    events = KernelEventParser().feed(line)
    assert [e.klass for e in events] == ["oom_kill"]
    entry = Entry(events[0].klass, events[0].subject, {**events[0].names, "job_id": "7"}, line, 0.0, 0.0)
    assert _victim(entry) == "job 7 (x, pid 5) killed: "


def test_only_slurms_own_cgroup_tree_names_a_job() -> None:
    """A user's delegated cgroup tree may hold a `job_4711` of their making: it names no job (it would blame
    another user's job for their OOM kill)."""
    assert _MEMCG_JOB.search("/user.slice/user-1000.slice/user@1000.service/app.slice/job_4711") is None
    for memcg, job, task in (("/slurm/uid_1000/job_4242/step_0/task_3", "4242", "3"),
                             ("/system.slice/slurmstepd.scope/job_77/step_0/user/task_1", "77", "1")):
        found, in_task = _MEMCG_JOB.search(memcg), _MEMCG_TASK.search(memcg)
        assert found is not None and in_task is not None
        assert (found.group(1), in_task.group(2)) == (job, task)
