"""SLURM hostlist expressions (`gpu[01-04,07],login1`) without shelling out to scontrol."""

from __future__ import annotations

from trainguard.core.text import linear

_RANGE = linear(r"^(\d+)(?:-(\d+))?$")
_BRACKET = linear(r"^([^\[]*)\[([^\]]+)\](.*)$")


def _split_top(expr: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in expr:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        parts.append(cur)
    return parts


MAX_HOSTS = 65536  # more nodes than any one job spans: a larger expression is refused, not expanded


def expand(expr: str) -> list[str]:
    """Raises ValueError for a malformed expression or one naming more than MAX_HOSTS hosts."""
    hosts: list[str] = []
    for part in _split_top(expr.strip()):
        match = _BRACKET.match(part)
        if not match:
            hosts.append(part)
            continue
        prefix, body, suffix = match.groups()
        for item in body.split(","):
            rng = _RANGE.match(item)
            if not rng:
                raise ValueError(f"invalid hostlist range {item!r} in {expr!r}")
            lo, hi = rng.group(1), rng.group(2) or rng.group(1)
            if len(lo) > 9 or len(hi) > 9 or int(hi) - int(lo) >= MAX_HOSTS:
                raise ValueError(f"hostlist range {item[:40]!r} too large")
            width = len(lo)
            for n in range(int(lo), int(hi) + 1):
                hosts.extend(expand(f"{prefix}{n:0{width}d}{suffix}"))
                if len(hosts) > MAX_HOSTS:
                    raise ValueError(f"hostlist {expr[:60]!r} names more than {MAX_HOSTS} hosts")
    return hosts
