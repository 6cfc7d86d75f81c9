"""A config as comparable data, from either settings mode (trainguard.core.settings): each settings object as its
class and its fields, every value with its type. `python -m tests.helpers.settings_tree [CONFIG]` prints the tree
of the config as the agent's process holds it (plain mode, validated by the child) and which pydantic modules that
process loaded."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any


def tree(value: Any) -> Any:
    from trainguard.core.settings import PlainSettings

    fields = type(value)._fields if isinstance(value, PlainSettings) else getattr(type(value), "model_fields", None)
    if isinstance(fields, dict):
        return {"class": f"{type(value).__module__}.{type(value).__qualname__}",
                **{name: tree(getattr(value, name)) for name in fields}}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"dataclass": type(value).__qualname__,
                **{f.name: tree(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if hasattr(value, "get_secret_value"):
        return {"secret": value.get_secret_value()}
    if isinstance(value, dict):
        return {"dict": {str(k): tree(v) for k, v in value.items()}}
    if isinstance(value, (list, tuple)):
        return {type(value).__name__: [tree(v) for v in value]}
    if isinstance(value, (set, frozenset)):
        return {type(value).__name__: sorted((tree(v) for v in value), key=repr)}
    return [type(value).__module__, type(value).__qualname__, repr(value)]


def built(engine: Any) -> dict[str, str]:
    """What the engine made of each check (a check whose build failed is a stand-in of another class)."""
    return {name: type(check).__qualname__ for name, check in engine.checks.items()}


def main() -> int:
    os.environ["TRAINGUARD_PLAIN_SETTINGS"] = "1"  # what `trainguard run` does for its own process
    from trainguard.agent.plainconfig import load_plain_config
    from trainguard.core.settings import PLAIN

    config = load_plain_config(sys.argv[1] if len(sys.argv) > 1 else None, "warning")
    # What the agent's engine builds from it: its checks, notifiers and actions, in the same process.
    from trainguard.pipeline.engine import Engine

    engine = Engine(config, self_check=True)
    print(json.dumps({"plain": PLAIN, "tree": tree(config), "checks": built(engine),
                      "pydantic": sorted(m for m in sys.modules if m.split(".")[0] in ("pydantic", "pydantic_core"))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
