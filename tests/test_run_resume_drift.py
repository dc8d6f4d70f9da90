"""Recipe drift on resume and relaunching a finished run (issue 10, finding 5): real `trainkit run`."""

from __future__ import annotations

import pytest
import json

from mlflow.tracking import MlflowClient

from run_helpers import mlp_recipe, trainkit


pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)


def _snapshot(run_dir) -> dict:
    """Content and mtime of what a relaunch must not touch."""
    files = [run_dir / "summary.json", run_dir / "reports" / "bottleneck.md", run_dir / "metrics.jsonl"]
    return {str(f): (f.read_bytes(), f.stat().st_mtime_ns) for f in files} | {
        "launches": sorted(p.name for p in (run_dir / "launches").iterdir())}


def test_finished_relaunch_is_a_no_op_drift_is_refused_and_accepted_changes_take_effect(tmp_path):
    """Guards: (1) a finished run relaunched (also with a safe change) prints "already complete" and
    exits 0 without touching summary/reports/metrics or the MLflow status; (2) a changed lr is refused
    with exit 2 and a key-by-key diff, nothing written; (3) --accept-changes makes the new lr real from
    the resumed step and continues in a new MLflow run whose params say so, linked to the old one."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    recipe = mlp_recipe(tmp_path, "drifty", optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9},
                        trainer={"max_steps": 6, "log_every": 1, "checkpoint": {"every": 3, "keep": 2}},
                        tracking={"experiment": "tests", "uri": uri, "enabled": True})
    run_dir = tmp_path / "runs" / "drifty"
    assert trainkit(tmp_path, "run", str(recipe)).returncode == 0
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("tests").experiment_id
    (first,) = client.search_runs([exp])
    before = _snapshot(run_dir)

    again = trainkit(tmp_path, "run", str(recipe), "data.num_workers=1")
    assert again.returncode == 0, again.output
    assert "already complete" in again.output
    assert _snapshot(run_dir) == before
    now = client.get_run(first.info.run_id)
    assert now.info.status == "FINISHED" and now.info.end_time == first.info.end_time

    refused = trainkit(tmp_path, "run", str(recipe), "optimizer.lr=0.003", "trainer.max_steps=10")
    assert refused.returncode == 2, refused.output
    assert "optimizer.lr: 0.1 -> 0.003" in refused.output and "--accept-changes" in refused.output
    assert "name=drifty-2" in refused.output
    assert _snapshot(run_dir) == before

    accepted = trainkit(tmp_path, "run", str(recipe), "optimizer.lr=0.003", "trainer.max_steps=10",
                        "--accept-changes")
    assert accepted.returncode == 0, accepted.output
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert {r["lr"] for r in rows if r["step"] <= 6} == {0.1} and {r["lr"] for r in rows if r["step"] > 6} == {0.003}
    runs = client.search_runs([exp])
    assert len(runs) == 2
    new = next(r for r in runs if r.info.run_id != first.info.run_id)
    old = client.get_run(first.info.run_id)
    assert new.data.params["optimizer.lr"] == "0.003" and old.data.params["optimizer.lr"] == "0.1"
    assert new.data.tags["trainkit.previous_run"] == old.info.run_id
    assert old.data.tags["trainkit.superseded_by"] == new.info.run_id and old.info.status == "KILLED"
    assert "optimizer.lr" in old.data.tags["trainkit.status_reason"]
    assert new.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(new.info.run_id, "train/loss")] == list(range(1, 11))


def test_a_schedule_that_decays_over_max_steps_refuses_a_new_max_steps(tmp_path):
    """Guards the max_steps rule: with a cosine schedule, extending max_steps would jump the lr, so it is
    drift (with the reason); with the default constant schedule the same change resumes (see above)."""
    recipe = mlp_recipe(tmp_path, "cosine", scheduler={"name": "cosine"},
                        trainer={"max_steps": 4, "log_every": 2, "checkpoint": {"every": 4, "keep": 1}},
                        launch={"nproc_per_node": 1, "run_dir": str(tmp_path / "runs"), "timeout_s": 60})
    assert trainkit(tmp_path, "run", str(recipe)).returncode == 0
    longer = trainkit(tmp_path, "run", str(recipe), "trainer.max_steps=8")
    assert longer.returncode == 2, longer.output
    assert "trainer.max_steps: 4 -> 8" in longer.output and "learning rate jump" in longer.output


def test_docs_list_exactly_the_safe_keys():
    """The safe-key list lives in one place (recipe/drift.py); docs/running.md must show the same keys."""
    from pathlib import Path

    from trainkit.recipe.drift import SAFE_KEYS

    text = (Path(__file__).resolve().parent.parent / "docs" / "running.md").read_text()
    section = text[text.index("## Recipe changes on resume"):text.index("## Non-finite values")]
    listed = [line[3:-1] for line in section.splitlines() if line.startswith("- `") and line.endswith("`")]
    assert listed == list(SAFE_KEYS)
