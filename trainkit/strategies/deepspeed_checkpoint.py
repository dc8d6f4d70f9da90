"""Resuming a ZeRO checkpoint without a second copy of the rank's optimizer state in memory.

Why: DeepSpeed's `TorchCheckpointEngine.load` `torch.load`s this rank's whole optimizer file (its fp32
partition and the AdamW moments) into memory, and only then copies the partition into its flat buffer
and hands the moments to the optimizer in place of the ones it holds: at the resume a rank holds its
optimizer state twice (+0.40 GiB per rank on the bench's 105 M-parameter model; docs/benchmarks.md,
"No rank holds the whole model").

`MappedCheckpointEngine` is DeepSpeed's own engine with one change: it loads memory-mapped
(`torch.load(mmap=True)`, private to the process), so nothing is read until DeepSpeed touches it, and
the old moments are freed when torch's `Optimizer.load_state_dict` replaces them with the mapped ones.
File pages a process has touched count in its resident memory (VmRSS/VmHWM) as long as they stay
mapped, so `settle` then moves the mapped optimizer state into the process's own memory one tensor at
a time, dropping each tensor's pages from the mapping once copied (madvise MADV_DONTNEED: nothing in
the mapping was written, so the file's contents are what a later touch would read again). The run
keeps no reference to the checkpoint file: a later rotation or rewrite of it cannot reach the
training state. Files saved without torch's zip format (DeepSpeed's `checkpoint_serialization: false`)
cannot be mapped and load as before.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from typing import Iterable

import torch
from torch.utils._pytree import tree_leaves

from .deepspeed_import import import_deepspeed

MADV_DONTNEED = 4  # madvise(2), Linux


def address_range(tensors: Iterable) -> tuple[int, int]:
    """The span of memory the tensors' storages cover (one file is one mapping)."""
    spans = [(t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
             for t in tensors if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes()]
    return (min(s for s, _ in spans), max(e for _, e in spans)) if spans else (0, 0)


def drop_pages(start: int, end: int) -> None:
    """Take the whole pages of [start, end) out of this process's resident set (Linux; elsewhere a no-op)."""
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page
    if last > first and sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first),
                                                  MADV_DONTNEED)


def within(tensor: torch.Tensor, spans: list[tuple[int, int]]) -> bool:
    ptr = tensor.untyped_storage().data_ptr()
    return any(start <= ptr < end for start, end in spans)


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
            self.loaded: list[list[torch.Tensor]] = []

        def load(self, path: str, map_location=None):
            if not _is_zip(path):
                return super().load(path, map_location=map_location)
            state = torch.load(path, map_location=map_location, weights_only=False, mmap=True)
            self.loaded.append([t for t in tree_leaves(state) if isinstance(t, torch.Tensor)])
            return state

        def settle(self, optimizer: torch.optim.Optimizer) -> None:
            """After DeepSpeed's load: the optimizer's mapped state into the process's memory, one tensor's
            pages resident at a time; the pages DeepSpeed read (its fp32 partition) out of the resident set."""
            spans = [address_range(tensors) for tensors in self.loaded]
            for span in spans:
                drop_pages(*span)
            for state in optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and within(value, spans):
                        state[key] = value.clone()
                        drop_pages(*address_range([value]))
            self.loaded = []  # the mappings go with the last tensor of theirs

    return MappedCheckpointEngine(config)


def _is_zip(path: str) -> bool:
    with open(path, "rb") as fh:
        return fh.read(4) == b"PK\x03\x04"
