"""Bad runtime inputs stop `trainkit run` before any worker starts, with the message a user needs."""

from __future__ import annotations

import pytest
from run_helpers import mlp_recipe, trainkit


pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)


def test_missing_data_root_and_unknown_torchvision_model_fail_before_launch(tmp_path):
    recipe = mlp_recipe(tmp_path, "bad-inputs",
                        model={"name": "torchvision.resnet5O", "args": {"num_classes": 4}},
                        data={"name": "imagefolder", "root": "no/such/folder", "batch_size": 4, "image_size": 32})
    result = trainkit(tmp_path, "run", str(recipe), timeout=120)
    assert result.returncode == 2, result.output
    err = result.stderr
    assert "data.root: data folder not found: no/such/folder" in err
    assert "bad-inputs.yaml:" in err  # located in the recipe file
    assert "torchvision has no classification model 'resnet5O'; did you mean 'torchvision.resnet50'?" in err
    assert "not started: 2 problem(s)" in err
    assert not (tmp_path / "runs").exists()  # nothing was created, no process started


def test_batch_larger_than_the_dataset_fails_before_launch_and_fp16_on_cpu_is_only_a_warning(tmp_path):
    """fp16 runs on the CPU (slowly; for testing loss scaling): a warning, not one of the errors."""
    recipe = mlp_recipe(tmp_path, "too-big", data={"num_samples": 10, "batch_size": 8}, precision="fp16")
    result = trainkit(tmp_path, "run", str(recipe), timeout=120)
    assert result.returncode == 2, result.output
    err = result.stderr
    assert ("batch_size 8 per device x 2 data-parallel ranks needs 16 samples per step, but the dataset has "
            "only 10 (5 per rank): with drop_last every epoch has zero batches") in err
    assert "needs CUDA" not in err
    assert "precision: fp16 on the CPU is slow" in err
    assert "not started: 1 problem(s)" in err
    assert not (tmp_path / "runs").exists()
