"""`data: {name: cifar10}` reads the python-pickle batches from a local folder (never downloads):
a small folder in the real format trains end to end, and a missing batch file stops the launch."""

from __future__ import annotations

import pytest
import pickle

import numpy as np

from run_helpers import mlp_recipe, summary, trainkit


pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)


def write_cifar(root, per_batch=16, seed=0):
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        labels = rng.integers(0, 10, per_batch)
        data = (rng.integers(0, 64, (per_batch, 3072)) + labels[:, None] * 19).astype(np.uint8)
        with open(folder / name, "wb") as fh:
            pickle.dump({"data": data, "labels": labels.tolist(), "batch_label": name}, fh)
    return folder


def cifar_recipe(tmp_path, name):
    return mlp_recipe(tmp_path, name, data={"name": "cifar10", "root": str(tmp_path / "cifar"), "batch_size": 8},
                      model={"name": "mlp", "args": {"in_features": 3072, "hidden": 32, "num_classes": 10}},
                      trainer={"max_steps": 6, "log_every": 3, "eval_every": 3, "eval_steps": 2,
                               "checkpoint": {"every": 6, "keep": 1}},
                      launch={"nproc_per_node": 1})


def test_cifar10_from_a_local_folder_trains_and_evaluates(tmp_path):
    write_cifar(tmp_path / "cifar")
    result = trainkit(tmp_path, "run", str(cifar_recipe(tmp_path, "cifar")))
    assert result.returncode == 0, result.output
    s = summary(tmp_path / "runs" / "cifar")
    assert s["steps"] == 6 and 0.0 <= s["eval"]["eval_accuracy"] <= 1.0


def test_a_missing_cifar10_batch_is_named_before_launch(tmp_path):
    (write_cifar(tmp_path / "cifar") / "data_batch_3").unlink()
    result = trainkit(tmp_path, "run", str(cifar_recipe(tmp_path, "cifar")))
    assert result.returncode == 2
    assert "CIFAR-10 not found" in result.stderr and "data_batch_3" in result.stderr
    assert not (tmp_path / "runs").exists()
