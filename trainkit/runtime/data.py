"""Datasets and the resumable distributed DataLoader.

Each builder named by a data block's `component` has the signature
``build(options, *, split, seed) -> Dataset | None`` (split: "train" or "eval"; None when the
recipe has no evaluation data). Samples are ``(input, label)``, or ``(input, label, skipped)``
where `skipped` counts unreadable files replaced by the next readable one.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, default_collate

from .. import registry
from ..recipe.pickle_check import SafeUnpickler, UnsafePickle
from ..recipe.blocks import IMAGE_EXTENSIONS, Cifar10Data, DataOptions, ImageFolderData, SyntheticData, scan_imagefolder
from . import progress_record
from .device_decode import EncodedImageFolder, eval_resize
from .loader_timing import TimedDataset, timed_collate
from .packed_samples import PackedSamples
from .readable_samples import first_readable
from .parent_watch import die_with_parent

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


# --------------------------------------------------------------------------- synthetic
class SyntheticDataset(Dataset):
    """Sample i is generated from (seed, start + i) alone, so every rank and every resume sees the
    same data. Inputs are noise plus a per-class channel offset (fixed by the seed), so a model can
    learn the labels; the eval split uses the same classes with fresh samples (start > 0)."""

    def __init__(self, num_samples: int, shape: list[int], num_classes: int, seed: int, sleep_ms: float = 0.0,
                 start: int = 0):
        self.num_samples, self.shape, self.num_classes = num_samples, tuple(shape), num_classes
        self.seed, self.sleep_s, self.start = seed, sleep_ms / 1000.0, start
        self.offsets = torch.randn(num_classes, self.shape[0], generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.start + int(i))
        label = torch.randint(0, self.num_classes, (), generator=g)
        x = torch.randn(self.shape, generator=g)
        offset = self.offsets[label].reshape((-1,) + (1,) * (len(self.shape) - 1))
        return x + offset, label


def build_synthetic(options: SyntheticData, *, split: str, seed: int) -> Dataset:
    if split == "train":
        return SyntheticDataset(options.num_samples, options.shape, options.num_classes, seed, options.sleep_ms)
    n = max(options.batch_size, options.num_samples // 10)
    return SyntheticDataset(n, options.shape, options.num_classes, seed, options.sleep_ms, start=options.num_samples)


# --------------------------------------------------------------------------- imagefolder
class ImageFolderDataset(Dataset):
    """Decodes real images with PIL; an unreadable one either raises (naming the file) or is
    replaced by the next readable image and counted."""

    def __init__(self, root: Path, transform, on_corrupt: str):
        self.root, self.transform, self.on_corrupt = root, transform, on_corrupt
        self.classes, samples = scan_imagefolder(root)
        self.samples = PackedSamples(samples)  # not copied into each DataLoader worker
        if not self.samples:
            raise FileNotFoundError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) under {root}/<class>/")

    def __len__(self) -> int:
        return len(self.samples)

    def _load(self, i: int):
        from PIL import Image

        path, label = self.samples[i]
        with Image.open(path) as img:
            return self.transform(img.convert("RGB")), label

    def __getitem__(self, i: int):
        (x, label), skipped = first_readable(self._load, self.samples, i, self.on_corrupt, self.root)
        return x, label, skipped


def image_transforms(image_size: int, train: bool):
    from torchvision import transforms as T

    if train:
        steps = [T.RandomResizedCrop(image_size), T.RandomHorizontalFlip()]
    else:
        steps = [T.Resize(eval_resize(image_size)), T.CenterCrop(image_size)]
    return T.Compose(steps + [T.ToTensor(), T.Normalize(MEAN, STD)])


def build_imagefolder(options: ImageFolderData, *, split: str, seed: int) -> Optional[Dataset]:
    root = options.root if split == "train" else options.val_root
    if root is None:
        return None
    if options.decode == "device":
        return EncodedImageFolder(Path(root).expanduser(), options.image_size, split == "train", options.on_corrupt,
                                  MEAN, STD)
    return ImageFolderDataset(Path(root).expanduser(), image_transforms(options.image_size, split == "train"),
                              options.on_corrupt)


# --------------------------------------------------------------------------- cifar10
class Cifar10Dataset(Dataset):
    """The python-pickle CIFAR-10 batches from a local folder (never downloaded)."""

    def __init__(self, folder: Path, train: bool):
        names = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
        images, labels = [], []
        for name in names:
            with open(folder / name, "rb") as fh:  # data only: a pickle naming any code is refused
                try:
                    entry = SafeUnpickler(fh, encoding="latin1").load()
                except UnsafePickle as exc:
                    raise UnsafePickle(f"{folder / name}: {exc}") from None
            images.append(torch.as_tensor(entry["data"], dtype=torch.uint8))
            labels.extend(entry["labels"])
        self.images = torch.cat(images).reshape(-1, 3, 32, 32)
        self.labels = torch.as_tensor(labels)
        self.train = train
        self.mean = torch.tensor((0.4914, 0.4822, 0.4465)).view(3, 1, 1)
        self.std = torch.tensor((0.2470, 0.2435, 0.2616)).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        x = (self.images[i].float() / 255.0 - self.mean) / self.std
        if self.train and torch.rand(()) < 0.5:
            x = x.flip(-1)
        return x, self.labels[i]


def build_cifar10(options: Cifar10Data, *, split: str, seed: int) -> Dataset:
    return Cifar10Dataset(Path(options.root).expanduser() / "cifar-10-batches-py", train=split == "train")


# --------------------------------------------------------------------------- loader
class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that can start part-way into an epoch, so a resumed run sees exactly the
    batches the interrupted one had not yet seen. `start_at` applies to the next iteration only."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.skip = 0

    def start_at(self, samples: int) -> None:
        self.skip = samples

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        skip, self.skip = self.skip, 0
        return iter(indices[skip:])

    def __len__(self) -> int:
        return self.num_samples - self.skip


class EvalSampler(torch.utils.data.Sampler):
    """This rank's share of a fixed, seeded random subset of the evaluation split.

    The subset is the first `limit` indices of a permutation of the whole split drawn from `seed`
    (the same on every rank and at every evaluation), so an ImageFolder sorted by class is sampled
    across its classes; `limit` None (or larger than the split) takes the whole split. Rank r reads
    subset[r::world_size]: no sample is read twice and none is padded in, so the shards may differ
    in length by one (the evaluation sums add up counts, not means). `set_epoch`/`start_at` are
    accepted for the train sampler's interface and change nothing.
    """

    def __init__(self, size: int, *, rank: int, world_size: int, seed: int, limit: Optional[int] = None):
        order = torch.randperm(size, generator=torch.Generator().manual_seed(seed)).tolist()
        self.indices = order[:size if limit is None else min(limit, size)][rank::world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)

    def set_epoch(self, epoch: int) -> None:
        pass

    def start_at(self, samples: int) -> None:
        pass


def eval_subset_size(batch_size: int, eval_steps: int, data_parallel_size: int) -> int:
    """Samples one evaluation reads over all data-parallel ranks (fewer when the split is smaller)."""
    return batch_size * eval_steps * data_parallel_size


def _loader_worker_init(parent_pid: int, worker_id: int) -> None:
    """DataLoader workers die with their rank at once (torch's own watchdog notices only when the
    worker next waits for work, which a worker stuck reading a file never does); each answers SIGUSR1
    with its stacks, for a hang report (runtime.progress_record)."""
    die_with_parent(parent_pid)
    progress_record.loader_worker_started()


def make_loader(dataset: Dataset, options: DataOptions, *, rank: int, world_size: int, seed: int,
                train: bool, pin_memory: bool, eval_steps: Optional[int] = None) -> DataLoader:
    """The training loader (resumable, shuffled per epoch) or, with `train=False`, the evaluation
    loader over `EvalSampler`'s subset of eval_steps x batch_size x world_size samples."""
    if train:
        sampler = ResumableDistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                              shuffle=options.shuffle, seed=seed, drop_last=False)
    else:
        limit = None if eval_steps is None else eval_subset_size(options.batch_size, eval_steps, world_size)
        sampler = EvalSampler(len(dataset), rank=rank, world_size=world_size, seed=seed, limit=limit)
    workers = options.num_workers
    collate = getattr(dataset, "collate", default_collate)  # a dataset whose samples need their own batching
    return DataLoader(
        # training batches come with the seconds their loader process spent on them (runtime.loader_timing)
        TimedDataset(dataset) if train else dataset,
        collate_fn=functools.partial(timed_collate, collate=collate) if train else collate,
        batch_size=options.batch_size, sampler=sampler, num_workers=workers,
        pin_memory=pin_memory, drop_last=options.drop_last if train else False,
        prefetch_factor=options.prefetch_factor if workers else None,
        persistent_workers=options.persistent_workers and workers > 0,
        generator=torch.Generator().manual_seed(seed * 7919 + rank),
        worker_init_fn=functools.partial(_loader_worker_init, os.getpid()) if workers else None,
    )


def build_datasets(options: DataOptions, seed: int) -> tuple[Dataset, Optional[Dataset]]:
    build = registry.component(options)
    return build(options, split="train", seed=seed), build(options, split="eval", seed=seed)
