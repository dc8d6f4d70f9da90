"""An image folder's index is not copied into each DataLoader worker (trainkit/runtime/packed_samples.py).

A forked worker shares its rank's pages until it writes to them; reading a Python object writes its
reference count, and a garbage collection writes every container's header. Measured in a real fork:
the private memory a child gains by reading every sample of a 200,000-image index once and collecting,
as a list of (Path, class) tuples (what ImageFolder datasets keep) against the packed index, whose
files come back as strs (a Path would intern its parts, writing to the interpreter's table of interned
strings all over: that copied 16 MB per child here).
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

from trainkit.runtime.packed_samples import PackedSamples

SAMPLES = 200_000


def index() -> list[tuple[Path, int]]:
    return [(Path(f"/data/imagenet/train/n{c:08d}/n{c:08d}_{i}.JPEG"), c) for i in range(SAMPLES)
            for c in [i % 1000]]


def private_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith(("Private_Dirty:", "Private_Clean:")))


def copied_by_a_reader(samples) -> int:
    """KiB a forked child makes its own by making SAMPLES reads (an epoch over the whole index) and
    collecting."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no torch, only the reads
        try:
            before = private_kib()
            for i in range(SAMPLES):
                path, label = samples[i % len(samples)]
            gc.collect()
            os.write(write, str(private_kib() - before).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        grown = int(f.read() or -1)
    os.waitpid(pid, 0)
    return grown


@pytest.mark.slow
def test_reading_the_packed_index_in_a_forked_worker_copies_almost_nothing_of_it():
    listed = index()
    packed = PackedSamples(listed)
    assert len(packed) == SAMPLES and packed[12345] == (str(listed[12345][0]), listed[12345][1])
    assert packed[-1] == (str(listed[-1][0]), listed[-1][1]) and [p for p, _ in packed[2:4]] == [str(p) for p, _ in listed[2:4]]
    gc.collect()
    gc.freeze()  # what the rank holds now is old: only the child's reads and collection dirty pages
    try:
        # the reads' own objects land in free slots of the rank's pages too: a 1,000-sample packed index
        # read as often is that baseline, the index itself adding nothing
        baseline = copied_by_a_reader(PackedSamples(listed[:1000]))
        as_list, as_packed = copied_by_a_reader(listed), copied_by_a_reader(packed)
    finally:
        gc.unfreeze()
    assert as_list - baseline > 20_000, (as_list, baseline)  # the list's pages are copied: tens of MB
    assert as_packed - baseline < 2_000, (as_packed, baseline, as_list)


def test_an_index_with_any_file_name_reads_back_exactly():
    names = [(Path("/d/a b/ü.jpg"), 0), (Path("/d/x/\udcff.png"), 3), (Path("rel/y.JPEG"), 1)]
    packed = PackedSamples(names)
    assert list(packed) == [(str(p), c) for p, c in names] and not PackedSamples([])
    with pytest.raises(IndexError):
        packed[3]


@pytest.mark.parametrize("decode", ["loader", "device"])
def test_both_image_folder_datasets_keep_the_packed_index(tmp_path, decode):
    """What the fork measurement above is worth to a run: the datasets `data.name: imagefolder` builds
    (PIL in the loader, or bytes for the device's decoder) hold their index packed."""
    from trainkit.recipe.blocks import ImageFolderData
    from trainkit.runtime.data import build_imagefolder
    from trainkit.runtime.imagefolder_maker import make_imagefolder

    root = make_imagefolder(tmp_path / "imgs", classes=2, per_class=2, size=16)
    dataset = build_imagefolder(ImageFolderData(name="imagefolder", root=str(root), batch_size=2, decode=decode),
                                split="train", seed=0)
    assert isinstance(dataset.samples, PackedSamples) and len(dataset.samples) == 4
