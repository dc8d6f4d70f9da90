"""`data.on_corrupt` for datasets of files: a sample whose file cannot be read either stops the run
naming the file, or is replaced by the next readable one and counted."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Sequence


def first_readable(load: Callable[[int], Any], samples: Sequence[tuple[Any, int]], i: int, on_corrupt: str,
                   root: Path) -> tuple[Any, int]:
    """(load(j), skipped): j is i, or with on_corrupt "skip" the first readable index after it (wrapping),
    skipped how many unreadable files were passed over. `samples`: the dataset's (file, class) pairs (a packed index: files as str)."""
    skipped = 0
    for attempt in range(len(samples)):
        j = (i + attempt) % len(samples)
        try:
            return load(j), skipped
        except Exception as exc:  # PIL raises many types for bad files
            path = samples[j][0]
            if on_corrupt == "error":
                raise RuntimeError(f"unreadable image {path}: {type(exc).__name__}: {exc} "
                                   f"(set data.on_corrupt: skip to skip and count such files)") from None
            print(f"trainkit: warning: skipping unreadable image {path}: {exc}", file=sys.stderr)
            skipped += 1
    raise RuntimeError(f"every image under {root} is unreadable")
