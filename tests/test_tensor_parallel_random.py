"""Tensor-parallel randomness per replica (issue 41, item 4). On a GPU, DTensor's RNG tracker made by
the first random op broadcasts rank 0's generator over the world; the worker makes it first, without
that sync, seeded per data-parallel replica (`seeding.seed_tensor_parallel_random`). The CPU has no
tracker, so what runs there is the wiring: which mesh and seed reach DTensor's `manual_seed`. On one
GPU (the GPU tier, `pytest -m gpu`; not run yet): the tracker made without a broadcast, and DTensor's
dropout replayed from the checkpoint's RNG state. Replicas drawing different masks, and a tensor-parallel
group one: tests/test_gpu.py on 4 GPUs (dp 2 x tp 2), not run yet."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import torch.distributed.tensor._random as dtensor_random

from trainkit.runtime.seeding import seed_tensor_parallel_random


def _mesh(device_type: str, tp: int):
    return SimpleNamespace(device_type=device_type, degree=lambda name: tp if name == "tp" else 1,
                           view=lambda name: f"the {name} mesh")


def test_a_gpu_run_with_tensor_parallel_seeds_dtensor_on_its_tp_mesh(monkeypatch):
    calls = []
    monkeypatch.setattr(dtensor_random, "manual_seed", lambda seed, mesh: calls.append((seed, mesh)))
    seed_tensor_parallel_random(7 + 3, _mesh("cuda", 2))
    assert calls == [(10, "the tp mesh")]


def test_nothing_to_seed_without_tensor_parallel_or_on_the_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(dtensor_random, "manual_seed", lambda seed, mesh: calls.append((seed, mesh)))
    for mesh in (None, _mesh("cuda", 1), _mesh("cpu", 2)):
        seed_tensor_parallel_random(7, mesh)
    assert calls == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_dtensor_dropout_replays_from_the_checkpointed_generator_without_a_broadcast(monkeypatch):
    """The one-GPU round trip (written without a GPU at hand): seeded as a worker seeds its tensor-parallel
    group, DTensor's RNG tracker exists before the first random op and was made without broadcasting
    rank 0's state; dropout on a DTensor then draws from the rank's CUDA generator, so the checkpoint's
    RNG state (`checkpoint.rng_state`) replays the masks drawn after it. One process, one GPU: the mesh
    is real, its tp degree is stated as 2 (one GPU has no tp group of 2) so the seeding does its work."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from run_helpers import free_port
    from trainkit.runtime.checkpoint import rng_state, set_rng_state

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("tp",))
        broadcasts = []
        broadcast = dist.broadcast
        monkeypatch.setattr(dist, "broadcast", lambda *a, **k: broadcasts.append(a) or broadcast(*a, **k))
        seed_tensor_parallel_random(11, SimpleNamespace(device_type="cuda", degree=lambda name: 2 if name == "tp" else 1,
                                                        view=lambda name: mesh))
        assert isinstance(dtensor_random._rng_tracker, dtensor_random.OffsetBasedRNGTracker)
        x = distribute_tensor(torch.ones(256, 256, device="cuda"), mesh, [Shard(0)])
        masks = lambda: torch.nn.functional.dropout(x, 0.5).full_tensor()  # noqa: E731
        first = masks()
        saved = rng_state()
        second = masks()
        set_rng_state(saved)
        assert torch.equal(masks(), second) and not torch.equal(first, second)
        assert broadcasts == []  # no world collective at the first random op
    finally:
        dtensor_random._rng_tracker = None
        dist.destroy_process_group()
