"""CommandCheck: a site's own script under the Nagios plugin conventions, so that an NHC or Nagios check runs inside
the agent with its incidents, actions and channels.

Exit 0/1/2/3 is OK/WARNING/CRITICAL/UNKNOWN (any other status UNKNOWN, the code said); the first line of its output is
the summary, the lines after it the details; what follows a `|` is performance data (Nagios plugin development
guidelines, "Performance data": `'label'=value[UOM];[warn];[crit];[min];[max]`, space-separated), exported as
`trainguard_command_perfdata{check, label, unit}` in base units, at most `max_labels` distinct labels per check.
"""

from __future__ import annotations

import errno
import math
import os
import pwd
import signal
from collections.abc import Sequence
from dataclasses import dataclass

from trainguard.checks.base import Check, CheckContext, CheckSettings
from trainguard.core.command import Finished, RunAs, run_bounded
from trainguard.core.model import Metric, Result, Sample, Status
from trainguard.core.settings import Duration, Field, Size, field_validator, model_validator
from trainguard.core.text import one_line, printable
from trainguard.core.units import parse_size

PERFDATA = Metric("trainguard_command_perfdata",
                  "A site command's performance data value, in base units (seconds, bytes; percent as printed).",
                  ("check", "label", "unit"))
PERFDATA_DROPPED = Metric("trainguard_command_perfdata_dropped",
                          "Performance data items of the last run not exported: unparsable, or a label past the cap.",
                          ("check",))
DISCARDED = Metric("trainguard_command_output_discarded_bytes",
                   "Bytes of the last run's output read past `output_limit` and discarded.", ("check",))
DURATION = Metric("trainguard_command_duration_seconds", "How long the last run of the command took.", ("check",))
EXIT_CODE = Metric("trainguard_command_exit_code",
                   "The last run's exit status (-N: ended by signal N; -1000: killed here, timed out or flooding).",
                   ("check",))
METRICS = (PERFDATA, PERFDATA_DROPPED, DISCARDED, DURATION, EXIT_CODE)

NAGIOS = {0: Status.OK, 1: Status.WARNING, 2: Status.CRITICAL, 3: Status.UNKNOWN}
LABEL_MAX = 64  # characters of a perfdata label kept in a metric label
SUMMARY_MAX = 300
DETAILS_MAX = 4000
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# UOM -> (unit label, factor to the base unit); the guidelines' UOMs, and the byte multiples plugins print.
_UNITS = {"": ("", 1.0), "s": ("seconds", 1.0), "ms": ("seconds", 1e-3), "us": ("seconds", 1e-6),
          "%": ("percent", 1.0), "b": ("bytes", 1.0), "kb": ("bytes", 1024.0), "mb": ("bytes", 1024.0**2),
          "gb": ("bytes", 1024.0**3), "tb": ("bytes", 1024.0**4), "c": ("counter", 1.0)}


class CommandSettings(CheckSettings):
    command: list[str] = Field(min_length=1, description="argv of the script, its path absolute; no shell "
                                                          "(`[\"/bin/sh\", \"-c\", \"...\"]` for one).")
    subject: str = Field("", description="The subject of its result (incidents are per subject); empty: the "
                                         "check's name.")
    user: str = Field("", description="Run it as this user (name or uid); empty: the agent's own. Another user "
                                      "needs the agent to run as root (the run-as-root.conf drop-in).")
    command_timeout: Duration | None = Field(None, gt=0, description="Its process group is killed after this: "
                                                                    "UNKNOWN \"timed out\". Shorter than `timeout`; "
                                                                    "default: 80% of it.")
    output_limit: Size = Field(parse_size("64KiB"), ge=1, description="Output read from each of stdout and "
                                                                      "stderr; the rest is discarded and counted.")
    max_labels: int = Field(32, ge=0, le=1000, description="Distinct perfdata labels exported for this check; "
                                                           "later ones are dropped (counted).")
    environment: dict[str, str] = Field(default_factory=dict, description="Variables set for it, besides PATH, "
                                                                          "HOME, USER, LOGNAME and LC_ALL=C.")

    @field_validator("command")
    @classmethod
    def _absolute(cls, argv: list[str]) -> list[str]:
        if not argv[0].startswith("/"):
            raise ValueError(f"{argv[0]!r}: give the script's absolute path")
        return argv

    @property
    def kill_after(self) -> float:
        """The script's own timeout: the check's leaves time to kill and reap it and report."""
        return self.command_timeout if self.command_timeout is not None else self.timeout * 0.8

    @model_validator(mode="after")
    def _fits(self) -> CommandSettings:
        if self.command_timeout is not None and self.command_timeout >= self.timeout:
            raise ValueError(f"command_timeout ({self.command_timeout:g}s) must be shorter than timeout "
                             f"({self.timeout:g}s)")
        return self


@dataclass(frozen=True)
class Perf:
    """One performance data item; `warn`/`crit` are the ranges as printed, `value`/`min`/`max` in the plugin's UOM."""

    label: str
    value: float
    uom: str
    warn: str = ""
    crit: str = ""
    min: float | None = None
    max: float | None = None


@dataclass(frozen=True)
class PluginOutput:
    summary: str
    long_text: str
    perfdata: tuple[Perf, ...]
    bad: int  # items that did not parse


def split_output(text: str) -> tuple[str, str, str]:
    """(first line's text, the long text, all performance data) per the guidelines: `TEXT|PERF` on the first line,
    then long text lines, the first `|` among them starting performance data that runs to the end."""
    first, _, rest = text.partition("\n")
    summary, _, perf = first.partition("|")
    long_text, bar, more = rest.partition("|")
    return summary.strip(), long_text.strip(), (perf + (" " + more.replace("\n", " ") if bar else "")).strip()


def parse_perfdata(text: str) -> tuple[list[Perf], int]:
    """The items of a performance data string, and how many did not parse. One pass over the text (linear): a label
    is quoted (`'a b'`, `''` a quote) or runs to `=`; the value field runs to the next blank."""
    items: list[Perf] = []
    bad = 0
    i, n = 0, len(text)
    while i < n:
        if text[i].isspace():
            i += 1
            continue
        label, i = _label(text, i)
        j = i
        while j < n and not text[j].isspace():
            j += 1
        item = _item(label, text[i + 1:j]) if label is not None and i < n and text[i] == "=" else None
        if item is None:
            bad += 1
        elif not math.isnan(item.value):  # "U" (undetermined) is NaN: no value, not an error
            items.append(item)
        i = j
    return items, bad


def _label(text: str, i: int) -> tuple[str | None, int]:
    n = len(text)
    if text[i] != "'":
        j = i
        while j < n and text[j] != "=" and not text[j].isspace():
            j += 1
        return (text[i:j] or None), j
    out: list[str] = []
    j = i + 1
    while j < n:
        if text[j] == "'":
            if j + 1 < n and text[j + 1] == "'":
                out.append("'")
                j += 2
                continue
            return "".join(out) or None, j + 1
        out.append(text[j])
        j += 1
    return None, j


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _item(label: str, field: str) -> Perf | None:
    parts = field.split(";")
    head = parts[0].replace(",", ".")  # some plugins print the locale's decimal comma
    if head == "U":
        return Perf(label, float("nan"), "")
    k = len(head)
    while k and not (head[k - 1].isdigit() or head[k - 1] == "."):
        k -= 1
    value, uom = _number(head[:k]), head[k:]
    if value is None or uom.lower() not in _UNITS:
        return None
    more = [*parts[1:5], "", "", "", ""]
    return Perf(label, value, uom, more[0], more[1], _number(more[2]), _number(more[3]))


def parse_output(text: str) -> PluginOutput:
    summary, long_text, perf = split_output(text)
    items, bad = parse_perfdata(perf)
    return PluginOutput(summary, long_text, tuple(items), bad)


def status_of(finished: Finished, timeout: float) -> tuple[Status, str]:
    """The status its exit says, and why when that is not its own word."""
    if finished.timed_out:
        return Status.UNKNOWN, f"timed out after {timeout:g}s"
    if finished.flooded:
        return Status.UNKNOWN, "printed without end: killed"
    code = finished.code
    assert code is not None
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return Status.UNKNOWN, f"killed by {name}"
    if code in NAGIOS:
        return NAGIOS[code], ""
    return Status.UNKNOWN, f"exited {code} (not a Nagios status)"


class CommandCheck(Check):
    Settings = CommandSettings
    metrics = METRICS
    settings: CommandSettings

    def __init__(self, name: str, settings: CheckSettings, context: CheckContext) -> None:
        super().__init__(name, settings, context)
        self.labels: set[str] = set()  # the labels exported so far: at most max_labels, so the series stay bounded

    @property
    def subject(self) -> str:
        return self.settings.subject or self.name

    def _identity(self) -> tuple[RunAs | None, pwd.struct_passwd | None]:
        wanted = self.settings.user
        if not wanted:
            try:
                return None, pwd.getpwuid(os.geteuid())
            except KeyError:
                return None, None
        entry = pwd.getpwuid(int(wanted)) if wanted.isdigit() else pwd.getpwnam(wanted)
        if entry.pw_uid == os.geteuid():
            return None, entry
        return RunAs(entry.pw_uid, entry.pw_gid, tuple(os.getgrouplist(entry.pw_name, entry.pw_gid))), entry

    def _environment(self, entry: pwd.struct_passwd | None) -> dict[str, str]:
        env = {"PATH": SAFE_PATH, "LC_ALL": "C", "HOME": entry.pw_dir if entry else "/"}
        if entry is not None:
            env |= {"USER": entry.pw_name, "LOGNAME": entry.pw_name}
        return env | self.settings.environment

    def run(self) -> Sequence[Result]:
        s = self.settings
        who = {"check": self.name}
        try:
            run_as, entry = self._identity()
        except (KeyError, ValueError):
            return [self._unknown(f"no such user {s.user!r}")]
        try:
            finished = run_bounded(s.command, s.kill_after, s.output_limit, run_as=run_as,
                                   env=self._environment(entry))
        except FileNotFoundError:
            return [self._unknown(f"{s.command[0]}: not found")]
        except PermissionError as exc:
            if run_as is not None and exc.errno == errno.EPERM:  # setgroups/setuid refused (exec refuses EACCES)
                return [self._unknown(f"cannot run as {s.user!r}: {exc.strerror} (needs the agent to run as root)")]
            return [self._unknown(f"{s.command[0]}: not executable ({exc.strerror})")]
        except OSError as exc:
            return [self._unknown(f"{s.command[0]}: cannot run: {exc.strerror or exc}")]
        status, why = status_of(finished, s.kill_after)
        out = finished.stdout.decode("utf-8", "replace")
        parsed = parse_output(out if out.strip() else finished.stderr.decode("utf-8", "replace"))
        summary = one_line(parsed.summary, SUMMARY_MAX) or f"no output (exit {finished.code})"
        if why:
            summary = f"{why}: {summary}" if parsed.summary else why
        samples, dropped = self._perf_samples(parsed.perfdata)
        samples += [PERFDATA_DROPPED(dropped + parsed.bad, who), DISCARDED(finished.discarded, who),
                    DURATION(round(finished.elapsed, 3), who),
                    EXIT_CODE(finished.code if finished.code is not None else -1000, who)]
        details = {"exit_code": finished.code, "elapsed_s": round(finished.elapsed, 3),
                   "output_discarded_bytes": finished.discarded, "command": s.command,
                   "long_output": printable(parsed.long_text, DETAILS_MAX),
                   "perfdata": [{"label": one_line(p.label, LABEL_MAX), "value": p.value, "uom": p.uom, "warn": p.warn,
                                 "crit": p.crit} for p in parsed.perfdata[:s.max_labels]]}
        if s.user:
            details["user"] = s.user
        return [self.result(self.subject, status, summary, details, samples)]

    def _perf_samples(self, items: Sequence[Perf]) -> tuple[list[Sample], int]:
        samples: list[Sample] = []
        dropped = 0
        seen: set[str] = set()
        for item in items:
            label = one_line(item.label, LABEL_MAX)
            if label in seen:  # a label printed twice would be two samples of one series
                dropped += 1
                continue
            if label not in self.labels and len(self.labels) >= self.settings.max_labels:
                dropped += 1
                continue
            self.labels.add(label)
            seen.add(label)
            unit, factor = _UNITS[item.uom.lower()]
            samples.append(PERFDATA(item.value * factor, {"check": self.name, "label": label, "unit": unit}))
        return samples, dropped

    def _unknown(self, summary: str) -> Result:
        return self.result(self.subject, Status.UNKNOWN, summary, {"command": self.settings.command})
