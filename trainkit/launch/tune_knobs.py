"""The knobs `trainkit tune` can try: one table row per knob, easy to extend.

A row (`recipe.blocks.Knob`) says which recipe key it sets, which values to try for a given recipe,
whether it changes what is trained (`semantic`: only tried with `--allow`), and which recipe keys
it changes alongside (the batch rule scales the learning rate). Without `--knobs`, a knob is tried when
a piece of the baseline's bottleneck advice proposes a change to its key (`Advice.changes`, see
`tune_plan`), at the advised value; `--knobs` names knobs to try at their own values, whatever the
diagnosis says. A strategy's own knobs are in its options class (`StrategyOptions.tune_knobs`), so a
plugin subclass inherits them.

Performance options (`performance.channels_last`, `performance.compile`, ...) are rows only when
the installed schema has them: `performance_knobs()` reads the schema.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from .. import registry
from ..recipe.blocks import Knob, PerformanceOptions
from ..recipe.blocks.knobs import flip as _flip
from ..recipe.blocks.knobs import get
from ..recipe.schema import Recipe
from ..runtime import host_allocator

__all__ = ["Knob", "get", "all_knobs", "not_applicable", "override_text"]


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


def _decodes_on_cuda(recipe: Recipe, facts: dict) -> Optional[str]:
    if get(recipe, "data.decode") is None:
        return f"dataset {recipe.data.name} decodes nothing (data.decode is imagefolder's)"
    return _needs_cuda(recipe, facts)


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


KNOBS: list[Knob] = [
    # data loading
    Knob("num_workers", "data.num_workers", _workers),
    Knob("prefetch_factor", "data.prefetch_factor", lambda r, f: [4] if (r.data.prefetch_factor or 2) < 4 else [],
         applies=_needs_workers),
    Knob("persistent_workers", "data.persistent_workers", _flip("data.persistent_workers", True),
         applies=_needs_workers),
    Knob("pin_memory", "data.pin_memory", _flip("data.pin_memory", True), applies=_needs_cuda),
    # JPEGs decoded on the GPU (runtime.device_decode): the loader processes only read files
    Knob("decode", "data.decode", lambda r, f: ["device"] if get(r, "data.decode") == "loader" else [],
         applies=_decodes_on_cuda),
    # training semantics (only with --allow)
    Knob("batch_size", "data.batch_size", _batch_values, semantic="batch", also=_batch_lr, note=_batch_note),
    Knob("precision", "precision", lambda r, f: ["bf16"] if r.precision == "fp32" else [], semantic="precision",
         note=lambda r, v: f"precision {r.precision} -> {v} (autocast: lower-precision matmuls)"),
    Knob("tf32", "performance.tf32", _flip("performance.tf32", True), semantic="precision", applies=_needs_cuda,
         note=lambda r, v: "fp32 matmuls on TF32 tensor cores (~10 mantissa bits)"),
]


def _advised_only(recipe: Recipe, facts: dict) -> list[Any]:
    """Mesh degrees are tried at the value the bottleneck advice gives (with the keys it changes alongside),
    which it proposes only where the compatibility matrix verifies the resulting mesh (analysis.mesh_advice)."""
    return []


# the mesh (issue 30): arms only from advice, e.g. {parallel.tp: 1, parallel.dp_shard: 2, data.batch_size: 2}
MESH_KNOBS = [Knob(f"mesh_{dim}", f"parallel.{dim}", _advised_only) for dim in ("dp_replicate", "dp_shard", "tp")]
OPTIONAL_BLOCKS = {"parallel"}  # blocks a recipe may leave out: an override creates them


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


def strategy_knobs() -> list[Knob]:
    """The knobs every registered strategy owns (`StrategyOptions.tune_knobs`), each once."""
    found: dict[str, Knob] = {}
    for name in registry.names("strategies"):
        try:
            options = registry.load("strategies", name)
        except registry.PluginError:  # a broken third-party strategy: its knobs are unknown
            continue
        for knob in getattr(options, "tune_knobs", lambda: [])():
            found.setdefault(knob.name, knob)
    return list(found.values())


def all_knobs() -> dict[str, Knob]:
    """Every knob by name: the general table, the performance rows and the strategies' own."""
    return {k.name: k for k in KNOBS + MESH_KNOBS + strategy_knobs() + performance_knobs()}


def not_applicable(knob: Knob, recipe: Recipe, facts: dict) -> Optional[str]:
    """Why `knob` cannot be tried on this recipe, or None. A strategy's knob applies to that strategy
    and to every plugin strategy that subclasses its options."""
    if knob.owner is not None and not isinstance(recipe.strategy, knob.owner):
        return f"only for strategy {knob.owner.plugin_name()} (this recipe: {recipe.strategy.name})"
    block = knob.path.rsplit(".", 1)[0] if "." in knob.path else "name"
    if block not in OPTIONAL_BLOCKS and get(recipe, block) is None:
        return f"the recipe has no {knob.path}"
    return knob.applies(recipe, facts) if knob.applies else None


def override_text(path: str, value: Any) -> str:
    if isinstance(value, bool):
        return f"{path}={'true' if value else 'false'}"
    if value is None:
        return f"{path}=null"
    return f"{path}={value:g}" if isinstance(value, float) else f"{path}={value}"
