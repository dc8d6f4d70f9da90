"""The knobs `trainkit tune` can try: one table row per knob, easy to extend.

A row says which recipe key it sets, which strategies it applies to, which values to try for a
given recipe, whether it changes what is trained (`semantic`: only tried with `--allow`), and which
recipe keys it changes alongside (the batch rule scales the learning rate). Without `--knobs`, a
knob is tried when the bottleneck diagnosis names its key in its advice (so new advice picks up
the matching knob by itself); `--knobs` names knobs to try whatever the diagnosis says.

Performance options (`performance.channels_last`, `performance.compile`, ...) are rows only when
the installed schema has them: `performance_knobs()` reads the schema.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..recipe.blocks import PerformanceOptions
from ..recipe.schema import Recipe
from ..runtime import host_allocator

Values = Callable[[Recipe, dict], list[Any]]  # (recipe, machine facts) -> values to try (not the current one)
Applies = Callable[[Recipe, dict], Optional[str]]  # -> why it does not apply, or None


@dataclass(frozen=True)
class Knob:
    name: str
    path: str  # the recipe key it sets
    values: Values
    strategies: tuple[str, ...] = ()  # empty: any strategy
    semantic: Optional[str] = None  # "batch" | "precision": changes training itself; needs --allow
    applies: Optional[Applies] = None
    also: Callable[[Recipe, Any], dict[str, Any]] = field(default=lambda recipe, value: {})  # coupled keys
    note: Callable[[Recipe, Any], str] = field(default=lambda recipe, value: "")  # the semantic change, in words


def get(recipe: Recipe, path: str) -> Any:
    value: Any = recipe
    for part in path.split("."):
        value = getattr(value, part, None)
    return value


def _cpus_per_rank(recipe: Recipe) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, recipe.launch.nproc_per_node))


def _workers(recipe: Recipe, facts: dict) -> list[Any]:
    now, per_rank = recipe.data.num_workers, _cpus_per_rank(recipe)
    if now == 0:
        return [min(per_rank, 8)]
    return [min(per_rank, 16)] if now < per_rank else [now * 2]


def _needs_workers(recipe: Recipe, facts: dict) -> Optional[str]:
    return None if recipe.data.num_workers > 0 else "needs data.num_workers > 0 (tune num_workers first)"


def _needs_cuda(recipe: Recipe, facts: dict) -> Optional[str]:
    return None if facts.get("cuda") else "no effect without a CUDA device"


def _cpu_run(recipe: Recipe, facts: dict) -> Optional[str]:
    if facts.get("cuda") and recipe.launch.backend != "gloo":
        return "host malloc matters on CPU runs (on a GPU the tensors live in CUDA's caching allocator)"
    return None


def _host_allocators(recipe: Recipe, facts: dict) -> list[str]:
    """The CPU policies other than the one the run has; `auto` is the strategy's own measured choice
    (runtime.host_allocator), so tune tries the other one against it."""
    current = host_allocator.for_recipe(recipe, "cpu")  # imports the strategy (torch), as a trial will
    return [policy for policy in ("retain", "release") if policy != current]


def _flip(path: str, to: bool) -> Values:
    return lambda recipe, facts: [to] if get(recipe, path) != to else []


def _batch_values(recipe: Recipe, facts: dict) -> list[Any]:
    return [recipe.data.batch_size * 2, recipe.data.batch_size * 4]


def _batch_lr(recipe: Recipe, value: Any) -> dict[str, Any]:
    """The linear scaling rule (Goyal et al. 2017): the learning rate grows with the global batch."""
    return {"optimizer.lr": round(recipe.optimizer.lr * value / recipe.data.batch_size, 10)}


def _batch_note(recipe: Recipe, value: Any) -> str:
    k = value / recipe.data.batch_size
    gb = recipe.global_batch
    return (f"global batch {gb} -> {int(gb * k) if gb else '?'}, optimizer.lr {recipe.optimizer.lr:g} -> "
            f"{recipe.optimizer.lr * k:g} (linear scaling rule: lr x {k:g} with batch x {k:g}); fewer optimizer "
            f"steps per epoch")


def _lower_zero(recipe: Recipe, facts: dict) -> list[Any]:
    stage = recipe.strategy.zero_stage
    return [stage - 1] if stage > 0 else []


KNOBS: list[Knob] = [
    # data loading
    Knob("num_workers", "data.num_workers", _workers),
    Knob("prefetch_factor", "data.prefetch_factor", lambda r, f: [4] if (r.data.prefetch_factor or 2) < 4 else [],
         applies=_needs_workers),
    Knob("persistent_workers", "data.persistent_workers", _flip("data.persistent_workers", True),
         applies=_needs_workers),
    Knob("pin_memory", "data.pin_memory", _flip("data.pin_memory", True), applies=_needs_cuda),
    # DDP communication
    Knob("bucket_cap_mb", "strategy.bucket_cap_mb",
         lambda r, f: [25.0] if r.strategy.bucket_cap_mb < 25 else [r.strategy.bucket_cap_mb * 4], strategies=("ddp",)),
    Knob("static_graph", "strategy.static_graph", _flip("strategy.static_graph", True), strategies=("ddp",)),
    Knob("gradient_as_bucket_view", "strategy.gradient_as_bucket_view",
         _flip("strategy.gradient_as_bucket_view", True), strategies=("ddp",)),
    Knob("comm_hook", "strategy.comm_hook", lambda r, f: ["bf16_compress"] if r.strategy.comm_hook == "none" else [],
         strategies=("ddp",), semantic="precision",
         note=lambda r, v: f"gradients are all-reduced in {v.split('_')[0]} (fewer mantissa bits)"),
    # sharded strategies
    Knob("reshard_after_forward", "strategy.reshard_after_forward", _flip("strategy.reshard_after_forward", False),
         strategies=("fsdp",)),
    Knob("zero_stage", "strategy.zero_stage", _lower_zero, strategies=("deepspeed",)),
    # training semantics (only with --allow)
    Knob("batch_size", "data.batch_size", _batch_values, semantic="batch", also=_batch_lr, note=_batch_note),
    Knob("precision", "precision", lambda r, f: ["bf16"] if r.precision == "fp32" else [], semantic="precision",
         note=lambda r, v: f"precision {r.precision} -> {v} (autocast: lower-precision matmuls)"),
    Knob("tf32", "performance.tf32", _flip("performance.tf32", True), semantic="precision", applies=_needs_cuda,
         note=lambda r, v: "fp32 matmuls on TF32 tensor cores (~10 mantissa bits)"),
]


# performance options with their own row, used only when the installed schema has the field
PERFORMANCE_ROWS = [
    Knob("compile", "performance.compile", lambda r, f: [True] if not r.performance.compile else []),
    Knob("cudnn_benchmark", "performance.cudnn_benchmark", _flip("performance.cudnn_benchmark", True),
         applies=_needs_cuda),
    Knob("host_allocator", "performance.host_allocator", _host_allocators, applies=_cpu_run),
]
NOT_SPEED_KNOBS = {"sync_batchnorm"}  # changes what is computed (BatchNorm statistics), never a speed-up


def performance_knobs() -> list[Knob]:
    """The performance rows the schema has, plus a knob for every other boolean performance option the
    table does not name (channels_last, ... as they land): tried as `true`."""
    fields = PerformanceOptions.model_fields
    named = {k.path for k in KNOBS}
    found = [k for k in PERFORMANCE_ROWS if k.path.split(".")[1] in fields and k.path not in named]
    named |= {k.path for k in found}
    for name, info in fields.items():
        path = f"performance.{name}"
        if path not in named and name not in NOT_SPEED_KNOBS and info.annotation is bool:
            found.append(Knob(name, path, _flip(path, True)))
    return found


def all_knobs() -> dict[str, Knob]:
    return {k.name: k for k in KNOBS + performance_knobs()}


def not_applicable(knob: Knob, recipe: Recipe, facts: dict) -> Optional[str]:
    """Why `knob` cannot be tried on this recipe, or None."""
    if knob.strategies and recipe.strategy.name not in knob.strategies:
        return f"only for strategy {'/'.join(knob.strategies)} (this recipe: {recipe.strategy.name})"
    if get(recipe, knob.path.rsplit(".", 1)[0] if "." in knob.path else "name") is None:
        return f"the recipe has no {knob.path}"
    return knob.applies(recipe, facts) if knob.applies else None


def suggested(knob: Knob, advice_texts: list[str]) -> bool:
    """Does the diagnosis advise changing this knob's key?"""
    return any(knob.path in text for text in advice_texts)


def override_text(path: str, value: Any) -> str:
    if isinstance(value, bool):
        return f"{path}={'true' if value else 'false'}"
    if value is None:
        return f"{path}=null"
    return f"{path}={value:g}" if isinstance(value, float) else f"{path}={value}"
