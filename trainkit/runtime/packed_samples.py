"""An image folder's index, (file, class) per sample, packed in three numpy arrays instead of a list of
tuples, so that DataLoader workers do not copy it.

Why: a forked worker shares its rank's memory until it writes to a page, and Python writes to every
object it touches (its reference count) and the garbage collector to every tracked container's
header. A list of (Path, int) tuples is millions of such objects for a large dataset (ImageNet: 1.28
M samples, ~200 MB), touched all over in a shuffled epoch: each worker ends up with its own copy
(torch's "copy-on-read" issue, pytorch/pytorch#13246; its docs' remedy is numpy arrays). Arrays of
bytes and ints are three objects whatever their length: reading them writes nothing.

A sample's file comes back as a `str`, not a `Path`: pathlib interns each part of a path it parses
(`sys.intern`), and inserting into and deleting from the interpreter's table of interned strings --
large after a scan of many files -- writes to it all over, which copies it into each worker too
(measured: 16 MB per worker for 200,000 files read as Paths, none as strs; tests/test_packed_samples.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence, Union

import numpy as np


class PackedSamples(Sequence):
    """(file, class) pairs, the file a str, read back from one byte buffer of the paths, their offsets and
    the classes."""

    def __init__(self, samples: Sequence[tuple[Union[Path, str], int]]):
        encoded = [str(path).encode("utf-8", "surrogateescape") for path, _ in samples]
        self._bytes = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        self._ends = np.cumsum([len(e) for e in encoded], dtype=np.int64)
        self._classes = np.array([label for _, label in samples], dtype=np.int64)

    def __len__(self) -> int:
        return len(self._classes)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        start = int(self._ends[i - 1]) if i else 0
        path = self._bytes[start:int(self._ends[i])].tobytes().decode("utf-8", "surrogateescape")
        return path, int(self._classes[i])
