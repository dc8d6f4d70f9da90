"""A third-party task end to end: plugins/example's `regression` task (MSE, eval MSE/MAE) with its
`waves` dataset, registered through entry points, trained by `trainkit run` on 2 processes."""

from __future__ import annotations

import json

import pytest

from run_helpers import losses, mlp_recipe, summary, trainkit

pytestmark = pytest.mark.distributed


def test_the_example_regression_task_trains_and_evaluates(tmp_path):
    path = mlp_recipe(tmp_path, "regress", task={"name": "regression"},
                      model={"name": "mlp", "args": {"in_features": 8, "hidden": 32, "num_classes": 1}},
                      data={"name": "waves", "batch_size": 16, "num_samples": 512, "dim": 8},
                      optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9},
                      trainer={"max_steps": 12, "log_every": 2, "eval_every": 6, "eval_steps": 4,
                               "checkpoint": {"every": 6}})
    result = trainkit(tmp_path, "run", str(path))
    assert result.returncode == 0, result.output[-6000:]
    run_dir = tmp_path / "runs" / "regress"
    out = losses(run_dir)
    assert out[-1] < out[0]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["rmse"] == pytest.approx(rows[-1]["loss"] ** 0.5)
    assert {"eval_mse", "eval_mae"} <= set(summary(run_dir)["eval"])


def test_an_unknown_task_option_is_refused_with_its_location(tmp_path):
    path = mlp_recipe(tmp_path, "bad", task={"name": "regression", "huber": 1.0})
    result = trainkit(tmp_path, "validate", str(path), timeout=60)
    assert result.returncode == 2 and "bad.yaml:" in result.output and "huber" in result.output, result.output
