"""ZeRO-3 in fp32: the optimizer steps the parameter partition itself, not a copy of it.

Why: ZeRO-3 keeps each rank's parameter partition in flat buffers (`fp16_partitioned_groups_flat`,
the "fp16" name is historical) and gives the optimizer an fp32 "master" partition
(`fp32_partitioned_groups_flat`) that it copies back into them after each step. When the parameters
are fp32 already, DeepSpeed means to skip that copy -- `_create_fp32_partitions` takes the parameter
partition itself as the master when dtype and device match ("In such cases we don't need another copy
of the weights"; its step's copy-back is then a copy onto itself). In DeepSpeed 0.19 that branch never
runs: it compares the tensor's `torch.device` with the accelerator's device name, a string
(`torch.device("cpu") == "cpu"` is False), so an fp32 rank holds its parameter partition twice (+0.20
GiB per rank on the bench's 105 M-parameter model at 2 ranks; docs/benchmarks.md, "No rank holds the
whole model").

`share_fp32_partitions` makes, after `deepspeed.initialize`, the sharing that branch intends: each
fp32 master takes its parameter partition's storage (the master tensors stay the optimizer's own
objects, so its state and parameter groups still refer to them). The values are equal bit for bit
(the master was a copy), so training and checkpoints do not change. Where DeepSpeed keeps the master
elsewhere on purpose (optimizer or parameter offload, a bf16/fp16 model) nothing is shared.
"""

from __future__ import annotations


def share_fp32_partitions(zero_optimizer) -> int:
    """Bytes freed per rank (0 where the master is not a same-dtype, same-device copy)."""
    if getattr(zero_optimizer, "offload_optimizer", True) or getattr(zero_optimizer, "offload_param", True):
        return 0
    freed = 0
    for flat, master in zip(getattr(zero_optimizer, "fp16_partitioned_groups_flat", []),
                            getattr(zero_optimizer, "fp32_partitioned_groups_flat", [])):
        if flat is None or flat is master or master.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr():
            continue
        if flat.dtype != master.dtype or flat.device != master.device or flat.shape != master.shape:
            continue
        freed += master.untyped_storage().nbytes()
        master.data = flat.data
    return freed
