"""Refused before launch, nothing started (issue 38). #11: the recipe the ranks train is the one that
was validated and logged: a value that a worker's own environment would change (`${oc.env:RANK,...}`)
is refused, naming it -- before, rank 1 trained at another learning rate than MLflow recorded, or a
combination `validate` refuses started anyway and failed on one rank. #10: a checkpoint another
strategy wrote."""

from __future__ import annotations

import pytest

from run_helpers import mlp_recipe, trainkit

pytestmark = pytest.mark.slow


def test_values_that_differ_by_rank_are_refused_before_launch(tmp_path):
    lr = mlp_recipe(tmp_path, "lr-by-rank", optimizer={"lr": "${oc.env:RANK,0.05}"})
    result = trainkit(tmp_path, "run", str(lr), timeout=120)
    assert result.returncode == 2, result.output[-3000:]
    assert "optimizer.lr" in result.stderr and "depend on the rank's environment" in result.stderr, result.stderr
    assert not (tmp_path / "runs" / "lr-by-rank" / "launches").exists()  # nothing started, nothing written

    same = mlp_recipe(tmp_path, "same-everywhere", optimizer={"lr": "${oc.env:TRAINKIT_TEST_LR,0.05}"},
                      trainer={"max_steps": 1, "checkpoint": {"every": 100}}, launch={"nproc_per_node": 1})
    result = trainkit(tmp_path, "run", str(same), timeout=120)
    assert result.returncode == 0, result.output[-3000:]  # an interpolation every rank resolves alike still runs
    phases = [line.split(":")[1].strip().split(" (")[0] for line in result.stdout.splitlines()
              if line.startswith("trainkit: ") and line.rstrip().endswith(" s)")]
    assert phases[:4] == ["workers up", "model built and placed", "data ready", "first step"], result.stdout  # #18


def test_resuming_another_strategys_checkpoint_is_refused_before_launch(tmp_path):
    """issue 38 #10: `trainer.resume: PATH` of a DDP checkpoint under FSDP failed on every rank with 5
    tracebacks; now refused before anything starts, naming the strategy that wrote it and the way to
    start from its weights."""
    import torch

    folder = tmp_path / "ddp-step-00000004"
    folder.mkdir()
    torch.save({}, folder / "model.pt")  # what DDP's checkpoint folder holds (DDPStrategy.owns_checkpoint)
    path = mlp_recipe(tmp_path, "other-strategy", strategy={"name": "fsdp"}, trainer={"resume": str(folder)})
    result = trainkit(tmp_path, "run", str(path), timeout=120)
    assert result.returncode == 2, result.output[-3000:]
    assert "written by strategy ddp" in result.stderr and "trainkit export" in result.stderr, result.stderr
    assert "Traceback" not in result.output
    assert not (tmp_path / "runs" / "other-strategy" / "launches").exists()
