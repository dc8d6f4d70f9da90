"""The doctor's output: an aligned plain-text table for people, JSON for CI."""

from __future__ import annotations

import json
from typing import Optional, Sequence

from .check import Check


def exit_code(checks: Sequence[Check]) -> int:
    """0 when nothing failed (warnings allowed), 1 when any check failed."""
    return 1 if any(c.status == "fail" for c in checks) else 0


def summary(checks: Sequence[Check]) -> str:
    counts = {s: sum(c.status == s for c in checks) for s in ("pass", "warn", "fail")}
    return ", ".join(f"{n} {s}" for s, n in counts.items())


def rows(checks: Sequence[Check]) -> str:
    """STATUS  CHECK  DETAIL, with each fix on the next line under its detail."""
    width = max([len(c.name) for c in checks] + [5])
    lines = []
    for c in checks:
        lines.append(f"{c.status.upper():<5} {c.name:<{width}}  {c.detail}")
        if c.fix and c.status != "pass":
            lines.append(f"{'':<5} {'':<{width}}  fix: {c.fix}")
    return "\n".join(lines)


def table(checks: Sequence[Check], title: Optional[str] = None) -> str:
    width = max([len(c.name) for c in checks] + [5])
    head = f"{'':<5} {'CHECK':<{width}}  DETAIL"
    out = ([title] if title else []) + [head, rows(checks), f"{summary(checks)} -> exit {exit_code(checks)}"]
    return "\n".join(out)


def as_json(checks: Sequence[Check], recipe: Optional[str]) -> str:
    return json.dumps({"recipe": recipe, "checks": [c.as_dict() for c in checks],
                       "summary": {s: sum(c.status == s for c in checks) for s in ("pass", "warn", "fail")},
                       "exit_code": exit_code(checks)}, indent=2)
