"""The model's sizes for the memory plan, measured on the meta device (no memory, no data read).

Parameters and buffers come from the model built on the meta device. Activations come from one
forward on a meta batch of the recipe's shape, counting what autograd saves for backward
(`torch.autograd.graph.saved_tensors_hooks`) -- the activations a rank holds between its forward and
its backward -- once with every block kept and once as activation checkpointing keeps it (each
repeated block's input, plus one block's own activations while it is recomputed).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..recipe.memory_plan import ModelSizes
from .model import factory
from .performance import repeated_blocks


def model_sizes(recipe: Any) -> ModelSizes:
    """Sizes of the recipe's model (built on the meta device) and of one micro-batch's activations."""
    spec = recipe.model
    with torch.device("meta"):
        model = factory(spec.name)(**spec.args)
    parameters = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    blocks = repeated_blocks(model, [])
    in_blocks = sum(p.numel() for b in blocks for p in b.parameters())
    largest = max([sum(p.numel() for p in b.parameters()) for b in blocks] + [parameters - in_blocks])
    batch = example_batch(recipe)
    whole, checkpointed = (None, None) if batch is None else _trace(model, blocks, batch)
    return ModelSizes(parameters=parameters, buffer_bytes=buffers, largest_unit=largest, activation_bytes=whole,
                      checkpointed_activation_bytes=checkpointed, micro_batch=recipe.data.batch_size)


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
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.train()
            model(batch)
    except Exception:  # an op without a meta kernel, a data-dependent shape: activations stay unknown
        return None, None
    finally:
        for h in handles:
            h.remove()
    checkpointed = sum(kept.values()) + max(per_block.values(), default=0)
    return sum(seen.values()), checkpointed if blocks else None
