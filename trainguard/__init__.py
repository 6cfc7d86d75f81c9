"""trainguard: a per-node watchdog agent for multi-day GPU training runs."""

from __future__ import annotations

__version__ = "0.1.0"

# Set by `trainguard run` for the imports of its own process only: the agent holds its settings as plain classes
# (trainguard.core.settings); every other process, the validating child included, never sees it.
PLAIN_SETTINGS_ENV = "TRAINGUARD_PLAIN_SETTINGS"
