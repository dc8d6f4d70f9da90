"""runtime/process_groups.py, the one registry for "a process group appeared" (issue 36): the
breakdown monitor's mesh timer hooks a mesh dimension flattened after it started. In process, on
torch's fake backend (an 8-rank mesh from rank 0's view, no peers)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from trainkit.runtime import process_groups
from trainkit.runtime.mesh_comm import MeshCommTimer, mesh_groups


def test_a_dimension_flattened_after_the_mesh_timer_started_is_hooked_at_the_next_step():
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        timer = MeshCommTimer(mesh_groups(mesh), torch.device("cpu"), mesh)
        assert set(timer.groups) == {"dp_replicate", "dp_shard", "tp"}
        seen = []
        assert process_groups.each_group(seen.append)
        before = process_groups.generation()
        mesh["dp_shard", "tp"]._flatten("dp_shard_tp")  # what DTensor does for a norm over both dimensions
        assert process_groups.generation() > before and len(seen) > 0
        timer.take(settle=False)  # a step boundary: the timer asks whether a group appeared
        assert set(timer.groups) == {"dp_replicate", "dp_shard", "tp", "dp_shard_tp"}
        timer.close()
    finally:
        process_groups._subscribers.clear()
        dist.destroy_process_group()
