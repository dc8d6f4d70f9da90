"""Run integrity under faults, through real `trainkit run` launches (2 gloo ranks or in-process):
one launch per run directory (RUN_DIR/launch.lock), workers that never outlive their launcher,
MLflow runs never left RUNNING by a dead launch, and the status edges of Ctrl-C and restarts."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

from run_helpers import env_for, mlp_recipe, trainkit, wait_for

pytestmark = pytest.mark.distributed


@pytest.fixture
def launches():
    """Start `trainkit run` in the background; every launcher and every worker is killed at teardown."""
    started: list[tuple[subprocess.Popen, Path]] = []

    def start(tmp: Path, recipe: Path, *args: str, **env: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "trainkit.cli", "run", str(recipe), *args], cwd=tmp,
                                env=env_for(tmp, **env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        started.append((proc, tmp))
        return proc

    yield start
    for proc, tmp in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        for p in workers_of(tmp):
            p.kill()


def workers_of(where: Path) -> list[psutil.Process]:
    """Live worker processes (ranks and their DataLoader workers) whose command line names `where`."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "trainkit.runtime.worker" in cmd and str(where) in cmd and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(p)
    return found


def the_run(uri: str, experiment: str = "integrity"):
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return runs[0]


def tracked(tmp: Path, name: str, **sections) -> tuple[Path, str]:
    uri = f"sqlite:///{tmp}/mlflow.db"
    return mlp_recipe(tmp, name, tracking={"experiment": "integrity", "uri": uri, "enabled": True},
                      **sections), uri


def lock_file(tmp: Path, name: str, **holder) -> Path:
    """A launch.lock as a launch on this host would write it; `holder` overrides fields."""
    run_dir = tmp / "runs" / name
    run_dir.mkdir(parents=True, exist_ok=True)
    me = psutil.Process()
    data = {"host": socket.gethostname(), "pid": me.pid, "start_time": me.create_time(),
            "boot_time": psutil.boot_time(), "since": time.time() - 30, "heartbeat": time.time(), "job": None,
            "launch": "feedface", "argv": "trainkit run old.yaml"}
    data.update(holder)
    (run_dir / "launch.lock").write_text(json.dumps(data))
    return run_dir


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# --------------------------------------------------------------------------- launcher death
def test_a_sigkilled_launcher_takes_its_workers_along_and_its_run_is_not_left_running(tmp_path, launches):
    """Guards issue 10's orphans: SIGKILL of `trainkit run` used to leave both ranks (each a session
    leader of its own) and their DataLoader workers training, the MLflow run RUNNING forever, and a
    rerun racing them in the same folder. Now every worker is gone within 10 s, `trainkit sync`
    closes the run KILLED with the reason, and an immediate rerun takes over the lock and resumes."""
    recipe, uri = tracked(tmp_path, "killed", data={"num_workers": 1},
                          trainer={"max_steps": 400, "checkpoint": {"every": 4, "keep": 2}})
    run_dir = tmp_path / "runs" / "killed"
    launcher = launches(tmp_path, recipe, TRAINKIT_FAULT_DELAY="rank=0,ms=150")
    wait_for(lambda: (run_dir / "checkpoints" / "step-00000004" / "meta.json").is_file(), 180, "a checkpoint")
    workers = workers_of(run_dir)
    assert len(workers) >= 4, [w.cmdline() for w in workers]  # 2 ranks + a DataLoader worker each
    os.kill(launcher.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    launcher.wait()  # not communicate(): orphaned workers would hold its pipes open
    wait_for(lambda: not workers_of(run_dir), 10, "every worker to exit after the launcher was SIGKILLed")
    assert time.monotonic() - killed_at <= 10

    synced = trainkit(tmp_path, "sync", str(run_dir), timeout=120)
    assert synced.returncode == 0, synced.output
    assert "died without closing" in synced.stdout
    run = the_run(uri)
    assert run.info.status == "KILLED"
    assert run.data.tags["trainkit.status_reason"] == "launcher died without closing the run"

    rerun = trainkit(tmp_path, "run", str(recipe), "trainer.max_steps=12")
    assert rerun.returncode == 0, rerun.output
    assert "took over the lock of a previous launch" in rerun.stderr and "is gone" in rerun.stderr
    assert "resumed from" in rerun.stdout
    again = the_run(uri)
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    assert not (run_dir / "launch.lock").exists()  # released at exit


def test_a_rerun_closes_the_run_a_dead_launch_left_running(tmp_path):
    """Guards the rerun path of finalization: a previous launch died (its lock names a dead pid)
    with its MLflow run RUNNING; the next launch warns, marks that run KILLED (tag
    trainkit.dead_launch names the dead launch), then continues it to FINISHED."""
    recipe, uri = tracked(tmp_path, "reopened", launch={"nproc_per_node": 1}, trainer={"max_steps": 2})
    first = trainkit(tmp_path, "run", str(recipe))
    assert first.returncode == 0, first.output
    run_dir = tmp_path / "runs" / "reopened"
    # what a SIGKILLed launcher leaves: a lock naming it, a newer launch record, the run reopened
    lock_file(tmp_path, "reopened", pid=dead_pid())
    dead = run_dir / "launches" / "20991231-000000"
    dead.mkdir()
    (dead / "command.txt").write_text("trainkit run reopened.yaml\n")
    with open(run_dir / "tracking" / "spool.jsonl", "a") as fh:
        fh.write(json.dumps({"op": "status", "status": "RUNNING", "ts": int(time.time() * 1000)}) + "\n")
    second = trainkit(tmp_path, "run", str(recipe), "trainer.max_steps=4")
    assert second.returncode == 0, second.output
    assert "took over the lock" in second.stderr
    assert "died without closing its MLflow run; marked KILLED" in second.stderr
    run = the_run(uri)
    assert run.info.status == "FINISHED" and run.data.tags["trainkit.dead_launch"] == "20991231-000000"


# --------------------------------------------------------------------------- one launch per run dir
def test_a_second_launch_of_the_same_run_dir_exits_2_at_once_naming_the_holder(tmp_path, launches):
    """Guards issue 10's double launch (two worker groups in one folder, one crashing in the other's
    checkpoint temp folder): the second `trainkit run` exits 2 at once (its start-up only: under
    10 s on 2 cores busy with the first launch's workers; waiting on the lock would take the
    holder's whole run or the 60 s staleness limit) and names the holder's
    host, pid and start, and how to proceed; the first one is undisturbed and keeps its lock's
    heartbeat fresh."""
    recipe = mlp_recipe(tmp_path, "twice", trainer={"max_steps": 400})
    first = launches(tmp_path, recipe, TRAINKIT_FAULT_DELAY="rank=0,ms=150")
    run_dir = tmp_path / "runs" / "twice"
    wait_for(lambda: workers_of(run_dir), 120, "the first launch's workers")
    started = time.monotonic()
    second = trainkit(tmp_path, "run", str(recipe), timeout=30)
    took = time.monotonic() - started
    assert second.returncode == 2, second.output
    assert took < 10.0, f"refused after {took:.1f}s"
    assert f"pid {first.pid}" in second.stderr and f"host {socket.gethostname()}" in second.stderr
    assert "since" in second.stderr and "launch.run_dir=" in second.stderr and "name=" in second.stderr
    assert first.poll() is None and workers_of(run_dir)  # still training
    # the holder keeps its lock fresh (every 10 s), or a long run would look stale after 60 s
    lock = json.loads((run_dir / "launch.lock").read_text())
    wait_for(lambda: json.loads((run_dir / "launch.lock").read_text())["heartbeat"] > lock["heartbeat"], 25,
             "a heartbeat")


def test_a_stopped_launcher_keeps_its_run_dir_and_its_workers_stop(tmp_path, launches):
    """Issue 25, case 7: a launcher stopped with Ctrl-Z (SIGSTOP) while its workers trained on lost its
    lock after 60 s; a second launch took over and resumed from a checkpoint the first was still
    writing: two trainings in one run directory. Now the workers stop on their own once the
    launcher's heartbeat is 3 beats old, and the stopped launcher's lock is not stale: a second
    launch is refused, naming the stopped process and how to resume or end it."""
    recipe = mlp_recipe(tmp_path, "stopped", trainer={"max_steps": 5000, "log_every": 5})
    # the heartbeat every 2 s instead of 10 (fault_injection): the rule, 3 beats of silence, unchanged
    first = launches(tmp_path, recipe, TRAINKIT_FAULT_DELAY="rank=0,ms=50", TRAINKIT_FAULT_HEARTBEAT="s=2")
    run_dir = tmp_path / "runs" / "stopped"
    wait_for(lambda: len(workers_of(run_dir)) == 2, 120, "the first launch's workers")
    os.kill(first.pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    wait_for(lambda: not workers_of(run_dir), 90, "the workers of the stopped launcher to stop")
    assert time.monotonic() - stopped_at > 4  # they waited for the silence, not for anything else
    logged = len((run_dir / "metrics.jsonl").read_text().splitlines())
    second = trainkit(tmp_path, "run", str(recipe), timeout=60)
    assert second.returncode == 2, second.output
    assert f"pid {first.pid}" in second.stderr and "it is stopped" in second.stderr, second.stderr
    assert f"kill -CONT {first.pid}" in second.stderr
    assert not workers_of(run_dir)  # nothing trains in the run directory
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == logged
    os.kill(first.pid, signal.SIGKILL)


@pytest.mark.parametrize("stale", ["dead pid", "reused pid", "old heartbeat"])
def test_a_stale_lock_is_taken_over_with_a_warning(tmp_path, stale):
    """Guards the takeover rules: a lock whose holder is gone (dead pid on this host), whose pid now
    belongs to another process (containers reuse pids: the start time differs), or whose
    heartbeat is older than 60 s (a holder on another host) does not block a launch."""
    holder = {"dead pid": {"pid": dead_pid()},
              "reused pid": {"start_time": psutil.Process().create_time() - 3600},
              "old heartbeat": {"host": "node-elsewhere", "heartbeat": time.time() - 120}}[stale]
    lock_file(tmp_path, "stale", **holder)
    recipe = mlp_recipe(tmp_path, "stale", launch={"nproc_per_node": 1}, trainer={"max_steps": 2})
    result = trainkit(tmp_path, "run", str(recipe))
    assert result.returncode == 0, result.output
    assert "warning: took over the lock of a previous launch" in result.stderr
    expected = {"dead pid": "is gone", "reused pid": "now belongs to another process",
                "old heartbeat": "limit 60 s"}[stale]
    assert expected in result.stderr
    assert not (tmp_path / "runs" / "stale" / "launch.lock").exists()


def test_a_launch_of_the_same_job_takes_over_a_live_holder_and_another_job_is_refused(tmp_path):
    """Guards requeue/restart of one scheduler job (SLURM --requeue, PyTorchJob OnFailure): a
    launch with the holder's job identity proceeds at once although the holder is alive; a launch
    of another job (or none) against the same live holder is refused with exit 2."""
    recipe = mlp_recipe(tmp_path, "requeued", launch={"nproc_per_node": 1}, trainer={"max_steps": 2})
    lock_file(tmp_path, "requeued", job="slurm:4242")  # held by this (live) test process
    other = trainkit(tmp_path, "run", str(recipe), SLURM_JOB_ID="777")
    assert other.returncode == 2 and f"pid {os.getpid()}" in other.stderr and "job slurm:4242" in other.stderr
    same = trainkit(tmp_path, "run", str(recipe), SLURM_JOB_ID="4242")
    assert same.returncode == 0, same.output
    assert "same job (slurm:4242)" in same.stderr


# --------------------------------------------------------------------------- status edges
def test_ctrl_c_after_training_completed_is_finished_and_exit_0(tmp_path, launches):
    """Guards issue 10's Ctrl-C after all steps, the final checkpoint and summary.json were written:
    it gave exit 130 and KILLED. It is a completed run: exit 0, FINISHED, and the console says what
    was interrupted. (monitor_interval 5 s keeps the agent busy after the workers finish.)"""
    recipe, uri = tracked(tmp_path, "late", launch={"monitor_interval": 5}, trainer={"max_steps": 6})
    launcher = launches(tmp_path, recipe)
    run_dir = tmp_path / "runs" / "late"

    def summary_written():
        try:
            return json.loads((run_dir / "summary.json").read_text())
        except (OSError, ValueError):
            return None

    wait_for(summary_written, 180, "summary.json")
    os.kill(launcher.pid, signal.SIGINT)
    out, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 0, out + err
    assert "interrupted after training completed; final checkpoint and summary are complete" in err \
        or "training is over; closing the run record first" in err, out + err
    run = the_run(uri)
    assert run.info.status == "FINISHED"


def test_a_restart_is_announced_with_rank_host_cause_and_checkpoint(tmp_path):
    """Guards issue 10's silent restarts: when rank 1 dies (os._exit(1) after step 7) and torchrun
    restarts the group, the console says which rank failed, on which host, why, and which
    checkpoint the new group resumes from."""
    recipe = mlp_recipe(tmp_path, "announced", launch={"max_restarts": 1})
    result = trainkit(tmp_path, "run", str(recipe), TRAINKIT_FAULT_INJECT="rank=1,step=7")
    assert result.returncode == 0, result.output
    line = next((l[l.index("trainkit: restart 1:"):] for l in result.output.splitlines()
                 if "trainkit: restart 1:" in l), None)
    assert line is not None, result.output
    assert "rank 1 (local rank 1" in line and f"on {socket.getfqdn(socket.gethostname())}" in line
    assert "without a Python exception" in line and "rank 1 exits at step 7" in line
    assert line.endswith(str(tmp_path / "runs" / "announced" / "checkpoints" / "step-00000004")), line
