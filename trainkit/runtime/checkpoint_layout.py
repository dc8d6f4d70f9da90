"""Where checkpoints lie in a run dir and whether the disk has room for the next one.

Torch-free on purpose: the launcher reads this after its workers are gone (what a full disk left
behind) without importing torch, and the worker's checkpointer writes by the same rules.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Optional

from ..run_dir import CHECKPOINT_PREFIX as PREFIX
from ..run_dir import CHECKPOINT_TMP as TMP  # a save in progress, or one that failed: `.tmp-step-...`


def step_of(folder: Path) -> int:
    return int(folder.name[len(PREFIX):])


def step_folders(ckpt_dir: Path) -> list[Path]:
    """Checkpoint folders, newest step first."""
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir() if p.is_dir() and p.name.startswith(PREFIX)
             and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]), reverse=True)


def folder_bytes(folder: Optional[Path]) -> int:
    try:
        return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder else 0
    except OSError:
        return 0


def _space_needed(ckpt_dir: Path, writing: Optional[str] = None, written: int = 0) -> tuple[Optional[Path], int]:
    """(previous complete checkpoint, bytes a checkpoint needs): the previous one's size, else what was written."""
    previous = next((f for f in step_folders(ckpt_dir) if f.name != writing), None)
    return previous, (folder_bytes(previous) if previous is not None else written)


def disk_too_full(ckpt_dir: Path) -> bool:
    """Less space is free than the newest checkpoint takes (1 MiB when there is none yet)."""
    _, need = _space_needed(ckpt_dir)
    return shutil.disk_usage(ckpt_dir).free < max(need, 1 << 20)


def failed_save(ckpt_dir: Path) -> Optional[str]:
    """The step folder whose save was abandoned (`.tmp-step-...` left behind), newest first."""
    if not ckpt_dir.is_dir():
        return None
    left = sorted((p.name[len(TMP):] for p in ckpt_dir.glob(f"{TMP}{PREFIX}*") if p.is_dir()), reverse=True)
    return left[0] if left else None


def disk_full_message(ckpt_dir: Path, writing: str, written: int = 0) -> str:
    """What a user reads when a checkpoint did not fit: where, how much is needed and free, what is kept."""
    previous, need = _space_needed(ckpt_dir, writing, written)
    free = shutil.disk_usage(ckpt_dir).free
    kept = f"the previous checkpoint {previous} is kept" if previous else "no earlier checkpoint exists"
    return (f"no space left on the disk holding {ckpt_dir} while writing {writing}: a checkpoint "
            f"needs about {need:,} bytes{' (the size of the previous one)' if previous else ''}, "
            f"{free:,} bytes are free; {kept}. Free space there, lower trainer.checkpoint.keep, or "
            f"set launch.run_dir to a bigger disk")
