"""The `blobs` dataset: options model (light, imported by `trainkit validate`) + builder (torch)."""

from typing import ClassVar, Literal

from pydantic import Field, PositiveInt

from trainkit.recipe.blocks import DataOptions


class BlobsData(DataOptions):
    """Gaussian clusters in `dim` dimensions, one cluster per class."""

    component: ClassVar[str] = "trainkit_example_plugin.data:build_blobs"
    name: Literal["blobs"]
    num_samples: PositiveInt = Field(default=1024, description="dataset length")
    dim: PositiveInt = Field(default=32, description="features per sample")
    num_classes: PositiveInt = Field(default=4, description="clusters")


def build_blobs(options: BlobsData, *, split: str, seed: int):
    """split: "train" or "eval" (a held-out tenth) -> a Dataset of (features, label)."""
    import torch
    from torch.utils.data import TensorDataset

    train = split == "train"
    g = torch.Generator().manual_seed(seed + (0 if train else 1))
    n = options.num_samples if train else max(options.batch_size, options.num_samples // 10)
    centers = torch.randn(options.num_classes, options.dim, generator=torch.Generator().manual_seed(seed)) * 3
    labels = torch.randint(0, options.num_classes, (n,), generator=g)
    x = centers[labels] + torch.randn(n, options.dim, generator=g)
    return TensorDataset(x, labels)


class WavesData(DataOptions):
    """Regression targets: y = sin(w . x) + noise, with w fixed by the seed."""

    component: ClassVar[str] = "trainkit_example_plugin.data:build_waves"
    name: Literal["waves"]
    num_samples: PositiveInt = Field(default=1024, description="dataset length")
    dim: PositiveInt = Field(default=8, description="features per sample")


def build_waves(options: WavesData, *, split: str, seed: int):
    import torch
    from torch.utils.data import TensorDataset

    w = torch.randn(options.dim, generator=torch.Generator().manual_seed(seed)) / options.dim ** 0.5
    g = torch.Generator().manual_seed(seed * 2 + (0 if split == "train" else 1))
    n = options.num_samples if split == "train" else max(options.batch_size, options.num_samples // 8)
    x = torch.randn(n, options.dim, generator=g)
    y = torch.sin(2 * x @ w) + 0.05 * torch.randn(n, generator=g)
    return TensorDataset(x, y)
