"""The run's device mesh: one owner (`RunMesh`) for the degrees, the `DeviceMesh` and every process
group derived from it.

Why one object (torchtitan's `ParallelDims` is the model): strategies, the loader, the timer, the Flight
Recorder and checkpoints ask it for a *named view* instead of each slicing, flattening or building a
mesh of its own. One `init_device_mesh` over all four dimensions, size-1 ones included, so a dimension's
name exists whether or not it is used; flattened groups are made once and cached here.

Named views (`RunMesh.view(name)`):
- "pp", "dp_replicate", "dp_shard", "tp": the mesh's own dimensions;
- "fsdp": what FSDP shards over -- "dp_shard", or the 2-D ("dp_replicate", "dp_shard") sub-mesh when
  there are replicas (`fully_shard` on a 2-D mesh is HSDP);
- "batch": the ranks reading different batches, ("dp_replicate", "dp_shard") flattened ("dp");
- "fsdp_tp": FSDP's dimensions and "tp" flattened, so DTensor reduces a norm over both in one
  all-reduce.

Adding a dimension (context or expert parallel): its name in `MESH_DIMS` (recipe/blocks/strategy.py,
the one tuple of names), its degree in `ParallelDims` and the `parallel:` block, and here the views
that include it (torchtitan's "loss" = batch x cp, "fsdp" = dp_shard x cp); then the strategy that
uses it asks for its view. docs/architecture.md, "Where to add a mesh dimension".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from ..recipe.blocks.strategy import MESH_DIMS

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ..recipe.blocks.strategy import ParallelDims

# outermost first, as torchtitan lays them out: a pipeline's stages are furthest apart, the ranks of
# one tensor-parallel group adjacent (one node's fast links)
DIM_NAMES = MESH_DIMS


def degrees(dims: "ParallelDims") -> tuple[int, ...]:
    """The degree of each of DIM_NAMES."""
    return tuple(int(getattr(dims, name)) for name in DIM_NAMES)


class RunMesh:
    """The degrees and the ("pp", "dp_replicate", "dp_shard", "tp") DeviceMesh over the whole process
    group, with the named views and groups every component asks for."""

    VIEWS = ("pp", "dp_replicate", "dp_shard", "tp", "fsdp", "batch", "fsdp_tp")

    def __init__(self, dims: "ParallelDims", device_mesh: "DeviceMesh"):
        self.dims, self.device_mesh = dims, device_mesh
        self._views: dict[str, "DeviceMesh"] = {}

    @classmethod
    def build(cls, dims: "ParallelDims", device_type: str) -> "RunMesh":
        return cls(dims, _device_mesh(device_type, degrees(dims)))

    @property
    def device_type(self) -> str:
        return self.device_mesh.device_type

    def degree(self, name: str) -> int:
        """A dimension's degree (from the recipe's dims: no process group is touched)."""
        return int(getattr(self.dims, name))

    def coordinate(self, name: str) -> int:
        """This rank's index along a dimension."""
        return dict(zip(self.device_mesh.mesh_dim_names, self.device_mesh.get_coordinate()))[name]

    @property
    def data_parallel_rank(self) -> int:
        """Which of the different batches this rank reads: ranks that differ only in "tp" or "pp" read the
        same. Read from the mesh's coordinate, not a sliced sub-mesh (a first slice imports torch._dynamo
        and builds process groups: seconds on a loaded CPU, for a number)."""
        return self.coordinate("dp_replicate") * self.degree("dp_shard") + self.coordinate("dp_shard")

    @property
    def data_parallel_size(self) -> int:
        return self.dims.dp

    @property
    def replica_index(self) -> int:
        """Which copy of a sharded model this rank holds a part of (its "dp_replicate" coordinate)."""
        return self.coordinate("dp_replicate")

    def view(self, name: str) -> "DeviceMesh":
        """A named (sub-)mesh; flattened ones are made once, on first use, by every rank alike."""
        if name not in self.VIEWS:
            raise KeyError(f"no mesh view {name!r}; the views are {', '.join(self.VIEWS)}")
        if name not in self._views:
            self._views[name] = self._make(name)
        return self._views[name]

    def group(self, name: str):
        """The process group of a 1-D view."""
        return self.view(name).get_group()

    def _make(self, name: str) -> "DeviceMesh":
        mesh = self.device_mesh
        if name in DIM_NAMES:
            return mesh[name]
        if name == "fsdp":
            return mesh["dp_replicate", "dp_shard"] if self.degree("dp_replicate") > 1 else mesh["dp_shard"]
        if name == "batch":
            return mesh["dp_replicate", "dp_shard"]._flatten("dp")
        # "fsdp_tp": a flattened (FSDP's dimensions..., "tp") group
        return mesh[(*self.view("fsdp").mesh_dim_names, "tp")]._flatten()


_BUILT: dict[tuple[str, tuple[int, ...]], tuple[object, "DeviceMesh"]] = {}


def _device_mesh(device_type: str, shape: tuple[int, ...]) -> "DeviceMesh":
    """The process's DeviceMesh of this shape, made once per process group. A worker builds one; a
    process that trains run after run (runtime/cell_runner.py: a whole compatibility grid) made a new
    mesh each time -- 4 dimension groups and the flattened ones, ~18 OS threads and 24 sockets a run,
    never freed, and each later run slower (2-4x after a hundred). Destroying them instead is not
    safe: a new mesh compares equal to an earlier one of its shape, and torch's DTensor and FSDP
    caches then hand out the destroyed groups. The same mesh again is what torch expects."""
    from torch.distributed import distributed_c10d
    from torch.distributed.device_mesh import init_device_mesh

    world = distributed_c10d._get_default_group()
    cached = _BUILT.get((device_type, shape))
    if cached is not None and cached[0] is world:  # a new default group (destroyed and made again): a new mesh
        return cached[1]
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=DIM_NAMES)
    _BUILT[(device_type, shape)] = (world, mesh)
    return mesh


def build_mesh(dims: "ParallelDims", device_type: str) -> RunMesh:
    """The run's mesh over the whole process group (`RunMesh`)."""
    return RunMesh.build(dims, device_type)


def data_parallel_coordinate(mesh: Optional[RunMesh]) -> tuple[int, int]:
    """(this rank's index, the count) among the data-parallel groups (`RunMesh.data_parallel_rank`)."""
    return mesh.data_parallel_rank, mesh.data_parallel_size
