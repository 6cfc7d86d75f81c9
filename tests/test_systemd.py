"""The service as installed, under a real systemd: a container boots systemd as PID 1 (tests/systemd_container.py),
a venv at /opt/trainguard gets the wheel built from this checkout (and nothing else of it), `trainguard install` writes
the unit, and the unit then runs as systemd enforces it: READY, the watchdog, the sandbox, the capabilities, the
drop-ins.

The tests run in file order on one installed service, each a step of its life: started, scraped, an XID, a hung job of
another user, the drop-ins, a restart, frozen, wedged, uninstalled. A test drop-in shortens WatchdogSec to 4s and
RestartSec to 1s so the watchdog steps take seconds, not minutes. Root only (nspawn, mounts); CI runs it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.docblocks import node_walk
from tests.packaging import Dists
from tests.systemd_container import SystemdContainer, missing_tools
from trainguard import __version__

from .conftest import REPO, require, require_root, unique_bus, wait_until, xid79

VENV = "/opt/trainguard"
TG = f"{VENV}/bin/trainguard"
NODE_PYTHON = "/usr/bin/python3"  # the node's own Python, as a new user would make the venv with
JOB_USER = "tgjob"
UNIT = "trainguard.service"
DROPIN_DIR = f"/etc/systemd/system/{UNIT}.d"
MAX_EXPOSURE = 2.5
WHEELHOUSE = "/mnt/wheelhouse"  # install.md's `wheelhouse/`, in the directory the install block runs from

CONFIG = """
[agent]
listen = "127.0.0.1:9721"

[jobs]
sources = ["process"]
refresh = "0s"

[jobs.processes.first]
cmdline = "tg-hung-first"
user = "tgjob"
logs = ["/home/tgjob/first/train.log"]
switch_dir = "/home/tgjob/first/.trainguard"

[jobs.processes.second]
cmdline = "tg-hung-second"
user = "tgjob"
logs = ["/home/tgjob/second/train.log"]
switch_dir = "/home/tgjob/second/.trainguard"

[checks.memory]

[checks.xid]
actions = { critical = [] }    # the kernel log holds other tests' XIDs: no action on them

[checks.hang]
interval = "1s"
stale_after = "3s"
native = true
actions = { critical = ["save", "signal"] }

[notifiers.console]
"""

TEST_DROPIN = """[Service]
WatchdogSec=4s
RestartSec=1s
"""

# A rank stuck in a collective: it logs, then waits forever; it records the signals it gets and lives on (a hang that
# a signal does not cure stays an incident across restarts).
JOB = """
import signal, sys, time, pathlib
run = pathlib.Path(sys.argv[1])
def record(signum, frame):
    with open(run / "signals", "a") as f:
        f.write(signal.Signals(signum).name + "\\n")
signal.signal(signal.SIGUSR1, record)
with open(run / "train.log", "a") as log:
    log.write("step 1 loss=2.31\\nentering allreduce\\n")
def wait_for_peers():
    while True:
        time.sleep(1)
wait_for_peers()
"""

# A GET inside the container (its network is private): the status code, a newline, the body.
HTTP_GET = """
import sys, urllib.request, urllib.error
try:
    with urllib.request.urlopen("http://127.0.0.1:9721" + sys.argv[1], timeout=5) as r:
        code, body = r.status, r.read()
except urllib.error.HTTPError as e:
    code, body = e.code, e.read()
print(code)
sys.stdout.write(body.decode())
"""


class Service:
    """The installed trainguard.service inside the container, and what the tests ask of it."""

    def __init__(self, container: SystemdContainer, install_output: str, start_s: float) -> None:
        self.c = container
        self.install_output = install_output
        self.start_s = start_s

    def show(self, *props: str, unit: str = UNIT) -> dict[str, str]:
        out = self.c.run(["systemctl", "show", unit, *(f"--property={p}" for p in props)]).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def main_pid(self) -> int:
        return int(self.show("MainPID")["MainPID"])

    def invocation(self) -> str:
        return self.show("InvocationID")["InvocationID"]

    def journal(self, invocation: str | None = None) -> str:
        """The agent's log lines: of one run of the service, or the unit's whole journal (systemd's lines too)."""
        match = [f"_SYSTEMD_INVOCATION_ID={invocation}"] if invocation else ["--unit", UNIT]
        return self.c.run(["journalctl", "--no-pager", "--output=cat", *match]).stdout

    def get(self, path: str) -> tuple[int, str]:
        out = self.c.run([NODE_PYTHON, "-c", HTTP_GET, path], check=False).stdout
        code, _, body = out.partition("\n")
        return (int(code) if code.isdigit() else 0), body

    def status(self) -> dict[str, Any]:
        """`trainguard status --json`, the operator's command, against the running agent."""
        return json.loads(self.c.run([TG, "status", "--json"]).stdout)  # type: ignore[no-any-return]

    def incident(self, check: str, subject: str) -> dict[str, Any] | None:
        return next((i for i in self.status()["incidents"] if i["check"] == check and i["subject"] == subject
                     and i["firing"]), None)

    def wait_serving(self, timeout: float = 30) -> None:
        """Active, and its first round done (/healthz says `ok` and nothing pending)."""
        wait_until(lambda: self.show("ActiveState")["ActiveState"] == "active" and self.get("/healthz") == (200, "ok\n"),
                   timeout, 0.2, what="the agent serving with its first round done")

    def wait_restarted(self, old_pid: int, timeout: float) -> None:
        def restarted() -> bool:
            state = self.show("MainPID", "ActiveState", "SubState")
            return state["MainPID"] not in ("0", str(old_pid)) and (state["ActiveState"], state["SubState"]) == \
                ("active", "running")
        wait_until(restarted, timeout, 0.2, what="systemd restarting the agent")

    def start_job(self, name: str) -> int:
        """A hung rank of JOB_USER under /home/tgjob/NAME, as a transient unit; its pid."""
        run = f"/home/{JOB_USER}/{name}"
        self.c.run(["install", "-d", "-o", JOB_USER, "-g", JOB_USER, "-m", "0755", run])
        self.c.write(f"{run}/job.py", JOB, owner=f"{JOB_USER}:{JOB_USER}")
        self.c.run(["systemd-run", f"--unit=tg-job-{name}", f"--uid={JOB_USER}", f"--gid={JOB_USER}", "--collect",
                    f"--working-directory={run}", NODE_PYTHON, f"{run}/job.py", run, f"tg-hung-{name}"])
        pid = wait_until(lambda: int(self.show("MainPID", unit=f"tg-job-{name}.service")["MainPID"]), 10,
                         what=f"job {name} running")
        return int(pid)  # type: ignore[arg-type]

    def exposure(self) -> float:
        out = self.c.run(["systemd-analyze", "security", "--no-pager", UNIT], check=False).stdout
        found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out)
        assert found, out
        return float(found.group(1))


def wheelhouse(dists: Dists, directory: Path) -> Path:
    """The wheel built from the checkout and its dependencies, for `pip install --no-index` inside (the container has
    no network): downloaded here by this pip, as wheels for the node's Python."""
    directory.mkdir()
    shutil.copy(dists.wheel, directory)
    version = subprocess.run([NODE_PYTHON, "-c", "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
                           f"--python-version={version}", "--dest", str(directory), str(dists.wheel)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"pip download of the dependencies failed:\n{proc.stderr[-3000:]}"
    return directory


@pytest.fixture(scope="module")
def kmsg_unlimited() -> Iterator[None]:
    """Userspace writes to /dev/kmsg are rate limited by default; the XID written inside must not be dropped."""
    knob = Path("/proc/sys/kernel/printk_devkmsg")
    old = knob.read_text().strip() if knob.exists() else None
    if old is not None:
        knob.write_text("on\n")
    yield
    if old is not None:
        knob.write_text(old + "\n")


@pytest.fixture(scope="module")
def service(dists: Dists, tmp_path_factory: pytest.TempPathFactory, kmsg_unlimited: None) -> Iterator[Service]:
    require_root()
    missing = missing_tools()
    require(not missing, f"needs {', '.join(missing)} (Debian: systemd-container, util-linux)")
    require(Path(NODE_PYTHON).exists(), f"needs {NODE_PYTHON}, the node's Python the venv is made with")
    wheels = wheelhouse(dists, tmp_path_factory.mktemp("systemd") / "wheelhouse")
    binds = {wheels: WHEELHOUSE, REPO / "tests" / "helpers": "/mnt/helpers"}
    with SystemdContainer(bind_ro=binds) as c:
        # install.md's install block to the letter (venv, pip from the wheelhouse, `trainguard install`, the link),
        # from the directory that holds wheelhouse/.
        install = c.run(["sh", "-ec", f"cd {WHEELHOUSE.rsplit('/', 1)[0]}\n{node_walk()[0].body}"], timeout=300).stdout
        if c.run(["id", JOB_USER], check=False).returncode != 0:
            c.run(["useradd", "--create-home", JOB_USER])
        c.write("/etc/trainguard/trainguard.toml", CONFIG, mode="0640", owner="root:trainguard")
        c.write(f"{DROPIN_DIR}/zz-test.conf", TEST_DROPIN)
        c.run(["systemctl", "daemon-reload"])
        t0 = time.monotonic()
        c.run(["systemctl", "start", UNIT], timeout=90)  # Type=notify: returns once READY=1 arrived
        yield Service(c, install, time.monotonic() - t0)


def test_installed_from_the_wheel_it_starts_ready_and_active(service: Service) -> None:
    c = service.c
    out = service.install_output
    assert f"wrote /etc/systemd/system/{UNIT} (ExecStart={TG})" in out, out
    assert "created /etc/trainguard (mode 0750)" in out and "wrote /etc/trainguard/trainguard.toml (mode 0640)" in out
    assert "systemctl daemon-reload" in out and "Next steps:" in out
    assert c.run([f"{VENV}/bin/python", "-c", "import trainguard; print(trainguard.__file__)"]).stdout.startswith(
        f"{VENV}/lib/")  # the wheel's trainguard, not the checkout's
    assert c.run([TG, "--version"]).stdout.strip() == f"trainguard {__version__}"
    assert c.run(["stat", "-c", "%a %U:%G", "/etc/trainguard"]).stdout.split() == ["750", "root:trainguard"]

    status = c.run(["systemctl", "status", "--no-pager", UNIT], check=False)
    assert status.returncode == 0 and "Active: active (running)" in status.stdout, status.stdout
    shown = service.show("Type", "ActiveState", "SubState", "StatusText", "NRestarts", "User")
    assert (shown["Type"], shown["ActiveState"], shown["SubState"], shown["User"]) == \
        ("notify", "active", "running", "trainguard")
    assert shown["StatusText"].startswith("watching 3 checks") and shown["NRestarts"] == "0"
    assert service.start_s < 30, service.start_s
    journal = service.journal()
    assert "msg=ready" in journal
    assert "mode is different" not in journal, journal  # ConfigurationDirectoryMode=0750 and the directory agree


def test_exposure_of_the_running_unit_is_at_most_2_5(service: Service) -> None:
    assert service.exposure() <= MAX_EXPOSURE


def test_healthz_and_metrics(service: Service) -> None:
    service.wait_serving()
    code, text = service.get("/metrics")
    assert code == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}
    statuses = {(s.labels["check"], s.labels["type"]) for s in families["trainguard_check_status"].samples}
    assert {("memory", "memory"), ("xid", "xid")} <= statuses  # (hang: no job yet, no result)
    [up] = families["trainguard_kmsg_follower_up"].samples
    assert up.labels["source"] == "kmsg" and up.value == 1  # /dev/kmsg read under DevicePolicy=closed


def test_xid_written_to_kmsg_inside_is_counted(service: Service) -> None:
    bus = unique_bus()
    service.c.run(["sh", "-c", 'printf "<4>%s\\n" "$1" > /dev/kmsg', "sh", xid79(bus)])

    def counted() -> float | None:
        families = text_string_to_metric_families(service.get("/metrics")[1])
        return next((s.value for f in families if f.name == "trainguard_gpu_xid_errors"
                     for s in f.samples if s.name.endswith("_total") and s.labels.get("bus_id") == bus
                     and s.labels.get("xid") == "79"), None)

    assert wait_until(counted, 10, 0.2, what="the XID counted") == 1
    incident = service.incident("xid", f"pci:{bus}")
    assert incident is not None and incident["status"] == "CRITICAL" and "fell off the bus" in incident["summary"]


def test_ptrace_probe_under_a_system_call_filter(service: Service) -> None:
    """What the hang check asks before it tries `py-spy --native`, in units filtered as trainguard's is or harder."""
    probe = [f"{VENV}/bin/python", "-c", "from trainguard.node.stacks import ptrace_refusal; print(ptrace_refusal())"]

    def under(*props: str) -> str:
        return service.c.run(["systemd-run", "--wait", "--pipe", "--quiet", *(f"--property={p}" for p in props),
                              *probe]).stdout.strip()

    assert under() == "None"
    assert under("SystemCallFilter=~ptrace", "SystemCallErrorNumber=EPERM") == \
        "the system call filter refuses ptrace (EPERM)"
    assert under("SystemCallFilter=~ptrace") == "the ptrace probe exited -31: no output"  # SIGSYS: killed, not refused


def test_hung_job_of_another_user_is_dumped_and_signalled(service: Service) -> None:
    c = service.c
    pid = service.start_job("first")
    incident = wait_until(lambda: service.incident("hang", "process:first"), 20, 0.3, what="the hang incident")
    assert isinstance(incident, dict)
    summary = incident["summary"]
    assert f"pid {pid}: wait_for_peers (job.py:" in summary, summary  # py-spy read another user's process
    dump = summary.rsplit("stacks in ", 1)[1]
    assert dump.startswith("/var/lib/trainguard/stacks/") and "wait_for_peers" in c.read(dump)

    def actions() -> dict[str, dict[str, Any]] | None:
        found = service.incident("hang", "process:first")
        done = {a["action"]: a for a in found["actions"]} if found else {}
        return done if {"save", "signal"} <= set(done) else None

    done = wait_until(actions, 10, 0.3, what="both actions recorded")
    assert isinstance(done, dict)
    assert done["signal"]["outcome"] == "ok"
    wait_until(lambda: c.run(["cat", "/home/tgjob/first/signals"], check=False).stdout == "SIGUSR1\n", 10,
               what="SIGUSR1 delivered to the other user's job")
    # Without the switch-files drop-in the user's directories are read-only to the agent: the save fails, and says why.
    assert done["save"]["outcome"] == "failed" and "Read-only file system" in done["save"]["detail"], done["save"]
    assert c.run(["ls", "-A", "/home/tgjob/first"]).stdout.split() == ["job.py", "signals", "train.log"]
    # native = true, but the unit's filter has no ptrace: said once at start, and the dump kept to Python frames.
    journal = service.journal(service.invocation())
    assert journal.count("native stacks refused") == 1, journal
    assert 'reason="the system call filter refuses ptrace (EPERM)"' in journal
    assert "(libc.so" not in c.read(dump)


def test_switch_files_and_native_stacks_dropins(service: Service) -> None:
    c = service.c
    out = c.run([TG, "install", "--dropin", "switch-files", "--dropin", "native-stacks"]).stdout
    assert f"wrote {DROPIN_DIR}/switch-files.conf" in out and f"wrote {DROPIN_DIR}/native-stacks.conf" in out
    assert "systemctl daemon-reload" in out
    c.run(["systemctl", "restart", UNIT], timeout=60)
    service.wait_serving()
    pid = service.start_job("second")
    incident = wait_until(lambda: service.incident("hang", "process:second"), 20, 0.3, what="the second hang")
    assert isinstance(incident, dict)
    save = wait_until(lambda: next((a for a in (service.incident("hang", "process:second") or {}).get("actions", [])
                                    if a["action"] == "save"), None), 10, 0.3, what="the save action")
    assert isinstance(save, dict) and save["outcome"] == "ok", save
    switch = "/home/tgjob/second/.trainguard/save"
    assert save["detail"] == f"created {switch}"
    assert c.run(["stat", "-c", "%U:%G", switch]).stdout.strip() == f"{JOB_USER}:{JOB_USER}"  # chown under @chown
    assert json.loads(c.read(switch))["incident"] == incident["id"]
    assert c.run(["ls", "-A", "/home/tgjob/second/.trainguard"]).stdout.split() == ["save"]  # no temporary file
    dump = incident["summary"].rsplit("stacks in ", 1)[1]
    text = c.read(dump)
    assert f"pid {pid}" in text and "wait_for_peers" in text and "(libc.so" in text  # native frames: ptrace allowed
    assert "native stacks refused" not in service.journal(service.invocation())


def test_restart_keeps_incidents_without_refiring(service: Service) -> None:
    c = service.c
    before = {i["id"]: i for i in service.status()["incidents"] if i["firing"]}
    dumps = c.run(["ls", "--full-time", "/var/lib/trainguard/stacks"]).stdout
    hung = [i for i in before.values() if i["check"] == "hang"]
    assert sorted(i["subject"] for i in hung) == ["process:first", "process:second"]
    c.run(["systemctl", "restart", UNIT], timeout=60)
    service.wait_serving()
    time.sleep(2)  # two more runs of the hang check over the still-hung jobs
    after = {i["id"]: i for i in service.status()["incidents"] if i["firing"]}
    assert set(after) == set(before)
    journal = service.journal(service.invocation())
    assert "event=fired" not in journal and "msg=action" not in journal, journal
    assert c.run(["ls", "--full-time", "/var/lib/trainguard/stacks"]).stdout == dumps  # one dump per hang


def test_frozen_agent_is_restarted_by_the_watchdog(service: Service) -> None:
    pid = service.main_pid()
    restarts = int(service.show("NRestarts")["NRestarts"])
    service.c.run(["kill", "-STOP", str(pid)])  # every thread stops, the watchdog pinger too
    service.wait_restarted(pid, 30)
    assert int(service.show("NRestarts")["NRestarts"]) == restarts + 1
    assert "Watchdog timeout" in service.journal()
    service.wait_serving()


def test_wedged_engine_is_restarted_by_the_watchdog(service: Service) -> None:
    """Only the scheduler's tick thread stops: the process lives, answers HTTP and runs its checks, but the engine's
    tick (its liveness, and what reports runs past their timeout) makes no progress."""
    c = service.c
    pid = service.main_pid()
    restarts = int(service.show("NRestarts")["NRestarts"])
    c.run(["systemd-run", "--unit=tg-wedge", "--collect", NODE_PYTHON, "/mnt/helpers/stop_thread.py", str(pid),
           "tick", f"{VENV}/bin/py-spy"])
    try:
        wait_until(lambda: "stopped thread" in c.run(["journalctl", "--no-pager", "-o", "cat", "-u", "tg-wedge"]).stdout,
                   15, 0.2, what="the tick thread stopped")
        wait_until(lambda: service.get("/healthz") == (503, "engine not making progress\n"), 15, 0.3,
                   what="/healthz reporting the wedge")
        assert service.main_pid() == pid  # alive and serving, yet wedged
        service.wait_restarted(pid, 30)
    finally:
        c.run(["systemctl", "stop", "tg-wedge"], check=False)
    assert int(service.show("NRestarts")["NRestarts"]) == restarts + 1
    journal = service.journal()
    assert "engine not making progress; withholding watchdog ping" in journal and "Watchdog timeout" in journal
    service.wait_serving()


def test_an_action_under_way_at_systemctl_stop_finishes(service: Service) -> None:
    """An XID fires, its action (a command that takes 3 s) is under way, and the operator stops the unit: systemd
    sends SIGTERM to the agent only (KillMode=mixed: its children are killed only after it exits), the agent waits for
    the action, and the command's work is done. The incident is saved as fired, so no later start would redo it."""
    c = service.c
    bus = unique_bus()
    config = CONFIG.replace('actions = { critical = [] }    # the kernel log holds other tests\' XIDs: no action on them',
                            'actions = { critical = ["mark"] }')
    assert config != CONFIG
    config += """
[actions.mark]
type = "exec"
command = ["sh", "-c", 'sleep 3; echo "$TRAINGUARD_SUBJECT" >> /var/lib/trainguard/acted']
"""
    c.write("/etc/trainguard/trainguard.toml", config, mode="0640", owner="root:trainguard")
    try:
        c.run(["systemctl", "restart", UNIT], timeout=60)  # on the same boot: the XIDs of earlier steps stay done
        service.wait_serving()
        invocation = service.invocation()
        c.run(["sh", "-c", 'printf "<4>%s\\n" "$1" > /dev/kmsg', "sh", xid79(bus)])
        wait_until(lambda: f"event=fired check=xid subject=pci:{bus}" in service.journal(invocation), 10, 0.2,
                   what="the XID to fire")
        c.run(["systemctl", "stop", UNIT], timeout=60)
        acted = c.run(["cat", "/var/lib/trainguard/acted"], check=False).stdout
        assert f"pci:{bus}" in acted.split(), service.journal(invocation)[-3000:]
        journal = service.journal(invocation)
        assert "msg=\"actions finished before shutdown\"" in journal and "cut short" not in journal
        assert "action=mark outcome=ok incident=" in journal
    finally:
        c.write("/etc/trainguard/trainguard.toml", CONFIG, mode="0640", owner="root:trainguard")
        c.run(["systemctl", "start", UNIT], timeout=60)
        service.wait_serving()


def test_systemctl_reload_refuses_a_bad_config_and_applies_a_good_one(service: Service) -> None:
    """ExecReload under the hardened unit: a broken config is refused in one journal line and the agent goes on (same
    pid, active, serving); the good one is applied in the same process."""
    c = service.c
    pid = service.main_pid()
    invocation = service.invocation()
    c.write("/etc/trainguard/trainguard.toml", CONFIG + '\n[checks.broken]\ntype = "disk"\nfree_warning = "x"\n',
            mode="0640", owner="root:trainguard")
    try:
        c.run(["systemctl", "reload", UNIT], timeout=60)
        wait_until(lambda: "reload refused; the running config stays" in service.journal(invocation), 30, 0.2,
                   what="the refusal in the journal")
        assert service.main_pid() == pid and service.show("ActiveState")["ActiveState"] == "active"
        assert service.get("/healthz")[0] == 200
    finally:
        c.write("/etc/trainguard/trainguard.toml", CONFIG, mode="0640", owner="root:trainguard")
    c.run(["systemctl", "reload", UNIT], timeout=60)
    wait_until(lambda: "msg=reloaded" in service.journal(invocation), 30, 0.2, what="the reload in the journal")
    assert service.main_pid() == pid
    service.wait_serving()


# What must differ on a test node from the docs' lines: a follow that never ends is bounded, the operator is a user
# the node has.
ON_A_TEST_NODE = {"journalctl -u trainguard -f": "timeout 2 journalctl -u trainguard -f",
                  "usermod -aG trainguard alice": f"usermod -aG trainguard {JOB_USER}"}  # the test node's operator
# What the docs say a line prints (their comment on it).
PRINTS = {"systemctl status trainguard": 'Status: "watching ', "curl -s localhost:9721/healthz": "ok\n",
          "journalctl -u trainguard -n 5": "msg=reloaded",
          "curl -s localhost:9721/metrics | grep trainguard_check_status": "trainguard_check_status{"}


def test_the_docs_walked_on_the_node(service: Service) -> None:
    """After install.md's install block (the fixture runs it): the rest of install.md, operations.md's config change
    and README's scrape, each line as the docs write it (`trainguard` through the link install.md makes), in the
    order a reader meets them (tests/docblocks.py). Each exits 0 and prints what the doc says it prints; a line
    gets a few seconds (a reader types slower than a test: the reload answers before the agent logs it)."""
    c = service.c
    _, walk = node_walk()
    assert set(ON_A_TEST_NODE) | set(PRINTS) <= set(walk), walk  # the docs changed: say how the walk runs them
    assert c.run(["readlink", "/usr/local/bin/trainguard"]).stdout.strip() == TG
    service.wait_serving()
    for line in walk:
        tried: list[subprocess.CompletedProcess[str]] = []

        def ran(line: str = line, tried: list[subprocess.CompletedProcess[str]] = tried) -> bool:
            tried.append(proc := c.run(["sh", "-c", ON_A_TEST_NODE.get(line, line)], check=False, timeout=30))
            done = proc.returncode == 0 or (line in ON_A_TEST_NODE and proc.returncode == 124)
            return done and PRINTS.get(line, "") in proc.stdout
        try:
            wait_until(ran, 10, 0.5, what=line)
        except AssertionError:
            raise AssertionError(f"{line!r} exited {tried[-1].returncode}, printed:\n{tried[-1].stdout[-2000:]}"
                                 f"{tried[-1].stderr[-2000:]}") from None
    assert service.show("UnitFileState")["UnitFileState"] == "enabled"
    # The operator added to the group reads everything over the control socket (install.md says so).
    status = c.run(["trainguard", "status"], user=JOB_USER).stdout
    assert "(/run/trainguard/control.sock)" in status and "last results" in status, status


def test_uninstall(service: Service) -> None:
    c = service.c
    out = c.run([TG, "uninstall"]).stdout
    assert f"systemctl disable --now {UNIT}" in out and f"removed /etc/systemd/system/{UNIT}" in out
    assert f"removed {DROPIN_DIR}/switch-files.conf" in out and f"removed {DROPIN_DIR}/native-stacks.conf" in out
    assert f"kept {DROPIN_DIR} (drop-ins that are not trainguard's)" in out  # the test's own drop-in stays
    assert service.show("ActiveState", "LoadState") == {"ActiveState": "inactive", "LoadState": "not-found"}
    assert c.run(["test", "-f", "/etc/trainguard/trainguard.toml"], check=False).returncode == 0  # config kept
    c.run(["usermod", "-aG", "trainguard", JOB_USER])  # an operator, as install.md says: the group outlives userdel
    purge = c.run([TG, "uninstall", "--purge"]).stdout
    assert "removed /etc/trainguard" in purge and "removed /var/lib/trainguard" in purge
    assert f"/etc/systemd/system/{UNIT} is not installed" in purge and "systemctl" not in purge  # nothing to fail
    assert f"kept group trainguard (members: {JOB_USER};" in purge and f"kept {VENV}, the virtualenv" in purge
    assert c.run(["id", "trainguard"], check=False).returncode != 0


def test_reinstall_after_a_purge_that_kept_the_group(service: Service) -> None:
    c = service.c
    out = c.run([TG, "install"]).stdout
    assert "created system user trainguard in the existing group trainguard" in out, out
    c.run(["systemctl", "enable", UNIT])
    assert service.show("LoadState", "UnitFileState") == {"LoadState": "loaded", "UnitFileState": "enabled"}
    assert c.run(["id", "-gn", "trainguard"]).stdout.strip() == "trainguard"
    c.run([TG, "uninstall", "--purge"])

