"""Recipe drift on resume: which changes between the checkpoint's recipe and the relaunched one may
continue the run, and which would silently train a different job.

*Safe* keys change only speed or observation (data loading, DDP bucketing, performance options,
monitors, tracking, log/eval/checkpoint cadence, restarts and timeouts). Every other change — model,
data content, strategy numerics, precision, optimizer, scheduler, batch, seed, world size — is drift:
`trainkit run` refuses it unless `--accept-changes` is given. This module is the one place that says
which is which (docs/running.md lists the same keys; a test keeps them equal). A plugin's options
model declares its own safe options with a `resume_safe_options` ClassVar.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from .flat import flatten

SAFE_KEYS = (
    "data.num_workers", "data.prefetch_factor", "data.pin_memory", "data.persistent_workers",
    "strategy.bucket_cap_mb", "strategy.static_graph", "strategy.gradient_as_bucket_view",
    "performance.*",
    "monitors", "monitors.*",
    "tracking.*",
    "trainer.log_every", "trainer.eval_every", "trainer.eval_steps", "trainer.checkpoint.*", "trainer.resume",
    "trainer.on_nonfinite", "trainer.max_skipped_steps",
    "launch.max_restarts", "launch.timeout_s", "launch.hang_timeout_s", "launch.debug_collectives", "launch.join_timeout_s",
    "launch.monitor_interval", "launch.run_dir",
    "launch.rdzv_backend", "launch.rdzv_endpoint", "launch.rdzv_id", "launch.node_rank",
)
SCHEDULES_USING_MAX_STEPS = ("cosine", "linear")  # lr_factor decays over max_steps: extending would jump lr


@dataclass(frozen=True)
class Change:
    key: str
    saved: Any
    now: Any

    def line(self) -> str:
        return f"  {self.key}: {_show(self.saved)} -> {_show(self.now)}"


def _show(value: Any) -> str:
    return "(unset)" if value is _MISSING else json.dumps(value, default=str)


_MISSING = object()


def changes(saved: dict, now: dict) -> list[Change]:
    a, b = flatten(saved), flatten(now)
    return [Change(k, a.get(k, _MISSING), b.get(k, _MISSING)) for k in sorted(set(a) | set(b))
            if a.get(k, _MISSING) != b.get(k, _MISSING)]


def is_safe(key: str, now: dict, plugin_safe: Iterable[str] = ()) -> bool:
    if key == "trainer.max_steps":
        return now.get("scheduler", {}).get("name", "constant") not in SCHEDULES_USING_MAX_STEPS
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in (*SAFE_KEYS, *plugin_safe))


@dataclass
class Drift:
    refused: list[Change]
    accepted: list[Change]

    def message(self, run_dir: str, name: str) -> str:
        lines = [f"the recipe changed since the checkpoint this run would resume from ({run_dir}):"]
        lines += [c.line() for c in self.refused]
        if any(c.key == "trainer.max_steps" for c in self.refused):
            lines.append("  (the learning-rate schedule decays over trainer.max_steps: changing it mid-run makes "
                         "the learning rate jump at the resumed step)")
        if any(c.key in ("launch.nproc_per_node", "launch.nnodes") for c in self.refused):
            lines.append("  (the world size differs from the one the checkpoint was saved with: per-rank data "
                         "positions and sharded states do not carry over)")
        lines.append(f"to train this recipe from scratch, give it another name (name={name}-2) or "
                     f"trainer.resume=never; to continue this run with the change, add --accept-changes "
                     f"(the MLflow run then continues in a new linked run with the new params)")
        return "\n".join(lines)


def compare(saved: dict, now: dict, plugin_safe: Iterable[str] = ()) -> Drift:
    found = changes(saved, now)
    safe = set(plugin_safe)
    return Drift(refused=[c for c in found if not is_safe(c.key, now, safe)],
                 accepted=[c for c in found if is_safe(c.key, now, safe)])


def plugin_safe_options(recipe) -> list[str]:
    """`block.option` keys that the recipe's plugins declare resume-safe (`resume_safe_options`)."""
    out: list[str] = []
    for block in ("model", "data", "strategy"):
        options = getattr(recipe, block, None)
        for option in getattr(type(options), "resume_safe_options", ()) if options is not None else ():
            out.append(f"{block}.{option}")
    return out


def summary(found: list[Change], limit: int = 400) -> Optional[str]:
    text = "; ".join(f"{c.key} {_show(c.saved)} -> {_show(c.now)}" for c in found)
    return text[:limit] if text else None
