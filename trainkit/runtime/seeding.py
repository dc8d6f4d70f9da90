"""A run's seeds: the same initial weights on every rank, then per-replica randomness.

Its own module because the order matters and is easy to break: the model is built under the shared
seed (every rank, and a one-process run, draws the same weights), and only after the strategy's set-up
does each data-parallel replica get its own stream (augmentation, dropout), shared within a
tensor-parallel group whose replicated activations must drop the same units.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from .mesh import RunMesh


def seed_everything(seed: int) -> None:
    """Python's, torch's (every device) and numpy's generators, from one seed."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


def replica_seed(seed: int, rank: int, tp_degree: int) -> int:
    """The seed of this rank's replica: tensor parallel is the innermost mesh dimension, so neighbouring
    ranks `rank // tp_degree` form one group and share it."""
    return seed + rank // tp_degree


def seed_replica(seed: int, rank: int, tp_degree: int, mesh: Optional["RunMesh"]) -> None:
    """Per-replica randomness, after the model is built and placed."""
    seed_everything(replica_seed(seed, rank, tp_degree))
    seed_tensor_parallel_random(replica_seed(seed, rank, tp_degree), mesh)


def seed_tensor_parallel_random(seed: int, mesh: Optional["RunMesh"]) -> None:
    """Random ops on tensor-parallel DTensors (dropout) draw from this rank's own generator, seeded
    `seed` -- the same within a tensor-parallel group, different between data-parallel replicas, as the
    worker seeds them -- and never from rank 0's. Without this, DTensor's RNG tracker, made at the first
    random op on a GPU, broadcasts rank 0's CUDA generator state over the whole world (torch's
    `OffsetBasedRNGTracker(run_state_sync=True)`): every replica then drops the same units, a world
    collective runs at an arbitrary point (under the pipeline too), and a resumed run, which broadcasts
    again at its own first random op, draws other masks than the uninterrupted one. Making the tracker
    first without that sync is torchtitan's way (`set_determinism`: DTensor's `manual_seed` on the
    tensor-parallel mesh); the generator it draws from is the device's own, which checkpoints keep
    (`checkpoint.rng_state`). The CPU has no tracker (DTensor's random ops use each rank's generator)."""
    if mesh is None or mesh.device_type == "cpu" or mesh.degree("tp") == 1:
        return
    from torch.distributed.tensor._random import manual_seed

    manual_seed(seed, mesh.view("tp"))
