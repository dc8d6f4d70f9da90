"""The grid's meshes (issue 30): `parallel:` blocks over the grid's ranks, and the cells that hold them.

Every new combination a `parallel:` block makes is a declared cell, accepted (then trained and held
to its reference like every other cell) or refused by `trainkit validate`: tensor parallel on the
models that declare a plan and on those that do not (their model facts refuse it), on the strategies
that lay ranks out on `tp` and on those that do not (`Capabilities.mesh_dims`), HSDP's replicate
dimension, and the pipeline's stages written as a mesh. With the grid's 2 ranks a mesh has one
dimension of 2. The meshes of several dimensions are cells of their own world size (`MESH_DEGREES`),
trained by their own tests instead of the grid's 2-rank launch: HSDP and FSDP x TP, 2 x 2 on 4 ranks,
by tests/test_parallel_mesh_runs.py's 4-rank launch; the 3-D mesh (pipeline x FSDP x TP, 2 x 2 x 2)
on 8 ranks by tests/test_pipeline_3d_runs.py.
"""

from __future__ import annotations

import math
from typing import Any

from ..blocks.parallel import ParallelOptions

# mesh -> the one dimension of a parallel: block that holds every rank ("none": no block, the strategy's
# own layout)
MESH_DIMENSION: dict[str, str] = {
    "tp": "tp",  # tensor parallel alone
    "replicate": "dp_replicate",  # HSDP's replicate dimension (FSDP: replicas of a 1-rank shard group)
    "pp": "pp",  # the pipeline's stages, written as a mesh
}


# meshes of several dimensions -> their degrees; the cell runs on their product of ranks
MESH_DEGREES: dict[str, dict[str, int]] = {
    "dp_replicate-dp_shard": {"dp_replicate": 2, "dp_shard": 2},  # HSDP: 2 replicas of a 2-rank shard group
    "dp_shard-tp": {"dp_shard": 2, "tp": 2},  # 2-D: FSDP over 2 tensor-parallel groups of 2
    "pp-dp_shard-tp": {"pp": 2, "dp_shard": 2, "tp": 2},  # 3-D: sharded pipeline stages (issue 30)
}


def mesh_world(mesh: str, world: int) -> int:
    """The ranks a cell of `mesh` runs on: the grid's `world`, or the product of a multi-dimensional mesh."""
    return math.prod(MESH_DEGREES[mesh].values()) if mesh in MESH_DEGREES else world


def mesh_block(mesh: str, world: int) -> dict[str, Any]:
    """The recipe fragment of `mesh` over `world` ranks: every rank on its dimension, the others 1; a
    multi-dimensional mesh with its own degrees and launch size."""
    if mesh in MESH_DEGREES:
        return {"parallel": dict(MESH_DEGREES[mesh]), "launch": {"nproc_per_node": mesh_world(mesh, world)}}
    return {} if mesh == "none" else {"parallel": {"dp_shard": 1, MESH_DIMENSION[mesh]: world}}


# the mesh cells: (strategy, model, precision, option, init, mesh); accepted ones first
MESH_ROWS: list[tuple[str, str, str, str, str, str]] = [
    ("fsdp", "transformer", "fp32", "none", "seeded", "tp"),
    ("fsdp", "transformer", "bf16", "none", "seeded", "tp"),
    ("fsdp", "transformer", "fp32", "grad_clip", "seeded", "tp"),  # one norm over DTensor gradients
    ("fsdp", "hf-llama", "fp32", "none", "constructor", "tp"),  # the plan from transformers' own
    ("fsdp", "transformer", "fp32", "none", "seeded", "replicate"),
    ("fsdp", "mlp", "fp32", "none", "seeded", "replicate"),
    ("pipeline", "transformer", "fp32", "none", "seeded", "pp"),
    # tensor parallel with each option and precision users combine it with (verified 2026-11-26; before,
    # only compile crashed and, in one process running them in turn, its leaked token mask failed the rest)
    ("fsdp", "transformer", "fp32", "checkpointing-selective", "seeded", "tp"),
    ("fsdp", "transformer", "fp32", "grad_accum", "seeded", "tp"),
    ("fsdp", "transformer", "fp16-dynamic", "none", "seeded", "tp"),
    ("fsdp+cpu_offload", "transformer", "fp32", "none", "seeded", "tp"),
    ("fsdp", "hf-llama", "bf16", "checkpointing-full", "constructor", "tp"),
    # 2-D on 4 ranks: HSDP and FSDP x TP, 2 x 2 (the meshes the doctor and the bottleneck advice offer)
    ("fsdp", "transformer", "fp32", "none", "seeded", "dp_replicate-dp_shard"),
    ("fsdp", "transformer", "fp32", "none", "seeded", "dp_shard-tp"),
    # LoRA under HSDP (issue 39): FSDP units of frozen and trainable parameters, replicated twice
    ("fsdp", "hf-llama", "fp32", "lora", "constructor", "dp_replicate-dp_shard"),
    # 3-D on 8 ranks: pp 2 x dp_shard 2 x tp 2, clipping across stages and meshes
    ("pipeline", "transformer", "fp32", "grad_clip", "seeded", "pp-dp_shard-tp"),
    # compile x tp (issue 40): each block compiled after its split, the vocabulary-split embedding eager;
    # refused until 2026-11-29 (the embedding's unfinished collective reached the first compiled block).
    # The transformer's is grid.COMBINED's compile+checkpointing cell on tp.
    ("fsdp", "hf-llama", "fp32", "compile", "constructor", "tp"),
    # refused: models without a tensor-parallel plan (their facts), strategies without a tp dimension
    ("fsdp", "mlp", "fp32", "none", "seeded", "tp"),
    ("fsdp", "resnet18", "fp32", "none", "seeded", "tp"),
    ("ddp", "transformer", "fp32", "none", "seeded", "tp"),
    ("zero3", "transformer", "fp32", "none", "seeded", "tp"),
    ("pipeline", "transformer", "fp32", "none", "seeded", "tp"),
]


def data_parallel(recipe: dict[str, Any], world: int) -> int:
    """The data-parallel size a cell's recipe gives its `parallel:` block over `world` ranks (the
    ranks reading different samples; tp and pp ranks share theirs)."""
    return ParallelOptions(**recipe["parallel"]).dims(world).dp
