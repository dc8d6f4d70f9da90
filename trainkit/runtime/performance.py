"""The recipe's `performance:` options, as small functions the worker and the strategies call.

Where each one applies differs per strategy (the strategies call these at the right point):

- backend flags (tf32, cudnn.benchmark) and the model-wide conversions (channels_last, SyncBatchNorm)
  happen once in the worker, before the strategy wraps the model;
- activation checkpointing goes on blocks (`checkpoint_blocks`) before any wrapper: FSDP per unit
  before `fully_shard`, DDP/DeepSpeed on the bare module, the pipeline inside each stage;
- torch.compile goes on the module a wrapper will hold (`compile_module`): the whole model before DDP
  wraps it (`torch.compile(DDP(m))` compiles nothing: DDP's forward breaks the graph), each block
  before FSDP shards it, each pipeline stage. `nn.Module.compile()` compiles in place, so parameter
  names -- and so checkpoints -- are those of the eager model.

Activation checkpointing runs each block's forward under `torch.utils.checkpoint` (non-reentrant),
set on the block itself instead of a wrapper module, so parameter names do not change either, and
torch.compile traces it.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from ..recipe.blocks import ActivationCheckpointingOptions, CompileOptions, PerformanceOptions

CONTAINERS = (nn.Sequential, nn.ModuleList)


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def block_classes(model: nn.Module, class_names: list[str]) -> list[str]:
    """The class names that make a block: the recipe's own (`wrap:`/`blocks:`), else what the model
    declares as the layers never to split -- `_no_split_modules`, the attribute Hugging Face models
    carry and Accelerate's automatic wrapping reads (the built-in transformer declares it too)."""
    return list(class_names or getattr(model, "_no_split_modules", None) or [])


def repeated_blocks(model: nn.Module, class_names: list[str]) -> list[nn.Module]:
    """The model's blocks, in registration (forward) order: the one notion of a block that FSDP's
    units, activation checkpointing, per-block compile and the memory plan share.

    With class names (`block_classes`: the recipe's, or the model's `_no_split_modules`): every module of
    those classes, outermost only. Otherwise (automatic): the repeated layers of the network -- inside each
    Sequential/ModuleList, the children with parameters whose class occurs more than once there
    (ResNet's Bottlenecks, an MLP's Linears, a stack of blocks); a container holding all of them is
    descended into, never taken as one block. A model without repetition falls back to the children with
    parameters of its containers (a one-layer stack keeps its layer as a block).
    """
    names = block_classes(model, class_names)
    if names:
        if type(model).__name__ in names:
            return []  # the root is the only block
        return _outermost_of(model, names)
    return _repeated_children(model, repeated_only=True) or _repeated_children(model, repeated_only=False)


def _outermost_of(model: nn.Module, names: list[str]) -> list[nn.Module]:
    chosen: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if type(child).__name__ in names:
                chosen.append(child)
            else:
                visit(child)

    visit(model)
    return chosen


def _repeated_children(model: nn.Module, *, repeated_only: bool) -> list[nn.Module]:
    chosen: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if isinstance(module, CONTAINERS):
            with_params = [c for c in module.children() if _has_params(c)]
            counts: dict[type, int] = {}
            for c in with_params:
                counts[type(c)] = counts.get(type(c), 0) + 1
        for child in module.children():
            hit = (isinstance(module, CONTAINERS) and _has_params(child)
                   and (counts[type(child)] > 1 or not (repeated_only or isinstance(child, CONTAINERS))))
            if hit:
                chosen.append(child)
            else:
                visit(child)

    visit(model)
    return chosen


def set_backend_flags(perf: PerformanceOptions) -> None:
    """Process-wide switches: TF32 (what MFU's peak is measured against) and cuDNN autotuning."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = perf.tf32
    torch.backends.cudnn.benchmark = perf.cudnn_benchmark


def prepare_model(model: nn.Module, perf: PerformanceOptions, *, contiguous_parameters: bool = False,
                  float8_all_gather: bool = False) -> nn.Module:
    """Model-wide conversions before the strategy wraps the model: SyncBatchNorm (DDP only, checked
    before launch) and the channels_last memory format of 4-D parameters -- unless the strategy keeps
    parameters contiguous (FSDP, ZeRO: `Capabilities.contiguous_parameters`), where the inputs alone
    are channels_last (FSDP refuses non-contiguous parameters); float8 linears, whose weights FSDP then
    all-gathers in float8 where the strategy says so (`Strategy.float8_all_gather`)."""
    if perf.sync_batchnorm:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if perf.channels_last and not contiguous_parameters:
        model = model.to(memory_format=torch.channels_last)
    if perf.float8:
        convert_to_float8(model, fsdp_all_gather=float8_all_gather)
    return model


def float8_linears(model: nn.Module) -> list[str]:
    """The Linear layers float8 converts: every one except the model's last (the output head, whose
    logits are the most precision-sensitive matmul -- torchtitan leaves its `output` in bf16 too) and
    those with a dimension not divisible by 16 (float8 matmul kernels need multiples of 16)."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    return [name for name, m in linears[:-1] if m.in_features % 16 == 0 and m.out_features % 16 == 0]


def convert_to_float8(model: nn.Module, *, fsdp_all_gather: bool = False) -> list[str]:
    """torchao's float8 training (dynamic tensorwise scaling) on `float8_linears(model)`, in place: each
    becomes a `Float8Linear` -- an nn.Linear subclass with the same parameters and names, so checkpoints
    load either way -- whose forward and backward matmuls cast to float8 with a fresh scale per tensor.
    Returns the converted names. Before the strategy wraps the model. With `fsdp_all_gather`, each
    weight is cast to float8 before FSDP all-gathers it (torchao's `enable_fsdp_float8_all_gather`, as
    torchtitan runs it): half the bytes of a bf16 all-gather, and the gathered weight is already the
    matmul's float8 input; the strategy then refreshes the scales after each optimizer step
    (`precompute_float8_scales`)."""
    import logging

    # torchao's import registers an Enum with torch's pytree, which logs a deprecation warning on every
    # rank (torch >= 2.14); quiet only that logger, only for the import
    pytree_log = logging.getLogger("torch.utils._pytree")
    level = pytree_log.level
    pytree_log.setLevel(logging.ERROR)
    try:
        from torchao.float8 import convert_to_float8_training
    finally:
        pytree_log.setLevel(level)
    from torchao.float8 import Float8LinearConfig

    chosen = set(float8_linears(model))
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_all_gather),
                               module_filter_fn=lambda module, fqn: fqn in chosen)
    return sorted(chosen)


def precompute_float8_scales(model: nn.Module) -> None:
    """After an optimizer step under FSDP's float8 all-gather: every float8 weight's scale for the next
    all-gathers, from one all-reduce of all their maxima instead of one per weight (torchao's
    `precompute_float8_dynamic_scale_for_fsdp`, which torchtitan calls after each step)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def checkpointed_blocks(model: nn.Module, ac: ActivationCheckpointingOptions) -> list[nn.Module]:
    """The blocks the options select: none, all of them (full) or every n-th (selective)."""
    if ac.mode == "none":
        return []
    blocks = repeated_blocks(model, ac.blocks)
    step = ac.every_n_blocks if ac.mode == "selective" else 1
    return blocks[::step]


def checkpoint_blocks(blocks: list[nn.Module]) -> None:
    """Activation checkpointing on each block: its forward runs under `torch.utils.checkpoint`
    (non-reentrant) and is recomputed in backward. The block's own `forward` is replaced on the
    instance, not wrapped in another module, so parameter names -- and checkpoints -- do not change;
    unlike the hooks of `torch.distributed._composable.checkpoint`, torch.compile traces it (dynamo
    turns it into its activation-checkpoint region), so compile and checkpointing combine, in
    torchtitan's order: checkpoint each block, then compile (docs/performance.md)."""
    import types

    for block in blocks:
        block.forward = types.MethodType(_checkpointed_forward, block)


def _checkpointed_forward(self: nn.Module, *args, **kwargs):
    """The class's forward under non-reentrant checkpointing (a bound method, so a deep copy of the
    block binds to the copy)."""
    from torch.utils.checkpoint import checkpoint

    if torch.compiler.is_compiling():  # dynamo's checkpoint region: its recomputation replays no buffer update
        return checkpoint(type(self).forward, self, *args, use_reentrant=False, **kwargs)
    return checkpoint(type(self).forward, self, *args, use_reentrant=False,
                      context_fn=lambda: (contextlib.nullcontext(), _statistics_kept(self)), **kwargs)


@contextlib.contextmanager
def _statistics_kept(block: nn.Module):
    """The recomputation in backward runs the block's forward a second time, and a BatchNorm in
    training mode updates its running statistics on every forward: a checkpointed ResNet's running
    mean, variance and batch count moved twice per step (guarded by tests/test_performance.py; torch's
    checkpoint leaves this to the caller). Their values before the recomputation are put back after it."""
    statistics = [b for m in block.modules()
                  if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats
                  for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None]
    before = [b.clone() for b in statistics]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in zip(statistics, before):
                buffer.copy_(value)


def apply_activation_checkpointing(model: nn.Module, ac: ActivationCheckpointingOptions) -> list[nn.Module]:
    blocks = checkpointed_blocks(model, ac)
    checkpoint_blocks(blocks)
    return blocks


def compile_kwargs(options: CompileOptions) -> dict:
    kwargs = {"mode": None if options.mode == "default" else options.mode, "fullgraph": options.fullgraph}
    if options.dynamic is not None:
        kwargs["dynamic"] = options.dynamic
    return kwargs


def compile_module(module: nn.Module, options: Optional[CompileOptions]) -> nn.Module:
    """torch.compile in place (`nn.Module.compile`): same object, same parameter names."""
    if options is not None:
        module.compile(**compile_kwargs(options))
    return module


def channels_last_input(x):
    """A 4-D floating tensor in channels_last memory format; anything else unchanged."""
    if isinstance(x, torch.Tensor) and x.dim() == 4:
        return x.contiguous(memory_format=torch.channels_last)
    return x


__all__ = ["apply_activation_checkpointing", "channels_last_input", "checkpoint_blocks", "checkpointed_blocks",
           "compile_kwargs", "compile_module", "block_classes", "convert_to_float8", "float8_linears",
           "precompute_float8_scales", "prepare_model",
           "repeated_blocks", "set_backend_flags"]
