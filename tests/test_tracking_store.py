"""One embedded MLflow store per project (issue 27): runs started from different folders of a
project land in the store at the project's root (the git repository holding the recipe), and
`trainkit runs` / `trainkit ui` started in any of its folders, and the link a run prints, read that
store. An explicit `tracking.uri` or MLFLOW_TRACKING_URI still wins.

In-process against a real SQLite store: the launcher's own `open_run` creates each run (what
`trainkit run` does before any worker starts), the CLI's `main` lists them.
"""

from __future__ import annotations

import pytest

from pathlib import Path

import yaml
from mlflow.tracking import MlflowClient

from trainkit.cli import main
from trainkit.launch.next_steps import next_steps
from trainkit.recipe import resolve
from trainkit.tracking import browse
from trainkit.tracking.run import open_run, tracking_uri

RECIPE = {"name": "store", "model": {"name": "mlp"}, "data": {"name": "synthetic", "batch_size": 8},
          "trainer": {"max_steps": 2}, "strategy": {"name": "ddp"}, "tracking": {"experiment": "store-test"}}


def project(tmp_path: Path) -> tuple[Path, Path]:
    """A git repository (a `.git` folder is what marks it) with a recipe under recipes/."""
    root = tmp_path / "project"
    (root / ".git").mkdir(parents=True)
    (root / "recipes").mkdir()
    (root / "notebooks").mkdir()
    recipe = root / "recipes" / "mlp.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    return root, recipe


@pytest.mark.slow
def test_runs_started_from_two_folders_land_in_the_projects_one_store(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root, recipe = project(tmp_path)
    store = root / "mlflow.db"
    for folder, name in ((root, "from-the-root"), (root / "recipes", "from-recipes")):
        monkeypatch.chdir(folder)
        resolved = resolve(Path(recipe.relative_to(folder)), [f"name={name}"])
        run_dir = folder / "runs" / name
        where = open_run(resolved, run_dir, run_dir / "launch-0", environment={})
        assert f"sqlite:///{store}" in where
        assert f"trainkit ui --uri sqlite:///{store}" in next_steps(resolved.recipe, run_dir, tracked=True)
    assert not (root / "recipes" / "mlflow.db").exists()
    client = MlflowClient(f"sqlite:///{store}")
    experiment = client.get_experiment_by_name("store-test")
    assert {r.info.run_name for r in client.search_runs([experiment.experiment_id])} == {"from-the-root",
                                                                                         "from-recipes"}

    monkeypatch.chdir(root / "notebooks")  # a third folder of the project: the same store
    capsys.readouterr()
    assert main(["runs"]) == 0
    listing = capsys.readouterr().out
    assert "from-the-root" in listing and "from-recipes" in listing
    served = []
    monkeypatch.setattr("trainkit.tracking.ui_server.serve", lambda cmd, health, announce: served.append(cmd) or 0)
    monkeypatch.setattr("trainkit.tracking.ui_server.bind_problem", lambda host, port: None)  # 5999 free or not
    assert main(["ui", "--port", "5999"]) == 0
    assert served and served[0][served[0].index("--backend-store-uri") + 1] == f"sqlite:///{store}"


def test_an_explicit_uri_or_mlflow_tracking_uri_wins_and_outside_a_project_the_folder_keeps_its_store(
        tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root, recipe = project(tmp_path)
    monkeypatch.chdir(root / "notebooks")
    explicit = f"sqlite:///{tmp_path}/explicit.db"
    assert tracking_uri(resolve(recipe, [f"tracking.uri={explicit}"]).recipe, recipe) == explicit
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/env.db")
    assert tracking_uri(resolve(recipe).recipe, recipe) == f"sqlite:///{tmp_path}/env.db"
    assert browse.default_uri() == f"sqlite:///{tmp_path}/env.db"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    elsewhere = tmp_path / "scratch"
    elsewhere.mkdir()
    lone = elsewhere / "lone.yaml"  # no repository above it (tmp_path is outside any)
    lone.write_text(yaml.safe_dump(RECIPE))
    assert tracking_uri(resolve(lone).recipe, lone) == f"sqlite:///{root}/mlflow.db"  # the current folder's project
    monkeypatch.setenv("TRAINKIT_RECIPE_ROOT", str(tmp_path))  # names the project, as for `defaults:`
    assert tracking_uri(resolve(recipe).recipe, recipe) == f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.delenv("TRAINKIT_RECIPE_ROOT")
    monkeypatch.chdir(elsewhere)
    assert tracking_uri(resolve(lone).recipe, lone) == f"sqlite:///{elsewhere}/mlflow.db"
