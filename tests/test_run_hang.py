"""A hung rank is found, named and reported within launch.hang_timeout_s (issue 29): real `trainkit run`,
2 ranks, gloo, a rank made to stop progressing by tests/fault_injection.py (TRAINKIT_FAULT_HANG)."""

from __future__ import annotations

import pytest
import json
import os
import pickle
import subprocess
import sys
import threading
import time

import psutil
from mlflow.tracking import MlflowClient

from run_helpers import free_port, mlp_recipe, trainkit

from trainkit.runtime.checkpoint import newest_valid

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)


HANG_TIMEOUT_S = 5
COLLECTIVE_TIMEOUT_S = 90  # what ended such a run before: the hang must be declared long before it


def _recipe(tmp_path, name: str, **launch):
    return mlp_recipe(tmp_path, name, trainer={"max_steps": 40, "log_every": 2, "checkpoint": {"every": 4, "keep": 2}},
                      launch={"nproc_per_node": 2, "timeout_s": COLLECTIVE_TIMEOUT_S,
                              "hang_timeout_s": HANG_TIMEOUT_S, **launch},
                      tracking={"enabled": True})


def _mlflow_run(tmp_path, name: str):
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.search_runs([e.experiment_id for e in client.search_experiments()],
                             filter_string=f"tags.mlflow.runName = '{name}'")[0]
    return run, [a.path for a in client.list_artifacts(run.info.run_id, "reports")]


def _flight_recorder(run_dir) -> tuple[str, dict]:
    """hang.md's Flight Recorder section, and each rank's dump (fr_trace's input) by rank."""
    section = (run_dir / "reports" / "hang.md").read_text().split("## Flight Recorder", 1)[1].split("\n## ", 1)[0]
    dumps = {int(path.name.removeprefix("rank")): pickle.loads(path.read_bytes())
             for path in (run_dir / "reports" / "flight-recorder").glob("rank*")}
    return section, dumps


def _left_running(tmp_path) -> list:
    """Processes of this run still alive (the workers' command line names the run directory)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if str(tmp_path) in " ".join(proc.info["cmdline"] or ()) and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except psutil.Error:
            pass
    return found


def test_a_stopped_rank_is_named_with_its_state_before_the_collective_timeout(tmp_path):
    """Guards the watchdog and the report on a rank that cannot answer: rank 1 SIGSTOPs itself in the
    forward of step 6. Before, the run ended only at the collective timeout, blaming the rank killed last
    ("killed by SIGKILL"). Now the hang is declared after hang_timeout_s, reports/hang.md names rank 1 at
    step 6, forward, stopped (State T), the failure summary blames rank 1, nothing is left running, the
    step-4 checkpoint is intact, and the MLflow run is FAILED with the report and a tag."""
    recipe = _recipe(tmp_path, "stopped")
    started = time.monotonic()
    result = trainkit(tmp_path, "run", str(recipe), timeout=COLLECTIVE_TIMEOUT_S + 60,
                      TRAINKIT_FAULT_HANG="rank=1,step=6,where=forward,how=stop")
    took = time.monotonic() - started
    assert result.returncode == 1, result.output
    assert took < COLLECTIVE_TIMEOUT_S, f"{took:.0f} s: the collective timeout, not the hang watch, ended the run"
    run_dir = tmp_path / "runs" / "stopped"
    report = (run_dir / "reports" / "hang.md").read_text()
    assert report.startswith("# Hang: rank 1 is behind at step 6, forward"), report
    assert "State T" in report and "cannot answer" in report, report
    assert "## Rank 0 " in report and 'File "' in report, report  # rank 0's stacks were collected
    assert "rank 1 (pid" in result.stderr and "hung at step 6, forward" in result.stderr, result.output
    assert "killed by SIGKILL" not in result.output, result.output
    # Flight Recorder: rank 0's record fetched while it waits in the gradient all-reduce; rank 1 cannot answer
    section, dumps = _flight_recorder(run_dir)
    assert sorted(dumps) == [0] and "| 1 | no dump | its process is stopped" in section, section
    assert dumps[0]["entries"][-1]["profiling_name"] == "gloo:all_reduce", dumps[0]["entries"][-1]
    assert "missed FR dumps from ranks ({1})" in section, section  # fr_trace, allowing the missing rank
    assert not _left_running(tmp_path)
    assert newest_valid(run_dir / "checkpoints", warn=False).name == "step-00000004"
    run, artifacts = _mlflow_run(tmp_path, "stopped")
    assert run.info.status == "FAILED"
    assert "reports/hang.md" in artifacts, artifacts
    assert run.data.tags["trainkit.hang"].startswith("hang: no rank made progress"), run.data.tags


def test_a_rank_sleeping_in_backward_is_named_and_the_same_hang_twice_stops_restarts(tmp_path):
    """Guards naming the rank behind when every rank is at the same step and phase, and the restart
    policy: rank 1 sleeps inside the backward of step 6 on every attempt. Before, the run waited out the
    collective timeout and the restart blamed rank 0, the healthy rank that timed out waiting. Now each
    attempt's hang is declared after hang_timeout_s naming rank 1 in backward (its own code, while rank 0
    waits inside torch); the restart is announced as rank 1's hang, resumes from step 4, hangs the same
    way, and the launcher stops restarting and says so."""
    recipe = _recipe(tmp_path, "sleeper", max_restarts=2)
    started = time.monotonic()
    result = trainkit(tmp_path, "run", str(recipe), timeout=2 * COLLECTIVE_TIMEOUT_S,
                      TRAINKIT_FAULT_HANG="rank=1,step=6,where=backward,how=sleep")
    took = time.monotonic() - started
    assert result.returncode == 1, result.output
    assert took < COLLECTIVE_TIMEOUT_S, f"{took:.0f} s: the collective timeout, not the hang watch, ended the run"
    run_dir = tmp_path / "runs" / "sleeper"
    report = (run_dir / "reports" / "hang.md").read_text()
    assert report.startswith("# Hang: rank 1 is behind at step 6, backward"), report
    assert "fault_injection.py" in report and "its own code" in report, report
    # Flight Recorder: both ranks' records, fetched while rank 0's main thread was blocked in backward
    # (its stacks above) and rank 1's slept; torch's fr_trace names rank 1 missing from rank 0's last
    # collective: the gradient all-reduce of step 6 (one DDP bucket of the MLP's 7556 parameters)
    section, dumps = _flight_recorder(run_dir)
    last = dumps[0]["entries"][-1]
    assert sorted(dumps) == [0, 1] and last["profiling_name"] == "gloo:all_reduce", last
    assert last["input_sizes"] == [[7556]] and last["collective_seq_id"] > dumps[1]["entries"][-1]["collective_seq_id"]
    assert (f"- ranks {{1}} did not join gloo:all_reduce #{last['collective_seq_id']} of group 0:default_pg "
            f"(input sizes [[7556]])") in section, section
    assert f"Not all ranks joining collective, sequence number: {last['collective_seq_id']}" in section, section
    assert "has errors" not in section, section  # every collective before it matched on both ranks
    assert (f"trainkit: Flight Recorder: ranks {{1}} did not join gloo:all_reduce #{last['collective_seq_id']} "
            f"of group 0:default_pg") in result.stderr, result.output  # on the console too
    assert "restart 1: rank 1 hung at step 6, backward" in result.stderr, result.output
    assert "the same hang as the previous attempt" in result.stderr and "not restarting" in result.stderr, \
        result.output
    assert "restart 2" not in result.stderr, result.output
    assert not _left_running(tmp_path)
    assert newest_valid(run_dir / "checkpoints", warn=False).name == "step-00000004"
    run, artifacts = _mlflow_run(tmp_path, "sleeper")
    assert run.info.status == "FAILED" and "reports/hang.md" in artifacts, (run.info.status, artifacts)


def test_a_rank_whose_loader_worker_is_stuck_is_named_as_waiting_for_its_data(tmp_path):
    """Guards the data phase of the report: rank 1's DataLoader worker (num_workers 1) sleeps in
    __getitem__ for the batch of step 6. Before, the report showed only rank 1's main thread waiting in
    torch's queue: nothing said why or where the data was. Now hang.md names rank 1 behind at step 6,
    data, waiting for its data loader, with the worker's own stacks (faulthandler, registered by the
    loader's worker_init_fn) down to the stuck __getitem__; nothing is left running, the step-4
    checkpoint is intact."""
    recipe = mlp_recipe(tmp_path, "loader", trainer={"max_steps": 40, "log_every": 2,
                                                      "checkpoint": {"every": 4, "keep": 2}},
                        data={"num_workers": 1},
                        launch={"nproc_per_node": 2, "timeout_s": COLLECTIVE_TIMEOUT_S,
                                "hang_timeout_s": HANG_TIMEOUT_S})
    started = time.monotonic()
    result = trainkit(tmp_path, "run", str(recipe), timeout=COLLECTIVE_TIMEOUT_S + 60,
                      TRAINKIT_FAULT_HANG="rank=1,step=6,where=data")
    took = time.monotonic() - started
    assert result.returncode == 1, result.output
    assert took < COLLECTIVE_TIMEOUT_S, f"{took:.0f} s: the collective timeout, not the hang watch, ended the run"
    run_dir = tmp_path / "runs" / "loader"
    report = (run_dir / "reports" / "hang.md").read_text()
    assert report.startswith("# Hang: rank 1 is behind at step 6, data"), report
    assert "it waits for its data loader: a loader worker is in" in report and "hanging_getitem" in report, report
    assert "### Rank 1's DataLoader worker (pid" in report, report
    worker_section = report.split("### Rank 1's DataLoader worker", 1)[1]
    assert "fault_injection.py" in worker_section and "_worker_loop" in worker_section, worker_section
    section, _ = _flight_recorder(run_dir)  # rank 0 went on to the gradient all-reduce of step 6 without it
    assert "- ranks {1} did not join gloo:all_reduce #" in section and "(input sizes [[7556]])" in section, section
    assert "  Flight Recorder: ranks {1} did not join gloo:all_reduce #" in result.stderr, result.output  # the summary
    assert "rank 1 (pid" in result.stderr and "hung at step 6, data" in result.stderr, result.output
    assert not _left_running(tmp_path)
    assert newest_valid(run_dir / "checkpoints", warn=False).name == "step-00000004"


def test_a_loader_worker_removes_the_stacks_files_of_finished_workers(tmp_path):
    """Each epoch and evaluation starts new DataLoader workers, each with its own stacks file: a new
    worker (`progress_record.loader_worker_started`) removes those of this rank's finished ones (a dead pid), not a live worker's nor another
    rank's, so live/ does not fill with one file per worker per epoch."""
    import subprocess
    import sys

    from trainkit.run_dir import loader_stacks_path
    from trainkit.runtime import progress_record

    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout.strip()
    dead, live = loader_stacks_path(tmp_path, 1, finished), loader_stacks_path(tmp_path, 1, os.getpid())
    other_rank = loader_stacks_path(tmp_path, 0, finished)
    for path in (dead, live, other_rank):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
    import faulthandler
    from types import SimpleNamespace

    # what a rank's new DataLoader worker runs first (worker_init_fn), here in this process
    record = SimpleNamespace(run_dir=tmp_path, rank=1, loader_stacks=None)
    saved, progress_record._record = progress_record._record, record
    try:
        progress_record.loader_worker_started()
    finally:
        progress_record._record = saved
        faulthandler.unregister(progress_record.STACKS_SIGNAL)
        record.loader_stacks.close()
    assert not dead.exists() and live.exists() and other_rank.exists()


RANK_HOLDING_THE_GIL = """
import ctypes, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from trainkit.runtime import flight_recorder

rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=rank, world_size=2)
flight_recorder.start(rank)  # what progress_record.start does in a watched worker
mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))  # groups made after the start
writer = dist.new_group(backend="gloo")  # as the checkpoint writer makes its own
dist.all_reduce(torch.ones(3))
dist.all_reduce(torch.ones(6), group=mesh.get_group("tp"))
dist.all_reduce(torch.ones(7), group=writer)
print("ready", flush=True)
ctypes.PyDLL(None).sleep(120)  # libc's sleep, called holding the GIL: no Python code runs in this process
"""


def test_every_group_is_recorded_and_served_while_the_rank_holds_the_gil(tmp_path):
    """Guards the two claims the Flight Recorder section rests on, which the hang runs above cannot
    show (their groups are the world's only): groups made after the record started (the device mesh's,
    a new_group like the checkpoint writer's) are hooked too, and the record is served while the rank
    runs no Python at all (the server is torch's C++ thread; a Python handler would wait for the GIL,
    as it would for a main thread blocked in a collective). Two gloo ranks, then each holds the GIL."""
    from trainkit.launch.flight_recorder_dumps import _ask, for_analysis
    from trainkit.runtime.flight_recorder import SOCKETS_ENV, socket_path

    env = {**os.environ, SOCKETS_ENV: str(tmp_path), "TORCH_FR_BUFFER_SIZE": "2000"}
    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_HOLDING_THE_GIL, str(rank), port], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for rank in (0, 1)]
    deadline = threading.Timer(120, lambda: [proc.kill() for proc in ranks])  # never hangs the suite
    deadline.start()
    try:
        for proc in ranks:
            assert proc.stdout.readline().strip() == "ready"
        for rank in (0, 1):
            dump, left_out = for_analysis(json.loads(_ask(socket_path(tmp_path, rank), "fr_trace_json")), "gloo")
            recorded = [(dump["pg_config"][e["process_group"][0]]["desc"], e["input_sizes"]) for e in dump["entries"]]
            assert recorded == [("default_pg", [[3]]), ("mesh_tp", [[6]]), ("undefined", [[7]])], recorded
            assert all(e["profiling_name"] == "gloo:all_reduce" for e in dump["entries"]) and not left_out
    finally:
        deadline.cancel()
        for proc in ranks:
            proc.kill()
            proc.wait(timeout=30)


WITHOUT_THE_GROUP_REGISTRY = """
import sys
import torch, torch.distributed as dist
from torch.distributed import distributed_c10d
from trainkit.runtime import flight_recorder

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
del distributed_c10d._register_pg_in_world  # as in a torch without it (the hook and server came in 2.14)
flight_recorder.start(0)
t = torch.ones(2)
dist.all_reduce(t)
print("trained", t.tolist(), flush=True)
dist.destroy_process_group()
"""


def test_a_torch_without_the_flight_recorder_trains_on_with_a_warning(tmp_path):
    """The Flight Recorder rests on torch 2.14's hook, worker server and a private group registry
    (runtime.process_groups wraps it): a torch without the registry must not stop the run; the groups
    that exist are still recorded, and the warning says later ones are not."""
    from trainkit.runtime.flight_recorder import SOCKETS_ENV

    env = {**os.environ, SOCKETS_ENV: str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", WITHOUT_THE_GROUP_REGISTRY, str(free_port())], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "trained [1.0, 1.0]" in done.stdout
    assert "does not say when a process group is made" in done.stderr, done.stderr[-2000:]
