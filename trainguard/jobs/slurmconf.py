"""What this node's slurm.conf says, read from the file: no RPC to slurmctld for a fact every node holds."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_CONF = Path("/etc/slurm/slurm.conf")
_MAX = 4 << 20  # a slurm.conf is kilobytes; never read an arbitrary file whole


def conf_path() -> Path:
    return Path(os.environ.get("SLURM_CONF") or DEFAULT_CONF)


def cluster_name(path: Path | None = None) -> str:
    """`ClusterName=` of slurm.conf (keys are case-insensitive, `#` starts a comment); "" when absent or unreadable."""
    try:
        with (path or conf_path()).open("rb") as f:
            text = f.read(_MAX).decode("utf-8", "replace")
    except OSError:
        return ""
    for line in text.splitlines():
        key, sep, value = line.split("#", 1)[0].partition("=")
        if sep and key.strip().lower() == "clustername":
            return value.strip()[:128]
    return ""
