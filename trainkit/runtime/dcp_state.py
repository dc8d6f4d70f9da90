"""The model's and optimizer's state as DCP checkpoints hold it: `get_state_dict`'s model and optimizer
entries, a frozen NF4 weight flattened into plain tensors (runtime.quantized.flat_for_dcp). One layout
for FSDP's own checkpoints and every background save (runtime.checkpoint_async)."""

from __future__ import annotations

from pathlib import Path

from .quantized import flat_for_dcp, value_wrapper_inner


def state_for_dcp(model, optimizer) -> tuple[dict, dict]:
    """({"model": ..., "optim": ...} to save or to load into, the model's own state dict)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": unwrapped(flat_for_dcp(model_sd)), "optim": unwrapped(optim_sd)}, model_sd


def unwrapped(state):
    """`state` with every value held by a wrapper subclass of one inner tensor of its own dtype (torchao's
    float8 training weight under FSDP's float8 all-gather, and the optimizer moments made like it) as that
    inner tensor, the same storage: DCP would pickle the wrapper, which `trainkit export` and `torch.load`
    (weights_only) refuse to read. Loading writes through the inner tensor into the wrapper's values."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if isinstance(state, dict):
        return {key: unwrapped(value) for key, value in state.items()}
    if isinstance(state, list):
        return [unwrapped(value) for value in state]
    if not isinstance(state, torch.Tensor):
        return state
    local = state.to_local() if isinstance(state, DTensor) else state
    if type(local) is torch.Tensor or not is_traceable_wrapper_subclass(local):
        return state
    inner = value_wrapper_inner(local)
    if inner is None:
        return state  # a quantized subclass (NF4): flat_for_dcp's
    if isinstance(state, DTensor):
        return DTensor.from_local(inner, state.device_mesh, state.placements, run_check=False,
                                  shape=state.shape, stride=state.stride())
    return inner


def load_dcp(folder: Path, model, optimizer) -> None:
    """Load a DCP folder of this layout into the model and optimizer, resharded to this run's mesh."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state, model_sd = state_for_dcp(model, optimizer)
    dcp.load(state, checkpoint_id=str(folder))  # a flattened NF4 weight is restored in place, through its views
    set_state_dict(model, optimizer, model_state_dict={k: state["model"].get(k, v) for k, v in model_sd.items()},
                   optim_state_dict=state["optim"])
