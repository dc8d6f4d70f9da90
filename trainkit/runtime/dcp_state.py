"""The model's and optimizer's state as DCP checkpoints hold it: `get_state_dict`'s model and optimizer
entries, a frozen NF4 weight flattened into plain tensors (runtime.quantized.flat_for_dcp). One layout
for FSDP's own checkpoints and every background save (runtime.checkpoint_async)."""

from __future__ import annotations

from pathlib import Path

from .quantized import flat_for_dcp


def state_for_dcp(model, optimizer) -> tuple[dict, dict]:
    """({"model": ..., "optim": ...} to save or to load into, the model's own state dict)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": flat_for_dcp(model_sd), "optim": optim_sd}, model_sd


def load_dcp(folder: Path, model, optimizer) -> None:
    """Load a DCP folder of this layout into the model and optimizer, resharded to this run's mesh."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state, model_sd = state_for_dcp(model, optimizer)
    dcp.load(state, checkpoint_id=str(folder))  # a flattened NF4 weight is restored in place, through its views
    set_state_dict(model, optimizer, model_state_dict={k: state["model"].get(k, v) for k, v in model_sd.items()},
                   optim_state_dict=state["optim"])
