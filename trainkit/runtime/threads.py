"""How many intra-op threads a world-size-1 run computes with, inside the launcher's process.

Why: torch's intra-op pool (OpenMP) has a thread per core, and each parallel region (a matmul, its
backward) ends at a barrier that waits for every thread of the pool. A world-size-1 run trains inside
the launcher process, beside the launcher's MLflow delivery thread (SQL, HTTP, spool files: Python
work in bursts, more of it the more often the run logs). When that thread takes one of the cores,
the pool thread it displaced is descheduled and every parallel region waits a scheduler time slice
(milliseconds) for it; another process on the machine does the same, and a pool of one thread has
no barrier to wait at. Measured on 2 shared cores with a 26k-parameter MLP, `log_every: 1`, 440
steps (docs/benchmarks.md, "One process: log_every 1 vs 10"): 15x the steps of `log_every: 10`; in
cProfile, `run_backward` 8.2 s, `linear` 5.4 s and AdamW's `sqrt` 3.5 s with a 2-thread pool, 0.14,
0.03 and 0.01 s with one thread. Leaving the delivery thread a core of its own removes the wait;
under torchrun the workers are processes of their own and the launcher already divides the cores
among them (OMP_NUM_THREADS = cores / processes per node).

`OMP_NUM_THREADS`, when set, is the user's choice and is kept.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator, Optional

from ..machine import usable_cores  # the cores this process may run on (its CPU affinity)


def per_rank(ranks: int) -> int:
    """Intra-op threads for each of `ranks` worker processes on this node: the cores this process may run
    on (a Slurm step's or a container's, not the host's) shared among them, at least one."""
    return max(1, usable_cores() // max(1, ranks))


def beside_the_launcher(cores: int) -> int:
    """Intra-op threads for a run that shares its process with the launcher's delivery thread: one
    core left for that thread (none to leave on a single core)."""
    return max(1, cores - 1)


@contextmanager
def sharing_the_launcher_process(delivering: bool) -> Iterator[Optional[int]]:
    """While a world-size-1 run trains in this process: size torch's intra-op pool to leave the
    delivery thread (when `delivering`) a core; restore the pool afterwards. Yields the thread
    count set, or None where nothing was changed (no delivery thread, or OMP_NUM_THREADS set)."""
    if not delivering or os.environ.get("OMP_NUM_THREADS"):
        yield None
        return
    import torch  # imported where the work is

    previous = torch.get_num_threads()
    wanted = min(previous, beside_the_launcher(usable_cores()))
    torch.set_num_threads(wanted)
    try:
        yield wanted
    finally:
        torch.set_num_threads(previous)
