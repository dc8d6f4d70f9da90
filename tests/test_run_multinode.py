"""Multi-node rendezvous on one machine: two `trainkit run` agents (one process each) meet through
torchrun's c10d rendezvous at launch.rdzv_endpoint, train as one 2-rank group on a shared run
directory, and make one MLflow run."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from mlflow.tracking import MlflowClient

from run_helpers import env_for, mlp_recipe, summary

pytestmark = pytest.mark.distributed


def test_two_agents_rendezvous_into_one_group_and_one_run(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    recipe = mlp_recipe(tmp_path, "two-nodes", launch={"nproc_per_node": 1, "nnodes": 2,
                                                        "rdzv_endpoint": f"127.0.0.1:{port}", "rdzv_id": "t"},
                        tracking={"experiment": "mn", "uri": uri, "enabled": True})
    agents = []
    for _ in range(2):
        agents.append(subprocess.Popen([sys.executable, "-m", "trainkit.cli", "run", str(recipe)], cwd=tmp_path,
                                       env=env_for(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True, start_new_session=True))
        time.sleep(1.0)
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=180)[0])
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
    assert [a.returncode for a in agents] == [0, 0], "\n---\n".join(outputs)
    s = summary(tmp_path / "runs" / "two-nodes")
    assert s["world_size"] == 2 and s["steps"] == 12 and s["replicas_identical"]
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("mn").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
