"""What this machine offers, read without importing torch: the defaults `trainkit init` writes and
the doctor's worker check come from the machine it runs on, not from a GPU server's."""

from __future__ import annotations

import glob
import os


def usable_cores() -> int:
    """The cores this process may run on (its affinity, as torch's DataLoader counts them)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def visible_gpus() -> int:
    """NVIDIA GPUs this process would see: the device files, narrowed by CUDA_VISIBLE_DEVICES."""
    present = len([p for p in glob.glob("/dev/nvidia*") if p[len("/dev/nvidia"):].isdigit()])
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return present
    return min(present, len([d for d in listed.split(",") if d.strip() and not d.strip().startswith("-")]))


def data_workers_per_rank(ranks: int) -> int:
    """DataLoader workers that fit beside `ranks` ranks: one core per rank's own process, the rest
    shared out, at most 8 (past that, decoding is rarely the limit)."""
    return max(0, min(8, usable_cores() // ranks - 1))
