"""A short real run (one process, in-process launch): whole-run time accounting in the report and as
metrics, system metrics even for a run far shorter than the sampling interval, the verdict as MLflow
run tags on an experiment of the model-training kind, and `trainkit compare` showing verdicts."""

from __future__ import annotations

import pytest
import json

from mlflow.tracking import MlflowClient

from run_helpers import mlp_recipe, trainkit


pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)


def test_short_run_accounts_wall_time_logs_system_metrics_and_tags_the_verdict(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    recipe = mlp_recipe(tmp_path, "accounted", launch={"nproc_per_node": 1},
                        trainer={"max_steps": 30, "log_every": 10, "checkpoint": {"every": 1, "keep": 1}},
                        tracking={"experiment": "diag", "uri": uri, "enabled": True},
                        monitors=["system", "breakdown"])
    result = trainkit(tmp_path, "run", str(recipe))
    assert result.returncode == 0, result.output
    run_dir = tmp_path / "runs" / "accounted"
    report = (run_dir / "reports" / "bottleneck.md").read_text()
    assert "Where the wall time went:" in report
    for part in ("train", "eval", "checkpoint", "logging", "startup", "shutdown"):
        assert f"| {part} | " in report
    evidence = json.loads((run_dir / "reports" / "breakdown.json").read_text())
    wall = evidence["wall"]
    assert wall["checkpoints"] == 30 and wall["checkpoint_s"] > 0 and wall["startup_s"] > 0
    assert sum(wall[f"{p}_s"] for p in ("train", "eval", "checkpoint", "logging", "startup", "shutdown")) \
        <= wall["wall_s"] * 1.01
    assert evidence["env"]["device"] == "cpu" and evidence["env"]["backend"] == "gloo"

    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keys = set().union(*(r.get("metrics", r) for r in logged))
    assert {"time/train_share", "time/checkpoint_share", "time/startup_share"} <= keys
    assert any(k.startswith("system/node0/cpu_percent") for k in keys), sorted(keys)  # 30 steps, well under 5 s

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("diag")
    assert exp.tags.get("mlflow.experimentKind") == "custom_model_development"
    run = client.search_runs([exp.experiment_id])[0]
    verdict = json.loads((run_dir / "reports" / "verdict.json").read_text())
    assert run.data.tags["trainkit.bottleneck"] == verdict["kind"]
    assert run.data.tags["trainkit.advice.1"] == verdict["advice"][0]
    assert float(run.data.tags["trainkit.time.checkpoint_share"]) > 0
    found = client.search_runs([exp.experiment_id], filter_string=f"tags.`trainkit.bottleneck` = '{verdict['kind']}'")
    assert [r.info.run_id for r in found] == [run.info.run_id]

    compared = trainkit(tmp_path, "compare", run.info.run_id[:8], run.info.run_id[:8], "--uri", uri)
    assert compared.returncode == 0, compared.output
    assert f"bottleneck        {verdict['kind']}" in compared.stdout or "bottleneck " in compared.stdout
    assert "step ms" in compared.stdout and "wall: checkpoint" in compared.stdout
