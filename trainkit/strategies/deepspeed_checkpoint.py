"""Resuming a ZeRO checkpoint without holding the rank's optimizer file in memory beside its state.

Why: DeepSpeed's `TorchCheckpointEngine.load` `torch.load`s this rank's whole optimizer file (its fp32
partition and the AdamW moments) into memory, then copies the partition into its flat buffer and
hands the moments to the optimizer. Loaded into an optimizer that has its state already, that held
the state twice (+0.40 GiB per rank on the bench's 105 M-parameter model); in a fresh process the
file's fp32 partition still comes on top of everything the rank holds, and on larger models it made
the load the run's peak (206 M parameters: 2.84 GiB against the steps' 2.62; docs/benchmarks.md,
"No rank holds the whole model").

`MappedCheckpointEngine` is DeepSpeed's own engine with one change: it loads memory-mapped
(`torch.load(mmap=True)`, a private mapping), so nothing is read until DeepSpeed touches it, and an
optimizer's old moments are freed when torch's `Optimizer.load_state_dict` replaces them with the
mapped ones. Touched file pages count in a process's resident memory (VmRSS/VmHWM) while they stay
mapped, so `settle` then drops the pages DeepSpeed read and moves the mapped optimizer state into the
process's own memory one tensor at a time, dropping each one's pages once copied (madvise
MADV_DONTNEED, only inside the file's own mapping as /proc/self/maps gives it; nothing wrote to it,
so a later touch would read the file again). Nothing keeps the mapping afterwards: a later rotation
of that checkpoint cannot reach the training state. Linux only; elsewhere, and for files not in
torch's zip format (DeepSpeed's `checkpoint_serialization: false`), DeepSpeed's own loading.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import torch
from torch.utils._pytree import tree_leaves

from .deepspeed_import import import_deepspeed

MADV_DONTNEED = 4  # madvise(2), Linux


def mapped_ranges(path: str) -> list[tuple[int, int]]:
    """The address ranges this process maps the file at `path` to (/proc/self/maps): the only memory
    `settle` ever drops pages of."""
    target = os.path.realpath(path)
    ranges = []
    with open("/proc/self/maps") as fh:
        for line in fh:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip("\n") == target:
                start, end = (int(a, 16) for a in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


def drop_pages(start: int, end: int) -> None:
    """Take the whole pages of [start, end), part of a private file mapping nothing wrote to, out of this
    process's resident set: a later touch reads them from the file again."""
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page
    if last > first:
        ctypes.CDLL(None, use_errno=True).madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first),
                                                  MADV_DONTNEED)


def within(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    ptr = tensor.untyped_storage().data_ptr()
    return tensor.device.type == "cpu" and any(start <= ptr < end for start, end in ranges)


def load_mapped(engine) -> None:
    """The engine's checkpoints load mapped, unless the recipe's `config:` chose another checkpoint engine
    (DeepSpeed's writers, DataStates): those keep their own loading."""
    import_deepspeed()
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    if type(engine.checkpoint_engine) is TorchCheckpointEngine:
        engine.checkpoint_engine = mapped_checkpoint_engine(engine._config, TorchCheckpointEngine)


def settle(engine, optimizer: torch.optim.Optimizer) -> None:
    """After `engine.load_checkpoint`: see `MappedCheckpointEngine.settle` (nothing for other engines)."""
    if hasattr(engine.checkpoint_engine, "settle"):
        engine.checkpoint_engine.settle(optimizer)


def mapped_checkpoint_engine(config, TorchCheckpointEngine):
    """DeepSpeed's torch.save/torch.load engine, loading memory-mapped (made once DeepSpeed is imported)."""

    class MappedCheckpointEngine(TorchCheckpointEngine):
        def __init__(self, config_params=None):
            super().__init__(config_params)
            # the tensors of each file loaded since the last settle: they keep its mapping (and so the
            # addresses `settle` drops pages of) alive until then
            self.loaded: list[tuple[list[torch.Tensor], list[tuple[int, int]]]] = []

        def load(self, path: str, map_location=None):
            if not (sys.platform.startswith("linux") and _is_zip(path)):
                return super().load(path, map_location=map_location)
            state = torch.load(path, map_location=map_location, weights_only=False, mmap=True)
            self.loaded.append(([t for t in tree_leaves(state) if isinstance(t, torch.Tensor)], mapped_ranges(path)))
            return state

        def settle(self, optimizer: torch.optim.Optimizer) -> None:
            """After DeepSpeed's load: the optimizer's mapped state into the process's memory, one tensor's
            pages resident at a time; the pages DeepSpeed read (its fp32 partition) out of the resident set."""
            ranges = [r for _, file_ranges in self.loaded for r in file_ranges]
            for start, end in ranges:
                drop_pages(start, end)
            for state in optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and within(value, ranges):
                        state[key] = value.clone()
                        start = value.untyped_storage().data_ptr()
                        drop_pages(start, start + value.untyped_storage().nbytes())
            self.loaded = []  # the mappings go with the last tensor of theirs

    return MappedCheckpointEngine(config)


def _is_zip(path: str) -> bool:
    with open(path, "rb") as fh:
        return fh.read(4) == b"PK\x03\x04"
