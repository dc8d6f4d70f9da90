"""NCCL's device memory on a rank, per communicator, from the run's mesh (the plan's "NCCL buffers" line).

Each process group of 2 or more ranks a rank belongs to holds an NCCL communicator with memory of its
own, outside torch's caching allocator. What one costs, read in the source of NCCL 2.30.7 (the version
torch 2.14.1 ships; docs/memory.md, "NCCL's buffers", has the lines), on the node the plan assumes: 8
H100/H200-class GPUs on NVSwitch, NCCL's cuMem allocations on (its default):

- at set-up, every channel NCCL may use for point-to-point (`pow2Up` of the collective channels: 32)
  makes three cuMem allocations, each rounded up to the 2 MiB granularity; plus ~5 MiB of fixed state;
- a ring's connections (at the first collective): per collective channel (24 there: 12 found by the
  topology search, doubled) a receive side holding the LL (0.5 MiB), LL128 (4.69 MiB) and Simple (4 MiB,
  NCCL_BUFFSIZE) buffers, rounded to 10 MiB, and a 2 MiB send side;
- NVLink SHARP (NVLS, on by default where NVSwitch multicast exists), for a group with 2 or more ranks on
  a node: 16 channels x 2 x 1 MiB per local rank of the group, and ~34 MiB of peer state;
- a group that spans nodes also connects a tree (another ring's worth across the network).

So an 8-rank group on one such node ~775 MiB, a 2-rank group there ~580 MiB. NCCL_MAX_NCHANNELS,
NCCL_NVLS_ENABLE=0 and NCCL_BUFFSIZE in the launcher's environment (the workers inherit it) are taken
into account. An upper estimate: a PCIe node runs 2-4 channels and no NVLS (~20-80 MiB per
communicator: the plan over-states it 5-30x there, and the doctor then warns instead of refusing), and
a group that never runs a collective skips the ring's and NVLS's buffers. Point-to-point (the pipeline's sends) connects up to 32
channels per peer on its own (not counted: the pipeline's groups are counted as collective groups).
"""

from __future__ import annotations

import math
import os
from itertools import product
from typing import Mapping, NamedTuple

MiB = 1 << 20
CUMEM_GRANULARITY = 2 * MiB  # NCCL rounds each cuMem allocation up to it
CHANNELS = 24  # collective channels on an 8-GPU NVSwitch node of H100/H200 (PCIe: 2-4)
SETUP_PER_CHANNEL = 3 * CUMEM_GRANULARITY  # three cuMem allocations per channel initialised at set-up
SETUP_FIXED = 5 * MiB  # the device communicator and rank maps (2 MiB rounding each)
LL_BYTES, LL128_BYTES, SIMPLE_BYTES = 512 << 10, 4_915_200, 4 * MiB  # per connection (SIMPLE: NCCL_BUFFSIZE)
SEND_SIDE = CUMEM_GRANULARITY  # a ring's sender holds only its small send state, rounded
NVLS_PER_LOCAL_RANK = 16 * 2 * MiB  # NVLS channels x 2 x (chunk 128 KiB x 8 steps)
NVLS_FIXED = 34 * MiB  # NVLS's peer pointers and credits
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "tp")  # runtime/mesh.py's dimension order, tp innermost


class Communicator(NamedTuple):
    """A process group a rank holds an NCCL communicator for: its name, how many ranks it has, and how
    many of them share rank 0's node (NVLS's buffers grow with them; a group beyond the node adds a tree)."""

    name: str
    ranks: int
    local_ranks: int

    @property
    def bytes(self) -> int:
        return self.bytes_under(os.environ)

    def bytes_under(self, environ: Mapping[str, str]) -> int:
        """The cost with NCCL's variables in `environ` (NCCL_MAX_NCHANNELS, NCCL_BUFFSIZE, NCCL_NVLS_ENABLE)."""
        channels = min(CHANNELS, _positive(environ, "NCCL_MAX_NCHANNELS", CHANNELS))
        p2p_channels = 1 << (channels - 1).bit_length()  # NCCL's pow2Up
        receive = LL_BYTES + LL128_BYTES + _positive(environ, "NCCL_BUFFSIZE", SIMPLE_BYTES)
        ring = channels * (math.ceil(receive / CUMEM_GRANULARITY) * CUMEM_GRANULARITY + SEND_SIDE)
        cost = SETUP_FIXED + p2p_channels * SETUP_PER_CHANNEL + ring
        if self.local_ranks >= 2 and environ.get("NCCL_NVLS_ENABLE", "2").strip() != "0":
            cost += NVLS_FIXED + NVLS_PER_LOCAL_RANK * self.local_ranks
        if self.ranks > self.local_ranks:
            cost += ring  # the tree's connections across nodes
        return cost


def _positive(environ: Mapping[str, str], name: str, default: int) -> int:
    try:
        value = int(environ.get(name, default))
    except ValueError:  # NCCL ignores a value it cannot read, and so does the plan
        return default
    return value if value > 0 else default


def communicators_of_mesh(degrees: dict[str, int], world_size: int, ranks_per_node: int) -> tuple[Communicator, ...]:
    """A rank's NCCL communicators on a mesh of these degrees, each with buffers of its own: the world's,
    each dimension's, and each flattened view's (runtime/mesh.py) -- a group of every rank is the
    world's (DeviceMesh reuses it), while a flattened view is a group of its own even where its ranks are
    one dimension's. An upper estimate: NCCL makes a group's communicator at its first collective, and a
    strategy may never run one on some dimension."""
    rep, shard, tp, pp = (degrees.get(d, 1) for d in ("dp_replicate", "dp_shard", "tp", "pp"))
    groups = {"pp": ("pp",), "dp_replicate": ("dp_replicate",), "dp_shard": ("dp_shard",), "tp": ("tp",)}
    if tp > 1 or pp > 1:  # the ranks reading different batches, flattened: the loss and evaluation sums
        groups["dp (flattened)"] = ("dp_replicate", "dp_shard")
    if tp > 1:  # FSDP's dimensions and tp, flattened for a norm over both (strategies/fsdp.py, pipeline_sharded.py)
        groups["fsdp x tp (flattened)"] = ("dp_replicate", "dp_shard", "tp") if rep > 1 else ("dp_shard", "tp")
    shape = {"pp": pp, "dp_replicate": rep, "dp_shard": shard, "tp": tp}
    out = [Communicator("world", world_size, min(world_size, ranks_per_node))]
    for name, dims in groups.items():
        members = _rank0_group(shape, dims)
        if 1 < len(members) < world_size:
            out.append(Communicator(name, len(members), sum(r < ranks_per_node for r in members)))
    return tuple(out)


def _rank0_group(shape: dict[str, int], dims: tuple[str, ...]) -> list[int]:
    """The global ranks of rank 0's group over `dims` of a row-major mesh in MESH_ORDER."""
    strides, stride = {}, 1
    for d in reversed(MESH_ORDER):
        strides[d] = stride
        stride *= shape[d]
    return [sum(i * strides[d] for i, d in zip(index, dims)) for index in product(*(range(shape[d]) for d in dims))]
