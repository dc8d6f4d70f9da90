"""JPEG decoding on the rank's device (`data.decode: device`), for loaders that cannot keep up.

Why: a ResNet on one GPU consumes thousands of images a second; decoding JPEGs with PIL in DataLoader
workers needs a host core per few hundred of them, so the GPUs wait on the host. Here the workers
only read each file's bytes and draw its augmentation (crop box, flip) from the JPEG header; the rank
decodes the whole batch at once with torchvision's `decode_jpeg` on its device (nvJPEG on CUDA), and
crops, resizes, flips and normalises there.

The augmentation is drawn in the worker with the same torch calls, in the same order, as the host path
(`runtime.data.image_transforms`), so with the same seed both paths crop and flip alike; the pixels
then differ only by the JPEG decoder and the resize kernel (tests/test_device_decode.py measures it).

Files that are not JPEGs (PNG, ...) are decoded (and a training crop cut) in the worker as before,
and only resized, flipped and normalised on the device. `on_corrupt` is applied in the worker to files
whose header cannot be read or whose JPEG data is truncated (no end-of-image marker after its last
scan); a JPEG that passes both but whose data is broken, where the device's decoder notices, is retried
on the host with PIL, and stops the run naming the file if PIL cannot read it either (docs/performance.md:
nvJPEG's hardware decoder may not notice). A failure that is the device's (out of memory, a CUDA error)
is raised as itself.

Hand-written: torchvision gives the decoder and the functional transforms, not a loader that splits
them between host and device (DALI does, but does not install here).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import NamedTuple, Optional

import torch
from torch.utils.data import Dataset

from ..recipe.blocks import IMAGE_EXTENSIONS, scan_imagefolder
from .packed_samples import PackedSamples
from .readable_samples import first_readable

JPEG_SCAN, JPEG_END = b"\xff\xda", b"\xff\xd9"  # start-of-scan and end-of-image markers
STANDALONE_MARKERS = {0x01, *range(0xD0, 0xD9)}  # markers without a length field (TEM, RSTn, SOI)
RESIZED_CROP_SCALE, RESIZED_CROP_RATIO = (0.08, 1.0), (3.0 / 4.0, 4.0 / 3.0)  # torchvision's defaults


class EncodedImage(NamedTuple):
    """One sample's image as the worker leaves it: a JPEG's bytes (or, for other formats, its decoded
    uint8 [3, H, W] pixels) and the augmentation drawn for it."""

    data: torch.Tensor
    encoded: bool  # data holds JPEG bytes (else decoded pixels)
    path: str
    crop: Optional[tuple[int, int, int, int]]  # training: (top, left, height, width) in the original
    flip: bool


class EncodedBatch:
    """A batch of `EncodedImage`s. `.to(device)` decodes and transforms it there into the normalised
    float [N, 3, S, S] batch the host path would have produced, so a task moves it like any input.

    Built in the loader's worker, it holds every image's bytes in one tensor: the worker hands the rank
    one shared-memory block per batch, not one per image (each costs the rank a file descriptor, a map
    and an unmap: ~0.12 ms, a cap of ~8,000 images/s per rank; bench/image_decode.py measures both)."""

    work_on_device = True  # the loop times its move as the step's compute, not as waiting for data

    def __init__(self, images: list[EncodedImage], image_size: int, mean, std):
        self.image_size, self.mean, self.std = image_size, mean, std
        self.shapes = [tuple(image.data.shape) for image in images]
        self.annotations = [(image.encoded, image.path, image.crop, image.flip) for image in images]
        self.data = _packed([image.data.reshape(-1) for image in images])

    def __len__(self) -> int:
        return len(self.shapes)

    @property
    def images(self) -> list[EncodedImage]:
        """Each image again, its data a view into the batch's one tensor."""
        images, start = [], 0
        for shape, (encoded, path, crop, flip) in zip(self.shapes, self.annotations):
            size = math.prod(shape)
            images.append(EncodedImage(self.data[start:start + size].view(shape), encoded, path, crop, flip))
            start += size
        return images

    def pin_memory(self, device=None) -> "EncodedBatch":
        return self  # the decoder reads the bytes from host memory itself; nothing to pin

    def to(self, device, non_blocking: bool = False) -> torch.Tensor:
        from torchvision.transforms.v2 import functional as F

        device = torch.device(device)
        if device.type == "cuda":
            # torchvision 0.29's nvJPEG decode allocates its outputs on this stream but writes them from a
            # stream of its own that does not wait for this one (pytorch/vision#9606): memory the step's
            # queued kernels still read could be handed to it. Their completion is awaited first: one host
            # wait per batch, the price of a correct batch (docs/performance.md).
            torch.cuda.current_stream(device).synchronize()
        images = self.images
        pixels = _decode(images, device)
        size = [self.image_size, self.image_size]
        out = []
        for image, img in zip(images, pixels):
            if image.crop is not None:  # training: RandomResizedCrop + RandomHorizontalFlip
                img = F.resized_crop(img, *image.crop, size=size, antialias=True)
                if image.flip:
                    img = F.horizontal_flip(img)
            else:  # evaluation: Resize(S * 256 / 224) + CenterCrop(S)
                img = F.center_crop(F.resize(img, [eval_resize(self.image_size)], antialias=True), size)
            out.append(img)
        batch = torch.stack(out).float().div_(255)
        mean, std = _normalisation(str(device), tuple(self.mean), tuple(self.std))
        return batch.sub_(mean).div_(std)


def _packed(parts: list[torch.Tensor]) -> torch.Tensor:
    """The uint8 tensors end to end in one. In a loader worker it is made in shared memory straight away,
    as torch's `default_collate` makes its batches (the same private storage call): sending it to the
    rank then copies nothing more."""
    total = sum(part.numel() for part in parts)
    out = None
    if parts and torch.utils.data.get_worker_info() is not None:
        out = parts[0].new(parts[0]._typed_storage()._new_shared(total, device="cpu")).resize_(total)
    return torch.cat(parts, out=out) if parts else torch.empty(0, dtype=torch.uint8)


def complete_jpeg(data: bytes) -> bool:
    """Whether a JPEG's image data is followed by an end-of-image marker: a partial download is not.
    The first start-of-scan is found by walking the header's marker segments (an EXIF thumbnail inside
    them has scans and an end marker of its own); inside scan data 0xFF is always stuffed (0xFF00) or a
    restart marker, so an end marker after it is a real one. Whatever a camera appends after the image
    (a motion photo's video) is allowed, as PIL allows it."""
    i = 2  # after the start-of-image marker
    while i + 4 <= len(data) and data[i] == 0xFF:
        marker = data[i + 1]
        if marker == JPEG_SCAN[1]:
            return data.find(JPEG_END, i) != -1
        if marker == 0xFF:  # fill byte before a marker
            i += 1
        elif marker in STANDALONE_MARKERS:
            i += 2
        else:
            i += 2 + int.from_bytes(data[i + 2:i + 4], "big")
    return False


@functools.lru_cache(maxsize=None)
def _normalisation(device: str, mean: tuple, std: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """mean and std as [1, 3, 1, 1] tensors on `device`, made once (not a host-to-device copy per batch)."""
    return (torch.tensor(mean, device=device).view(1, 3, 1, 1), torch.tensor(std, device=device).view(1, 3, 1, 1))


def eval_resize(image_size: int) -> int:
    """The shorter side an evaluation image is resized to before its centre crop (both paths)."""
    return int(math.ceil(image_size * 256 / 224))


def _decode(images: list[EncodedImage], device: torch.device) -> list[torch.Tensor]:
    """Each image's uint8 [3, H, W] pixels on `device`: the JPEGs in one batched call."""
    from torchvision.io import ImageReadMode, decode_jpeg

    jpegs = [i for i, image in enumerate(images) if image.encoded]
    pixels: list[Optional[torch.Tensor]] = [None if image.encoded else image.data.to(device) for image in images]
    if jpegs:
        try:
            decoded = decode_jpeg([images[i].data for i in jpegs], mode=ImageReadMode.RGB, device=device)
        except RuntimeError as exc:  # one bad or unsupported file fails the batch: find it, decode the rest alone
            _raise_if_the_device_failed(exc)
            decoded = [_decode_one(images[i], device) for i in jpegs]
        for i, img in zip(jpegs, decoded):
            pixels[i] = img
    return pixels


def _decode_one(image: EncodedImage, device: torch.device) -> torch.Tensor:
    from torchvision.io import ImageReadMode, decode_jpeg

    try:
        return decode_jpeg(image.data, mode=ImageReadMode.RGB, device=device)
    except RuntimeError as exc:
        _raise_if_the_device_failed(exc)
    try:  # a JPEG variant the device's decoder refuses (e.g. CMYK), or a broken one: the host decodes it
        pixels = _host_pixels(image.path)
    except Exception as exc:  # PIL raises many types for bad files
        raise RuntimeError(f"unreadable image {image.path}: {type(exc).__name__}: {exc} (its header and "
                           "end marker read, so the loader could not skip it: remove the file, or use "
                           "data.decode: loader, which decodes in the loader and can skip it)") from None
    return pixels.to(device)  # the device's own failure (out of memory) is not the file's


def _raise_if_the_device_failed(exc: RuntimeError) -> None:
    """Re-raise a decoder failure that is the device's, not a file's: out of memory (torchvision's batched
    decoder rewraps the allocator's error as a plain RuntimeError, "Error while decoding JPEG images: CUDA
    out of memory. ..."), or a CUDA error, which leaves the context unusable. Retrying image by image,
    then on the host, would only name a good file as unreadable."""
    from .memory_watch import is_out_of_memory

    if is_out_of_memory(exc) or isinstance(exc, getattr(torch, "AcceleratorError", ())):
        raise exc


def _host_pixels(path: str) -> torch.Tensor:
    from PIL import Image

    with Image.open(path) as img:
        return _rgb_pixels(img)


def _rgb_pixels(img) -> torch.Tensor:
    """A PIL image's pixels as uint8 [3, H, W], decoded on the host."""
    import numpy as np

    return torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1).contiguous()


class EncodedImageFolder(Dataset):
    """An ImageFolder whose samples are `EncodedImage`s: read and augmentation drawn here (in the
    loader's workers), decoded and transformed on the rank's device (`EncodedBatch.to`)."""

    def __init__(self, root: Path, image_size: int, train: bool, on_corrupt: str, mean, std):
        self.root, self.image_size, self.train, self.on_corrupt = root, image_size, train, on_corrupt
        self.mean, self.std = mean, std
        self.classes, samples = scan_imagefolder(root)
        self.samples = PackedSamples(samples)  # not copied into each DataLoader worker
        if not self.samples:
            raise FileNotFoundError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) under {root}/<class>/")

    def __len__(self) -> int:
        return len(self.samples)

    def _load(self, i: int) -> tuple[EncodedImage, int]:
        from PIL import Image
        from torchvision.transforms import RandomResizedCrop

        path, label = self.samples[i]
        with open(path, "rb") as f:  # not Path(path): pathlib interns each part (see packed_samples.py)
            data = f.read()
        with Image.open(path) as img:  # reads the header only: the size, for the crop box
            encoded = img.format == "JPEG"
            if encoded and not complete_jpeg(data):
                raise OSError("truncated JPEG (no end-of-image marker after its last scan)")
            pixels = torch.frombuffer(bytearray(data), dtype=torch.uint8) if encoded else None
            crop, flip = None, False
            if self.train:  # the same draws, in the same order, as RandomResizedCrop + RandomHorizontalFlip
                crop = tuple(int(v) for v in RandomResizedCrop.get_params(img, list(RESIZED_CROP_SCALE),
                                                                          list(RESIZED_CROP_RATIO)))
                flip = bool(torch.rand(1) < 0.5)
            if not encoded:  # decoded here; a training crop is cut here too, so only its pixels travel
                pixels = _rgb_pixels(img)
                if crop is not None:
                    top, left, height, width = crop
                    pixels, crop = pixels[:, top:top + height, left:left + width], (0, 0, height, width)
        return EncodedImage(pixels.contiguous(), encoded, str(path), crop, flip), label

    def __getitem__(self, i: int):
        (image, label), skipped = first_readable(self._load, self.samples, i, self.on_corrupt, self.root)
        return image, label, skipped

    def collate(self, samples) -> tuple[EncodedBatch, torch.Tensor, torch.Tensor]:
        """The DataLoader's collate function for these samples (runtime.data.make_loader)."""
        images, labels, skipped = zip(*samples)
        return (EncodedBatch(list(images), self.image_size, self.mean, self.std),
                torch.tensor(labels, dtype=torch.long), torch.tensor(skipped, dtype=torch.long))
