"""`trainkit bench scaling`: the tool and its outputs (on 2 shared CPU cores a speedup means nothing,
so none is asserted): a table row per world size, a PNG plot, MLflow artifacts, and the same for a
hand-written torchrun script."""

from __future__ import annotations

import pytest
import json
from pathlib import Path

from run_helpers import mlp_recipe, trainkit

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)


REPO = Path(__file__).resolve().parent.parent


def test_scaling_of_a_recipe_writes_table_plot_and_mlflow_artifacts(tmp_path):
    path = mlp_recipe(tmp_path, "tiny", tracking={"enabled": True, "experiment": "scaling-test"})
    result = trainkit(tmp_path, "bench", "scaling", str(path), "--nproc", "1,2", "--steps", "6", "--warmup", "2",
                      "--reference", "1:1,2:1.8,4:3.5", "--reference-label", "source")
    assert result.returncode == 0, result.output[-4000:]
    out = tmp_path / "runs" / "tiny-scaling"
    data = json.loads((out / "scaling.json").read_text())
    assert [p["nproc"] for p in data["points"]] == [1, 2]
    assert [p["global_batch"] for p in data["points"]] == [8, 16]  # weak scaling: 8 per process
    assert data["points"][0]["speedup"] == 1.0 and all(p["samples_per_s"] > 0 for p in data["points"])
    assert "| 2 | 16 |" in (out / "scaling.md").read_text() and "efficiency" in result.stdout
    assert (out / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name("scaling-test").experiment_id])[0]
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id, "scaling")) == \
        ["scaling/scaling.json", "scaling/scaling.md", "scaling/scaling.png"]


def test_scaling_of_a_hand_written_script(tmp_path):
    result = trainkit(tmp_path, "bench", "scaling", "--script", str(REPO / "bench" / "plain_ddp.py"), "--nproc", "1",
                      "--steps", "5", "--warmup", "1", "--batch", "8", "--no-mlflow", "--out", str(tmp_path / "out"),
                      PYTHONPATH=str(REPO))
    assert result.returncode == 0, result.output[-4000:]
    assert json.loads((tmp_path / "out" / "scaling.json").read_text())["points"][0]["global_batch"] == 8
    assert (tmp_path / "out" / "scaling.png").is_file()


def test_recipe_or_script_not_both(tmp_path):
    result = trainkit(tmp_path, "bench", "scaling", "--nproc", "1")
    assert result.returncode == 2 and "RECIPE or --script" in result.stderr
