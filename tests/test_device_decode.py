"""`data.decode: device` against the loader's own decoding: the same crops, flips and pixels (within
one level of 255 from the resize kernels), unreadable files skipped or named as before. In-process;
the run with loader workers is in tests/test_run_imagefolder.py, the CUDA decoder in tests/test_gpu.py."""

from __future__ import annotations

import pytest
import torch

from trainkit.recipe.blocks import ImageFolderData
from trainkit.runtime.data import STD, build_imagefolder
from trainkit.runtime.imagefolder_maker import make_imagefolder


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """8 PNGs and 8 JPEGs of 64 x 64 (make_imagefolder alternates the formats)."""
    return make_imagefolder(tmp_path_factory.mktemp("decode") / "imgs", classes=2, per_class=8, size=64, seed=0)


def datasets(root, split: str, **options):
    made = {decode: ImageFolderData(name="imagefolder", root=str(root), val_root=str(root), batch_size=4,
                                    image_size=48, decode=decode, **options) for decode in ("loader", "device")}
    return {decode: build_imagefolder(o, split=split, seed=0) for decode, o in made.items()}


def levels_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in levels of 255 of the un-normalised pixels."""
    return ((a - b) * torch.tensor(STD).view(1, 3, 1, 1) * 255).abs()


@pytest.mark.parametrize("split", ["train", "eval"])
def test_the_device_path_gives_the_loaders_batch(images, split):
    by = datasets(images, split)
    n = len(by["loader"])
    torch.manual_seed(3)  # the augmentation's draws: the same calls in the same order on both paths
    on_host = torch.stack([by["loader"][i][0] for i in range(n)])
    torch.manual_seed(3)
    samples = [by["device"][i] for i in range(n)]
    images_, labels, skipped = by["device"].collate(samples)
    on_device = images_.to("cpu")
    assert on_device.shape == on_host.shape == (n, 3, 48, 48) and on_device.dtype == torch.float32
    assert labels.tolist() == [by["loader"][i][1] for i in range(n)] and skipped.sum() == 0
    apart = levels_apart(on_host, on_device)
    assert apart.max() <= 1.0 + 1e-4, apart.max()  # resize kernels round differently by at most one level
    assert apart.mean() < 0.1, apart.mean()  # ... and rarely
    if split == "train":  # the crops really are random (else equality above would be trivial for eval)
        assert {s[0].crop for s in samples} != {samples[0][0].crop} and any(s[0].flip for s in samples)
        assert {s[0].encoded for s in samples} == {True, False}  # JPEG bytes and decoded PNGs both


@pytest.mark.slow  # a DataLoader worker process
def test_a_batch_leaves_its_loader_worker_in_one_shared_memory_block(images):
    """Guards `EncodedBatch`'s packing: a batch crosses from a DataLoader worker to the rank as one shared
    tensor, not one per image (each costs the rank ~0.1 ms of CPU: bench/image_decode.py); every image is
    a view into it, and a PNG brings only its training crop's pixels, not the whole picture."""
    from torch.utils.data import DataLoader

    dataset = datasets(images, "train")["device"]
    batch, labels, _ = next(iter(DataLoader(dataset, batch_size=16, num_workers=1, collate_fn=dataset.collate)))
    tensors = [value for value in vars(batch).values() if isinstance(value, torch.Tensor)]
    assert len(tensors) == 1 and tensors[0].is_shared() and len(batch) == len(labels) == 16
    block = tensors[0].untyped_storage().data_ptr()
    assert {image.data.untyped_storage().data_ptr() for image in batch.images} == {block}
    pngs = [image for image in batch.images if not image.encoded]
    assert pngs and all(tuple(p.data.shape[1:]) == p.crop[2:] and p.crop[:2] == (0, 0) for p in pngs)
    assert any(p.data.shape[1] * p.data.shape[2] < 64 * 64 for p in pngs)  # cut in the worker


def test_unreadable_files_are_skipped_and_counted_or_named(tmp_path):
    root = make_imagefolder(tmp_path / "imgs", classes=1, per_class=6, size=32, seed=1)
    files = sorted((root / "class_00").iterdir())
    jpgs = [f for f in files if f.suffix == ".jpg"]
    (root / "class_00" / "img_0000.png").write_bytes(b"not an image")
    jpgs[0].write_bytes(jpgs[0].read_bytes()[:200])  # truncated: a partial download
    # readable, as PIL reads it: what a camera appends after the image (a motion photo's video, with
    # marker-like bytes in it)
    jpgs[1].write_bytes(jpgs[1].read_bytes() + b"\xff\xd8 a video \xff\xda appended \xff\xda")
    by = datasets(root, "train", on_corrupt="skip")
    device = by["device"]
    got = [device[i] for i in range(len(device))]
    skips = [s[2] for s in got]
    assert skips == [by["loader"][i][2] for i in range(len(files))]  # replaced and counted as the loader does
    assert skips[0] == 2 and sum(skips) == 3  # the PNG, then the truncated JPEG after it; that JPEG once more
    assert len(device.collate(got)[0].to("cpu")) == len(files)

    device = datasets(root, "train")["device"]  # on_corrupt: error
    with pytest.raises(RuntimeError, match=f"unreadable image {jpgs[0]}.*on_corrupt: skip"):
        device[files.index(jpgs[0])]


def test_a_jpeg_whose_data_is_broken_stops_the_batch_naming_the_file(tmp_path):
    root = make_imagefolder(tmp_path / "imgs", classes=1, per_class=4, size=32, seed=2)
    broken = sorted((root / "class_00").glob("*.jpg"))[0]
    data = bytearray(broken.read_bytes())
    table = data.index(b"\xff\xc4")  # a Huffman table: its code counts made bogus (the header still reads)
    data[table + 5:table + 21] = b"\xff" * 16
    broken.write_bytes(bytes(data))
    device = datasets(root, "train", on_corrupt="skip")["device"]
    batch = device.collate([device[i] for i in range(len(device))])[0]
    with pytest.raises(RuntimeError, match=f"unreadable image {broken}.*data.decode: loader"):
        batch.to("cpu")


def test_tune_tries_decoding_on_the_gpu_for_an_image_folder_on_cuda(tmp_path):
    """The bottleneck report's `data.decode: device` advice has a knob, so `trainkit tune` can prove it
    (or not) on a GPU; not on a CPU run, and not for a dataset with nothing to decode."""
    from run_helpers import mlp_recipe
    from trainkit.launch import tune_knobs
    from trainkit.recipe import resolve

    knob = tune_knobs.all_knobs()["decode"]
    images = resolve(str(mlp_recipe(tmp_path, "images", data={"name": "imagefolder", "root": str(tmp_path),
                                                                  "batch_size": 4}))).recipe
    assert tune_knobs.not_applicable(knob, images, {"cuda": True}) is None
    assert knob.values(images, {"cuda": True}) == ["device"]
    assert "CUDA" in tune_knobs.not_applicable(knob, images, {"cuda": False})
    synthetic = resolve(str(mlp_recipe(tmp_path, "synthetic"))).recipe
    assert "decodes nothing" in tune_knobs.not_applicable(knob, synthetic, {"cuda": True})


@pytest.mark.parametrize("failure", ["batched", "host-copy"])
def test_the_device_running_out_of_memory_while_decoding_is_out_of_memory_not_an_unreadable_file(images, monkeypatch,
                                                                                                   failure):
    """torchvision's batched GPU decoder rewraps the allocator's out of memory as a plain RuntimeError; the
    one-by-one retry and the host fallback must not turn it into "unreadable image <a good file>", which
    the worker would not report as out of memory (no snapshot, no fatal marker: restarts repeat it).
    The decoder is replaced here (no GPU): "batched" fails like torchvision's op does, "host-copy" lets the
    decoder refuse the file and fails the host pixels' copy to the device."""
    import torchvision.io

    from trainkit.runtime import device_decode, memory_watch

    wrapped = RuntimeError("Error while decoding JPEG images: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 "
                           "has a total capacity of 79.19 GiB of which 1.50 MiB is free.")

    def decoder(data, mode=None, device="cpu"):
        raise wrapped if failure == "batched" else RuntimeError("Failed to decode batch: 6")

    class Pixels:
        def to(self, device):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB.")

    monkeypatch.setattr(torchvision.io, "decode_jpeg", decoder)
    monkeypatch.setattr(device_decode, "_host_pixels", lambda path: Pixels())
    device = datasets(images, "train")["device"]
    jpeg = next(i for i in range(len(device)) if str(device.samples[i][0]).endswith(".jpg"))
    batch = device.collate([device[jpeg]])[0]
    with pytest.raises(RuntimeError) as raised:
        batch.to("cpu")
    assert "unreadable image" not in str(raised.value)
    assert memory_watch.is_out_of_memory(raised.value), raised.value
