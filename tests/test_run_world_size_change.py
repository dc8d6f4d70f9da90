"""Resuming with another world size (issue 10): the data position is global, so no sample is skipped or
repeated; strategies whose checkpoints cannot be resharded refuse with both world sizes named."""

from __future__ import annotations

import pytest
from collections import Counter

from run_helpers import mlp_recipe, trainkit


pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)


def _samples(folder) -> list[str]:
    return [line for f in sorted(folder.glob("rank*.txt")) for line in f.read_text().split()]


def test_resuming_on_half_the_ranks_continues_at_the_same_global_sample(tmp_path):
    """Guards the global data position: 2 ranks train 4 steps (64 samples), 1 rank resumes from that
    checkpoint for 4 more steps (32 samples). Together they must be exactly the first 96 samples a
    1-rank run sees, none twice (a per-rank position would replay samples 32..63)."""
    data = {"name": "synthetic", "batch_size": 8, "num_samples": 256, "shape": [3, 4, 4], "num_classes": 4}
    first = mlp_recipe(tmp_path, "two", data=data, trainer={"max_steps": 4, "log_every": 4,
                                                            "checkpoint": {"every": 4, "keep": 1}})
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir(), (tmp_path / "c").mkdir()
    assert trainkit(tmp_path, "run", str(first), TRAINKIT_FAULT_RECORD_SAMPLES=str(tmp_path / "a")).returncode == 0
    ckpt = tmp_path / "runs" / "two" / "checkpoints" / "step-00000004"
    resumed = mlp_recipe(tmp_path, "one", data=data, trainer={"max_steps": 8, "log_every": 4, "resume": str(ckpt),
                                                              "checkpoint": {"every": 8, "keep": 1}},
                         launch={"nproc_per_node": 1, "run_dir": str(tmp_path / "runs"), "timeout_s": 60})
    result = trainkit(tmp_path, "run", str(resumed), TRAINKIT_FAULT_RECORD_SAMPLES=str(tmp_path / "b"))
    assert result.returncode == 0, result.output
    reference = mlp_recipe(tmp_path, "ref", data=data, trainer={"max_steps": 12, "log_every": 12},
                           launch={"nproc_per_node": 1, "run_dir": str(tmp_path / "runs"), "timeout_s": 60})
    assert trainkit(tmp_path, "run", str(reference), TRAINKIT_FAULT_RECORD_SAMPLES=str(tmp_path / "c")).returncode == 0
    a, b, c = _samples(tmp_path / "a"), _samples(tmp_path / "b"), _samples(tmp_path / "c")
    assert (len(a), len(b), len(c)) == (64, 32, 96)
    assert not set(a) & set(b)
    assert Counter(a + b) == Counter(c)


def test_a_pipeline_checkpoint_refuses_another_world_size_naming_both(tmp_path):
    """Guards the refusal: pipeline stage files follow the world size; loading a 2-rank checkpoint on
    1 rank fails before any step with both sizes in the message (not a key error deep in torch)."""
    pipe = {"name": "pipeline", "microbatches": 2}
    model = {"name": "mlp", "args": {"in_features": 48, "hidden": 32, "num_classes": 4, "depth": 3}}
    first = mlp_recipe(tmp_path, "pipe2", strategy=pipe, model=model,
                       trainer={"max_steps": 2, "checkpoint": {"every": 2, "keep": 1}})
    assert trainkit(tmp_path, "run", str(first)).returncode == 0
    ckpt = tmp_path / "runs" / "pipe2" / "checkpoints" / "step-00000002"
    second = mlp_recipe(tmp_path, "pipe1", strategy=pipe, model=model, trainer={"max_steps": 4, "resume": str(ckpt)},
                        launch={"nproc_per_node": 1, "run_dir": str(tmp_path / "runs"), "timeout_s": 60})
    result = trainkit(tmp_path, "run", str(second))
    assert result.returncode != 0, result.output
    assert "was saved by 2 ranks and this launch has 1" in result.output
    assert "cannot be resharded" in result.output
