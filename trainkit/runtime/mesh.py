"""The run's device mesh: one `init_device_mesh` over the recipe's parallel degrees.

Why one mesh with all four named dimensions, size-1 ones included (torchtitan's `ParallelDims`
does the same): every strategy and monitor then asks the same object for its group ("tp",
("dp_replicate", "dp_shard")) instead of each doing rank arithmetic of its own, and a dimension's
name exists whether or not it is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ..recipe.blocks.strategy import ParallelDims

# outermost first, as torchtitan lays them out: a pipeline's stages are furthest apart, the ranks of
# one tensor-parallel group adjacent (one node's fast links)
DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "tp")


def degrees(dims: "ParallelDims") -> tuple[int, ...]:
    """The degree of each of DIM_NAMES."""
    return tuple(int(getattr(dims, name)) for name in DIM_NAMES)


def build_mesh(dims: "ParallelDims", device_type: str) -> "DeviceMesh":
    """The 4-D mesh ("pp", "dp_replicate", "dp_shard", "tp") over the whole process group."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, degrees(dims), mesh_dim_names=DIM_NAMES)


def data_parallel_coordinate(mesh: "DeviceMesh") -> tuple[int, int]:
    """(this rank's index, the count) among the data-parallel groups: ranks that differ only in "tp" or
    "pp" read the same batch. Read from the mesh's coordinate, not a sliced sub-mesh (a first slice
    imports torch._dynamo and builds process groups: seconds on a loaded CPU, for a number)."""
    at = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    size = dict(zip(mesh.mesh_dim_names, mesh.shape))
    return at["dp_replicate"] * size["dp_shard"] + at["dp_shard"], size["dp_replicate"] * size["dp_shard"]
