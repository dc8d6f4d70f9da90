"""Tensor parallel (issue 30): split the layers of a model across the ranks of the mesh's "tp"
dimension with torch's DTensor `parallelize_module`, using the plan the model itself declares.

The plan belongs to the model family, not to trainkit: a model module that supports tensor
parallel has a method

    def tensor_parallel_plan(self, *, loss_parallel: bool = False) -> dict[str, ParallelStyle]

mapping module names (fnmatch patterns such as "layers.*.attention.wq", as `parallelize_module`
takes them) to torch's parallel styles. The built-in transformer and the Hugging Face causal-LM
wrapper declare theirs (trainkit/models/). The styles, in Megatron-LM's pairing as torchtitan uses
it: `ColwiseParallel` for the projections that widen (q/k/v, the MLP's up/gate) and
`RowwiseParallel` for the ones that narrow back (attention out, MLP down), so each pair needs one
all-reduce (or reduce-scatter) forward and one backward and the activations in between stay
local; `SequenceParallel` for the norms, so the residual stream between blocks is sharded on the
sequence instead of replicated (less activation memory, same communication volume);
`PrepareModuleInput` where a block needs the whole sequence back.

Loss parallel: with `loss_parallel=True` the model keeps its logits sharded on the vocabulary (a
`Shard(-1)` DTensor), and the cross-entropy is computed without gathering them, under torch's
`loss_parallel()` context, which must enclose the loss *and* its backward (`loss_context`).
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel
from torch.distributed.tensor.parallel import parallelize_module

PLAN_METHOD = "tensor_parallel_plan"


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool) -> nn.Module:
    """Shard `model` in place over the 1-D `tp_mesh` with the plan it declares; returns it.

    Raises:
        RuntimeError: the model declares no tensor-parallel plan (the message names its class).
    """
    declare = getattr(model, PLAN_METHOD, None)
    if not callable(declare):
        raise RuntimeError(
            f"model {type(model).__module__}.{type(model).__qualname__} declares no tensor-parallel plan: a model "
            f"that supports parallel.tp > 1 defines {PLAN_METHOD}(self, *, loss_parallel=False) returning "
            "{module name pattern: torch ParallelStyle} (see docs/plugins.md, 'Tensor parallel'); use parallel.tp: 1")
    return parallelize_module(model, tp_mesh, declare(loss_parallel=loss_parallel))


def settle_collectives_before_compiled_blocks(model: nn.Module, blocks: list[nn.Module]) -> None:
    """Make every module outside `blocks` hand on finished tensors, not collectives still in flight.
    For compiling the blocks of a tensor-parallel model.

    Why: torch's Rowwise/ColwiseParallel return their output's redistribution unfinished (an
    `AsyncCollectiveTensor`, waited on at its first use). The vocabulary-split embedding runs eager,
    outside the compiled blocks, so the first block received such a tensor, and AOTAutograd (torch 2.14)
    handed the gradient of that input back in the wrong form: without FSDP the backward failed ("'Tensor'
    object has no attribute '_local_tensor'"), under FSDP it went through with wrong gradients (losses
    2e-5 to 2e-3 off one process's from step 2). Waiting for the collective before the block (a copy of
    the tensor, which is what waiting on one produces) keeps autograd's chain and costs one copy of the
    embedding's output per step. Inside a compiled block the collectives are traced and stay asynchronous.
    Hand-written: torch offers no switch for a style's asynchronous output.
    """
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    inside = {id(m) for block in blocks for m in block.modules()}

    def settled(_module, _args, output):
        if isinstance(output, AsyncCollectiveTensor):
            return output.clone()  # any non-view op waits and returns a plain tensor; autograd records it
        return None

    for module in model.modules():
        if module is not model and id(module) not in inside:
            module.register_forward_hook(settled)


def loss_context(enabled: bool) -> ContextManager:
    """torch's `loss_parallel()` when the logits stay sharded on the vocabulary, else a no-op; enter it
    around the loss *and* its backward."""
    return torch_loss_parallel() if enabled else contextlib.nullcontext()


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """A DTensor (a loss or logits under loss parallel) as the plain tensor it stands for; any other
    tensor unchanged. For what leaves the step: logged losses, evaluation sums, exported outputs."""
    return value.full_tensor() if isinstance(value, DTensor) else value
