"""Pretrained weights from a local Hugging Face directory (config.json + model.safetensors, or sharded
model-0000x-of-0000n.safetensors with their index), read into the model after the strategy has placed
it, each rank reading only its own slices.

The library's mechanism: torch.distributed.checkpoint's `HuggingFaceStorageReader` plans the read from
the state dict each rank holds -- whole tensors under DDP, each rank's DTensor shard under FSDP, HSDP and
tensor parallel -- and copies the slices it asks for from the safetensors files (lazily, `get_slice`),
converting the dtype (a bf16 checkpoint into fp32 parameters). Never `torch.load`: safetensors hold no
code. What the files do not hold stays as built: LoRA adapters (their B matrices are zero, so the model
starts as the checkpoint) and an output head tied to the embedding.

Under a strategy that shards parameters (FSDP, HSDP, FSDP x TP) the model is built on the meta device
(`model.init: auto`): the checkpoint's parameters are only allocated as each rank's shards, the others
(LoRA adapters, a head tied to the embedding) get seeded values (runtime.materialize), and this read
fills the rest, so no rank ever holds a whole copy. Under DDP and ZeRO-1/2 each rank holds the whole
model anyway and builds it with its factory. Under ZeRO-3 the model is built partitioned (DeepSpeed's
zero.Init), and its `materialize` gathers one module at a time and copies that module's tensors in
(`PretrainedTensors`, rank 0 reading): the read holds one module whole, as training does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn

def checkpoint_tensor_names(directory: Path) -> set[str]:
    """The tensor names the directory's safetensors hold (read from their headers only)."""
    from safetensors import safe_open

    names: set[str] = set()
    for file in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return names


class PretrainedTensors:
    """One tensor at a time from a directory's safetensors files, by checkpoint name: for a reader that
    fills a module it has gathered (ZeRO-3's `materialize`), where DCP's reader needs a state dict of
    plain tensors or DTensors. Each file is opened (memory-mapped) once; `read` copies one tensor out."""

    def __init__(self, directory: str):
        from safetensors import safe_open

        self._files = [safe_open(str(f), framework="pt") for f in sorted(Path(directory).glob("*.safetensors"))]
        self._where = {name: f for f in self._files for name in f.keys()}

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def read(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)


def filled_by_pretrained(model: nn.Module) -> frozenset:
    """The parameters (by owning module and name, as runtime.materialize names them) that the model's
    pretrained directory holds: read after set-up, so a model built on the meta device need not give
    them values first. Empty for a model without a pretrained directory."""
    directory = getattr(model, "pretrained_dir", None)
    if not directory:
        return frozenset()
    from .materialize import owners, parameter_name

    present = checkpoint_tensor_names(Path(directory))
    return frozenset(parameter_name(name, p) for name, module in owners(model) for p, v in module._parameters.items()
                     if v is not None and model.pretrained_name(parameter_name(name, p)) in present)


def load_pretrained(module: nn.Module, directory: str, to_checkpoint_name: Callable[[str], str]) -> list[str]:
    """Read `directory`'s weights into `module` (the strategy's unwrapped model) in place; returns the
    parameter names left as built (not in the checkpoint)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    present = checkpoint_tensor_names(Path(directory))
    state: dict[str, torch.Tensor] = {}
    left: list[str] = []
    for name, tensor in module.state_dict().items():
        stored = to_checkpoint_name(name)
        if stored in present and stored not in state:
            state[stored] = tensor
        else:
            left.append(name)
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(directory)))
    return left


def save_adapter(module: nn.Module, directory: Path, rank: int):
    """A LoRA run's adapter directory, written by rank 0 (PEFT's format). Only the trainable tensors are
    gathered (`full_tensor()` of each DTensor shard, every rank taking part): the adapters, never the frozen
    base. None for a model without adapters."""
    save = getattr(module, "save_adapter", None)
    if save is None or not getattr(getattr(module, "model", None), "peft_config", None):
        return None
    from torch.distributed.tensor import DTensor

    trainable = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
                 for name, p in module.named_parameters() if p.requires_grad}
    if rank == 0:
        save(str(directory), trainable)
    return directory
