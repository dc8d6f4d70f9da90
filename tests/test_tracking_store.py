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


@pytest.mark.slow  # run tags ask git for the commit
@pytest.mark.parametrize("first", ["node 0", "node 1"])
def test_two_nodes_sharing_a_run_directory_make_one_run_at_once_whichever_comes_first(tmp_path, monkeypatch, first):
    """A job's later node waits for the first node's run (up to 60 s, as the launcher passes it). On a
    run directory both nodes share, the later node once waited *inside* the spool's delivery when it
    reached the spool first: the first node could not deliver, and the job started a minute late (the
    k8s pod test took 75 s instead of 17). Now either order makes one RUNNING run within seconds."""
    import threading
    import time

    recipe = tmp_path / "job.yaml"
    recipe.write_text(yaml.safe_dump({**RECIPE, "tracking": {"experiment": "job",
                                                             "uri": f"sqlite:///{tmp_path}/mlflow.db"}}))
    monkeypatch.chdir(tmp_path)
    resolved = resolve(Path("job.yaml"))
    shared = tmp_path / "runs" / "store"
    shared.mkdir(parents=True)
    wheres: dict[int, str] = {}

    def node(rank: int) -> None:
        wheres[rank] = open_run(resolved, shared, shared / f"launch-{rank}", environment={}, job="pytorchjob:tk",
                                wait_s=0.0 if rank == 0 else 60.0)

    order = [0, 1] if first == "node 0" else [1, 0]
    start = time.monotonic()
    threads = [threading.Thread(target=node, args=(order[0],))]
    threads[0].start()
    time.sleep(1.5)  # the first one is in (or waiting) before the other comes
    threads.append(threading.Thread(target=node, args=(order[1],)))
    threads[1].start()
    for t in threads:
        t.join(90)
    took = time.monotonic() - start
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("job").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "RUNNING", [(r.info.run_id, r.info.status) for r in runs]
    assert all(runs[0].info.run_id in wheres[r] for r in (0, 1)), wheres
    assert took < 15, f"the nodes waited {took:.0f} s for each other"


def test_the_closing_link_to_a_tracking_server_opens_the_run_in_the_training_view(tmp_path):
    """Issue 38 #17: MLflow 3 opens the GenAI view unless the link asks for the model-training one
    (`workflowType=machine_learning`, kept by the UI across its pages). The last line of a run names
    the run's own page with it, and no credentials of the server's URI."""
    from trainkit.tracking.spool import Spool

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({**RECIPE, "tracking": {"uri": "http://user:pw@mlflow.example:5000/"}}))
    run_dir = tmp_path / "runs" / "store"
    spool = Spool(run_dir)
    spool.append([{"op": "create", "uri": "http://user:pw@mlflow.example:5000/", "experiment": "e", "key": "k",
                   "run_name": "store", "ts": 0, "tags": {}}])
    assert "open http://mlflow.example:5000/#/experiments?workflowType=machine_learning" in \
        next_steps(resolve(recipe).recipe, run_dir, tracked=True)  # not delivered yet: the server's root
    spool.save_state({**spool.state(), "run_id": "abc123", "experiment_id": "7"})
    line = next_steps(resolve(recipe).recipe, run_dir, tracked=True).splitlines()[-1]
    assert "open http://mlflow.example:5000/#/experiments/7/runs/abc123?workflowType=machine_learning" in line, line
    assert "pw" not in line and "user" not in line
