"""Each warning once per rank: a library that warns on every call must not flood the console.

DeepSpeed's ZeRO collectives call torch's deprecated `all_gather_into_tensor` / `reduce_scatter_tensor`
on every step, and torch's own `warnings.catch_warnings` blocks reset the per-location registry that
Python's default filter dedupes with: a 440-step ZeRO-3 run printed ~1,760 warning lines. Filters
cannot fix it (other code installs its own), so the rank's `warnings.showwarning` -- the documented
hook that prints a warning that passed the filters -- prints each (category, text) once.
"""

from __future__ import annotations

import warnings

_shown: set = set()


def show_each_warning_once() -> None:
    """Replace `warnings.showwarning` in this process (idempotent)."""
    original = warnings.showwarning
    if getattr(original, "__trainkit_once__", False):
        return

    def once(message, category, filename, lineno, file=None, line=None):
        key = (category, str(message))
        if key in _shown:
            return
        _shown.add(key)
        original(message, category, filename, lineno, file, line)

    once.__trainkit_once__ = True
    warnings.showwarning = once
