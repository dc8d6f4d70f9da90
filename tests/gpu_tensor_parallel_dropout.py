"""Run by tests/test_gpu.py under torchrun on 4 GPUs: dropout on a tensor-parallel DTensor, seeded as a
trainkit worker seeds each rank (`seeding.seed_replica` on the run's mesh, dp_replicate 2 x tp 2).

    python -m torch.distributed.run --nproc_per_node 4 tests/gpu_tensor_parallel_dropout.py OUT

Each rank writes OUT/masks-rank<R>.json: its replica, a hash of the mask it drew itself on a replicated
DTensor, and hashes of three whole masks of a sharded one -- the first drawn, the second, and the second
again after restoring the RNG state saved between them as a checkpoint saves it (`checkpoint.rng_state`). Issue 41, item 4: one tensor-parallel group draws one mask (its
ranks hold parts of one activation), replicas draw different ones, a restored state replays."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from trainkit.recipe.blocks.strategy import ParallelDims
from trainkit.runtime.checkpoint import rng_state, set_rng_state
from trainkit.runtime.mesh import build_mesh
from trainkit.runtime.seeding import seed_replica


def main(out: Path) -> None:
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    try:
        dims = ParallelDims(dp_replicate=2, tp=2)
        mesh = build_mesh(dims, "cuda")
        seed_replica(7, rank, dims.tp, mesh)
        ones = torch.ones(64, 64, device="cuda")
        sharded = distribute_tensor(ones, mesh.view("tp"), [Shard(0)])
        replicated = distribute_tensor(ones, mesh.view("tp"), [Replicate()])

        def digest(t: torch.Tensor) -> str:
            return hashlib.sha256(t.ne(0).cpu().numpy().tobytes()).hexdigest()

        def mask() -> str:  # the whole mask, gathered from the group's shards
            return digest(torch.nn.functional.dropout(sharded, 0.5).full_tensor())

        # a replicated activation: each rank draws the whole mask itself, not gathered from the others
        own = digest(torch.nn.functional.dropout(replicated, 0.5).to_local())
        first = mask()
        saved = rng_state()
        second = mask()
        set_rng_state(saved)
        again = mask()
        (out / f"masks-rank{rank}.json").write_text(json.dumps(
            {"replica": mesh.replica_index, "replicated": own, "first": first, "second": second, "again": again}))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
