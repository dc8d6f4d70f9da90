"""End to end on real image files: generated ImageFolder, JPEG/PNG decoding in DataLoader workers (or,
with data.decode: device, on the rank's device from the bytes the workers read), a corrupt file skipped
and counted, evaluation, 2 DDP ranks."""

from __future__ import annotations

import pytest

from run_helpers import mlp_recipe, summary, trainkit


pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)


@pytest.mark.parametrize("decode", ["loader", "device"])
def test_imagefolder_run_with_workers_and_a_counted_corrupt_image(tmp_path, decode):
    made = trainkit(tmp_path, "data", "make-imagefolder", "imgs", "--classes", "4", "--per-class", "8",
                    "--size", "40", "--seed", "1", timeout=120)
    assert made.returncode == 0, made.output
    pngs = sorted((tmp_path / "imgs").rglob("*.png"))
    jpgs = sorted((tmp_path / "imgs").rglob("*.jpg"))
    assert len(pngs) + len(jpgs) == 32 and pngs and jpgs
    (tmp_path / "imgs" / "class_00" / "img_0000.png").write_bytes(b"not an image")
    recipe = mlp_recipe(
        tmp_path, "images",
        model={"name": "small_cnn", "args": {"num_classes": 4, "width": 8}},
        data={"name": "imagefolder", "root": "imgs", "val_root": "imgs", "image_size": 32, "batch_size": 4,
              "num_workers": 2, "prefetch_factor": 2, "persistent_workers": True, "on_corrupt": "skip",
              "decode": decode},
        trainer={"max_steps": 6, "log_every": 2, "eval_every": 3, "eval_steps": 2, "checkpoint": {"every": 3}})
    result = trainkit(tmp_path, "run", str(recipe))
    assert result.returncode == 0, result.output
    s = summary(tmp_path / "runs" / "images")
    assert s["steps"] == 6 and s["world_size"] == 2
    assert s["skipped_images"] >= 1  # 48 samples drawn from 32 files: the bad one is hit at least once
    assert "unreadable images skipped" in result.stdout
    assert 0.0 <= s["eval"]["eval_accuracy"] <= 1.0 and s["eval"]["eval_loss"] > 0


def test_a_corrupt_image_with_on_corrupt_error_names_the_file(tmp_path):
    from trainkit.recipe.blocks import ImageFolderData
    from trainkit.runtime.data import build_imagefolder
    from trainkit.runtime.imagefolder_maker import make_imagefolder

    root = make_imagefolder(tmp_path / "imgs", classes=2, per_class=2, size=16, seed=0)
    bad = root / "class_00" / "img_0000.png"
    bad.write_bytes(b"\x89PNG truncated")
    options = ImageFolderData(name="imagefolder", root=str(root), batch_size=2, image_size=16)
    dataset = build_imagefolder(options, split="train", seed=0)
    with pytest.raises(RuntimeError, match=f"unreadable image {bad}.*on_corrupt: skip"):
        dataset[0]
