"""Durable file writes and content hashes, shared by checkpoints, strategies and export.

A checkpoint is only as good as its slowest file to reach the disk: every save here is fsynced,
and folders are fsynced after a rename so the rename itself survives a power cut.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch


def fsync_save(obj: Any, path: Path) -> None:
    """torch.save that reaches the disk before returning."""
    with open(path, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
