"""`trainkit run ... | head -3` trains to the end (issue 38 #13): the reader of the progress lines leaves
after three of them; rank 0 (which prints progress) and the launcher (which prints its own lines) then
write into a closed pipe. Before, rank 0 died of BrokenPipeError, the restart met the same pipe and the
run ended FAILED with two MLflow runs. Asserted: one launch, every step logged once, the summary
written, and the MLflow store holds one FINISHED run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from run_helpers import env_for, mlp_recipe

pytestmark = pytest.mark.distributed


def test_run_piped_into_head_trains_to_the_end(tmp_path):
    steps = 12
    path = mlp_recipe(tmp_path, "piped", trainer={"max_steps": steps, "log_every": 1, "checkpoint": {"every": 6}},
                      launch={"max_restarts": 1}, tracking={"enabled": True, "experiment": "piped"})
    command = f"{sys.executable} -m trainkit.cli run {path} | head -3"
    env = env_for(tmp_path, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db")
    proc = subprocess.Popen(["sh", "-c", command], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert len(out.splitlines()) <= 3, out
    run_dir = tmp_path / "runs" / "piped"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), (rows, err[-3000:])
    assert (run_dir / "summary.json").is_file(), err[-3000:]
    assert len(list((run_dir / "launches").iterdir())) == 1

    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("piped").experiment_id])
    assert [r.info.status for r in runs] == ["FINISHED"], [(r.info.run_name, r.info.status) for r in runs]
