"""What the active diagnostic tools print, read into check results: `dcgmi diag -j`, `nvidia-smi -q`, nccl-tests'
`all_reduce_perf`, perftest's `ib_write_bw`/`ib_read_lat` and `ibstat`, and a site command under the Nagios
conventions. Each reader takes the tool's exit status and output and never raises: output the reader does not
recognise is UNKNOWN (the test said nothing we can judge), never a pass.

The shapes are the real tools' (tests/data/diag/ holds their output, each file cited)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from trainguard.core.model import Result, Status, worst
from trainguard.core.text import one_line
from trainguard.gpu.nvml import normalize_bus_id

CHECK = "diag"
FAILED_GPUS = "failed_gpus"  # a result's GPUs with a fault: index or bus id, serial, UUID where said, reasons
_LINE = 300  # the most of one tool line a summary quotes


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return one_line(lines[-1], _LINE) if lines else "no output"


def _result(subject: str, status: Status, summary: str, **details: Any) -> Result:
    return Result(CHECK, subject, status, one_line(summary, 400), details)


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and abs(value) < 1e15 else None  # not NaN, not absurd


# dcgmi diag -j ------------------------------------------------------------------------------------------------------

_DCGM_FAIL, _DCGM_WARN = {"fail"}, {"warn", "warning"}


def _dcgm_document(out: str) -> dict[str, Any] | None:
    """The JSON document dcgmi printed: DCGM 3 prints a banner line before it ("Successfully ran diagnostic...")."""
    start = out.find("{")
    if start < 0:
        return None
    try:
        doc = json.loads(out[start:])
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def _dcgm_tests(doc: dict[str, Any]) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    # DCGM 4: "DCGM Diagnostic"; DCGM 3: "DCGM GPU Diagnostic"; both group tests in test_categories.
    body = doc.get("DCGM Diagnostic") or doc.get("DCGM GPU Diagnostic") or {}
    categories = body.get("test_categories") if isinstance(body, dict) else None
    for category in categories if isinstance(categories, list) else []:
        tests = category.get("tests") if isinstance(category, dict) else None
        for test in tests if isinstance(tests, list) else []:
            if isinstance(test, dict) and isinstance(test.get("name"), str):
                results = test.get("results")
                yield test["name"], [r for r in results if isinstance(r, dict)] if isinstance(results, list) else []


def _dcgm_entity(result: dict[str, Any]) -> str:
    for key in ("entity_id", "gpu_id", "gpu_ids"):
        if key in result:
            group = result.get("entity_group", "GPU")
            return f"{group} {result[key]}" if key == "entity_id" else f"GPU {result[key]}"
    return "node"


def _dcgm_warnings(result: dict[str, Any]) -> list[str]:
    raw = result.get("warnings", result.get("warning"))
    items = raw if isinstance(raw, list) else [raw] if raw else []
    out = []
    for item in items:
        text = item.get("warning") if isinstance(item, dict) else item
        if isinstance(text, str) and text.strip():
            code = item.get("error_id") if isinstance(item, dict) else None
            out.append(one_line(f"{text.strip()}" + (f" (DCGM error {code})" if isinstance(code, int) else ""), _LINE))
    return out


def _dcgm_verdicts(tests: list[tuple[str, list[dict[str, Any]]]]
                   ) -> tuple[dict[str, list[str]], dict[str, list[str]], list[str], list[str]]:
    """Each test's reasons by verdict: failed and warned (`ENTITY: reason`), and the tests passed or skipped."""
    failed: dict[str, list[str]] = {}
    warned: dict[str, list[str]] = {}
    skipped, passed = [], []
    for name, results in tests:
        statuses = {str(r.get("status", "")).strip().lower() for r in results}
        for r in results:
            status = str(r.get("status", "")).strip().lower()
            if status in _DCGM_FAIL | _DCGM_WARN:
                said = _dcgm_warnings(r) or [status]
                (failed if status in _DCGM_FAIL else warned).setdefault(name, []).extend(
                    f"{_dcgm_entity(r)}: {w}" for w in said)
        if not failed.get(name) and not warned.get(name):
            (passed if "pass" in statuses else skipped).append(name)
    return failed, warned, passed, skipped


def _known(value: object) -> str:
    """An identifier as the tools print it, "" for their blanks (DCGM's `<<<NOT_SUPPORTED>>>`, nvidia-smi's N/A)."""
    text = str(value or "").strip()
    return "" if text.startswith("<<<") or text in ("N/A", "[N/A]") else text[:64]


def _dcgm_failed_gpus(doc: dict[str, Any], tests: list[tuple[str, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """Each GPU a test failed on: its DCGM GPU id (NVML's index), its serial where `entity_groups` lists one, and
    the reasons (`TEST: reason`): what the ledger records against that GPU."""
    serials: dict[int, str] = {}
    for group in doc.get("entity_groups") if isinstance(doc.get("entity_groups"), list) else []:
        if isinstance(group, dict) and group.get("entity_group") == "GPU" and isinstance(group.get("entities"), list):
            serials.update((e["entity_id"], _known(e.get("serial_num"))) for e in group["entities"]
                           if isinstance(e, dict) and isinstance(e.get("entity_id"), int))
    gpus: dict[int, dict[str, Any]] = {}
    for name, results in tests:
        for r in results:
            index = r.get("entity_id", r.get("gpu_id"))
            if (str(r.get("status", "")).strip().lower() in _DCGM_FAIL and r.get("entity_group", "GPU") == "GPU"
                    and isinstance(index, int) and not isinstance(index, bool)):
                gpu = gpus.setdefault(index, {"index": index, "serial": serials.get(index, ""), "reasons": []})
                gpu["reasons"].extend(f"{name}: {w}" for w in _dcgm_warnings(r) or ["fail"])
    return list(gpus.values())[:64]


def read_dcgmi(level: int, rc: int, out: str) -> Result:
    """`dcgmi diag -r LEVEL -j`: CRITICAL when a test failed on an entity (named with DCGM's own explanation),
    WARNING when one warned, OK when every test that ran passed (skipped tests are listed, not judged). dcgmi exits
    non-zero on a failure (226, DCGM_ST_NVVS_ERROR): the document decides; without one, the run said nothing. The
    GPUs a test failed on are listed (`failed_gpus`)."""
    subject = f"dcgmi diag -r {level}"
    doc = _dcgm_document(out)
    tests = list(_dcgm_tests(doc)) if doc else []
    if not doc or not tests:
        return _result(subject, Status.UNKNOWN, f"{subject} gave no result (exit {rc}): {_last_line(out)}", rc=rc)
    failed, warned, passed, skipped = _dcgm_verdicts(tests)
    details = {"rc": rc, "failed": sorted(failed), "warned": sorted(warned), "passed": passed, "skipped": skipped,
               "reasons": [w for ws in failed.values() for w in ws][:20],
               FAILED_GPUS: _dcgm_failed_gpus(doc, tests)}
    if failed:
        first = next(iter(failed.items()))
        return _result(subject, Status.CRITICAL, f"{subject}: failed {', '.join(failed)}: {first[1][0]}", **details)
    if warned:
        first = next(iter(warned.items()))
        return _result(subject, Status.WARNING, f"{subject}: warned {', '.join(warned)}: {first[1][0]}", **details)
    if not passed:
        return _result(subject, Status.UNKNOWN, f"{subject}: every test skipped ({', '.join(skipped)})", **details)
    return _result(subject, Status.OK, f"{subject}: passed {', '.join(passed)}"
                   + (f" (skipped: {', '.join(skipped)})" if skipped else ""), **details)


# nvidia-smi -q ------------------------------------------------------------------------------------------------------

# nvidia-smi's documented exit statuses (man nvidia-smi, RETURN VALUE) that mean the GPUs, not the query, are wrong.
SMI_EXITS = {6: "a query failed (no devices found?)", 9: "the NVIDIA driver is not loaded",
             10: "the NVIDIA kernel detected an interrupt issue with a GPU", 14: "an infoROM is corrupted",
             15: "a GPU has fallen off the bus"}


@dataclass
class _SmiGpu:
    bus_id: str
    faults: list[str]
    warnings: list[str]
    serial: str = ""
    uuid: str = ""

    def read(self, where: str, key: str, value: str) -> None:
        """One `key : value` line of this GPU's section (`where`: the subsection's path)."""
        if where == "Remapped Rows" and value == "Yes":
            self.faults.append("row remapping failed (RMA)" if key == "Remapping Failure Occurred"
                               else "row remap pending (reset the GPU)")
        elif where == "Retired Pages" and key == "Pending Page Blacklist" and value == "Yes":
            self.faults.append("page retirement pending (reset the GPU)")
        elif where == "ECC Errors/Volatile" and "Uncorrectable" in key and value.isdigit() and int(value) > 0:
            self.faults.append(f"{value} volatile {key} ECC error(s)")
        elif where == "GPU Reset Status" and key == "Reset Required" and value == "Yes":
            self.faults.append("reset required")
        elif not where and key == "Persistence Mode" and value == "Disabled":
            self.warnings.append("persistence mode off")
        elif where.startswith("Clocks Event Reasons") and key.startswith("HW") and value == "Active":
            self.warnings.append(f"{key} active")
        elif not where and key in ("Serial Number", "GPU UUID"):
            setattr(self, "serial" if key == "Serial Number" else "uuid", _known(value))

    def failed(self) -> dict[str, Any]:
        """This GPU's faults as the ledger reads them: the bus id as NVML's (normalised), serial and UUID."""
        return {"bus_id": normalize_bus_id(self.bus_id), "serial": self.serial, "uuid": self.uuid,
                "reasons": self.faults}


def _smi_sections(out: str) -> Iterator[tuple[list[str], str, str]]:
    """(section path, key, value) of every `key : value` line, the path from the indentation."""
    path: list[tuple[int, str]] = []
    for raw in out.splitlines():
        if not raw.strip():
            continue
        indent = len(raw) - len(raw.lstrip(" "))
        key, sep, value = raw.strip().partition(" : ")  # not ":": a bus id and a time hold colons
        while path and path[-1][0] >= indent:
            path.pop()
        if sep and value.strip():
            yield [p for _, p in path], key.strip(), value.strip()
        else:
            path.append((indent, key.strip()))


def read_nvidia_smi(rc: int, out: str, expected_gpus: int = 0) -> Result:
    """`nvidia-smi -q`: CRITICAL for fewer GPUs than `expected_gpus`, a pending row remap or page retirement (the
    GPU needs a reset), a failed remap (RMA), uncorrectable ECC errors since the driver loaded, a reset required;
    WARNING for persistence mode off or a hardware clock slowdown. The GPUs with a fault are listed
    (`failed_gpus`: bus id, serial, UUID)."""
    subject = "nvidia-smi"
    if rc != 0:
        why = SMI_EXITS.get(rc)
        return _result(subject, Status.CRITICAL if why else Status.UNKNOWN,
                       f"nvidia-smi -q exited {rc}{': ' + why if why else ''}: {_last_line(out)}", rc=rc)
    attached: int | None = None
    gpus: list[_SmiGpu] = []
    for path, key, value in _smi_sections(out):
        if not path and key == "Attached GPUs":
            attached = int(value) if value.isdigit() else None
            continue
        if path and path[0].startswith("GPU ") and (not gpus or gpus[-1].bus_id != path[0][4:]):
            gpus.append(_SmiGpu(path[0][4:], [], []))
        if not gpus or not path:
            continue
        gpus[-1].read("/".join(path[1:]), key, value)
    count = attached if attached is not None else len(gpus)
    details: dict[str, Any] = {"gpus": count, "expected": expected_gpus,
                               "faults": {g.bus_id: g.faults for g in gpus if g.faults},
                               "warnings": {g.bus_id: g.warnings for g in gpus if g.warnings},
                               FAILED_GPUS: [g.failed() for g in gpus if g.faults]}
    if attached is None and not gpus:
        return _result(subject, Status.UNKNOWN, f"nvidia-smi -q printed no GPU: {_last_line(out)}", **details)
    problems = [f"GPU {g.bus_id}: {', '.join(g.faults)}" for g in gpus if g.faults]
    if expected_gpus and count < expected_gpus:
        problems.insert(0, f"{count} of {expected_gpus} GPUs attached")
    if problems:
        return _result(subject, Status.CRITICAL, "nvidia-smi: " + "; ".join(problems), **details)
    warned = [f"GPU {g.bus_id}: {', '.join(g.warnings)}" for g in gpus if g.warnings]
    if warned:
        return _result(subject, Status.WARNING, "nvidia-smi: " + "; ".join(warned), **details)
    return _result(subject, Status.OK, f"nvidia-smi: {count} GPU(s), no pending remap, retirement or ECC error",
                   **details)


# all_reduce_perf (nccl-tests) ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PerfRow:
    size: int  # bytes
    busbw: float  # GB/s, the better of out-of-place and in-place
    wrong: int  # #wrong of both


def parse_nccl_table(out: str) -> tuple[list[PerfRow], float | None, list[str]]:
    """(per-size rows, `# Avg bus bandwidth`, `Test NCCL failure` lines). A row: size count type redop root, then
    time algbw busbw #wrong twice (out-of-place, in-place); a `#wrong` of N/A (validation off) counts as 0."""
    rows, avg, failures = [], None, []
    for line in out.splitlines():
        text = line.strip()
        if "Test NCCL failure" in text or "Test CUDA failure" in text:
            failures.append(one_line(text, _LINE))
        elif text.startswith("# Avg bus bandwidth"):
            avg = _number(text.partition(":")[2].strip())
        elif text and not text.startswith("#"):
            fields = text.split()
            if len(fields) >= 13 and fields[0].isdigit():
                out_bw, in_bw = _number(fields[7]), _number(fields[11])
                wrong = sum(int(f) for f in (fields[8], fields[12]) if f.isdigit())
                if out_bw is not None and in_bw is not None:
                    rows.append(PerfRow(int(fields[0]), max(out_bw, in_bw), wrong))
    return rows, avg, failures


def read_all_reduce(rc: int, out: str, expected_busbw: float = 0.0) -> Result:
    """`all_reduce_perf` across the node's GPUs: CRITICAL when NCCL failed, a result was wrong, or the bus bandwidth
    at the largest size is below `expected_busbw` GB/s (0: reported, not judged). The largest size is judged, not
    the average over all sizes, which small messages' latency dominates."""
    subject = "all_reduce_perf"
    rows, avg, failures = parse_nccl_table(out)
    if failures:
        return _result(subject, Status.CRITICAL, f"all_reduce_perf: {failures[0]}", rc=rc, failures=failures[:5])
    if not rows:
        return _result(subject, Status.UNKNOWN, f"all_reduce_perf gave no result (exit {rc}): {_last_line(out)}",
                       rc=rc)
    top = max(rows, key=lambda r: r.size)
    wrong = sum(r.wrong for r in rows)
    details = {"rc": rc, "busbw": top.busbw, "size": top.size, "avg_busbw": avg, "expected": expected_busbw,
               "wrong": wrong}
    figures = f"bus bandwidth {top.busbw:g} GB/s at {top.size} B" + (
        f" (expected {expected_busbw:g})" if expected_busbw else "")
    if wrong:
        return _result(subject, Status.CRITICAL, f"all_reduce_perf: {wrong} wrong result(s); {figures}", **details)
    if rc != 0:
        return _result(subject, Status.CRITICAL, f"all_reduce_perf exited {rc}: {_last_line(out)}", **details)
    if expected_busbw and top.busbw < expected_busbw:
        return _result(subject, Status.CRITICAL, f"all_reduce_perf: {figures}: below expected", **details)
    return _result(subject, Status.OK, f"all_reduce_perf: {figures}", **details)


# perftest (ib_write_bw, ib_read_lat) --------------------------------------------------------------------------------

def parse_perftest(out: str) -> tuple[str, list[list[float]]]:
    """(the table's header line, its numeric rows). perftest prints warnings (a CPU frequency that is not max)
    inside its table: only rows of numbers count."""
    header, rows = "", []
    for line in out.splitlines():
        text = line.strip()
        if text.startswith("#bytes"):
            header = text
        elif header and text and text[0].isdigit():
            values = [_number(f) for f in text.split()]
            if len(values) >= 3 and all(v is not None for v in values):
                rows.append([v for v in values if v is not None])
    return header, rows


def read_perftest(tool: str, device: str, rc: int, out: str, expected: float = 0.0) -> Result:
    """A perftest loopback run on `device`. Bandwidth tests (`*_bw`): the average (Gb/s; MB/s and MiB/s are
    converted) of the largest message against `expected` Gb/s, a minimum. Latency tests (`*_lat`): the typical
    latency (usec) against `expected` usec, a maximum. A run that printed no table failed: CRITICAL (a healthy
    HCA's loopback does not)."""
    subject = f"{tool} {device}"
    header, rows = parse_perftest(out)
    if rc != 0 or not rows:
        return _result(subject, Status.CRITICAL, f"{subject} failed (exit {rc}): {_last_line(out)}", rc=rc)
    last = rows[-1]
    if tool.endswith("_lat"):
        # #bytes #iterations t_min t_max t_typical ...
        value = last[4] if len(last) > 4 else last[-1]
        details = {"rc": rc, "latency_us": value, "expected": expected}
        text = f"{subject}: typical latency {value:g} usec" + (f" (at most {expected:g})" if expected else "")
        bad = bool(expected) and value > expected
    else:
        # #bytes #iterations BW peak BW average MsgRate
        value = last[3] * (8 * 1.048576 / 1000 if "MiB/sec" in header else 8 / 1000 if "MB/sec" in header else 1)
        details = {"rc": rc, "gbits": value, "bytes": int(last[0]), "expected": expected}
        text = f"{subject}: {value:g} Gb/s average at {int(last[0])} B" + (
            f" (expected {expected:g})" if expected else "")
        bad = bool(expected) and value < expected
    return _result(subject, Status.CRITICAL if bad else Status.OK, text + (": out of bounds" if bad else ""),
                   **details)


# ibstat -------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class IbPort:
    ca: str
    port: str
    state: str
    physical: str
    rate: float | None
    link_layer: str

    @property
    def up(self) -> bool:
        return self.state == "Active" and self.physical == "LinkUp"


def parse_ibstat(out: str) -> list[IbPort]:
    ports: list[IbPort] = []
    ca, port, fields = "", "", {}

    def close() -> None:
        if ca and port:
            ports.append(IbPort(ca, port, fields.get("State", ""), fields.get("Physical state", ""),
                                _number(fields.get("Rate", "")), fields.get("Link layer", "")))

    for line in out.splitlines():
        text = line.strip()
        if text.startswith("CA '") and text.endswith("'"):
            close()
            ca, port, fields = text[4:-1], "", {}
        elif text.startswith("Port ") and text.endswith(":"):
            close()
            port, fields = text[5:-1], {}
        elif port:
            key, _, value = text.partition(":")
            fields[key.strip()] = value.strip()
    close()
    return ports


def read_ibstat(rc: int, out: str, devices: tuple[str, ...] = (), min_rate: float = 0.0) -> Result:
    """`ibstat`: a port of one of `devices` (the HCAs jobs use) that is not Active/LinkUp, or slower than
    `min_rate` Gb/s, is CRITICAL; without `devices` every port is judged, but only as a WARNING (an unused port
    may well be down), and a node without any HCA is OK."""
    subject = "ibstat"
    ports = parse_ibstat(out)
    if not ports:  # no HCA: nothing to judge, unless jobs need one
        said = f"ibstat listed no port (exit {rc}): {_last_line(out)}"
        return _result(subject, Status.CRITICAL if devices else Status.OK, said, rc=rc)
    judged = [p for p in ports if p.ca in devices] if devices else ports
    missing = sorted(set(devices) - {p.ca for p in ports})
    bad = [f"{p.ca} port {p.port} {p.state}/{p.physical}" for p in judged if not p.up]
    bad += [f"{p.ca} port {p.port} at {p.rate:g} Gb/s" for p in judged
            if p.up and min_rate and p.rate is not None and p.rate < min_rate]
    bad = [f"{ca} missing" for ca in missing] + bad
    details = {"rc": rc, "ports": {f"{p.ca}/{p.port}": f"{p.state}/{p.physical} {p.rate}" for p in ports},
               "bad": bad}
    if bad:
        status = Status.CRITICAL if devices else Status.WARNING
        return _result(subject, status, "ibstat: " + "; ".join(bad), **details)
    return _result(subject, Status.OK, f"ibstat: {len(judged)} port(s) Active/LinkUp", **details)


# a site command -----------------------------------------------------------------------------------------------------

def read_site_command(name: str, rc: int, out: str) -> Result:
    """Nagios plugin conventions: exit 0/1/2/3 is OK/WARNING/CRITICAL/UNKNOWN, the first line (before any `|`
    performance data) the summary; any other exit is UNKNOWN."""
    first = next((line for line in out.splitlines() if line.strip()), "").partition("|")[0].strip()
    status = Status(rc) if rc in (0, 1, 2, 3) else Status.UNKNOWN
    said = one_line(first, _LINE) or f"exit {rc}"
    return _result(name, status, f"{name}: {said}" + ("" if rc in (0, 1, 2, 3) else f" (exit {rc})"), rc=rc)


def verdict(results: list[Result]) -> Status:
    return worst(r.status for r in results)
