"""A recipe as flat dotted keys (`trainer.checkpoint.every`, `monitors.0.name`): the one spelling used
by drift checks on resume and by MLflow params, so both name a setting the same way."""

from __future__ import annotations

from typing import Any


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Nested recipe data -> {dotted key: leaf value}; lists of blocks by index, lists of plain values
    (and empty containers) as leaves."""
    out: dict[str, Any] = {}
    if isinstance(data, dict) and data:
        for k, v in data.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(data, list) and data and any(isinstance(v, (dict, list)) for v in data):
        for i, v in enumerate(data):
            out.update(flatten(v, f"{prefix}.{i}"))
    else:
        out[prefix] = data
    return out
