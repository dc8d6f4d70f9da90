"""Frozen weights held by a quantized tensor subclass (torchao's NF4: QLoRA's 4-bit base): what the
strategies, the non-finite guard and the replica hash must treat as stored parts, not float values."""

from __future__ import annotations

import torch


def frozen_quantized(t: torch.Tensor) -> bool:
    """A frozen weight held by a quantized tensor subclass, or FSDP2's DTensor shard of one. A subclass
    that keeps its values as one tensor of its own dtype is not quantized: torchao's float8 training
    weight (`WeightWithDynamicFloat8CastTensor`, FSDP's float8 all-gather) holds the full-precision
    weight and casts only when it is gathered -- and a state dict's values have requires_grad off."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if t.requires_grad or not is_traceable_wrapper_subclass(t):
        return False  # a plain tensor: nothing more to import (an export measures its own memory)
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return frozen_quantized(t.to_local())
    return value_wrapper_inner(t) is None


def value_wrapper_inner(t: torch.Tensor):
    """The one inner tensor of a wrapper subclass that keeps its values in its own dtype (torchao's float8
    training weight), or None (a quantized subclass's storage is several tensors or another dtype)."""
    inner = [getattr(t, name) for name in t.__tensor_flatten__()[0]]
    return inner[0] if len(inner) == 1 and inner[0].dtype == t.dtype else None


def stored_parts(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """A frozen quantized weight's (or its local shard's) stored tensors by name: 4-bit data and scales."""
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return {inner: getattr(local, inner) for inner in local.__tensor_flatten__()[0]}


def shard_problem(name: str, weight: torch.Tensor, shards: int) -> str:
    """Why FSDP2 cannot split a frozen NF4 weight into `shards` row-wise parts (torchao's NF4 split takes
    whole rows and whole groups of scales per part), with the fix; "" when it can."""
    groups = getattr(weight, "quantization_factor", None)
    if groups is None:
        return ""
    if weight.size(0) % shards or groups.numel() % shards:
        return (f"{name}: its {weight.size(0)} rows and {groups.numel()} groups of NF4 scales cannot be split "
                f"evenly over {shards} FSDP shards; use a number of ranks that divides both, strategy ddp, or "
                f"drop model.args.lora.quantize_base")
    return ""


QUANTIZED_PART = "/nf4."  # a flattened NF4 weight's entries in a DCP checkpoint: "<weight>/nf4.<inner tensor>"
QUANTIZED_FORMAT = "/nf4"  # ... and its format (block sizes, shape, dtype), a small non-tensor entry


def flat_for_dcp(model_state: dict) -> dict:
    """The model's state dict with every frozen NF4 weight (or FSDP2's DTensor shard of one) as its stored
    tensors, each its own entry (FSDP's shards as 1-D DTensor shards of the whole weight's), and its
    format. DCP writes a tensor subclass as a pickled object that only its own class can copy into
    (torchao's NF4 `copy_` into a plain tensor fails): flattened, a checkpoint is plain tensors, which an
    offline merge (`trainkit export`) reads without a process group. The entries are views of the weight's
    own tensors, so a `dcp.load` into this dict restores the weights in place.
    Hand-written: neither DCP nor torchao flattens a quantized subclass for a checkpoint."""
    if not any(frozen_quantized(v) for v in model_state.values() if isinstance(v, torch.Tensor)):
        return model_state
    from torch.distributed.tensor import DTensor, Shard

    flat = {}
    for name, value in model_state.items():
        if not (isinstance(value, torch.Tensor) and frozen_quantized(value)):
            flat[name] = value
            continue
        local = value.to_local() if isinstance(value, DTensor) else value
        for inner, part in stored_parts(value).items():
            if isinstance(value, DTensor) and inner in SHARDED_PARTS:
                shards = value.device_mesh.size()
                part = DTensor.from_local(part, value.device_mesh, [Shard(0)], run_check=False,
                                          shape=(part.numel() * shards,), stride=(1,))
            flat[f"{name}{QUANTIZED_PART}{inner}"] = part
        flat[f"{name}{QUANTIZED_FORMAT}"] = {"block_size": local.block_size, "scaler_block_size": local.scaler_block_size,
                                             "shape": list(value.shape), "dtype": str(value.dtype).split(".")[-1]}
    return flat


SHARDED_PARTS = ("quantized_data", "quantized_scalers", "quantization_factor")  # torchao's, split by FSDP2


def whole_from_dcp(state: dict) -> dict:
    """A consolidated (offline) model state dict with each flattened NF4 weight (`flat_for_dcp`) whole
    again: a torchao NF4 tensor, as a one-process or DDP checkpoint holds it."""
    formats = {k[: -len(QUANTIZED_FORMAT)]: v for k, v in state.items() if k.endswith(QUANTIZED_FORMAT)}
    if not formats:
        return state
    import importlib

    from torchao.quantization import NF4Tensor

    SubclassTensorArgs = importlib.import_module(NF4Tensor.__module__).SubclassTensorArgs  # the shape record it takes

    out = {k: v for k, v in state.items() if not k.endswith(QUANTIZED_FORMAT) and QUANTIZED_PART not in k}
    for name, fmt in formats.items():
        parts = {k.split(QUANTIZED_PART, 1)[1]: v for k, v in state.items() if k.startswith(name + QUANTIZED_PART)}
        shape = torch.Size(fmt["shape"])
        meta = SubclassTensorArgs(shape, (shape[-1], 1) if len(shape) == 2 else (1,), 0, getattr(torch, fmt["dtype"]),
                                  torch.device("cpu"), False)
        out[name] = NF4Tensor(meta, fmt["block_size"], shape.numel() // fmt["block_size"], fmt["scaler_block_size"],
                              parts["quantized_scalers"], parts["quantization_factor"], parts["scaler_mean"],
                              parts["quantized_data"], parts["nf4"])
    return out
