"""Which ranks form each group of a device mesh, and the world sizes a launch can have (no torch).

The rank order is `init_device_mesh`'s: the ranks 0..N-1 laid row-major over the dimensions in
torchtitan's order ("pp", "dp_replicate", "dp_shard", "tp"), so tensor-parallel groups are
neighbouring ranks (one node's fast links) and pipeline stages the farthest apart. `trainkit plan`
shows these groups; the runtime builds the same mesh (trainkit/runtime/mesh.py).
"""

from __future__ import annotations

from itertools import product
from typing import Any

from .blocks.strategy import MESH_DIMS, ParallelDims

SHOWN_GROUPS = 4  # groups listed per dimension in `trainkit plan` (the rest are counted)


def rank_groups(dims: ParallelDims, dim: str) -> list[list[int]]:
    """The groups of ranks along `dim`: ranks whose coordinates differ only in `dim`, in rank order."""
    sizes = [getattr(dims, d) for d in MESH_DIMS]
    axis = MESH_DIMS.index(dim)
    others = [range(n) if i != axis else range(1) for i, n in enumerate(sizes)]
    groups = []
    for fixed in product(*others):
        coords = [list(fixed) for _ in range(sizes[axis])]
        for k, c in enumerate(coords):
            c[axis] = k
        groups.append([_rank(c, sizes) for c in coords])
    return groups


def _rank(coords: list[int], sizes: list[int]) -> int:
    rank = 0
    for c, n in zip(coords, sizes):
        rank = rank * n + c
    return rank


def launch_world_sizes(launch: Any) -> list[int]:
    """Every world size a launch can start with: one, or each of an elastic 'MIN:MAX' node range
    (empty when nnodes is malformed: another rule reports that)."""
    nnodes = launch.nnodes
    if not isinstance(nnodes, str):
        return [launch.nproc_per_node * nnodes]
    low, _, high = nnodes.partition(":")
    if not (low.isdigit() and high.isdigit()) or not 0 < int(low) <= int(high):
        return []
    return [launch.nproc_per_node * n for n in range(int(low), int(high) + 1)]


def degrees_text(degrees: dict[str, int]) -> str:
    """'dp_replicate 2 x dp_shard 2 x tp 2': the degrees above 1 (all of them if none is)."""
    shown = {d: n for d, n in degrees.items() if n != 1} or degrees
    return " x ".join(f"{d} {n}" for d, n in shown.items())


def mesh_lines(dims: ParallelDims) -> list[str]:
    """`trainkit plan`'s mesh: the degrees, then the groups of every dimension above 1."""
    degrees = dims.degrees()
    lines = [f"mesh:            {' x '.join(f'{d} {n}' for d, n in degrees.items())} = {dims.world_size} ranks "
             f"(init_device_mesh order; data-parallel {dims.dp} = dp_replicate x dp_shard)"]
    for dim, n in degrees.items():
        if n > 1:
            groups = rank_groups(dims, dim)
            shown = " ".join(str(g).replace(" ", "") for g in groups[:SHOWN_GROUPS])
            more = f" ... ({len(groups) - SHOWN_GROUPS} more)" if len(groups) > SHOWN_GROUPS else ""
            lines.append(f"  {dim + ':':<15}{len(groups)} group(s) of {n}: {shown}{more}")
    return lines
