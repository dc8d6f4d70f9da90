"""Reading runs back: `trainkit runs`, `trainkit compare`, `trainkit sync`, and the optional model
and checkpoint artifacts."""

from __future__ import annotations

import pytest
import torch
from mlflow.tracking import MlflowClient

from run_helpers import mlp_recipe, trainkit
from trainkit.tracking.delivery import deliver
from trainkit.tracking.spool import Spool

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two")
    uri = f"sqlite:///{tmp}/mlflow.db"
    for name, lr, extra in (("lr-a", 0.1, {"log_model": True, "log_checkpoints": True}), ("lr-b", 0.05, {})):
        recipe = mlp_recipe(tmp, name, optimizer={"name": "sgd", "lr": lr, "momentum": 0.9},
                            tracking={"experiment": "cmp", "uri": uri, "enabled": True, **extra})
        result = trainkit(tmp, "run", str(recipe))
        assert result.returncode == 0, result.output
    return tmp, uri


def test_runs_lists_both_and_compare_shows_what_differs(two_runs):
    tmp, uri = two_runs
    listing = trainkit(tmp, "runs", "--uri", uri)
    assert listing.returncode == 0, listing.output
    assert "lr-a" in listing.stdout and "lr-b" in listing.stdout and listing.stdout.count("FINISHED") == 2
    cmp = trainkit(tmp, "compare", "lr-a", "lr-b", "--uri", uri)
    assert cmp.returncode == 0, cmp.output
    lr_row = next(line for line in cmp.stdout.splitlines() if line.startswith("optimizer.lr"))
    assert lr_row.split()[1:] == ["0.1", "0.05"]
    assert any(line.startswith("loss (final)") for line in cmp.stdout.splitlines())
    assert "compare-runs?runs=" in cmp.stdout
    missing = trainkit(tmp, "compare", "nope", "--uri", uri)
    assert missing.returncode == 2 and "no run matches 'nope'" in missing.stderr


def test_log_model_and_log_checkpoints_store_a_loadable_model(two_runs):
    tmp, uri = two_runs
    import mlflow.pytorch

    client = MlflowClient(uri)
    run = next(r for r in client.search_runs([client.get_experiment_by_name("cmp").experiment_id])
               if r.info.run_name == "lr-a")
    assert [a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")] == ["checkpoints/step-00000012"]
    local = client.download_artifacts(run.info.run_id, "model", str(tmp / "dl"))
    model = mlflow.pytorch.load_model(local)
    saved = torch.load(tmp / "runs" / "lr-a" / "checkpoints" / "step-00000012" / "model.pt", weights_only=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())


def test_sync_delivers_what_an_unreachable_store_left_in_the_spool(tmp_path):
    (tmp_path / "later").write_text("")  # a file where the store's folder should be: unreachable store
    uri = f"sqlite:///{tmp_path}/later/mlflow.db"
    run_dir = tmp_path / "run"
    spool = Spool(run_dir)
    spool.append([{"op": "create", "uri": uri, "experiment": "sync", "run_name": "offline", "ts": 1, "tags": {}}])
    spool.append([{"op": "metric", "key": "loss", "value": 1.0 / s, "ts": s, "step": s} for s in range(1, 6)])
    pending, error = deliver(run_dir)
    assert pending == 6 and error
    (tmp_path / "later").unlink()
    (tmp_path / "later").mkdir()  # the store is back
    mixed = trainkit(tmp_path, "sync", str(run_dir), str(tmp_path / "nothing-here"))
    assert mixed.returncode == 2 and "nothing-here has no tracking spool" in mixed.stderr
    assert spool.pending_count() == 6  # a bad folder in the list: nothing is delivered, not half of it
    result = trainkit(tmp_path, "sync", str(run_dir))
    assert result.returncode == 0, result.output
    client = MlflowClient(uri)
    assert [m.step for m in client.get_metric_history(spool.state()["run_id"], "loss")] == [1, 2, 3, 4, 5]
    again = trainkit(tmp_path, "sync", str(tmp_path / "nothing-here"))
    assert again.returncode == 2 and "has no tracking spool" in again.stderr


def test_ui_serves_the_store_on_loopback(tmp_path):
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "trainkit.cli", "ui", "--uri", f"sqlite:///{tmp_path}/m.db",
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().startswith(f"MLflow UI for sqlite:///{tmp_path}/m.db: http://127.0.0.1:{port}")
        deadline = time.monotonic() + 90
        while True:
            try:
                assert urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "the UI never came up"
                time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def test_tracking_commands_answer_bad_input_with_a_message(tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    res = trainkit(tmp_path, "sync", str(a_file))
    assert res.returncode == 2 and "has no tracking spool" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "typo").exists()
    res = trainkit(tmp_path, "sync", str(tmp_path / "typo"))
    assert res.returncode == 2 and not (tmp_path / "typo").exists()  # looking creates nothing
    res = trainkit(tmp_path, "runs", "--uri", f"sqlite:///{tmp_path}/none.db")
    assert res.returncode == 1 and "no MLflow store at" in res.stderr and not (tmp_path / "none.db").exists()
    (tmp_path / "run" / "reports").mkdir(parents=True)
    (tmp_path / "run" / "reports" / "breakdown.json").write_text('{"per_rank": [')
    res = trainkit(tmp_path, "report", str(tmp_path / "run"))
    assert res.returncode == 1 and "is not valid JSON" in res.stderr and "Traceback" not in res.stderr


def test_the_compare_link_names_every_experiment_of_its_runs(tmp_path):
    """Issue 27: runs from two experiments gave a link listing only the first experiment, and the UI
    answered "Runs were not found". In-process: two runs made with MLflow's client, no launch."""
    from trainkit.tracking.browse import compare

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    ids = [client.create_experiment(name) for name in ("exp-a", "exp-b")]
    for exp, name in zip(ids, ("run-a", "run-b")):
        run = client.create_run(exp, run_name=name)
        client.log_param(run.info.run_id, "optimizer.lr", name)
        client.set_terminated(run.info.run_id)
    out = compare(["run-a", "run-b"], uri=uri)
    link = next(line for line in out.splitlines() if "compare-runs" in line)
    assert f'experiments=["{ids[0]}","{ids[1]}"]' in link, link
