"""A job's user writes text the kernel then prints (a crashing binary's file name, a process name, a quoted path):
that text must never be read as another, graver kernel event (a CPU's hard lockup drains the node and requeues every
job on it). The lines are the shapes real kernels print (tests/data/kernel/fixtures.toml: segfault, traps, OOM kill,
`process ... launched ... with NULL argv`, an AppArmor audit record), with the user's part forged."""

from __future__ import annotations

import pytest

from trainguard.checks.kernel import Entry, _victim
from trainguard.jobs.kernelnotes import JobProcess, KernelNotes
from trainguard.jobs.slurmnode import job_of_cgroup
from trainguard.node.kernel_events import KernelEventParser
from trainguard.node.kmsg import KernelRecord

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
    real = KernelEventParser().feed("Out of memory: Killed process 15784 (python3) total-vm:11964kB, anon-rss:4288kB, "
                                    "file-rss:3028kB, shmem-rss:0kB")[0]  # tests/data/kernel/fixtures.toml's
    entry = Entry(real.klass, real.subject, {**real.names, "job_id": "7"}, real.line, 0.0, 0.0)
    assert _victim(entry) == "job 7 (python3, pid 15784, 4.2 MiB anon) killed: "
    notes = KernelNotes(clock=lambda: 1e9)  # the job checks' notes read the same number the same way
    notes.remember("j", "j", {5: JobProcess("0"), 15784: JobProcess("1")})
    notes.feed(KernelRecord(1, 3, 0, 5_000_000, line))
    notes.feed(KernelRecord(2, 3, 0, 9_000_000, real.line))
    assert [(k.pid, k.anon_kb) for k in notes.kills("j")] == [(5, None), (15784, 4288)]


def test_only_slurms_own_cgroup_tree_names_a_job() -> None:
    """A user's delegated cgroup tree may hold a `job_4711` of their making: it names no job (it would blame
    another user's job for their OOM kill)."""
    assert job_of_cgroup("/user.slice/user-1000.slice/user@1000.service/app.slice/job_4711") == (None, None)
    assert job_of_cgroup("/slurm/uid_1000/job_4242/step_0/task_3") == ("4242", "3")
    assert job_of_cgroup("/system.slice/slurmstepd.scope/job_77/step_0/user/task_1") == ("77", "1")
    assert job_of_cgroup("/system.slice/n3_slurmstepd.scope/job_78/step_batch/user/task_0") == ("78", "0")
    assert job_of_cgroup("/slurm_n3/uid_5/job_9") == ("9", None)


def test_the_job_checks_notes_take_a_job_only_from_slurms_tree_too() -> None:
    """The job checks' kernel notes read the same record: a kill in a user's own `job_4711` is no kill of job 4711."""
    notes = KernelNotes(clock=lambda: 1e9)
    memcg = "/user.slice/user-1000.slice/user@1000.service/app.slice/job_4711"
    notes.feed(KernelRecord(1, 3, 0, 5_000_000, "oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,"
                            f"mems_allowed=0,oom_memcg={memcg},task_memcg={memcg},task=python,pid=31337,uid=1000"))
    assert notes.kills(job_id="4711") == []
    notes.feed(KernelRecord(2, 3, 0, 6_000_000, "oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,"
                            "mems_allowed=0,oom_memcg=/slurm/uid_1000/job_4242,task_memcg=/slurm/uid_1000/job_4242/"
                            "step_0/task_3,task=python,pid=31338,uid=1000"))
    assert [(k.pid, k.task) for k in notes.kills(job_id="4242")] == [(31338, "3")]
