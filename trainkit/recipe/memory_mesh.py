"""Mesh alternatives for a recipe that will not fit (issue 30): FSDP with tensor parallel (each rank holds
1/tp of every layer, and FSDP shards the rest over dp_shard) and HSDP across nodes, each with the memory
plan's predicted figure -- offered only where the compatibility matrix verifies the resulting
combination (`compatibility.verified`). Arithmetic only (no torch), like the memory plan.

The global batch stays: tensor-parallel ranks read the same samples, so fewer data-parallel ranks take
as many more gradient-accumulation steps (the micro-batch, and with it the activations, unchanged).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Optional

from .blocks.fsdp import FSDPOptions
from .memory_plan import MemoryAdvice, ModelSizes, Setting, plan, split_by_tp
from .nccl_memory import communicators_of_mesh
from .model_facts import facts_for


def _verdict(recipe: Any, degrees: dict[str, int], strategy: Optional[str]):
    from .compatibility.verified import verdict_for

    return verdict_for(recipe, degrees, strategy=strategy)


def candidates(recipe: Any, world: int) -> list[tuple[dict[str, int], str]]:
    """(mesh degrees, what) worth planning: tp within a node over FSDP, and HSDP over several nodes."""
    per_node = recipe.launch.nproc_per_node
    nodes = world // max(1, per_node)
    out = []
    tp = 2
    while tp <= per_node and world % tp == 0:
        if facts_for(recipe.model.name).tensor_parallel_refusal(tp, dict(recipe.model.args)):  # validate's rule
            tp *= 2
            continue
        out.append(({"pp": 1, "dp_replicate": 1, "dp_shard": world // tp, "tp": tp},
                    f"FSDP x tensor parallel {tp}: each rank holds 1/{tp} of every layer (tp within a node), FSDP "
                    f"shards that over {world // tp} ranks"))
        tp *= 2
    if nodes > 1:
        out.append(({"pp": 1, "dp_replicate": nodes, "dp_shard": per_node, "tp": 1},
                    f"HSDP: shards within each node ({per_node} ranks), {nodes} replicas across nodes"))
    return out


def mesh_alternatives(recipe: Any, sizes: ModelSizes, s: Setting, available: int,
                      verdict: Optional[Callable[..., Any]] = None) -> list[MemoryAdvice]:
    """The mesh changes that lower the plan, each with its figure, where the matrix verifies them (a recipe
    that already has a tensor-parallel or pipeline mesh gets none)."""
    dims = recipe.parallel_dims(s.world_size)
    if s.world_size < 2 or dims.tp > 1 or dims.pp > 1:
        return []
    now = plan(sizes, s).per_rank
    fsdp = isinstance(recipe.strategy, FSDPOptions)
    out = []
    for degrees, what in candidates(recipe, s.world_size):
        dp = degrees["dp_replicate"] * degrees["dp_shard"]
        tp = degrees["tp"]
        # an FSDP recipe keeps its own options (cpu_offload, ...) on the new mesh; another strategy gets FSDP's defaults
        sharding = recipe.strategy if fsdp else FSDPOptions(name="fsdp")
        layout = split_by_tp(sharding.memory_layout(degrees["dp_shard"]), tp)
        accum = s.grad_accum_steps * dims.dp // dp if (s.grad_accum_steps * dims.dp) % dp == 0 else None
        if accum is None:
            continue
        communicators = (communicators_of_mesh(degrees, s.world_size, s.ranks_per_node or s.world_size)
                         if s.nccl_communicators else ())
        predicted = plan(sizes, replace(s, layout=layout, grad_accum_steps=accum, tensor_parallel=tp,
                                        nccl_communicators=communicators))
        if predicted.per_rank >= now:
            continue
        answer = (verdict or _verdict)(recipe, degrees, None if fsdp else "fsdp")
        if not answer.verified:
            continue
        changes = {} if fsdp else {"strategy.name": "fsdp"}
        changes.update({f"parallel.{d}": n for d, n in degrees.items() if d != "pp"})
        if accum != s.grad_accum_steps:
            changes["trainer.grad_accum_steps"] = accum
        out.append(MemoryAdvice(changes, predicted, predicted.per_rank <= available, f"{what}; {answer.text()}"))
    return out


__all__ = ["candidates", "mesh_alternatives"]
