"""trainguard: a per-node watchdog agent for multi-day GPU training runs."""

from __future__ import annotations

__version__ = "0.1.0"
