"""`trainkit doctor`: can this machine run this recipe? One measured check per row (pass / warn /
fail), each failure with its fix. `trainkit run` repeats the quick subset before every launch.

Exit codes: 0 no check failed (warnings allowed), 1 at least one failed, 2 the recipe is invalid.
"""

from __future__ import annotations

import sys

from .check import Check
from .registry import CHECKS, run_checks
from .report import as_json, exit_code, rows, table

__all__ = ["Check", "CHECKS", "run_checks", "table", "as_json", "exit_code", "before_launch"]


def before_launch(resolved) -> int:
    """The quick checks for `trainkit run`: prints warnings and failures; returns how many failed."""
    checks = [c for c in run_checks(resolved, fast_only=True) if c.status != "pass"]
    if checks:
        print(resolved.redact_text(rows(checks)), file=sys.stderr)
    return sum(c.status == "fail" for c in checks)
