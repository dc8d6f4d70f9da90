"""`trainkit export CHECKPOINT_DIR OUT.pt`: one plain state_dict for inference, whatever strategy
wrote the checkpoint (DDP's single file, FSDP's DCP shards, pipeline stages, DeepSpeed ZeRO
partitions). Runs in one process, without a process group.
"""

from __future__ import annotations

from pathlib import Path

STRATEGIES = (  # each class says whether it wrote a folder and how to consolidate it
    "trainkit.strategies.ddp:DDPStrategy",
    "trainkit.strategies.fsdp:FSDPStrategy",
    "trainkit.strategies.pipeline:PipelineStrategy",
    "trainkit.strategies.deepspeed:DeepSpeedStrategy",
)


class ExportError(Exception):
    pass


def consolidated_state_dict(folder: Path) -> tuple[str, dict]:
    """(strategy class name, whole-model state_dict on the CPU)."""
    from .. import registry
    from .checkpoint import problem_with

    folder = Path(folder)
    if not folder.is_dir():
        raise ExportError(f"{folder}: no such checkpoint folder")
    why = problem_with(folder)
    if why:
        raise ExportError(f"{folder}: not a complete checkpoint: {why}")
    for path in STRATEGIES:
        cls = registry.import_path(path)
        if cls.owns_checkpoint(folder):
            return cls.__name__, cls.consolidated_state_dict(folder)
    raise ExportError(f"{folder}: no strategy recognises its files ({', '.join(sorted(p.name for p in folder.iterdir()))})")


def export(folder: Path, out: Path) -> str:
    """Write the consolidated state_dict to `out` (fp32 or the training dtype, plain tensors)."""
    import torch

    from .checkpoint import fsync_save

    name, state = consolidated_state_dict(folder)
    state = {k: (v.detach().cpu().contiguous() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fsync_save(state, Path(out))
    n = sum(v.numel() for v in state.values() if isinstance(v, torch.Tensor))
    return f"trainkit: exported {len(state)} tensors ({n:,} values) from {folder} ({name}) to {out}"
