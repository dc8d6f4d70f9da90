"""Write a small synthetic ImageFolder of real PNG/JPEG files, deterministic from a seed.

Each class has its own colour and stripe orientation (plus noise), so a model can learn it and the
demo and tests exercise real decoding in real DataLoader workers.
"""

from __future__ import annotations

import colorsys
from pathlib import Path

import numpy as np


def make_imagefolder(root: str | Path, classes: int = 4, per_class: int = 32, size: int = 64, seed: int = 0,
                     val_per_class: int = 0) -> Path:
    """Create ROOT/class_XX/img_YYYY.{png,jpg}; returns ROOT. Existing files are overwritten.

    With `val_per_class` > 0, a held-out split: ROOT/train/class_XX/ (per_class images) and
    ROOT/val/class_XX/ (val_per_class further images drawn from the same distribution, never
    seen in training)."""
    from PIL import Image

    root = Path(root)
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size]
    for c in range(classes):
        if val_per_class:
            folders = {split: root / split / f"class_{c:02d}" for split in ("train", "val")}
        else:
            folders = {"train": root / f"class_{c:02d}"}
        for folder in folders.values():
            folder.mkdir(parents=True, exist_ok=True)
        base = np.array(colorsys.hsv_to_rgb(c / max(classes, 1), 0.8, 0.9)) * 255
        angle = np.pi * c / max(classes, 1)
        for i in range(per_class + val_per_class):
            folder = folders["train"] if i < per_class else folders["val"]
            period = rng.uniform(6, 12)
            phase = rng.uniform(0, 2 * np.pi)
            stripes = np.sin((xx * np.cos(angle) + yy * np.sin(angle)) * 2 * np.pi / period + phase)
            img = base[None, None, :] * (0.75 + 0.25 * stripes[..., None])
            img = img + rng.normal(0, 12, size=(size, size, 3))
            pixels = np.clip(img, 0, 255).astype(np.uint8)
            ext = "png" if i % 2 == 0 else "jpg"
            Image.fromarray(pixels).save(folder / f"img_{i:04d}.{ext}")
    return root
