"""Running the external tools the agent relies on (SLURM commands, quota tools): a timeout always, and every
failure turned into one readable error of the caller's kind."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence


def run_tool(argv: Sequence[str], timeout: float, error: type[Exception], *, label: str | None = None,
             hint: str = "", ok_codes: tuple[int, ...] | None = (0,), env: Mapping[str, str] | None = None,
             with_stderr: bool = False, missing: type[Exception] | None = None) -> str:
    """stdout of `argv`; `error(message)` when it is missing, times out, fails to start or exits outside `ok_codes`.
    `label` names the command in messages (default: the whole argv); `hint` follows a timeout message.
    `ok_codes=None`: any exit status, for a tool that exits non-zero on a partial answer the caller still reads;
    `with_stderr`: stderr follows stdout, for a tool that reports part of its answer there; `missing`: raised instead
    of `error` when the tool is not installed (a subclass of it, for callers that tell the two apart)."""
    name = label or " ".join(argv)
    tool = os.path.basename(argv[0])
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                              errors="replace", env=dict(env) if env is not None else None)
    except FileNotFoundError:
        raise (missing or error)(f"{tool} not installed (not found on PATH)") from None
    except subprocess.TimeoutExpired:
        raise error(f"{name} timed out after {timeout:g}s{hint}") from None
    except OSError as exc:
        raise error(f"{tool} failed to start: {exc}") from None
    if ok_codes is not None and proc.returncode not in ok_codes:
        said = (proc.stderr or proc.stdout).strip().splitlines()
        raise error(f"{name} exited {proc.returncode}: {said[-1] if said else 'no output'}")
    return proc.stdout + proc.stderr if with_stderr else proc.stdout
