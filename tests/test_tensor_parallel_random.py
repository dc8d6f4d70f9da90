"""Tensor-parallel randomness per replica (issue 41, item 4). On a GPU, DTensor's RNG tracker made by
the first random op broadcasts rank 0's generator over the world; the worker makes it first, without
that sync, seeded per data-parallel replica (`seeding.seed_tensor_parallel_random`). The CPU has no
tracker, so what runs there is the wiring: which mesh and seed reach DTensor's `manual_seed`. The
effect (replicas drawing different masks, a resume drawing the same ones) needs GPUs: the GPU tier's
tensor-parallel runs (tests/test_gpu.py, 2+ GPUs), not run yet."""

from __future__ import annotations

from types import SimpleNamespace

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
