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
from typing import Callable, Optional

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


class PretrainedSource:
    """Where a model built without its weights gets them: a Hugging Face directory or a `model.weights`
    file. `names` and `read` serve a reader that fills one gathered module at a time (ZeRO-3's
    `materialize`, rank 0); `load_into` is the read after set-up, each rank copying only the slices it
    holds."""

    where: str

    def names(self) -> set[str]:
        raise NotImplementedError

    def read(self, name: str) -> torch.Tensor:
        """One tensor, whole, on the CPU (memory-mapped where the format allows)."""
        raise NotImplementedError

    def checkpoint_name(self, name: str) -> str:
        """The stored name of the model's state-dict entry `name`."""
        return name

    def load_into(self, module: nn.Module) -> list[str]:
        """Fill `module` (the strategy's unwrapped model) in place; returns the entries left as built."""
        raise NotImplementedError


class HuggingFaceDirectory(PretrainedSource):
    """A save_pretrained directory's safetensors files. The read after set-up is DCP's
    `HuggingFaceStorageReader`: it plans the read from the state dict each rank holds (whole tensors,
    or DTensor shards) and copies the slices it asks for lazily, converting the dtype."""

    def __init__(self, directory: str, to_checkpoint_name: Callable[[str], str]):
        self.where, self._to_checkpoint_name = str(directory), to_checkpoint_name
        self._where: Optional[dict] = None  # tensor name -> its open file

    def names(self) -> set[str]:
        return checkpoint_tensor_names(Path(self.where))

    def checkpoint_name(self, name: str) -> str:
        return self._to_checkpoint_name(name)

    def read(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if self._where is None:  # each file opened (memory-mapped) once, its names listed once
            files = [safe_open(str(f), framework="pt") for f in sorted(Path(self.where).glob("*.safetensors"))]
            self._where = {key: f for f in files for key in f.keys()}
        return self._where[name].get_tensor(name)

    def load_into(self, module: nn.Module) -> list[str]:
        return load_pretrained(module, self.where, self._to_checkpoint_name)


class WeightsFile(PretrainedSource):
    """A `model.weights` state dict file: `.safetensors` (read lazily), or torch.save's format, loaded
    memory-mapped (`torch.load(mmap=True, weights_only=True)`): the file's pages are shared, clean page
    cache, and each rank copies out only what it holds. Hand-written (no DCP reader reads a torch.save
    file): each DTensor's local slice is cut from the mapped whole with `distribute_tensor(...,
    src_data_rank=None)`, which slices without communicating."""

    def __init__(self, path: str):
        self.where = str(path)
        self._state: Optional[dict] = None

    def _tensors(self) -> dict:
        if self._state is None:
            if self.where.endswith(".safetensors"):
                from safetensors import safe_open

                handle = safe_open(self.where, framework="pt")
                self._state = {name: _Lazy(handle, name) for name in handle.keys()}
            else:
                try:
                    state = torch.load(self.where, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError:  # torch.save's legacy (non-zip) format cannot be mapped: a private copy
                    state = torch.load(self.where, map_location="cpu", weights_only=True)
                self._state = unwrap_state_dict(state)
        return self._state

    def names(self) -> set[str]:
        return set(self._tensors())

    def read(self, name: str) -> torch.Tensor:
        value = self._tensors()[name]
        return value.get() if isinstance(value, _Lazy) else value

    def load_into(self, module: nn.Module) -> list[str]:
        from torch.distributed.tensor import DTensor, distribute_tensor

        names, left = self.names(), []
        with torch.no_grad():
            for name, target in module.state_dict(keep_vars=True).items():
                if name not in names:
                    left.append(name)
                    continue
                whole = self.read(name)
                if isinstance(target, DTensor):
                    mine = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None)
                    target.to_local().copy_(mine.to_local())
                else:
                    target.copy_(whole)
        return left


class _Lazy:
    """A tensor of an open safetensors file, read when asked for."""

    def __init__(self, handle, name: str):
        self.handle, self.name = handle, name

    def get(self) -> torch.Tensor:
        return self.handle.get_tensor(self.name)


def unwrap_state_dict(state):
    """The state dict inside a saved object: itself, or its "model" / "state_dict" entry (training
    scripts' checkpoints)."""
    for key in ("model", "state_dict"):
        if isinstance(state, dict) and key in state and isinstance(state[key], dict):
            return state[key]
    return state


def pretrained_source(model: nn.Module) -> Optional[PretrainedSource]:
    """The weights `model` was built without and still needs (a pretrained directory, or a weights file
    when the model was built on the meta device); None when it has them, or has none to get."""
    directory = getattr(model, "pretrained_dir", None)
    if directory:
        return HuggingFaceDirectory(directory, model.pretrained_name)
    weights = getattr(model, "weights_file", None)
    return WeightsFile(weights) if weights else None


def filled_by_pretrained(model: nn.Module) -> frozenset:
    """The parameters (by owning module and name, as runtime.materialize names them) that the model's
    pretrained source holds: read later, so a model built on the meta device need not give them values
    first. Empty for a model without one."""
    source = pretrained_source(model)
    if source is None:
        return frozenset()
    from .materialize import owners, parameter_name

    present = source.names()
    return frozenset(parameter_name(name, p) for name, module in owners(model) for p, v in module._parameters.items()
                     if v is not None and source.checkpoint_name(parameter_name(name, p)) in present)


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
