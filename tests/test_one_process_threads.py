"""A world-size-1 run trains inside the launcher's process, beside its MLflow delivery thread: its
intra-op threads leave that thread a core (runtime/threads.py says why: on 2 shared cores a
one-process run with `log_every: 1` was 15x slower than with `log_every: 10`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from run_helpers import LAUNCH_TIMEOUT_S, env_for, mlp_recipe, summary
from trainkit.runtime import threads


pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)


def launch_without_omp_setting(tmp, recipe) -> subprocess.CompletedProcess:
    """`trainkit run` as a user runs it: OMP_NUM_THREADS unset (the test helpers set it to 1)."""
    env = env_for(tmp)
    env.pop("OMP_NUM_THREADS")
    proc = subprocess.Popen([sys.executable, "-m", "trainkit.cli", "run", str(recipe)], cwd=tmp, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def torch_default_threads(tmp) -> int:
    """The intra-op pool torch gives a process of this machine when OMP_NUM_THREADS is unset."""
    if not os.environ.get("OMP_NUM_THREADS"):  # this process's own pool is that default
        import torch

        return torch.get_num_threads()
    env = env_for(tmp)
    env.pop("OMP_NUM_THREADS")
    res = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                         capture_output=True, text=True, timeout=120)
    return int(res.stdout)


@pytest.mark.skipif(threads.usable_cores() < 2, reason="one core: nothing to leave")
def test_a_tracked_one_process_run_leaves_the_delivery_thread_a_core(tmp_path):
    """Guards the fix (remove the launcher's `sharing_the_launcher_process` and the summary says
    torch's default, a thread per core): the run's summary records a core left, and the run is
    delivered to MLflow."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    recipe = mlp_recipe(tmp_path, "one-proc", launch={"nproc_per_node": 1}, trainer={"max_steps": 4},
                        tracking={"enabled": True, "experiment": "threads", "uri": uri})
    res = launch_without_omp_setting(tmp_path, recipe)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "in-process" in res.stdout
    default = torch_default_threads(tmp_path)
    assert default >= 2, "torch's default pool on this machine has nothing to leave"
    assert summary(tmp_path / "runs" / "one-proc")["intra_op_threads"] == min(default, threads.usable_cores() - 1)
    assert "FINISHED" in res.stdout


def test_the_users_omp_num_threads_is_kept(monkeypatch):
    """OMP_NUM_THREADS is the user's choice: the pool is left alone; without a delivery thread too."""
    import torch

    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", str(before))
    with threads.sharing_the_launcher_process(delivering=True) as changed:
        assert changed is None and torch.get_num_threads() == before
    monkeypatch.delenv("OMP_NUM_THREADS")
    with threads.sharing_the_launcher_process(delivering=False) as changed:
        assert changed is None and torch.get_num_threads() == before


@pytest.mark.parametrize("affinity, ranks, expected", [(range(64), 8, 8), (range(2), 8, 1), (range(3), 2, 1)])
def test_workers_share_the_cores_this_process_may_run_on_not_the_hosts(monkeypatch, affinity, ranks, expected):
    """Under Slurm the step may run on fewer cores than the host has (its CPUs bound): the launcher's
    OMP_NUM_THREADS for its ranks divides those (the script no longer sets it to every CPU per rank).
    In-process: the file's mark says slow for its launches; this one starts nothing."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(affinity))
    monkeypatch.setattr(os, "cpu_count", lambda: 256)
    assert threads.per_rank(ranks) == expected
