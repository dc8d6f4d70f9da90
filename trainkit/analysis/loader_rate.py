"""The data loader's own rate against what the model consumed, per rank (the bottleneck report's
evidence; the production seconds are measured by runtime.loader_timing). No torch: `trainkit report`
reads a run directory without it."""

from __future__ import annotations

import math
from typing import NamedTuple, Optional


class LoaderRate(NamedTuple):
    """The loader against the model, per rank, in samples per second."""

    per_worker: float  # one loader process
    workers: int  # the processes producing batches (the rank itself with num_workers 0)
    capacity: float  # all of them at once
    consumed: float  # what the steps would take without waiting for data (the model's pace)

    @property
    def headroom(self) -> float:
        return self.capacity / self.consumed

    def workers_needed(self) -> int:
        return max(1, math.ceil(self.consumed / self.per_worker))


def loader_rate(loader_s_per_step: Optional[float], step_s: float, data_wait_s: float, samples_per_step: int,
                num_workers: int) -> Optional[LoaderRate]:
    """From the median production seconds of one step's batches, the median step time and data wait;
    None where the loader was not timed."""
    model_s = step_s - data_wait_s
    if not loader_s_per_step or loader_s_per_step <= 0 or model_s <= 0:
        return None
    per_worker = samples_per_step / loader_s_per_step
    workers = max(1, num_workers)
    return LoaderRate(per_worker, workers, per_worker * workers, samples_per_step / model_s)
