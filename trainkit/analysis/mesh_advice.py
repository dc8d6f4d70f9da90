"""Communication advice that knows the mesh (issue 30): from the per-dimension figures (`mesh_comm`
evidence), a recipe change on `parallel.*` keys -- offered only where the compatibility matrix verifies
the resulting combination (`recipe.compatibility.verified`); otherwise the evidence says which cell is
missing and no mesh advice is given.

The mechanisms, in the recipe's terms (torchtitan's and PyTorch's FSDP2/HSDP documentation):
- dp_shard costliest across nodes: FSDP all-gathers every unit's parameters in forward and again in
  backward and reduce-scatters its gradients over all dp_shard ranks, so each of those collectives runs
  at the inter-node link's speed. HSDP (dp_replicate = nodes, dp_shard = ranks per node) keeps the
  all-gathers and reduce-scatters inside a node and crosses nodes once per step, an all-reduce of each
  rank's gradient shard among the replicas; each rank then holds 1/(ranks per node) of the parameters,
  gradients and optimizer state instead of 1/world.
- tp costliest: tensor parallel all-reduces / all-gathers activations inside every layer, forward and
  backward, on the critical path (nothing overlaps them). A tp group wider than a node pays the
  inter-node link in each of them: keep tp within a node (or lower it); its ranks move to dp_shard,
  which communicates once per unit and overlaps with compute.
"""

from __future__ import annotations

from math import gcd
from typing import Any, Callable, Optional

from .advice import COMMUNICATION, Advice

MESH_SHARE = 0.10  # a dimension whose collectives are in flight more than this share of the step gets advice


def _verdict(recipe, degrees: dict[str, int]):
    from ..recipe.compatibility.verified import verdict_for  # validate's rules: only when advice is due

    return verdict_for(recipe, degrees)


def _nodes(per_rank: list[dict], recipe) -> int:
    """Hosts the ranks ran on (the evidence's own), else the recipe's launch.nnodes."""
    hosts = {r.get("host") for r in per_rank if r.get("host")}
    if hosts:
        return len(hosts)
    nnodes = recipe.launch.nnodes
    return nnodes if isinstance(nnodes, int) else 1


def _shown(degrees: dict[str, int]) -> str:
    return " x ".join(f"{d} {n}" for d, n in degrees.items() if n > 1) or "one rank"


def mesh_advice(recipe, per_rank: list[dict], facts: dict, step_s: float,
                verdict: Optional[Callable[[Any, dict], Any]] = None) -> tuple[list[Advice], list[str]]:
    """(advice, evidence lines): a mesh change for the costliest dimension where it is due and verified,
    or the line saying why none is offered. `facts`: mesh_comm's (comm_<dim>_ms, comm_costliest_dim)."""
    top = facts.get("comm_costliest_dim")
    world = len(per_rank)
    if top is None or world < 2 or step_s <= 0:
        return [], []
    share = facts[f"comm_{top}_ms"] / 1000 / step_s
    if share <= MESH_SHARE:
        return [], []
    dims = recipe.parallel_dims(world)
    now = {d: getattr(dims, d) for d in ("pp", "dp_replicate", "dp_shard", "tp")}
    nodes = _nodes(per_rank, recipe)
    per_node = max(1, world // nodes)
    proposal = _proposal(top, now, nodes, per_node)
    if proposal is None:
        return [], []
    name, changed, mechanism = proposal
    new = {**now, **changed}
    batch = _same_global_batch(recipe, now, new)
    if batch is None:
        return [], [f"mesh advice withheld: {name} ({_shown(new)}) changes the data-parallel size from "
                    f"{now['dp_replicate'] * now['dp_shard']} to {new['dp_replicate'] * new['dp_shard']} and "
                    f"data.batch_size {recipe.data.batch_size} does not divide to keep the global batch"]
    seen = {k: v for k, v in facts.items() if k.startswith("comm_") and isinstance(v, float)}
    seen[f"comm_{top}_share"] = share
    answer = (verdict or _verdict)(recipe, new)
    if not answer.verified:
        return [], [f"mesh advice withheld: {name} ({_shown(new)}) is {answer.text()}; the doctor and `trainkit "
                    f"tune` offer mesh changes only where the compatibility matrix verifies them"]
    changes = {f"parallel.{d}": v for d, v in changed.items()}
    was = {f"parallel.{d}": now[d] for d in changed}
    if batch != recipe.data.batch_size:  # the same samples per optimizer step: only the layout changes
        changes["data.batch_size"], was["data.batch_size"] = batch, recipe.data.batch_size
        mechanism += f"; data.batch_size {recipe.data.batch_size} -> {batch} keeps the global batch"
    return [Advice(share * 0.5, f"{mechanism} ({top} in flight {facts[f'comm_{top}_ms']:.1f} ms per step, "
                                f"{share:.0%} of it; {name}: {answer.text()})",
                   changes, was, COMMUNICATION, seen)], []


def _same_global_batch(recipe, now: dict[str, int], new: dict[str, int]) -> Optional[int]:
    """data.batch_size that keeps the global batch on the new mesh (None: it does not divide)."""
    before, after = now["dp_replicate"] * now["dp_shard"], new["dp_replicate"] * new["dp_shard"]
    total = recipe.data.batch_size * before
    return total // after if total % after == 0 else None


def _proposal(top: str, now: dict[str, int], nodes: int, per_node: int) -> Optional[tuple[str, dict, str]]:
    """(what, the changed degrees, the mechanism) for the costliest dimension, or None."""
    if top == "dp_shard" and nodes > 1 and now["dp_replicate"] == 1 and now["dp_shard"] > per_node \
            and per_node % (now["tp"] * now["pp"]) == 0:
        shard = per_node // (now["tp"] * now["pp"])
        replicate = now["dp_shard"] // shard
        return ("HSDP", {"dp_replicate": replicate, "dp_shard": shard},
                f"FSDP all-gathers parameters (forward and backward) and reduce-scatters gradients over all "
                f"{now['dp_shard']} dp_shard ranks on {nodes} nodes, each collective at the inter-node link's "
                f"speed; HSDP shards within a node ({shard} ranks) and crosses nodes once per step, an "
                f"all-reduce of each rank's gradient shard among {replicate} replicas (each rank then holds "
                f"1/{shard} of the model state instead of 1/{now['dp_shard']})")
    if top == "tp" and now["tp"] > 1:
        tp = gcd(now["tp"], per_node) if now["tp"] > per_node else now["tp"] // 2
        where = (f"its group of {now['tp']} ranks spans nodes ({per_node} ranks per node), so every one pays the "
                 f"inter-node link; tp {tp} keeps it within a node") if now["tp"] > per_node else \
            f"tp {tp} halves the ranks in each of them"
        return ("tp " + str(tp), {"tp": tp, "dp_shard": now["dp_shard"] * now["tp"] // tp},
                f"tensor parallel all-reduces activations inside every layer, forward and backward, with nothing "
                f"to overlap them; {where}, and its ranks move to dp_shard (one all-gather and reduce-scatter per "
                f"unit, overlapped with compute; more memory per rank for the model state)")
    return None


__all__ = ["MESH_SHARE", "mesh_advice"]
