"""Non-finite values never reach a checkpoint (issue 10, finding 1): real `trainkit run`, 2 ranks, gloo."""

from __future__ import annotations

import pytest
import torch
from mlflow.tracking import MlflowClient

from run_helpers import mlp_recipe, trainkit

from trainkit.runtime.checkpoint import step_folders


pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)


def _finite_checkpoint_weights(folder) -> bool:
    state = torch.load(folder / "model.pt", map_location="cpu", weights_only=True)
    return all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


def _status(tmp_path, name: str) -> str:
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              filter_string=f"tags.mlflow.runName = '{name}'")
    return runs[0].info.status


def test_exploding_lr_stops_the_run_before_a_nan_checkpoint(tmp_path):
    """Guards the `stop` mode: the issue's exploding-lr recipe (lr x 1e30 from step 7) used to write
    all-NaN checkpoints, rotate the good one away and restart from NaN. Now it stops FAILED naming the
    step, no restart redoes it, and every kept checkpoint (the newest included) has finite weights."""
    recipe = mlp_recipe(tmp_path, "explode", optimizer={"name": "sgd", "lr": 0.01, "momentum": 0.0},
                        scheduler={"name": "step", "warmup_steps": 0, "step_size": 6, "gamma": 1e30},
                        trainer={"max_steps": 24, "log_every": 1, "checkpoint": {"every": 3, "keep": 2}},
                        launch={"nproc_per_node": 2, "run_dir": str(tmp_path / "runs"), "timeout_s": 60,
                                "max_restarts": 1},
                        tracking={"enabled": True})
    result = trainkit(tmp_path, "run", str(recipe))
    assert result.returncode != 0, result.output
    assert "non-finite" in result.output and "at step" in result.output, result.output
    assert "not restarting" in result.output, result.output  # the restart did not redo the failure
    kept = step_folders(tmp_path / "runs" / "explode" / "checkpoints")
    assert kept, "the good checkpoints before the explosion were deleted"
    assert all(_finite_checkpoint_weights(f) for f in kept), [f.name for f in kept]
    assert max(int(f.name[5:]) for f in kept) <= 9  # lr is 1e28 from step 7: nothing after step 9 is finite
    assert _status(tmp_path, "explode") == "FAILED"


def test_planted_nan_stop_names_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    """Guards the exact step in the message and the pre-checkpoint check: rank 1 alone produces a NaN at
    step 6 (rank 0's own loss stays finite); the run stops at step 6, the step-4 checkpoint stays the
    newest and loads with finite weights, and no step-8 checkpoint exists."""
    recipe = mlp_recipe(tmp_path, "planted", trainer={"max_steps": 12, "log_every": 3,
                                                      "checkpoint": {"every": 4, "keep": 1}})
    result = trainkit(tmp_path, "run", str(recipe), TRAINKIT_FAULT_NAN="rank=1,step=6")
    assert result.returncode != 0, result.output
    assert "non-finite loss at step 6" in result.output, result.output
    kept = step_folders(tmp_path / "runs" / "planted" / "checkpoints")
    assert [f.name for f in kept] == ["step-00000004"]
    assert _finite_checkpoint_weights(kept[0])
    assert "last good checkpoint" in result.output and "step-00000004" in result.output


def test_skip_step_discards_the_bad_step_and_finishes(tmp_path):
    """Guards `skip_step`: the NaN step is discarded on every rank (DDP would otherwise spread rank 1's NaN
    gradient to all), the run finishes with finite weights and logs skipped_steps = 1."""
    recipe = mlp_recipe(tmp_path, "skipper", trainer={"max_steps": 10, "log_every": 1, "on_nonfinite": "skip_step",
                                                      "checkpoint": {"every": 5, "keep": 1}})
    result = trainkit(tmp_path, "run", str(recipe), TRAINKIT_FAULT_NAN="rank=1,step=4")
    assert result.returncode == 0, result.output
    assert "step 4: non-finite loss or gradient; optimizer step skipped" in result.output
    import json

    rows = [json.loads(line) for line in (tmp_path / "runs" / "skipper" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 10 and rows[-1]["skipped_steps"] == 1
    assert [r["skipped_steps"] for r in rows if r["step"] == 3] == [0]
    final = step_folders(tmp_path / "runs" / "skipper" / "checkpoints")[0]
    assert final.name == "step-00000010" and _finite_checkpoint_weights(final)


def test_skip_step_keeps_no_poisoned_batchnorm_statistics(tmp_path):
    """Guards skip_step on a CNN with BatchNorm (issue 25, case 9): one infinite input at step 4 puts inf
    into the running statistics during the forward, before the step is found non-finite. The skipped
    step must restore them: every checkpoint's buffers are finite, the step-4 statistics equal the
    step-3 ones, and the run's evaluation is finite."""
    recipe = mlp_recipe(tmp_path, "bn-skip", model={"name": "torchvision.resnet18", "args": {"num_classes": 4}},
                        data={"name": "synthetic", "shape": [3, 16, 16], "num_classes": 4, "batch_size": 4,
                              "num_samples": 64},
                        trainer={"max_steps": 8, "log_every": 1, "on_nonfinite": "skip_step",
                                 "eval_every": 8, "eval_steps": 2, "checkpoint": {"every": 1, "keep": 10}},
                        launch={"nproc_per_node": 1})
    result = trainkit(tmp_path, "run", str(recipe), TRAINKIT_FAULT_NAN="rank=0,step=4,where=input")
    assert result.returncode == 0, result.output
    assert "step 4: non-finite loss or gradient; optimizer step skipped" in result.output
    folders = {int(f.name[5:]): f for f in step_folders(tmp_path / "runs" / "bn-skip" / "checkpoints")}
    assert sorted(folders) == list(range(1, 9)), sorted(folders)
    states = {step: torch.load(f / "model.pt", map_location="cpu", weights_only=True) for step, f in folders.items()}
    for step, state in states.items():
        bad = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
        assert not bad, (step, bad[:5])
    running = [k for k in states[3] if k.endswith("running_mean")]
    assert running and all(torch.equal(states[3][k], states[4][k]) for k in running)  # step 4 left no trace
    assert not all(torch.equal(states[4][k], states[5][k]) for k in running)  # later steps still update them
    import json

    summary = json.loads((tmp_path / "runs" / "bn-skip" / "summary.json").read_text())
    assert all(v == v and abs(v) != float("inf") for v in summary["eval"].values()), summary["eval"]
