"""A DataLoader worker's own memory: what the cluster job writers count per worker
(trainkit/cluster/node_resources.py, LOADER_WORKER_BYTES).

    python bench/loader_worker_memory.py --images 1000 --size 400 --batches 15

trainkit's ImageFolderDataset (PIL decoding, RandomResizedCrop 224, the training transforms) over
generated JPEGs, batch 64, 2 workers, prefetch 2. A forked worker shares its rank's pages until it
writes to them; over a long run Python's garbage collector writes to the header of every container it
walks, so the worker's own pages (USS: Private_Clean + Private_Dirty of /proc/PID/smaps_rollup) grow
towards what its collections touch. Reported per worker after the first and the last batch, twice: as
the workers run by themselves, and with a full collection (`gc.collect()`) every 20 samples, which is
where a long run's workers end up. The batches a worker has ready live in shared memory (/dev/shm,
counted apart) and are not in these figures.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from pathlib import Path

import torch

from trainkit.runtime.data import ImageFolderDataset, image_transforms
from trainkit.runtime.imagefolder_maker import make_imagefolder


class Collecting(ImageFolderDataset):
    """The dataset with a full garbage collection every 20 samples: a long run's worker, sooner."""

    def __getitem__(self, i):
        if i % 20 == 0:
            gc.collect()
        return super().__getitem__(i)


def own_mib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith(("Private_Clean:", "Private_Dirty:"))) >> 10


def measure(dataset, batches: int) -> list[tuple[int, int]]:
    """(after the first batch, after the last) MiB of each worker's own pages."""
    loader = torch.utils.data.DataLoader(dataset, batch_size=64, num_workers=2, shuffle=True, prefetch_factor=2,
                                         persistent_workers=True)
    batch_iter = iter(loader)
    next(batch_iter)
    first = [own_mib(w.pid) for w in batch_iter._workers]
    for _ in range(batches - 1):
        next(batch_iter)
    last = [own_mib(w.pid) for w in batch_iter._workers]
    del batch_iter
    return list(zip(first, last))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--size", type=int, default=400, help="side of the generated JPEGs, pixels")
    parser.add_argument("--batches", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = make_imagefolder(Path(tmp) / "images", classes=10, per_class=max(1, args.images // 10), size=args.size)
        print(f"torch {torch.__version__}; {args.images} JPEGs of {args.size} px, batch 64, 2 workers, "
              f"{args.batches} batches; MiB of each worker's own pages (first batch -> last)")
        for name, kind in (("as they run", ImageFolderDataset), ("with full collections", Collecting)):
            figures = measure(kind(root, image_transforms(224, True), "error"), args.batches)
            print(f"  {name}: " + ", ".join(f"{a} -> {b}" for a, b in figures))


if __name__ == "__main__":
    main()
