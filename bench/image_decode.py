"""Images per second of each part of the image pipeline, `data.decode: loader` against `device`.

    python bench/image_decode.py [--device cuda] [--pairs 7] [--size 320] [--images 128]

Makes an ImageFolder of JPEGs (`--size` px squares, 224 px training crops) and times, alternately, per
round: one loader process producing samples the loader way (PIL decode + RandomResizedCrop + flip +
normalise), one loader process producing them the device way (file bytes + header + the crop's draws),
and the rank turning the device way's batch into the model's input on `--device` (decode_jpeg + crops
on the device). Then the handoff: the rank's own CPU time to receive the device way's batches from 2
loader worker processes, each image's bytes in a tensor of its own against the batch's in one tensor
(what `EncodedBatch` sends), alternated. Prints each part's rate per round and the median and spread,
for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def jpeg_folder(root: Path, images: int, size: int) -> Path:
    """`images` JPEGs of noise over smooth colour (JPEG's typical photo cost), in 4 classes."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:size, 0:size]
    for i in range(images):
        folder = root / f"class_{i % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        base = np.stack([np.sin(xx / rng.uniform(8, 40) + c) * 60 + 128 for c in range(3)], -1)
        pixels = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"img_{i:04d}.jpg", quality=90)
    return root


def per_image(collate):
    """The batch as a list of per-image tensors (the handoff before `EncodedBatch` packed them)."""
    def collate_each(samples):
        return [image for image, _, _ in samples], collate(samples)[1]
    return collate_each


def rank_cpu_per_batch(dataset, collate, batch_size: int, batches: int) -> float:
    """The rank's CPU seconds per batch spent receiving batches from 2 loader workers (its waits for
    them are not CPU time): unpickling, mapping and unmapping the shared memory they arrive in."""
    from torch.utils.data import DataLoader, RandomSampler

    sampler = RandomSampler(dataset, replacement=True, num_samples=batch_size * (batches + 1))
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=2, collate_fn=collate,
                        prefetch_factor=2)
    it = iter(loader)
    next(it)  # workers started
    start = time.process_time()
    for _ in range(batches):
        next(it)
    return (time.process_time() - start) / batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--size", type=int, default=320)
    parser.add_argument("--images", type=int, default=128)
    args = parser.parse_args()
    from trainkit.recipe.blocks import ImageFolderData
    from trainkit.runtime.data import build_imagefolder

    torch.set_num_threads(1)  # one loader process's worth of CPU, as each DataLoader worker has
    with tempfile.TemporaryDirectory() as tmp:
        root = jpeg_folder(Path(tmp), args.images, args.size)
        made = {d: build_imagefolder(ImageFolderData(name="imagefolder", root=str(root), batch_size=args.images,
                                                     decode=d), split="train", seed=0) for d in ("loader", "device")}
        device = torch.device(args.device)
        n = len(made["loader"])
        made["device"].collate([made["device"][i] for i in range(n)])[0].to(device)  # warm-up
        rates: dict[str, list[float]] = {"loader process, decode: loader": [], "loader process, decode: device": [],
                                         f"rank on {device.type}, decode: device": []}
        for _ in range(args.pairs):
            t0 = time.perf_counter()
            torch.stack([made["loader"][i][0] for i in range(n)])
            t1 = time.perf_counter()
            batch = made["device"].collate([made["device"][i] for i in range(n)])[0]
            t2 = time.perf_counter()
            batch.to(device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t3 = time.perf_counter()
            for key, seconds in zip(rates, (t1 - t0, t2 - t1, t3 - t2)):
                rates[key].append(n / seconds)
                print(f"{key}: {n / seconds:.0f} images/s", flush=True)
        handoff: dict[str, list[float]] = {"rank CPU per batch, a tensor per image": [],
                                           "rank CPU per batch, one tensor (EncodedBatch)": []}
        dataset = made["device"]
        for _ in range(args.pairs):
            for key, collate in zip(handoff, (per_image(dataset.collate), dataset.collate)):
                handoff[key].append(rank_cpu_per_batch(dataset, collate, n, batches=8))
                print(f"{key}: {handoff[key][-1] * 1000:.2f} ms", flush=True)
    print(f"\n{n} JPEGs of {args.size} px, 224 px crops, torch {torch.__version__}, {args.pairs} rounds:")
    for key, values in rates.items():
        print(f"  {key}: median {statistics.median(values):.0f} images/s (range {min(values):.0f}-{max(values):.0f})")
    for key, values in handoff.items():
        print(f"  {key} of {n}: median {statistics.median(values) * 1000:.2f} ms "
              f"(range {min(values) * 1000:.2f}-{max(values) * 1000:.2f})")


if __name__ == "__main__":
    main()
