"""`trainkit export CHECKPOINT_DIR OUT.pt`: one plain state_dict for inference, whatever strategy
wrote the checkpoint (DDP's single file, FSDP's DCP shards, pipeline stages, DeepSpeed ZeRO
partitions, or a plugin strategy's own). Runs in one process, without a process group.

Strategies are found through the plugin registry, so a third-party strategy that implements
`owns_checkpoint` / `consolidated_state_dict` exports like the built-in ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from .. import registry
from .checkpoint import problem_with
from .files import fsync_save


class ExportError(Exception):
    pass


def _strategy_classes() -> Iterator[type]:
    """Every registered strategy's implementation (a plugin that fails to import is skipped)."""
    for name in registry.names("strategies"):
        try:
            options = registry.load("strategies", name)
            yield registry.import_path(options.component)
        except Exception:  # a broken plugin must not stop the export of another strategy's checkpoint
            continue


def consolidated_state_dict(folder: Path) -> tuple[str, dict]:
    """(strategy class name, whole-model state_dict on the CPU)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ExportError(f"{folder}: no such checkpoint folder")
    why = problem_with(folder)
    if why:
        raise ExportError(f"{folder}: not a complete checkpoint: {why}")
    for cls in _strategy_classes():
        if cls.owns_checkpoint(folder):
            try:
                return cls.__name__, cls.consolidated_state_dict(folder)
            except ValueError as exc:  # the strategy's reader found files that do not fit together
                raise ExportError(f"{folder}: cannot be read as a {cls.__name__} checkpoint: {exc}") from exc
    raise ExportError(f"{folder}: no strategy recognises its files ({', '.join(sorted(p.name for p in folder.iterdir()))})")


def export(folder: Path, out: Path) -> str:
    """Write the consolidated state_dict to `out` (fp32 or the training dtype, plain tensors)."""
    name, state = consolidated_state_dict(folder)
    state = {k: (v.detach().cpu().contiguous() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fsync_save(state, Path(out))
    n = sum(v.numel() for v in state.values() if isinstance(v, torch.Tensor))
    return f"trainkit: exported {len(state)} tensors ({n:,} values) from {folder} ({name}) to {out}"
