"""`validate`'s rules for the `parallel:` block (issue 30): the degrees fill the world, each dimension
is one the strategy lays ranks out on, and tensor parallel is one the model declares a plan for.

Light (no torch): the strategy answers through `Capabilities.mesh_dims`, the model through its
facts' `tensor_parallel_refusal`. An elastic launch ('MIN:MAX' nodes) is checked at every world
size it can start with, so its block needs an inferred (-1) dimension that absorbs the node count.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

from .. import registry
from .blocks import Finding, ParallelDims
from .blocks.parallel import INFERRED, ParallelOptions
from .mesh_layout import degrees_text, launch_world_sizes
from .model_facts import facts_for


def findings(r: Any) -> Iterator[Finding]:
    """Every problem of the recipe's mesh, each once (an elastic launch repeats them per size)."""
    if r.parallel is None:
        return
    sizes = launch_world_sizes(r.launch)
    if len(sizes) > 1 and r.parallel.inferred() is None:
        yield ("parallel",), (
            f"launch.nnodes '{r.launch.nnodes}' starts {', '.join(map(str, sizes))} ranks (nproc_per_node "
            f"{r.launch.nproc_per_node} per node), but {degrees_text(r.parallel.degrees())} = "
            f"{r.parallel.known_product()} fits one world size at most; set one dimension to -1 (e.g. dp_shard: -1) "
            f"so that it grows with the nodes")
        return
    seen: set[Finding] = set()
    for world_size in sizes:
        found = [f for f in _at(r, world_size) if f not in seen]
        seen.update(found)
        yield from found
        if any(path == ("parallel",) for path, _ in found):
            return  # the degrees do not fill this size: one message with its arithmetic is enough


def _at(r: Any, world_size: int) -> Iterator[Finding]:
    fill = fills_the_world(r.parallel, world_size, r.launch)
    if fill:
        yield ("parallel",), fill
        return
    dims = r.parallel_dims(world_size)
    refused = list(_dimensions_of_the_strategy(r, dims))
    yield from refused
    if dims.tp > 1 and ("parallel", "tp") not in [path for path, _ in refused]:
        why = facts_for(r.model.name).tensor_parallel_refusal(dims.tp, dict(r.model.args))
        if why:
            yield ("parallel", "tp"), f"model {r.model.name} cannot be split over tp {dims.tp} ranks: {why}"
    if dims.tp > 1 and dims.pp > 1 and r.performance.compile_options is not None:
        yield ("performance", "compile"), (
            f"performance.compile with tensor parallel inside pipeline stages (parallel.pp {dims.pp} x tp {dims.tp}) "
            "is not verified: FSDP waits for the tensor-parallel embedding's collective before its first compiled "
            "block (without it the gradients are silently wrong), the pipeline's stages do not yet; set "
            "performance.compile: false, or use strategy fsdp for tp")


def fills_the_world(p: ParallelOptions, world_size: int, launch: Any) -> Optional[str]:
    """Why the degrees do not multiply to `world_size`, with the arithmetic, or None."""
    ranks = f"launch runs {world_size} ranks (nnodes {_nodes(launch, world_size)} x nproc_per_node " \
            f"{launch.nproc_per_node})"
    known, inferred = p.known_product(), p.inferred()
    written = {d: n for d, n in p.degrees().items() if n != INFERRED}
    if inferred is None:
        if known == world_size:
            return None
        return (f"{degrees_text(written)} = {known}, but {ranks}; make the degrees multiply to {world_size}, "
                f"or set one of them to -1 to infer it from the world size")
    if world_size % known == 0:
        return None
    return (f"{inferred} {INFERRED} is inferred as the world size / ({degrees_text(written)} = {known}), but {ranks}, "
            f"which {known} does not divide; make the other degrees multiply to a divisor of {world_size}"
            + (" at every node count of the elastic range" if isinstance(launch.nnodes, str) else ""))


def _nodes(launch: Any, world_size: int) -> int:
    return world_size // launch.nproc_per_node


def _dimensions_of_the_strategy(r: Any, dims: ParallelDims) -> Iterator[Finding]:
    s = r.strategy
    own = s.capabilities().mesh_dims
    for dim, n in dims.degrees().items():
        if n > 1 and dim not in own:
            inferred = ", inferred from -1" if dim == r.parallel.inferred() else ""
            others = strategies_with(dim)
            offer = f"strategy {' or '.join(others)} lays ranks out on {dim}" if others else \
                f"no installed strategy lays ranks out on {dim}"
            yield ("parallel", dim), (
                f"strategy {s.name} does not lay ranks out on {dim} (parallel.{dim} is {n}{inferred}; its "
                f"dimensions: {', '.join(d for d in dims.degrees() if d in own)}); {offer}: use it, or set "
                f"parallel.{dim}: 1" + (f" and put the -1 on one of {s.name}'s dimensions" if inferred else ""))


def strategies_with(dim: str) -> list[str]:
    """Registered strategies whose default options lay ranks out on `dim` (for the refusal's fix)."""
    found = []
    for name in registry.names("strategies"):
        try:
            options = registry.load("strategies", name)(name=name)
        except Exception:  # a plugin that needs more than its name, or fails to import: not offered
            continue
        if dim in options.capabilities().mesh_dims:
            found.append(name)
    return found
