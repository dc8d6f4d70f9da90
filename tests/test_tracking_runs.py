"""MLflow tracking through real `trainkit run` launches (2 gloo ranks), read back with MlflowClient:
one run per job (a resume that rewinds nothing continues it; one that rewinds opens a linked new run), params/tags/metrics/artifacts,
the final status, and every point delivered exactly once across a tracking-server outage."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from run_helpers import env_for, free_port, mlp_recipe, start_mlflow_server, stop_mlflow_server, trainkit

pytestmark = pytest.mark.distributed


def tracked(tmp: Path, name: str, uri: str, **sections) -> Path:
    return mlp_recipe(tmp, name, tracking={"experiment": "tests", "uri": uri, "enabled": True}, **sections)


def only_run(uri: str):
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("tests")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return client, runs[0]


def steps(client, run, key="train/loss") -> list[int]:  # trainkit's `loss` in MLflow (tracking/metric_names.py)
    return [m.step for m in client.get_metric_history(run.info.run_id, key)]


def test_one_run_with_params_tags_metrics_artifacts_on_the_embedded_store(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    result = trainkit(tmp_path, "run", str(tracked(tmp_path, "tracked", uri)))
    assert result.returncode == 0, result.output
    client, run = only_run(uri)
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["trainer.checkpoint.every"] == "4" and params["model.args.hidden"] == "64"
    assert params["strategy.name"] == "ddp" and params["data.shape"] == "[3, 4, 4]"
    tags = run.data.tags
    assert tags["strategy"] == "ddp" and tags["world_size"] == "2" and tags["precision"] == "fp32"
    assert tags["torch"].startswith("2.") and tags["trainkit.version"] and tags["hostname"]
    assert steps(client, run) == list(range(1, 13))  # log_every 1, each step once, in order
    assert {"train/lr", "train/step/samples_per_s"} <= set(run.data.metrics)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"recipe.yaml", "summary.json", "launches"} <= artifacts


def rows_per_key_step(db: Path) -> dict:
    """(run, key, step) -> how many values mlflow.db holds (read straight from the store's table)."""
    with sqlite3.connect(db) as con:
        return {(r, k, s): n for r, k, s, n in
                con.execute("SELECT run_uuid, key, step, COUNT(*) FROM metrics GROUP BY run_uuid, key, step")}


def test_a_restart_that_rewinds_continues_in_a_new_linked_run_with_one_value_per_step(tmp_path):
    """Guards "one value per (key, step)": rank 1 dies after step 7, the restart resumes from step 4 and
    redoes 5..7. The dead attempt's run ends KILLED, superseded; the job's current run holds steps 1..12
    exactly once (1..4 copied, the rest trained), linked by trainkit tags; metrics.jsonl has each step
    once and the dead attempt's lines set aside. A later resume that rewinds nothing keeps the run."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    recipe = tracked(tmp_path, "resumed", uri, launch={"max_restarts": 1})
    first = trainkit(tmp_path, "run", str(recipe), TRAINKIT_FAULT_INJECT="rank=1,step=7")
    assert first.returncode == 0, first.output
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert len(runs) == 2, [r.info.run_id for r in runs]
    current = next(r for r in runs if "trainkit.superseded_by" not in r.data.tags)
    old = next(r for r in runs if "trainkit.superseded_by" in r.data.tags)
    assert current.info.status == "FINISHED" and old.info.status == "KILLED"
    assert old.data.tags["trainkit.superseded_by"] == current.info.run_id
    assert current.data.tags["trainkit.previous_run"] == old.info.run_id
    assert current.data.params == old.data.params
    # the link where the UI shows it (issue 38 #16): each description names the other run, and the console
    assert current.data.tags["mlflow.note.content"].startswith(f"Continues run {old.info.run_id}")
    assert "from step 4" in current.data.tags["mlflow.note.content"]
    assert old.data.tags["mlflow.note.content"].startswith(f"Superseded by run {current.info.run_id}")
    assert f"tracking: run {current.info.run_id} continues run {old.info.run_id}" in first.stdout, first.stdout
    assert steps(client, current) == list(range(1, 13))  # in order, each once
    assert not [k for k, n in rows_per_key_step(tmp_path / "mlflow.db").items() if n > 1]
    run_dir = tmp_path / "runs" / "resumed"
    assert [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())] == \
        list(range(1, 13))
    aside = list(run_dir.glob("metrics.rewound-*.jsonl"))
    assert len(aside) == 1 and [json.loads(x)["step"] for x in aside[0].read_text().splitlines()] == [5, 6, 7]
    listed = trainkit(tmp_path, "runs", "--uri", uri)
    assert listed.returncode == 0, listed.output
    assert f"continues {old.info.run_id[:8]}" in listed.stdout and old.info.run_id[:12] not in listed.stdout
    assert "1 superseded attempt(s) hidden" in listed.stdout
    everything = trainkit(tmp_path, "runs", "--uri", uri, "--all")
    assert f"superseded by {current.info.run_id[:8]}" in everything.stdout

    second = trainkit(tmp_path, "run", str(recipe), "trainer.max_steps=16")
    assert second.returncode == 0, second.output
    again = client.get_run(current.info.run_id)
    assert again.info.status == "FINISHED" and "trainkit.superseded_by" not in again.data.tags
    assert steps(client, again) == list(range(1, 17))
    assert len(client.search_runs([client.get_experiment_by_name("tests").experiment_id])) == 2


def test_a_failed_job_is_marked_failed_with_the_reason(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    result = trainkit(tmp_path, "run", str(tracked(tmp_path, "doomed", uri)), TRAINKIT_FAULT_INJECT="rank=1,step=3")
    assert result.returncode == 1
    _, run = only_run(uri)
    assert run.info.status == "FAILED"
    assert "rank 1" in run.data.tags["trainkit.status_reason"]


def test_sigterm_marks_the_run_killed(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    recipe = tracked(tmp_path, "stopped", uri, data={"sleep_ms": 20.0}, trainer={"max_steps": 1000, "log_every": 1})
    proc = subprocess.Popen([sys.executable, "-m", "trainkit.cli", "run", str(recipe)], cwd=tmp_path,
                            env=env_for(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        metrics = tmp_path / "runs" / "stopped" / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert time.monotonic() < deadline and proc.poll() is None, "training never started"
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "stopped by SIGTERM" in out
    _, run = only_run(uri)
    assert run.info.status == "KILLED"


# --------------------------------------------------------------------------- a real server, down at start and mid-run
def test_every_point_arrives_exactly_once_in_order_across_server_outages(tmp_path):
    """One run meets both outages a tracking server has: down when the run starts (the MLflow run is
    created late, when it comes up), then stopped mid-run and back. Training never waits for it; every
    point is kept in the run's spool meanwhile and arrives exactly once, in step order."""
    from trainkit.tracking.spool import Spool

    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = None
    recipe = tracked(tmp_path, "outage", uri, data={"sleep_ms": 15.0},  # ~0.12 s a step: ~29 s of training
                     trainer={"max_steps": 240, "log_every": 1, "checkpoint": {"every": 120, "keep": 2}})
    proc = subprocess.Popen([sys.executable, "-m", "trainkit.cli", "run", str(recipe)], cwd=tmp_path,
                            env=env_for(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    run_dir = tmp_path / "runs" / "outage"
    metrics = run_dir / "metrics.jsonl"

    def logged() -> int:
        return metrics.read_text().count("\n") if metrics.exists() else 0

    def wait_for(done, what: str, within: float = 120) -> None:
        deadline = time.monotonic() + within
        while not done():
            assert time.monotonic() < deadline and proc.poll() is None, what
            time.sleep(0.2)

    try:
        wait_for(lambda: logged() >= 10, "training never started")
        assert Spool(run_dir).pending_count() > 0  # down at start: kept locally
        server = start_mlflow_server(tmp_path, port)  # the server comes up ...
        client = MlflowClient(uri)
        wait_for(lambda: (exp := client.get_experiment_by_name("tests")) is not None and any(
            steps(client, r) for r in client.search_runs([exp.experiment_id])), "nothing delivered once the server was up")
        stop_mlflow_server(server)  # ... goes away mid-run ...
        server = None
        down_at = logged()
        time.sleep(3)
        assert proc.poll() is None, "training must go on while the server is down"
        assert logged() > down_at
        assert Spool(run_dir).pending_count() > 0  # kept locally meanwhile
        server = start_mlflow_server(tmp_path, port)  # ... and comes back (same store, same port)
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out
        client, run = only_run(uri)
        assert run.info.status == "FINISHED"
        assert steps(client, run) == list(range(1, 241))  # every point, exactly once, in step order
        assert Spool(run_dir).pending_count() == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if server is not None:
            stop_mlflow_server(server)
