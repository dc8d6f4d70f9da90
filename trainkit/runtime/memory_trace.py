"""The model's sizes for the memory plan, measured on the meta device (no memory, no data read).

Parameters and buffers come from the model built on the meta device. Activations come from one
forward on a meta batch of the recipe's shape, counting what autograd saves for backward
(`torch.autograd.graph.saved_tensors_hooks`) -- the activations a rank holds between its forward and
its backward -- once with every block kept and once as activation checkpointing keeps it (each
repeated block's input, plus one block's own activations while it is recomputed).

Attention is traced as the fused kernels run it, not as the meta device would: on the meta device
`scaled_dot_product_attention` takes the math path, which saves the B x H x T x T attention weights
(twice, in fp32 under autocast) -- quadratic in the sequence -- while the kernels a run uses (flash and
memory-efficient on CUDA, the flash kernel torch has for CPU) save the output and a B x H x T log-sum-exp.
`FusedAttentionShapes` stands in for the call during the trace and saves exactly those.

The blocks are `runtime.performance.repeated_blocks` -- the same units FSDP shards and checkpointing
recomputes -- so the plan names the unit it gathers and what checkpointing keeps.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..recipe.memory_plan import ModelSizes
from . import model_sizes_cache
from .model import factory
from .performance import repeated_blocks


def recipe_block_names(recipe: Any) -> list[str]:
    """The class names the recipe makes its blocks: a sharding strategy's `wrap:` (its units), else
    checkpointing's `blocks:`; empty: the model's own (`repeated_blocks`)."""
    return list(getattr(recipe.strategy, "wrap", None) or recipe.performance.checkpointing.blocks or [])


def largest_unit_of(recipe: Any) -> int:
    """Parameter elements of the recipe's largest block (built on the meta device: no memory); 0 where
    the model does not build there."""
    try:
        model = _on_meta(recipe)
    except Exception:  # reported by preflight's model checks
        return 0
    return max((n for n, _ in _units(model, recipe)), default=0)


def _on_meta(recipe: Any) -> nn.Module:
    spec = recipe.model
    with torch.device("meta"):
        return factory(spec.name)(**spec.args)


def _units(model: nn.Module, recipe: Any) -> list[tuple[int, str]]:
    """(parameter elements, class name) of each of the recipe's blocks."""
    return [(sum(p.numel() for p in b.parameters()), type(b).__name__)
            for b in repeated_blocks(model, recipe_block_names(recipe))]


def model_sizes(recipe: Any) -> ModelSizes:
    """Sizes of the recipe's model (built on the meta device) and of one micro-batch's activations;
    read back from the last trace of the same model, batch and code (`model_sizes_cache`)."""
    batch = example_batch(recipe)
    key = model_sizes_cache.key_parts(
        recipe.model.model_dump(mode="json"), factory(recipe.model.name),
        None if batch is None else (tuple(batch.shape), str(batch.dtype)), recipe_block_names(recipe))
    return model_sizes_cache.sizes(key, lambda: _measured_sizes(recipe, batch))


def _measured_sizes(recipe: Any, batch: Optional[torch.Tensor]) -> ModelSizes:
    model = _on_meta(recipe)
    parameters = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    largest_parameter = max((p.numel() for p in model.parameters() if p.requires_grad), default=0)
    quantized = sum(layer.weight.numel() for layer in getattr(model, "quantized_base_layers", list)())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    blocks = repeated_blocks(model, recipe_block_names(recipe))
    units = _units(model, recipe)
    in_blocks = sum(n for n, _ in units)
    largest, name = max(units + [(parameters - in_blocks, "the rest of the model (the root unit)")])
    whole, checkpointed = (None, None) if batch is None else _trace(model, blocks, batch)
    return ModelSizes(parameters=parameters, buffer_bytes=buffers, largest_unit=largest, activation_bytes=whole,
                      checkpointed_activation_bytes=checkpointed, micro_batch=recipe.data.batch_size,
                      largest_unit_name=name, blocks=len(blocks),
                      trainable=None if trainable == parameters else trainable, quantized=quantized,
                      largest_parameter=largest_parameter)


def example_batch(recipe: Any) -> Optional[torch.Tensor]:
    """A meta batch of the recipe's inputs: token ids for sequence data, floats of the sample shape
    otherwise; None where the data block does not say its shape."""
    data, batch = recipe.data, recipe.data.batch_size
    seq_len = getattr(data, "seq_len", None)
    if isinstance(seq_len, int):
        return torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    shape = data.sample_shape() or getattr(data, "shape", None)
    if not shape:
        return None
    return torch.zeros(batch, *shape, device="meta")


def _trace(model: nn.Module, blocks: list[nn.Module], batch: torch.Tensor) -> tuple[Optional[int], Optional[int]]:
    """(bytes saved for backward, the same with every block checkpointed); (None, None) if the model
    does not run on the meta device."""
    # a storage's identity tells views and autograd's aliases of one tensor apart from other tensors
    # (meta storages have no data pointer, but each is its own object)
    storage = lambda t: t.untyped_storage()  # noqa: E731
    params = {storage(p)._cdata for p in model.parameters()}
    seen: dict[int, int] = {}  # storage -> bytes
    per_block: dict[int, int] = {}
    kept: dict[int, int] = {}  # what checkpointing keeps: saved outside the blocks, and block inputs
    current: list[int] = []
    alive: list[torch.Tensor] = []  # keeps the storages alive, so their identities stay unique

    def pack(t: torch.Tensor):
        key, size = storage(t)._cdata, storage(t).nbytes()
        if key not in params and key not in seen:
            seen[key] = size
            alive.append(t)
            if current:
                per_block[current[-1]] = per_block.get(current[-1], 0) + size
            else:
                kept[key] = size
        return t

    def enter(i: int):
        def hook(module, args):
            current.append(i)
            for a in args:
                if isinstance(a, torch.Tensor):
                    kept.setdefault(storage(a)._cdata, storage(a).nbytes())
                    alive.append(a)
        return hook

    def leave(module, args, out):
        current.pop()

    handles = []
    for i, block in enumerate(blocks):
        handles += [block.register_forward_pre_hook(enter(i)), block.register_forward_hook(leave)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), FusedAttentionShapes():
            model.train()
            model(batch)
    except Exception:  # an op without a meta kernel, a data-dependent shape: activations stay unknown
        return None, None
    finally:
        for h in handles:
            h.remove()
    checkpointed = sum(kept.values()) + max(per_block.values(), default=0)
    return sum(seen.values()), checkpointed if blocks else None


class _FusedAttention(torch.autograd.Function):
    """Shapes only: what a flash / memory-efficient attention kernel saves for backward (q, k, v, the
    output, the fp32 log-sum-exp per query) -- torch's `_scaled_dot_product_flash_attention` and
    `_efficient_attention` outputs."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        logsumexp = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, logsumexp)
        return out

    @staticmethod
    def backward(ctx, grad):  # never run: the trace is forward only
        raise NotImplementedError


class FusedAttentionShapes(torch.overrides.TorchFunctionMode):
    """During the trace, `F.scaled_dot_product_attention` saves what the fused kernels save; and a
    meta tensor's truth value -- which has no data -- is taken as True: Hugging Face's mask code asks
    `(position_ids[:, -1] == 0).all()` (packed sequences?) before any layer runs, which made the trace
    of every transformers model fail and the plan say "activations unknown". The question only picks
    the mask's kind, not the shapes the layers save."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.scaled_dot_product_attention:
            q, k, v = args[:3]
            return _FusedAttention.apply(q, k, v)
        if func is torch.Tensor.__bool__ and args and getattr(args[0], "is_meta", False):
            return True
        return func(*args, **(kwargs or {}))
