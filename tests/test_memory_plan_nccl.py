"""The plan's NCCL buffers (issue 41, item 3): on CUDA with NCCL each process group of 2 or more ranks a rank
belongs to holds a communicator with buffers of its own, outside torch's allocator; the plan counts them
per communicator from the mesh. In-process: the arithmetic from resolved recipes. The figure per
communicator is an estimate from NCCL 2.30.7's source (trainkit/recipe/nccl_memory.py), to be checked against
nvidia-smi on GPUs (tests/test_gpu.py)."""

from __future__ import annotations

import pytest

from lm_runs import tiny_lm
from run_helpers import write_recipe
from trainkit.recipe.memory_plan import ModelSizes, plan, setting_of
from trainkit.recipe.nccl_memory import Communicator, communicators_of_mesh
from trainkit.recipe.resolver import resolve

SIZES = ModelSizes(parameters=10_000_000, buffer_bytes=0, largest_unit=1_000_000, activation_bytes=50_000_000)


def resolve_setting(tmp_path, device_type: str = "cuda"):
    return setting_of(resolve(tmp_path / "nccl.yaml").recipe, device_type)


def nccl_line(tmp_path, device_type: str = "cuda", **sections):
    path = write_recipe(tmp_path, "nccl", tiny_lm({"files": ["x.txt"], "tokenizer": "t.json"}), **sections)
    setting = setting_of(resolve(path).recipe, device_type)
    lines = [p for p in plan(SIZES, setting).parts if p.name == "NCCL buffers"]
    return tuple(c.name for c in setting.nccl_communicators), (lines[0] if lines else None)


def test_each_group_of_the_mesh_holds_a_communicator_and_the_world_group_serves_whole_world_views(tmp_path):
    """HSDP 2 x 2 with tp 2 on 8 GPUs: the world, each dimension of more than one rank, and data
    parallel flattened (4 ranks); FSDP's dimensions with tp flattened span all 8, so they are the world's."""
    groups, line = nccl_line(tmp_path, strategy={"name": "fsdp"}, launch={"nproc_per_node": 8},
                             parallel={"dp_replicate": 2, "dp_shard": 2, "tp": 2})
    assert groups == ("world", "dp_replicate", "dp_shard", "tp", "dp (flattened)")
    assert line.where == "device" and line.bytes == sum(c.bytes for c in communicators_of_mesh(
        {"dp_replicate": 2, "dp_shard": 2, "tp": 2}, 8, 8))
    assert "5 communicators (world 775 MiB, dp_replicate 583 MiB, dp_shard 583 MiB, tp 583 MiB, dp (flattened) " \
           "647 MiB;" in line.how, line.how


def test_a_communicators_cost_follows_nccls_own_allocations():
    """NCCL 2.30.7 on an 8-GPU NVSwitch node of H100/H200 (nccl_memory.py's sources): set-up 32 channels x 3 cuMem
    allocations of 2 MiB + 5 MiB; a ring, 24 channels x (10 + 2) MiB; NVLS, 34 MiB + 32 MiB per rank of the
    group on the node; a group across nodes, a tree's connections too."""
    setup, ring = 5 + 32 * 6, 24 * 12
    assert Communicator("world", 8, 8).bytes_under({}) == (setup + ring + 34 + 8 * 32) << 20  # 775 MiB
    assert Communicator("tp", 2, 2).bytes_under({}) == (setup + ring + 34 + 2 * 32) << 20  # 583 MiB
    assert Communicator("dp_replicate", 2, 1).bytes_under({}) == (setup + 2 * ring) << 20  # one rank per node: no NVLS
    # NCCL's own variables, as the workers inherit them from the launcher
    world = Communicator("world", 8, 8)
    assert world.bytes_under({"NCCL_NVLS_ENABLE": "0"}) == (setup + ring) << 20
    assert world.bytes_under({"NCCL_MAX_NCHANNELS": "4"}) == (5 + 4 * 6 + 4 * 12 + 34 + 8 * 32) << 20
    assert world.bytes_under({"NCCL_BUFFSIZE": str(8 << 20)}) == (setup + 24 * (14 + 2) + 34 + 8 * 32) << 20
    assert world.bytes_under({"NCCL_MAX_NCHANNELS": "many"}) == world.bytes_under({})
    # 16 ranks on two nodes, dp_shard 8 x tp 2: rank 0's dp_shard group has 4 ranks on its node
    by_name = {c.name: c for c in communicators_of_mesh({"dp_shard": 8, "tp": 2}, 16, 8)}
    assert (by_name["dp_shard"].ranks, by_name["dp_shard"].local_ranks) == (8, 4)
    assert (by_name["tp"].ranks, by_name["tp"].local_ranks) == (2, 2)


@pytest.mark.parametrize("sections, expected", [
    ({"strategy": {"name": "ddp"}, "launch": {"nproc_per_node": 8}}, ("world",)),  # DDP's dimension is the world
    # FSDP x TP: the data-parallel ranks flattened (the loss and evaluation sums) are a group of their own,
    # though they are dp_shard's ranks; FSDP's dimensions with tp span the world
    ({"strategy": {"name": "fsdp"}, "launch": {"nproc_per_node": 4}, "parallel": {"dp_shard": 2, "tp": 2}},
     ("world", "dp_shard", "tp", "dp (flattened)")),
])
def test_a_dimension_of_every_rank_is_the_world_group(tmp_path, sections, expected):
    groups, line = nccl_line(tmp_path, **sections)
    assert groups == expected and line.bytes == sum(c.bytes for c in resolve_setting(tmp_path).nccl_communicators)


@pytest.mark.parametrize("device_type, sections", [
    ("cuda", {"launch": {"nproc_per_node": 1}}),  # one GPU: no peers
    ("cuda", {"launch": {"nproc_per_node": 2, "backend": "gloo"}}),
    ("cpu", {"launch": {"nproc_per_node": 2}}),
])
def test_no_nccl_no_buffers(tmp_path, device_type, sections):
    assert nccl_line(tmp_path, device_type, strategy={"name": "ddp"}, **sections) == ((), None)


def test_a_mesh_the_plan_proposes_is_planned_with_its_own_communicators(tmp_path):
    """The plan's mesh alternative for a 1 B-parameter DDP recipe on 8 GPUs (FSDP 4 x tp 2): its NCCL line
    counts the communicators of its own mesh (4), not the DDP recipe's one. (For a small model the
    alternative's three more communicators outweigh what it shards, and the plan rightly proposes none.)"""
    from types import SimpleNamespace

    from trainkit.recipe.memory_mesh import mesh_alternatives

    path = write_recipe(tmp_path, "ddp8", tiny_lm({"files": ["x.txt"], "tokenizer": "t.json"}),
                        strategy={"name": "ddp"}, launch={"nproc_per_node": 8})
    recipe = resolve(path).recipe
    accepted = lambda *args: SimpleNamespace(verified=True, text=lambda: "verified")  # noqa: E731
    big = ModelSizes(parameters=1_000_000_000, buffer_bytes=0, largest_unit=50_000_000, activation_bytes=2 * 10**9)
    advice = mesh_alternatives(recipe, big, setting_of(recipe, "cuda"), available=2**40, verdict=accepted)
    counted = []
    for a in advice:
        degrees = {k.split(".", 1)[1]: v for k, v in a.changes.items() if k.startswith("parallel.")}
        line = next(p for p in a.plan.parts if p.name == "NCCL buffers")
        expected = communicators_of_mesh(degrees, 8, 8)
        assert line.bytes == sum(c.bytes for c in expected), (degrees, line.how)
        counted.append(len(expected))
    assert advice and max(counted) > 1, [a.text for a in advice]


@pytest.mark.parametrize("degrees", [
    {"dp_replicate": 2, "dp_shard": 2, "tp": 2}, {"dp_shard": 2, "tp": 2}, {"pp": 2, "tp": 2},
    {"pp": 2, "dp_shard": 2}, {"dp_replicate": 2, "dp_shard": 4}, {"dp_replicate": 8}, {"pp": 2, "dp_shard": 2, "tp": 2},
], ids=str)
def test_the_groups_counted_are_the_groups_torch_makes_for_the_runs_mesh(degrees):
    """Against torch itself, in one process (its "fake" backend stands for 8 ranks): the run's mesh
    (runtime/mesh.py) with the views the strategies ask for -- the data-parallel ranks flattened where tp or
    pp splits the batch's ranks (`Strategy.data_parallel_group`), FSDP's dimensions with tp where there is tp
    -- gives rank 0 exactly the groups of 2 or more ranks the plan counts: a group of every rank is the
    world's, a flattened view is a group of its own."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from trainkit.recipe.blocks.strategy import ParallelDims
    from trainkit.runtime.mesh import build_mesh

    dims = ParallelDims(**degrees)
    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dims.world_size)
    try:
        mesh = build_mesh(dims, "cpu")
        if dims.tp * dims.pp > 1:
            mesh.view("batch")
        if dims.tp > 1:
            mesh.view("fsdp_tp")
        made = [distributed_c10d.get_process_group_ranks(pg) for pg in distributed_c10d._world.pg_map]
    finally:
        dist.destroy_process_group()
    made = [ranks for ranks in made if len(ranks) > 1]
    counted = communicators_of_mesh(dims.degrees(), dims.world_size, 4)  # as if 4 ranks a node
    assert len(made) == len(counted), (made, counted)
    # each group's size and ranks on rank 0's node, as torch placed its ranks
    assert sorted((len(r), sum(x < 4 for x in r)) for r in made) == sorted((c.ranks, c.local_ranks) for c in counted)
