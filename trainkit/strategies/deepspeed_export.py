"""ZeRO-3 checkpoint -> one whole-model state_dict, holding one copy of the model and nothing more.

Why not DeepSpeed's `get_fp32_state_dict_from_zero_checkpoint`: it maps every rank's whole optimizer
file at once (`torch.load(mmap=True)`) and builds the consolidated tensors from those mappings, so the
exporting process ends up holding the consolidated model *and* every rank's fp32 partition as mapped
pages -- 2.1x the model's fp32 size above its start on a 19 M-parameter MLP (docs/benchmarks.md, "No rank
holds the whole model"). Here each rank file is opened on the meta device (torch records where each
storage lies in the file: `_checkpoint_offset`, nothing is read), and each parameter's slices are read
from the rank files straight into that parameter's own tensor: the process holds the consolidated
model (as FSDP's export does) plus a file handle per rank. The optimizer's moments are never read.

DeepSpeed's own parser still reads the (small) model-state files: the parameter names and shapes in
order, the buffers, shared and frozen parameters.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch


def _flat_groups(optim_file: Path):
    """(zero stage, partition count, this rank's fp32 flat groups as meta tensors); reads only the pickle."""
    from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT, PARTITION_COUNT, ZERO_STAGE

    state = torch.load(optim_file, map_location="meta", weights_only=False)[OPTIMIZER_STATE_DICT]
    count = state[PARTITION_COUNT]
    return state[ZERO_STAGE], (max(count) if isinstance(count, list) else count), state.get(FP32_FLAT_GROUPS)


def _read_into(fh, offset: int, out: torch.Tensor) -> None:
    """Fill the contiguous CPU tensor `out` with the bytes at `offset` of the open file."""
    view = memoryview(out.numpy()).cast("B")
    fh.seek(offset)
    done = 0
    while done < len(view):  # a single read(2) returns at most ~2 GiB
        n = fh.readinto(view[done:])
        if not n:
            raise ValueError(f"{fh.name}: ends before the partition it describes")
        done += n


class _RankFile:
    """One rank's fp32 flat partition, read by element range without loading it."""

    def __init__(self, path: Path, groups: list[torch.Tensor]):
        self.fh = open(path, "rb", buffering=0)
        self.groups = []  # (first element in the concatenated partition, numel, byte offset in the file)
        start = 0
        for g in groups:
            if g.dtype != torch.float32:
                raise ValueError(f"{path}: fp32 partition of dtype {g.dtype}")
            where = getattr(g.untyped_storage(), "_checkpoint_offset", None)
            if where is None:  # torch records it for its zip format, which DeepSpeed writes
                raise ValueError(f"{path}: not in torch's zip format; its partition cannot be located")
            byte = where + g.storage_offset() * g.element_size()
            self.groups.append((start, g.numel(), byte))
            start += g.numel()
        self.numel = start

    def read(self, first: int, out: torch.Tensor) -> None:
        """Elements [first, first + out.numel()) of the concatenated partition into `out` (flat)."""
        pos, end = 0, out.numel()
        for g_start, g_numel, g_byte in self.groups:
            lo, hi = max(first + pos, g_start), min(first + end, g_start + g_numel)
            if lo >= hi:
                continue
            _read_into(self.fh, g_byte + (lo - g_start) * 4, out[lo - first:hi - first])
            pos = hi - first
        if pos != end:
            raise ValueError(f"{self.fh.name}: the partition has {self.numel} elements, fewer than its parameters")

    def close(self) -> None:
        self.fh.close()


def zero3_state_dict(ds_folder: Path) -> dict:
    """The fp32 state_dict of the ZeRO-3 checkpoint in `ds_folder` (the tag folder DeepSpeed wrote)."""
    from deepspeed.utils.zero_to_fp32 import (_zero3_merge_frozen_params, get_model_state_files, get_optim_files,
                                              parse_model_states)

    models = parse_model_states(get_model_state_files(str(ds_folder)))
    optim_files = [Path(p) for p in get_optim_files(str(ds_folder))]
    parsed = [_flat_groups(p) for p in optim_files]
    stage, world_size, _ = parsed[0]
    if int(stage) != 3:
        raise ValueError(f"{ds_folder}: a ZeRO stage {int(stage)} checkpoint, not stage 3")
    if world_size != len(optim_files):
        raise ValueError(f"{ds_folder}: written by {world_size} ranks but {len(optim_files)} optimizer files are "
                         "there (a rank's file is missing)")
    ranks = [_RankFile(path, groups) for path, (_, _, groups) in zip(optim_files, parsed)]
    try:
        state: dict = dict(models[0].buffers)
        _zero3_merge_frozen_params(state, world_size, models)
        shapes = {name: shape for group in models[0].param_shapes for name, shape in group.items()}
        offset = 0  # of each parameter's partition in every rank's concatenated flat groups
        for name, shape in shapes.items():
            numel = math.prod(shape)
            part = math.ceil(numel / world_size)
            flat = torch.empty(numel, dtype=torch.float32)
            for rank, source in enumerate(ranks):
                lo, hi = rank * part, min((rank + 1) * part, numel)
                if lo < hi:
                    source.read(offset, flat[lo:hi])
            state[name] = flat.view(shape)
            offset += part
        if any(offset != r.numel for r in ranks):
            raise ValueError(f"{ds_folder}: the parameters take {offset} elements of each rank's partition, which "
                             f"holds {ranks[0].numel}: the model-state and optimizer files do not match")
    finally:
        for r in ranks:
            r.close()
    for alias, source in models[0].shared_params:
        if source in state:
            state[alias] = state[source]
    return state
