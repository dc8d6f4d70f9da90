"""Sharded pipeline stages (issue 30): torchtitan's 3-D, pipeline x FSDP x tensor parallel.

Each stage is the model with only its blocks left, under their original names
(`pipeline_stages.nested_stage`); the model's own tensor-parallel plan, filtered to the modules the
stage holds, splits it over the mesh's "tp"; FSDP's `apply_fsdp` shards each block and the stage root
over "dp_shard"; the strategy then hands the stage to `PipelineStage` on the mesh's "pp" group. FSDP
reduces the gradients over the data-parallel ranks (torch's schedule calls its post-backward once per
step), so nothing is averaged by hand in this layout.

Checkpoints are DCP's sharded state dicts, keyed by the original parameter names, like the FSDP
strategy's: a checkpoint written on pp x dp_shard x tp loads on another mesh (FSDP on one process is
tested) and `trainkit export` consolidates it.
"""

from __future__ import annotations

from fnmatch import fnmatch
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..recipe.blocks import FSDPOptions, PerformanceOptions
from .fsdp import apply_fsdp, grad_norm_on_meshes
from .pipeline_stages import flatten_blocks
from .tensor_parallel import PLAN_METHOD


def stage_plan(model: nn.Module, stage: nn.Module) -> dict:
    """The model's tensor-parallel plan without the patterns that name no module of `stage` (the plan of
    the whole model names the embedding, every block, the norm and the head)."""
    declare = getattr(model, PLAN_METHOD, None)
    if not callable(declare):
        raise RuntimeError(f"model {type(model).__qualname__} declares no tensor-parallel plan ({PLAN_METHOD}); "
                           "use parallel.tp: 1")
    names = [n for n, _ in stage.named_modules() if n]
    return {pattern: style for pattern, style in declare(loss_parallel=False).items()
            if any(fnmatch(n, pattern) for n in names)}


def shard_stage(stage: nn.Module, model: nn.Module, mesh, precision_name: str,
                performance: PerformanceOptions) -> nn.Module:
    """Tensor parallel on mesh["tp"] (the model's plan), then `fully_shard` on each of the stage's blocks
    and on the stage root over the data-parallel mesh (the FSDP strategy's `apply_fsdp`)."""
    from torch.distributed.tensor.parallel import parallelize_module

    shard_mesh = mesh.view("fsdp")
    if mesh.degree("tp") > 1:
        parallelize_module(stage, mesh.view("tp"), stage_plan(model, stage))
        # one flattened (data-parallel, "tp") group: DTensor reduces a norm over both in one all-reduce
        mesh.view("fsdp_tp")
    # the units: the pipeline's own blocks (flatten_blocks), by their classes; not resharded after forward
    # (torchtitan's choice under pp: else each micro-batch gathers every unit again)
    units = sorted({type(block).__name__ for _, block in flatten_blocks(stage)})
    options = FSDPOptions(name="fsdp", wrap=units, reshard_after_forward=False)
    return apply_fsdp(stage, shard_mesh, options, precision_name, performance)


def clip_grad_norm_across_stages(params: list[nn.Parameter], max_norm: float, pp_group) -> torch.Tensor:
    """The global gradient norm: each stage's (over its DTensor meshes, `grad_norm_on_meshes`) squared and
    summed over the pipeline's ranks, torchtitan's `clip_grad_norm_` under pp; every gradient scaled by it."""
    groups, norm = grad_norm_on_meshes(params)
    squared = norm.detach().float().pow(2)
    dist.all_reduce(squared, group=pp_group)
    total = squared.sqrt()
    for group in groups:
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def save_sharded(folder: Path, part: nn.Module, optimizer: torch.optim.Optimizer, model_names: list[str]) -> None:
    """DCP's sharded state dicts of this rank's part of the model, under the original names. The one
    optimizer parameter group is saved naming every parameter of the whole model (each rank holds one
    stage's), so every rank writes the same group and a one-group optimizer on another mesh reads it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(part, optimizer)
    (group,) = optim_sd["param_groups"]
    optim_sd["param_groups"] = [{**group, "params": list(model_names)}]
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder))


def load_sharded(folder: Path, part: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Loads a DCP checkpoint of any mesh (DCP reshards); the saved group's settings, this rank's names."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(part, optimizer)
    mine = list(optim_sd["param_groups"][0]["params"])  # a copy: dcp.load overwrites the group in place
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(folder))
    state["optim"]["param_groups"] = [{**state["optim"]["param_groups"][0], "params": mine}]
    set_state_dict(part, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
