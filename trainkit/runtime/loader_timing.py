"""How fast the data loader produces batches on its own, measured where it works.

Why: a step's data wait says only that the loader fell behind; it cannot say by how much, or whether
the loader has room to spare (with worker processes the wait is ~0 until they stop keeping up, and
then it is the shortfall, not the loader's speed). The bottleneck report needs the loader's own rate
-- e.g. decoded JPEGs per second -- beside what the model consumes.

How: the training dataset is wrapped so that DataLoader's batched fetch (`__getitems__`, which
torch's fetcher calls when a dataset has it) notes when it started, and the collate function hands
back `Produced(batch, seconds)`: the time that process (a worker, or the rank's own with
`num_workers: 0`) took to read, decode, transform and collate the batch. The training loop unwraps it
(`Loop.batches`) and adds each step's production seconds to its timings (`StepTimes.loader`);
the bottleneck report turns them into rates (`analysis.loader_rate`).
Hand-written: torch's DataLoader times nothing, and its profiler events stay inside each worker.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

from torch.utils.data import Dataset, default_collate


class Produced(NamedTuple):
    """A batch and the seconds one loader process spent producing it."""

    batch: Any
    seconds: float


class _Samples(list):
    """The samples of one batch, with the moment their fetch started."""

    started: float = 0.0


class TimedDataset(Dataset):
    """`dataset`, fetched a batch at a time with the start of each fetch noted."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        return self.dataset[index]

    def __getitems__(self, indices) -> _Samples:
        started = time.perf_counter()
        fetch = getattr(self.dataset, "__getitems__", None)
        samples = _Samples(fetch(indices) if fetch else [self[i] for i in indices])
        samples.started = started
        return samples

    def __getattr__(self, name: str):  # the wrapped dataset's own attributes (classes, tokenizer, ...)
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


def timed_collate(samples, collate=default_collate) -> Produced:
    batch = collate(list(samples))
    started = getattr(samples, "started", None)
    return Produced(batch, 0.0 if started is None else time.perf_counter() - started)
