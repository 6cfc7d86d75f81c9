"""The `trainguard` command: run, check, status, ack, silence, clear, validate, notify-test, selftest, install,
uninstall, config-reference, metrics-reference, slurm-prolog, slurm-epilog, diag, kernel, history."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from trainguard import PLAIN_SETTINGS_ENV, __version__
from trainguard.core.logs import setup_logging
from trainguard.core.model import Status, worst
from trainguard.core.text import one_line
from trainguard.core.units import format_duration, parse_duration, parse_size
from trainguard.jobs.prolog import GATE_DIR

if TYPE_CHECKING:  # imported where used: one-shot commands start faster, and `run` holds no pydantic (main)
    from trainguard.core.model import Result
    from trainguard.notifiers.base import NotifierSettings
    from trainguard.pipeline.config import Config
    from trainguard.pipeline.engine import Engine

EXIT_CONFIG = 2
# sysexits.h's EX_NOPERM: a command this user may not run (the config or the control socket is root's and the
# trainguard group's). Apart from 0-3 (`check`'s Nagios codes, the operator commands') and 4 (sent, not
# answered), so that a script never reads it as a status.
EXIT_NOPERM = 77
# sysexits.h's EX_DATAERR: the state database is a newer release's; the agent refuses the downgrade (the unit's
# RestartPreventExitStatus keeps systemd from trying again every 5 s).
EXIT_SCHEMA = 65
OPERATOR_EXIT = (" Exit code: 0 done, 1 refused (the message says why), 3 the agent was not reached or the "
                 "exchange failed, 4 sent and not answered yet (do not run it again: `trainguard status`), "
                 f"{EXIT_NOPERM} this user may not (root and the trainguard group only).")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainguard", description="Per-node watchdog for GPU training runs.")
    parser.add_argument("--version", action="version", version=f"trainguard {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_config(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--config", "-c", metavar="PATH",
                       help="config file (default: $TRAINGUARD_CONFIG or /etc/trainguard/trainguard.toml; "
                            "built-in defaults when that file does not exist)")
        p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="override agent.log_level")
        return p

    with_config(sub.add_parser("run", help="run the agent in the foreground",
                               description="Run the agent in the foreground until SIGTERM or SIGINT."))
    p = with_config(sub.add_parser(
        "check", help="run every check once and exit with the Nagios code of the worst status",
        description="Run one round of every check and print the results. Exit code: 0 OK, 1 WARNING, "
                    "2 CRITICAL, 3 UNKNOWN, for the most severe status (OK < UNKNOWN < WARNING < CRITICAL). "
                    "Usable as a SLURM HealthCheckProgram or job prolog."))
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.add_argument("--critical-only", action="store_true",
                   help="exit 0 unless a result is CRITICAL (for a SLURM prolog: only CRITICAL refuses the node)")
    p.add_argument("--drain", action="store_true",
                   help="on CRITICAL, drain this node through the configured `drain` action, with the reason "
                        "(for a SLURM HealthCheckProgram)")
    p.add_argument("--since", default="boot", type=since_arg, metavar="DURATION|boot",
                   help="count only kernel log records (XIDs, SXids) newer than this, e.g. 10m, 2h, 1d; default "
                        "boot: all of this boot's (a prolog that should not refuse a node for an XID hours old)")
    p = with_config(sub.add_parser("status", help="show a running agent's incidents and last results",
                                   description="Ask a running agent's /status endpoint and print a table."))
    p.add_argument("--url", help="agent base URL (default: from the config's agent.listen)")
    p.add_argument("--json", action="store_true", help="print the raw JSON")
    p = with_config(sub.add_parser("ack", help="acknowledge incidents: no more reminders (they stay visible)",
                                   description="Acknowledge the incidents of a check (or one subject) of the running "
                                               "agent: reminders stop; the incident stays until it resolves. Over the "
                                               "control socket: root and the trainguard group." + OPERATOR_EXIT))
    p.add_argument("target", metavar="CHECK[/SUBJECT]")
    p.add_argument("--reason", default="", help="why (recorded and announced)")
    p = with_config(sub.add_parser("silence", help="silence a check (or one subject) for a while",
                                   description="While the silence lasts, nothing of these incidents is announced and "
                                               "no action runs; its end is announced, with what fired meanwhile."
                                               + OPERATOR_EXIT))
    p.add_argument("target", metavar="CHECK[/SUBJECT]")
    p.add_argument("--for", dest="duration", required=True, metavar="DURATION", help="e.g. 2h, 30m")
    p.add_argument("--reason", required=True, help="why (recorded and announced)")
    p = with_config(sub.add_parser("clear", help="the cause is fixed: resolve the incident and forget its history",
                                   description="Resolve an incident now because its cause is fixed (a GPU was reset): "
                                               "the check forgets what it recorded about the subject (an XID's "
                                               "history), and only what happens from now on fires again. It waits "
                                               "for the check's run under way (its timeout, plus 30 s)."
                                               + OPERATOR_EXIT))
    p.add_argument("target", metavar="CHECK/SUBJECT")
    p.add_argument("--reason", required=True, help="what was fixed (recorded and announced)")
    p = with_config(sub.add_parser(
        "history", help="the node ledger: faults, drains, resumes, reboots and repairs, by component",
        description="Print this node's ledger from the state database (read only; root, or the service user): every "
                    "hardware fault, drain, resume, reboot, lemon hold and operator's clear, against the component's "
                    "identity (a GPU's serial, an HCA's node GUID, the node), and the lemon holds standing "
                    "(docs/node-lifecycle.md). Exit code: 0, 1 no state database, "
                    f"{EXIT_SCHEMA} a newer release's database, {EXIT_NOPERM} this user may not read it."))
    which = p.add_mutually_exclusive_group()
    which.add_argument("--gpu", metavar="SERIAL|UUID", help="only this GPU")
    which.add_argument("--component", metavar="ID", help="only this component (an HCA's node GUID, an NVSwitch's "
                                                         "PCI address)")
    which.add_argument("--node", action="store_true", help="only the node's own entries (drains, resumes, reboots)")
    p.add_argument("--since", default="30d", type=duration_arg, metavar="DURATION",
                   help="entries newer than this (default 30d; the ledger keeps ledger.retention, 90d)")
    p.add_argument("--json", action="store_true", help="print JSON")
    with_config(sub.add_parser("validate", help="check a config file and print the effective config",
                               description="Validate a config file and print the effective config (secrets redacted)."))
    p = with_config(sub.add_parser("notify-test", help="send a test message through the configured channels",
                                   description="Send one test message through each configured notification channel "
                                               "(or one) and print each outcome. Exit code 1 if any failed."))
    p.add_argument("--channel", metavar="NAME", help="only this channel")
    with_config(sub.add_parser(
        "selftest", help="prove the running agent works end to end: a test fault through each real path",
        description="The running agent injects a harmless test fault through each real path and this command shows "
                    "each hop as it happens: a record in the kernel log read by the xid check's reader (written "
                    "when run as root), a disk threshold on a scratch directory, a test job's hang (a process the agent starts, "
                    "watched by the hang check), the incidents, their events, each "
                    "channel's answer, the series on /metrics, then the resolution and its messages. Everything "
                    "sent says [trainguard selftest] TEST (Alertmanager: label test=\"true\"); no action ever runs "
                    "for it, and nothing is left afterwards. Over the control socket: root and the trainguard group. "
                    f"Exit code: 0 every hop passed, 1 a hop failed (named), 3 the agent was not reached, "
                    f"{EXIT_NOPERM} this user may not."))
    p = sub.add_parser("install", help="install the systemd unit, a commented config and the service user",
                       description="Install /etc/systemd/system/trainguard.service (ExecStart: this trainguard), "
                                   "the drop-ins asked for, /etc/trainguard (0750) with trainguard.toml (0640, kept "
                                   "if present) and the system user; print what was done and the next steps.")
    p.add_argument("--root", default="/", metavar="DIR", help="stage under DIR instead of / (no user is created)")
    p.add_argument("--user", default="trainguard", help="service user (default: trainguard)")
    p.add_argument("--dropin", action="append", default=[], metavar="NAME",
                   help="also install this shipped drop-in into /etc/systemd/system/trainguard.service.d/ "
                        "(repeatable): switch-files, native-stacks, run-as-root; see docs/install.md")
    p = sub.add_parser("uninstall", help="remove the systemd unit (and with --purge the config, state and user)")
    p.add_argument("--root", default="/", metavar="DIR", help="the DIR given to install --root")
    p.add_argument("--user", default="trainguard", help="service user (default: trainguard)")
    p.add_argument("--purge", action="store_true", help="also remove /etc/trainguard, /var/lib/trainguard, the user "
                                                        "and the /usr/local/bin/trainguard link to this trainguard")
    p = with_config(sub.add_parser(
        "xid", help="what the agent knows and does about XIDs (all of NVIDIA's catalog, or the codes given)",
        description="Print NVIDIA's catalog entry for each XID (mnemonic, description, immediate and investigatory "
                    "resolution bucket) and what this agent does about it with this config: status, how long it "
                    "lasts, the actions it runs, and why trainguard reads the bucket as it does. Without codes: one "
                    "line per code of the catalog."))
    p.add_argument("codes", nargs="*", type=int, metavar="CODE", help="XID numbers, e.g. 79 48 149")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--markdown", action="store_true",
                   help="print the table of docs/runbooks/gpu-xid.md: each response of the default config, its XIDs")
    p = with_config(sub.add_parser(
        "kernel", help="the kernel events the agent reads besides XIDs; given lines (or - for stdin), what each is",
        description="Without lines: the catalog of kernel events (trainguard/node/kernel_events.toml): each class, "
                    "its status, how it clears, what the operator does. With lines (paste dmesg, journalctl -k or "
                    "syslog output; - reads stdin): which event each is, what it names, the status, the actions this "
                    "config runs for it, and why. Lines that are no event are left out."))
    p.add_argument("lines", nargs="*", metavar="LINE", help="kernel log lines, or - for stdin")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--markdown", action="store_true", help="print the catalog table of docs/kernel-events.md")
    p = with_config(sub.add_parser(
        "diag", help="run the active diagnostics (dcgmi, nvidia-smi, all_reduce_perf, perftest, ibstat) now",
        description="Run a diagnostics level with the tools and figures of the `diag` action's settings "
                    "(docs/diagnostics.md), one test after another within the level's budget. Refused while a "
                    "job holds the GPUs. Exit code: 0 passed, 1 a warning, 2 a test failed, 3 a test gave no "
                    "result or the run was refused."))
    p.add_argument("--level", choices=["quick", "standard", "long"], help="default: the `diag` action's level")
    p.add_argument("--action", default="diag", metavar="NAME", help="the diag action whose settings to use")
    p.add_argument("--json", action="store_true", help="print JSON")
    sub.add_parser("config-reference", help="print the configuration reference (markdown) generated from the code")
    sub.add_parser("metrics-reference", help="print every metric the agent exports (markdown), from their declarations")
    for hook, when in (("slurm-prolog", "starts"), ("slurm-epilog", "ends")):
        p = with_config(sub.add_parser(
            hook, help=f"SLURM {hook[6:].capitalize()} hook: record the job that {when} for the agent; with --check, "
                       "gate the node",
            description=f"Run by slurmd (as root, from a Prolog=/Epilog= script) when a job {when} on this node: "
                        "writes what slurmd's environment says of the job to a small file the agent reads "
                        "(docs/slurm.md). Reads no config, calls no SLURM command, always exits 0. With --check, "
                        "then gates the node, still without a SLURM command, and exits 2 when it fails (SLURM "
                        "drains the node): " + ("the config's gate checks within --budget" if hook == "slurm-prolog"
                                                else "no process of the job left, GPU memory back, /dev/shm clean")
                        + "."))
        p.add_argument("--dir", default="/run/trainguard/jobs", metavar="DIR",
                       help="where the records go: the agent's [jobs] prolog_dir (default: /run/trainguard/jobs)")
        p.add_argument("--check", action="store_true", help="after the record, gate the node (exit 2 on failure)")
        p.add_argument("--gate-dir", default=GATE_DIR, metavar="DIR",
                       help=f"where the gates leave their verdicts and the GPU memory baseline (default: {GATE_DIR})")
        if hook == "slurm-prolog":
            p.add_argument("--checks", default="", metavar="NAMES",
                           help="comma-separated checks of the config to run (default: gpu, xid and the disk checks "
                                "that name paths)")
            p.add_argument("--budget", default="10s", type=parse_duration, metavar="DURATION",
                           help="past this the gate lets the job start (default 10s)")
            p.add_argument("--since", default="1h", type=since_arg, metavar="DURATION|boot",
                           help="count only kernel log records newer than this (default 1h)")
            p.add_argument("--diag", default="", metavar="ACTION",
                           help="after the checks, the quick diagnostics of this diag action of the config, when its "
                                "budget_quick fits what is left of --budget (default: none)")
        else:
            p.add_argument("--shm-max", default="64MiB", type=parse_size, metavar="SIZE",
                           help="the job user's files allowed to remain in each --tmp dir (default 64MiB)")
            p.add_argument("--tmp", action="append", metavar="DIR",
                           help="a directory where the job's user must leave no more than --shm-max (repeatable; "
                                "default /dev/shm)")
            p.add_argument("--gpu-memory-slack", default="512MiB", type=parse_size, metavar="SIZE",
                           help="GPU memory in use allowed above the prolog gate's baseline (default 512MiB)")
            p.add_argument("--grace", default="3s", type=parse_duration, metavar="DURATION",
                           help="how long the job's processes may take to exit before they count (default 3s)")
    return parser


def cmd_gate(args: argparse.Namespace) -> int:
    """`slurm-prolog --check` / `slurm-epilog --check`: the record was written; now the node's verdict."""
    from trainguard.agent import gates

    if args.command == "slurm-epilog":
        return gates.run_epilog_gate(os.environ, args.gate_dir, args.tmp or ["/dev/shm"], args.shm_max,
                                     args.gpu_memory_slack, args.grace)
    config = _config(args)
    if isinstance(config, int):
        return config
    try:
        gated = gates.gate_config(config, [n for n in args.checks.split(",") if n])
        diag = gates.diag_settings(config, args.diag) if args.diag else None
    except KeyError as exc:
        print(f"trainguard prolog gate: {exc.args[0]}", file=sys.stderr)
        return EXIT_CONFIG
    return gates.run_prolog_gate(gated, args.gate_dir, args.budget, kernel_since_usec(args.since), diag=diag)


def _load(args: argparse.Namespace) -> Config:
    from trainguard.core.settings import PLAIN
    from trainguard.pipeline.config import default_state_dir

    # One-shot commands print results on stdout; their logs only matter when something is wrong.
    setup_logging(args.log_level or ("info" if args.command == "run" else "warning"))
    if args.command == "run":
        try:
            default_state_dir().mkdir(parents=True, exist_ok=True, mode=0o750)
        except OSError:
            pass  # a configured state_dir may be elsewhere; the store reports real problems
    if PLAIN:
        from trainguard.agent.plainconfig import ValidatorError, load_plain_config

        try:
            config = load_plain_config(args.config, args.log_level or "info")
        except ValidatorError as exc:  # not the config's fault: exit 1 (restarted), not 2 (fix the config)
            raise SystemExit(f"trainguard: {exc}") from None
    else:
        from trainguard.agent.configfile import load_config

        config = load_config(args.config)
    if args.command == "run" and not args.log_level:
        setup_logging(config.agent.log_level)
    return config


def _reloader(args: argparse.Namespace) -> Callable[[], Config]:
    """The agent's config read and validated again as at start (SIGHUP): ConfigError or ValidatorError when not."""
    from trainguard.core.settings import PLAIN

    def load() -> Config:
        if PLAIN:
            from trainguard.agent.plainconfig import load_plain_config

            return load_plain_config(args.config, args.log_level or "info")
        from trainguard.agent.configfile import load_config

        return load_config(args.config)

    return load


def _table(rows: list[list[str]]) -> str:
    # Summaries and subjects carry what a job's user wrote: one line per row, no escape sequence reaches a terminal.
    rows = [[one_line(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1] for r in rows)


def _warn(config: Config) -> bool:
    """Say on stderr what is valid in the config but almost surely not meant; whether there was anything."""
    for warning in config.warnings():
        print(f"trainguard: warning: {config.source or '(built-in default)'}: {warning}", file=sys.stderr)
    return bool(config.warnings())


def since_arg(value: str) -> float | None:
    """`--since`: seconds back from now, or None for `boot` (the whole of this boot's kernel log)."""
    if value.strip().lower() == "boot":
        return None
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, or 'boot'") from None


def duration_arg(value: str) -> str:
    try:
        parse_duration(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def kernel_since_usec(seconds: float | None) -> int | None:
    """Where `--since` starts in the kernel log's clock: microseconds since boot (CLOCK_MONOTONIC, what the kernel
    stamps records with); None (everything) for `boot` or a duration longer than the uptime."""
    if seconds is None:
        return None
    start = time.clock_gettime(time.CLOCK_MONOTONIC) - seconds
    return int(start * 1e6) if start > 0 else None


def cmd_check(config: Config, as_json: bool, critical_only: bool = False, drain: bool = False,
              since: float | None = None) -> int:
    from trainguard.pipeline.engine import Engine
    from trainguard.pipeline.store import Store

    _warn(config)  # stderr only: the exit code a SLURM health check reads stays that of the results

    engine = Engine(config, store=Store(None), notifiers={}, kernel_since_usec=kernel_since_usec(since))
    reports = engine.run_round(ingest=False)
    results = [r for report in reports for r in report.results]
    # Idle checks watch hardware this node lacks: listed, but they never change the exit code.
    idle = {report.check: report.idle_reason or "" for report in reports if report.outcome == "idle"}
    overall = worst(r.status for r in results)
    drained = _drain(engine, [r for r in results if r.status is Status.CRITICAL]) if drain else None
    if as_json:
        print(json.dumps({"node": config.agent.node_name, "status": overall.name,
                          "results": [r.to_dict() for r in results], "idle": idle, "drain": drained}, indent=1))
    else:
        rows = [["STATUS", "CHECK", "SUBJECT", "SUMMARY"]]
        rows += [[r.status.name, r.check, r.subject, r.summary]
                 for r in sorted(results, key=lambda r: (-r.status.severity, r.check, r.subject))]
        rows += [["IDLE", name, "-", reason] for name, reason in sorted(idle.items())]
        print(_table(rows))
        print(f"\n{config.agent.node_name}: {overall.name}")
        if drained:
            print(drained)
    if critical_only:
        return int(Status.CRITICAL) if overall is Status.CRITICAL else 0
    return int(overall)


def _drain(engine: Engine, critical: list[Result]) -> str | None:
    """Drain through the configured `drain` action (its reason format, its own-drain tag), as an incident would."""
    import time
    import uuid

    from trainguard.core.events import Event, EventKind

    if not critical:
        return None
    if "drain" not in engine.responder.actions:
        return "drain: no `drain` action configured"
    summary = "; ".join(f"{r.check}: {r.summary}" for r in critical)
    now = time.time()
    event = Event(EventKind.FIRED, f"check-{uuid.uuid4().hex[:8]}", critical[0].check, critical[0].subject,
                  Status.CRITICAL, summary, engine.responder.node, now, now)
    record = engine.responder.run_named("drain", event)
    return f"drain: {record['outcome']}: {record['detail']}"


def cmd_kernel(config: Config, lines: list[str], as_json: bool, markdown: bool) -> int:
    from trainguard.checks.kernel import KernelSettings, explain_lines
    from trainguard.node.kernel_events import catalog

    if markdown:
        from trainguard.reference import kernel_markdown

        print(kernel_markdown(), end="")
        return 0
    name = next((n for n in config.checks if config.kind_of_check(n) == "kernel"), None)
    settings = config.checks[name] if name is not None else KernelSettings()
    assert isinstance(settings, KernelSettings)
    if not lines:
        rows = [["CLASS", "KIND", "STATUS", "CLEARS", "TITLE"]]
        rows += [[c.name, c.kind, "counted" if c.counted else c.severity.name, c.clearing()[:60], c.title]
                 for c in catalog().values() if c.role == "event" and c.pattern is not None]
        if as_json:
            print(json.dumps([{"class": r[0], "kind": r[1], "status": r[2], "title": r[4]} for r in rows[1:]], indent=1))
        else:
            print(_table(rows))
        return 0
    text = sys.stdin.read().splitlines() if lines == ["-"] else lines
    found = explain_lines(text, settings)
    if as_json:
        print(json.dumps(found, indent=1))
        return 0
    for e in found:
        names = ", ".join(f"{k}={v}" for k, v in e["names"].items())
        print(f"{e['class']} ({e['title']}) on {e['subject']}: {e['status']}"
              + (" node fault" if e["node_fault"] and e["status"] == "CRITICAL" else "")
              + f"\n  names: {names}\n  actions: {', '.join(e['actions']) or 'none'}\n  why: {e['why']}"
              f"\n  lever: {e['lever']}\n  line: {e['line'][:200]}")
    if not found:
        print("no kernel event in these lines")
    return 0


def cmd_diag(config: Config, action: str, level: str | None, as_json: bool) -> int:
    from trainguard.actions.diag import gpu_holders, run_level
    from trainguard.agent.gates import diag_settings
    from trainguard.jobs.slurm import SlurmClient
    from trainguard.pipeline.ledger import record_diag

    try:
        settings = diag_settings(config, action)
    except KeyError as exc:
        print(f"trainguard: {exc.args[0]}", file=sys.stderr)
        return EXIT_CONFIG
    chosen = level or getattr(settings, "level", None) or getattr(settings, "validation", "quick")
    chosen = "quick" if chosen == "none" else chosen
    slurm = SlurmClient(config.jobs.slurm_timeout, config.jobs.slurm_bin_dir)
    report = run_level(settings, chosen, lambda: gpu_holders(slurm, config.jobs.slurm_node))
    unrecorded = record_diag(config.agent.state_dir, config.agent.node_name, report, "cli",
                             config.ledger.boot_id_path)
    if unrecorded and not report.refused and report.results:
        print(f"trainguard diag: {unrecorded}", file=sys.stderr)
    if as_json:
        print(json.dumps({"node": config.agent.node_name, **report.to_dict()}, indent=1))
    else:
        rows = [["STATUS", "TEST", "SUMMARY"]] + [[r.status.name, r.subject, r.summary] for r in report.results]
        if len(rows) > 1:
            print(_table(rows) + "\n")
        print(f"{config.agent.node_name}: {report.summary()}")
    return int(report.status)


def cmd_xid(config: Config, codes: list[int], as_json: bool) -> int:
    from trainguard.checks.xid import XidSettings, explain
    from trainguard.gpu.xid_catalog import catalog

    name = next((n for n in config.checks if config.kind_of_check(n) == "xid"), None)
    settings = config.checks[name] if name is not None else XidSettings()
    assert isinstance(settings, XidSettings)
    where = f"[checks.{name}]" if name is not None else "xid check defaults; the check is not in this config"
    entries = [explain(code, settings) for code in (codes or sorted(catalog()))]
    for e in entries:  # the actions its most severe outcome runs
        e["actions"] = settings.actions.for_status(Status[e["worst"]])
    if as_json:
        print(json.dumps({"config": where, "xids": entries}, indent=1))
        return 0
    if not codes:
        rows = [["XID", "RESPONSE", "NVIDIA-IMMEDIATE", "MNEMONIC"]]
        rows += [[str(e["xid"]), e["response"], e["nvidia_immediate"] or "-", e["mnemonic"]] for e in entries]
        print(_table(rows))
        print(f"\n{len(entries)} codes; `trainguard xid CODE` for one in full. Responses as set by {where}.")
        return 0
    for e in entries:
        print(f"XID {e['xid']} {e['mnemonic']}")
        print(f"  NVIDIA      {e['description']}")
        if e["known"]:
            print(f"              immediate {e['nvidia_immediate'] or '(none)'}, investigatory "
                  f"{e['nvidia_investigatory'] or '(none)'}")
        print(f"  trainguard  {e['response']} ({e['source']}): {e['status']}")
        print(f"  advice      {e['todo']}")
        for verdict, d in e.get("decode", {}).items():
            rows = f", {d['rows']} table rows" if d["rows"] else ""
            print(f"  decode      {verdict}: {d['response']} ({d['status']}){rows}" + (f"; {d['why']}" if d["why"] else ""))
        for action, todo in e.get("recovery_actions", {}).items():
            print(f"  recovery    {action}: {todo}")
        if e["why"]:
            print(f"  why         {e['why']}")
        print(f"  actions     {', '.join(e['actions']) or 'none'} ({where})")
    return 0


def cmd_notify_test(config: Config, channel: str | None) -> int:
    import time
    import uuid

    from trainguard.core.events import Event, EventKind
    from trainguard.notifiers.base import NotifierError
    from trainguard.pipeline.engine import Engine
    from trainguard.pipeline.store import Store

    notifiers = Engine(config, store=Store(None)).notifiers
    source = config.source or "the built-in default config"
    if channel is not None and channel not in notifiers:
        if channel in config.notifiers:
            problem = f"[notifiers.{channel}] in {source} has enabled = false; remove that line to test it"
        else:
            problem = (f"no [notifiers.{channel}] table in {source} (enabled channels: "
                       f"{', '.join(notifiers) or 'none'}); docs/notifications.md shows each channel's keys")
        print(f"trainguard notify-test: {problem}", file=sys.stderr)
        return EXIT_CONFIG
    if not notifiers:
        print(f"trainguard notify-test: no enabled notification channel in {source}: add a [notifiers.NAME] table "
              "(console, slack, email, alertmanager, webhook; docs/notifications.md)", file=sys.stderr)
        return EXIT_CONFIG
    # A test message is the channel's credentials and transport, not its routing: say so, and what routing would
    # keep out, so that "ok" is not read as "real alerts arrive".
    print("test messages bypass each channel's routing (min_severity, send_resolved, checks, exclude_checks, match, "
          "exclude_match); real alerts pass through it")
    now = time.time()
    event = Event(EventKind.FIRED, f"test-{uuid.uuid4().hex[:8]}", "notify-test", "test", Status.WARNING,
                  "trainguard test message: this channel works", config.agent.node_name, now, now)
    failed = 0
    for name, notifier in notifiers.items():
        if channel is not None and name != channel:
            continue
        try:
            notifier.deliver([event])
            print(f"{name}: ok" + (f" (routing: {rules})" if (rules := _routing(notifier.settings)) else ""))
        except NotifierError as exc:
            failed += 1
            print(f"{name}: FAILED ({'permanent' if exc.permanent else 'transient'}): {exc}")
    return 1 if failed else 0


def _routing(settings: NotifierSettings) -> str:
    """A channel's routing rules that differ from their defaults, as written in the config."""
    defaults = type(settings).model_fields
    keys = ("min_severity", "send_resolved", "checks", "exclude_checks", "match", "exclude_match")
    dumped = settings.model_dump(mode="json", include=set(keys))
    return ", ".join(f"{key} = {json.dumps(dumped[key])}" for key in keys
                     if getattr(settings, key) != defaults[key].get_default(call_default_factory=True))


def cmd_status(config: Config, url: str | None, as_json: bool) -> int:
    from trainguard.agent.client import AgentUnreachableError, fetch

    try:
        data, where = fetch(config, "/status", url, lambda note: print(f"trainguard: {note}", file=sys.stderr))
    except AgentUnreachableError as exc:
        print(f"trainguard: cannot reach the agent: {exc}", file=sys.stderr)
        if url is None:  # where it looked came from the config: say which, and how to point elsewhere
            listen = config.agent.listen or "(none)"
            print(f"trainguard: is the agent running? The address is agent.listen = {listen!r} of "
                  f"{config.source or 'the built-in default config'}; pass the agent's config with --config PATH, "
                  "or its address with --url http://HOST:PORT", file=sys.stderr)
        return 3
    if as_json:
        print(json.dumps(data, indent=1))
        return 0
    print(f"node {data['node']}  version {data['version']}  pid {data['pid']}  "
          f"healthy {'yes' if data['healthy'] else 'NO'}  ({where}"
          + ("" if data.get("details", True) else f": no summaries, no job names; {ON_THE_SOCKET}") + ")")
    _print_incidents(data.get("incidents", []))
    for s in data.get("silences", []):
        until = time.strftime("%Y-%m-%d %H:%M", time.localtime(s["until"]))
        print("\n" + one_line(f"silenced: {s['check']}" + (f"/{s['subject']}" if s.get("subject") else "")
                              + f" until {until} by {s['by']}{_said(s, 'reason', ': ')}"))
    if data.get("jobs"):
        _print_jobs(data["jobs"])
    print("\nlast results (AGE: since the run that said it)\n" + _table(_result_rows(data)))
    return 0


def _print_incidents(incidents: list[dict[str, Any]]) -> None:
    print(f"\nincidents ({sum(1 for i in incidents if i['firing'])} firing, "
          f"{sum(1 for i in incidents if not i['firing'])} pending)")
    if incidents:
        print(_table([["STATE", "STATUS", "CHECK", "SUBJECT", "SUMMARY"]] + [
            ["firing" if i["firing"] else "pending", i["status"], i["check"], i["subject"], _said(i, "summary")]
            for i in incidents]))
    for i in incidents:
        if i.get("acked"):
            print(one_line(f"  {i['check']}/{i['subject']}: acknowledged by {i['acked']['by']}"
                           + _said(i["acked"], "reason", ": ")))
        for a in i.get("actions", []):
            print(one_line(f"  {i['check']}/{i['subject']}: action {a['action']} {a['outcome']}"
                           + _said(a, "detail", ": ")))


def _result_rows(data: dict[str, Any]) -> list[list[str]]:
    """Each check's last results with their age: a summary ("progressing (heartbeat step 12, 0s ago)") speaks as of
    its run, up to a check interval ago; a result about a job that has ended since says so."""
    now = data.get("now") or time.time()  # the agent's clock (a document of an older agent lacks it: ours)
    rows = [["STATUS", "CHECK", "SUBJECT", "AGE", "SUMMARY"]]
    for name, chk in data.get("checks", {}).items():
        age = format_duration(now - chk["last_run"]) if chk.get("last_run") else "-"
        rows += [[r["status"], name, r["subject"], age, ("(job ended) " if r.get("job_ended") else "")
                  + _said(r, "summary")] for r in chk.get("results", [])]
        if chk.get("outcome") == "idle":
            rows.append(["IDLE", name, "-", age, chk.get("idle_reason") or ""])
    return rows


ON_THE_SOCKET = "they are on the control socket (root or the trainguard group)"


def _said(data: dict[str, Any], key: str, prefix: str = "") -> str:
    """A text of /status after `prefix`; where there is none (the TCP view leaves texts out), nothing after a prefix
    and "-" in a column."""
    return f"{prefix}{data[key]}" if data.get(key) else ("" if prefix else "-")


def _print_jobs(jobs: dict[str, Any]) -> None:
    print("\n" + one_line(f"jobs on this node ({', '.join(jobs['sources'])}"
                          + "".join(f"; {src} ERROR: {err}" for src, err in jobs.get("errors", {}).items()) + ")"))
    if jobs["jobs"]:
        print(_table([["KEY", "NAME", "USER", "STATE", "PIDS"]] + [
            [j["key"], j.get("name") or "-", j.get("user") or "-", j["state"], ",".join(map(str, j.get("pids") or []))
             or "-"] for j in jobs["jobs"]]))


def cmd_operator(config: Config, args: argparse.Namespace) -> int:
    from trainguard.agent.client import (
        COMMAND_TIMEOUT_S,
        AgentUnreachableError,
        CommandPendingError,
        CommandRefusedError,
        command,
    )

    body = {"target": args.target, "reason": args.reason}
    if args.command == "silence":
        body["for"] = args.duration
    timeout = COMMAND_TIMEOUT_S
    check = config.checks.get(args.target.partition("/")[0])
    if args.command == "clear" and check is not None:  # it waits for that check's run under way
        timeout += check.timeout
    try:
        reply, _ = command(config, "/" + ("ack" if args.command == "ack" else args.command), body, timeout)
    except CommandRefusedError as exc:
        print(f"trainguard {args.command}: {exc}", file=sys.stderr)
        return 1
    except CommandPendingError as exc:
        print(f"trainguard {args.command}: not answered yet: {exc}", file=sys.stderr)
        return 4
    except AgentUnreachableError as exc:
        print(f"trainguard {args.command}: cannot reach the agent: {exc}", file=sys.stderr)
        return 3
    print(reply["done"])
    return 0


def cmd_history(config: Config, args: argparse.Namespace) -> int:
    import time
    from dataclasses import asdict

    from trainguard.pipeline.ledger import read_history
    from trainguard.pipeline.store import SchemaTooNewError

    component = args.gpu or args.component or (config.agent.node_name if args.node else None)
    try:
        rows, held = read_history(config.agent.state_dir, time.time() - parse_duration(args.since), component,
                                  "gpu" if args.gpu else None)
    except SchemaTooNewError as exc:
        print(f"trainguard history: {exc}", file=sys.stderr)
        return EXIT_SCHEMA
    except FileNotFoundError as exc:
        print(f"trainguard history: {exc}: the agent has not run here with this config", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"held": [asdict(h) for h in held], "entries": [asdict(r) for r in rows]}, indent=2))
        return 0
    for hold in held:
        print(f"HELD ({hold.rule}): {hold.reason}; trainguard clear lemon/{hold.subject} --reason ... once repaired")
    if not rows:
        print("no entries" + (f" for {component}" if component else "") + f" in the last {args.since}")
        return 0
    print(_table([["WHEN (UTC)", "KIND", "COMPONENT", "EVENT", "CLASS", "SUMMARY"]] + [
        [time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r.at)), r.kind, r.component, r.event, r.cls or "-",
         one_line(r.summary, 120)] for r in rows]))
    return 0


def cmd_selftest(config: Config) -> int:
    from trainguard.agent.client import AgentUnreachableError, CommandPendingError, CommandRefusedError, command
    from trainguard.pipeline.selftest import GIVE_UP_S

    kmsg = os.access("/dev/kmsg", os.W_OK)  # root: the kernel path is tested too
    try:
        test, where = command(config, "/selftest", {"kmsg": kmsg, "reason": "trainguard selftest"})
        print(f"trainguard selftest {test['id']} on {test['node']} ({where}): everything it sends says "
              "[trainguard selftest] TEST; no action runs for it")
        if kmsg and test.get("kernel_readers"):
            _write_kmsg(test["record"])
        shown, deadline = 0, time.monotonic() + GIVE_UP_S
        while True:
            for hop in test["hops"][shown:]:
                mark = {True: "ok", False: "FAILED", None: "skipped"}[hop["ok"]]
                print(one_line(f"{hop['at']:7.2f}s  {hop['path']:<8} {hop['hop']:<28} {mark:<7} {hop['detail']}", 2000))
            shown = len(test["hops"])
            if test["done"] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
            test, _ = command(config, "/selftest", None)
    except CommandRefusedError as exc:
        print(f"trainguard selftest: {exc}", file=sys.stderr)
        return 1
    except (AgentUnreachableError, CommandPendingError) as exc:
        print(f"trainguard selftest: cannot reach the agent: {exc}", file=sys.stderr)
        return 3
    failed = [f"{h['hop']}: {h['detail']}" for h in test["hops"] if h["ok"] is False]
    if not test["done"]:
        failed.append(f"not finished after {GIVE_UP_S:g}s (`trainguard selftest` again shows it once done)")
    for line in failed:
        print(one_line(f"trainguard selftest: FAILED {line}", 2000), file=sys.stderr)
    print(f"selftest {'FAILED' if failed else 'passed'}: {len(test['hops']) - len(failed)} of {len(test['hops'])} "
          "hops passed" + (" (skipped ones say why)" if any(h["ok"] is None for h in test["hops"]) else ""))
    return 1 if failed else 0


def _write_kmsg(record: str) -> None:
    """The test record, at priority info: a line in `dmesg` that says what it is, shaped like no fault."""
    try:
        fd = os.open("/dev/kmsg", os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, f"<6>{record}\n".encode())
        finally:
            os.close(fd)
    except OSError as exc:  # the agent's kernel hop fails, and says so: this says why
        print(f"trainguard selftest: writing the test record to /dev/kmsg failed: {exc}", file=sys.stderr)


def cmd_install(args: argparse.Namespace) -> int:
    from pathlib import Path

    from trainguard.install import NEXT_STEPS, Installer, InstallError, documentation, dropins, executable_path, path_link

    installer = Installer(Path(args.root), args.user, with_dropins=tuple(getattr(args, "dropin", ())))
    try:
        done = installer.uninstall(args.purge) if args.command == "uninstall" else installer.install()
    except (InstallError, OSError) as exc:
        print(f"trainguard {args.command}: {exc}", file=sys.stderr)
        return 1
    print("\n".join(done))
    if args.command == "install":
        print(NEXT_STEPS.format(config=installer.config_path, user=args.user, dropins=", ".join(dropins()),
                                docs=documentation(), trainguard=executable_path(),
                                link=path_link(executable_path())), end="")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "run" and "trainguard.core.settings" not in sys.modules:
        # The agent's own process holds its settings as plain classes, validated by a child (see
        # trainguard.core.settings): the mode is fixed at that module's import, and only for this process.
        os.environ[PLAIN_SETTINGS_ENV] = "1"
        import trainguard.core.settings  # noqa: F401
    os.environ.pop(PLAIN_SETTINGS_ENV, None)  # never inherited: not by the child, an action's command or a hook
    if args.command in ("slurm-prolog", "slurm-epilog"):
        from trainguard.jobs.prolog import run_hook

        recorded = run_hook(args.dir, os.environ, ended=args.command == "slurm-epilog")  # always first, always 0
        return cmd_gate(args) if args.check else recorded
    if args.command in ("install", "uninstall"):
        return cmd_install(args)
    if args.command in ("config-reference", "metrics-reference"):
        from trainguard.reference import markdown, metrics_markdown

        print(markdown() if args.command == "config-reference" else metrics_markdown(), end="")
        return 0
    try:
        config = _config(args)
        if isinstance(config, int):
            return config
        if args.command != "run":
            return _one_shot(config, args)
    except PermissionError as exc:  # here once, for every command: what was refused, in one line
        print(f"trainguard: {args.command} needs root or the trainguard group ({_refused(exc)})", file=sys.stderr)
        return EXIT_NOPERM
    from trainguard.agent.daemon import run_daemon
    from trainguard.pipeline.store import SchemaTooNewError

    try:
        return run_daemon(config, reload=_reloader(args))
    except SchemaTooNewError as exc:  # a downgrade: refused in one line, the database left as it is
        print(f"trainguard: {exc}", file=sys.stderr)
        return EXIT_SCHEMA


def _refused(exc: PermissionError) -> str:
    return one_line(f"{exc.filename}: permission denied" if exc.filename else str(exc.strerror or exc), 300)


def _config(args: argparse.Namespace) -> Config | int:
    """The config, or the exit code of a config error. `status`, `xid` and `kernel` go on with the built-in defaults
    when this user may not read the config (/etc/trainguard is root's and the trainguard group's): what any user may
    see of the agent, NVIDIA's catalog and the kernel events' catalog need none of it."""
    from trainguard.pipeline.config import ConfigError

    try:
        return _load(args)
    except ConfigError as exc:
        print(f"trainguard: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except PermissionError as exc:
        if args.command not in ("status", "xid", "kernel"):
            raise
        from trainguard.agent.configfile import default_config

        then = ("the default responses (this node's config may differ)" if args.command in ("xid", "kernel")
                else f"--url {args.url}" if args.url else "the agent's default address (--url for another)")
        print(f"trainguard: {_refused(exc)}: {args.command} goes on with {then}", file=sys.stderr)
        return default_config(nvml_probe=lambda: "not needed by this command")


def cmd_validate(config: Config) -> int:
    """The effective config, and whether a running agent would take it at a reload: its engine built as the agent's
    reload builds it first (trainguard.agent.daemon.refusal). Warnings keep exit 0: the agent starts, and says them."""
    from trainguard.agent.daemon import refusal

    print(json.dumps(config.to_dict(), indent=2))
    warned = _warn(config)
    source = config.source or "(built-in default)"
    why = refusal(config)
    if why is not None:
        print(f"trainguard validate: {source} parses, but a running agent would refuse it at `systemctl reload "
              f"trainguard` (and keep its own): {one_line(why, 2000)}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"config OK: {source}" + (" (with warnings)" if warned else "") + "; a running agent takes it at "
          "`systemctl reload trainguard` (a config it refuses, it says why in the journal and keeps its own)",
          file=sys.stderr)
    return 0


def _one_shot(config: Config, args: argparse.Namespace) -> int:
    if args.command == "validate":
        return cmd_validate(config)
    if args.command == "check":
        return cmd_check(config, args.json, args.critical_only, args.drain, args.since)
    if args.command == "status":
        return cmd_status(config, args.url, args.json)
    if args.command == "notify-test":
        return cmd_notify_test(config, args.channel)
    if args.command in ("ack", "silence", "clear"):
        return cmd_operator(config, args)
    if args.command == "kernel":
        return cmd_kernel(config, args.lines, args.json, args.markdown)
    if args.command == "history":
        return cmd_history(config, args)
    if args.command == "diag":
        return cmd_diag(config, args.action, args.level, args.json)
    if args.command == "selftest":
        return cmd_selftest(config)
    assert args.command == "xid", args.command
    if args.markdown:
        from trainguard.reference import xid_markdown

        print(xid_markdown(), end="")
        return 0
    return cmd_xid(config, args.codes, args.json)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
