"""FabricCheck: on an NVSwitch system (HGX/DGX A100, H100, H200), the NVLink fabric is up: the fabric manager runs,
the NVSwitches are all there, each GPU is registered with the fabric (NVML fabric state "completed", status success)
and the fabric manager's log is free of new errors.

Without the fabric manager, or with a GPU not registered, CUDA cannot set up peer-to-peer over NVLink and multi-GPU
jobs fail at start (`cudaErrorSystemNotReady`): CRITICAL, and the node is drained so no job lands on it. Idle on a
node without NVSwitches whose GPUs report no fabric state.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainguard.checks.base import ActionBinding, CheckContext, CheckIdle, CheckSettings, NvmlCheck
from trainguard.core.model import Metric, Result, Status
from trainguard.core.settings import Duration, Field, NonNegativeInt
from trainguard.core.text import linear
from trainguard.core.units import format_duration
from trainguard.gpu.nvml import FABRIC_STATES, Fabric, NvmlUnavailableError, Reading
from trainguard.logscan.reader import LogTail, Position
from trainguard.node.access import AGENT
from trainguard.node.sysfs import pci_devices

SEEN_KEY = "fabric.max_nvswitches"
LOG_KEY = "fabric.log_position"

_GPU = ("gpu", "uuid")
FM_UP = Metric("trainguard_fabric_manager_up", "1 while the NVIDIA fabric manager process runs (NVSwitch systems).")
NVSWITCHES = Metric("trainguard_nvswitch_count", "NVSwitches on this node's PCI bus.")
NVSWITCHES_EXPECTED = Metric("trainguard_nvswitch_expected_count",
                             "NVSwitches this node should have: configured, or the most seen on this node.")
FABRIC_STATE = Metric("trainguard_gpu_fabric_state", "The GPU's NVLink fabric registration state (NVML: 0 not "
                      "supported, 1 not started, 2 in progress, 3 completed).", _GPU)
FABRIC_REGISTERED = Metric("trainguard_gpu_fabric_registered", "1 if the GPU completed its fabric registration "
                           "successfully.", _GPU)
FM_LOG_ERRORS = Metric("trainguard_fabric_manager_log_errors_total", "ERROR and CRITICAL lines the fabric manager "
                       "logged since the agent started reading its log.", counter=True)
METRICS = (FM_UP, NVSWITCHES, NVSWITCHES_EXPECTED, FABRIC_STATE, FABRIC_REGISTERED, FM_LOG_ERRORS)

# `[Feb 27 2025 15:10:02] [ERROR] [tid 12727] detected NVSwitch non-fatal error 12028 on fid 0 on NVSwitch pci bus
# id 00000000:86:00.0 physical id 3 port 61` (a real fabricmanager.log line).
_LOG_LINE = linear(r"^\[[^\]]{1,40}\]\s*\[(?P<level>[A-Z]{1,10})\]\s*(?:\[tid \d{1,10}\]\s*)?(?P<msg>.*)$")
_ERROR_LEVELS = ("ERROR", "CRITICAL", "FATAL")


class FabricSettings(CheckSettings):
    fire_after: Duration = Field(120.0, ge=0, description="How long a fault must hold before it fires: GPUs register "
                                 "with the fabric within a minute or two of the fabric manager starting.")
    pci_root: str = Field("/sys/bus/pci/devices", description="Where sysfs lists PCI devices (NVSwitches are found "
                          "there).")
    expected_nvswitches: NonNegativeInt | None = Field(None, description="NVSwitches this node should have; unset: "
                                                       "the most seen on this node.")
    fabric_manager_process: str = Field("nv-fabricmanager", description="The fabric manager's process name.")
    fabric_manager_log: str = Field("/var/log/fabricmanager.log", description="The fabric manager's log; new "
                                    "ERROR lines are a WARNING. Empty: not read.")
    log_clear_after: Duration = Field(3600.0, gt=0, description="A fabric manager log error stops being reported "
                                      "after this long without another.")
    actions: ActionBinding = Field(default_factory=lambda: ActionBinding(critical=["drain"]))


def registration(index: int, fabric: Fabric) -> tuple[Status, str]:
    """One GPU's fabric registration in words."""
    state = FABRIC_STATES.get(fabric.state, str(fabric.state))
    if fabric.state == 3 and fabric.status == 0:
        return Status.OK, f"GPU {index}: registered with the NVLink fabric"
    if fabric.state == 3:
        return Status.CRITICAL, (f"GPU {index}: fabric registration failed (NVML status {fabric.status}): "
                                 "multi-GPU jobs cannot use NVLink; restart the fabric manager, else reset the GPUs")
    return Status.CRITICAL, (f"GPU {index}: not registered with the NVLink fabric (state {state}): multi-GPU jobs "
                             "fail to start; check the fabric manager")


class FabricCheck(NvmlCheck):
    Settings = FabricSettings
    metrics = METRICS
    settings: FabricSettings

    def __init__(self, name: str, settings: CheckSettings, context: CheckContext) -> None:
        super().__init__(name, settings, context)
        saved = self.load_state(LOG_KEY).get("position")
        self.tail = LogTail(self.settings.fabric_manager_log, AGENT, Position.from_list(saved) if saved else None)
        self.log_errors = 0
        self.last_error: tuple[float, str] | None = None

    def run(self) -> Sequence[Result]:
        switches = [d.address for d in pci_devices(Path(self.settings.pci_root)) if d.is_nvswitch]
        try:
            readings = self.present(self.nvml.fabric())
        except NvmlUnavailableError:
            readings = []  # the gpu check reports NVML itself; the NVSwitches and the fabric manager still count
        registering = [r for r in readings if r.value is not None and r.value.state != 0]
        state = self.context.state
        seen = int(state.get(SEEN_KEY) or 0)
        if not switches and not registering and not seen and not self.settings.expected_nvswitches:
            raise CheckIdle("no NVSwitch on this node and no GPU in an NVLink fabric")
        if len(switches) > seen:
            state.put(SEEN_KEY, str(len(switches)))
        results = [self._switches(switches, seen)]
        if switches or seen or self.settings.expected_nvswitches:
            results.append(self._fabric_manager())
        results += [self.unanswered(r) or self._gpu(r) for r in readings
                    if r.error or (r.value is not None and r.value.state != 0)]
        if self.settings.fabric_manager_log:
            results.append(self._log())
        return results

    def _switches(self, switches: list[str], seen: int) -> Result:
        expected = self.settings.expected_nvswitches
        source = "configured"
        if expected is None:
            expected, source = max(seen, len(switches)), "seen on this node"
        status = Status.CRITICAL if len(switches) < expected else Status.OK
        summary = f"{len(switches)} of {expected} NVSwitches on the PCI bus ({expected} {source})"
        if status is Status.CRITICAL:
            summary += ": one fell off the bus or out of the driver; the fabric is down, reboot the node"
        return self.result("nvswitches", status, summary, {"nvswitches": switches, "expected": expected,
                                                           "source": source},
                           [NVSWITCHES(len(switches)), NVSWITCHES_EXPECTED(expected)])

    def _fabric_manager(self) -> Result:
        pids = self.context.proc.pids_named(self.settings.fabric_manager_process)
        if pids:
            return self.result("fabric-manager", Status.OK, f"fabric manager running (pid {pids[0]})",
                               {"pids": pids}, [FM_UP(1)])
        return self.result("fabric-manager", Status.CRITICAL,
                           f"fabric manager not running ({self.settings.fabric_manager_process}): the NVLink fabric is "
                           "not managed and multi-GPU jobs fail to start; systemctl start nvidia-fabricmanager",
                           {"pids": []}, [FM_UP(0)])

    def _gpu(self, reading: Reading[Fabric | None]) -> Result:
        gpu, fabric = reading.gpu, reading.value or Fabric(0, 0)
        status, summary = registration(gpu.index, fabric)
        labels = self.gpu_labels(reading)
        registered = 1 if fabric.state == 3 and fabric.status == 0 else 0
        return self.result(gpu.uuid or f"gpu{gpu.index}", status, summary,
                           {"index": gpu.index, "uuid": gpu.uuid, "bus_id": gpu.bus_id,
                            "state": FABRIC_STATES.get(fabric.state), "status": fabric.status},
                           [FABRIC_STATE(fabric.state, labels), FABRIC_REGISTERED(registered, labels)])

    def _log(self) -> Result:
        """New ERROR lines of the fabric manager's log. The first read starts at its end: old errors are history."""
        now = self.context.clock()
        if self.tail.position is None:
            self.tail.position = _end_of(self.settings.fabric_manager_log)
        for chunk in self.tail.read(limit=4 << 20):
            for raw in chunk.decode("utf-8", "replace").splitlines():
                m = _LOG_LINE.match(raw[:4096])
                if m and m.group("level") in _ERROR_LEVELS:
                    self.log_errors += 1
                    self.last_error = (now, m.group("msg").strip()[:300])
        if self.tail.position is not None:
            self.save_state(LOG_KEY, {"position": self.tail.position.to_list()})
        details: dict[str, Any] = {"path": self.settings.fabric_manager_log, "errors_read": self.log_errors}
        samples = [FM_LOG_ERRORS(self.log_errors)]
        if self.last_error and now - self.last_error[0] <= self.settings.log_clear_after:
            at, message = self.last_error
            details["last_error"] = message
            return self.result("fabric-manager-log", Status.WARNING,
                               f"fabric manager logged an error {format_duration(now - at)} ago: {message}",
                               details, samples)
        return self.result("fabric-manager-log", Status.OK, "no new fabric manager errors", details, samples)


def _end_of(path: str) -> Position | None:
    try:
        st = Path(path).stat()
    except OSError:
        return None
    position = Position(st.st_dev, st.st_ino, st.st_size)
    try:
        with open(path, "rb") as f:
            position.head = f.read(64).hex()
    except OSError:
        return None
    return position
