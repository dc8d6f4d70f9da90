"""`trainkit top` under a pseudo-terminal while a run trains, and its refusal of a folder that is not
a run; the `tensorboard` monitor's scalars read back with TensorBoard's own event reader."""

from __future__ import annotations

import pytest
import os
import pty
import select
import signal
import subprocess
import sys
import time

from run_helpers import env_for, mlp_recipe, trainkit


pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)


def test_top_shows_ranks_phases_and_system_while_training(tmp_path):
    recipe = mlp_recipe(tmp_path, "watched", launch={"nproc_per_node": 1}, data={"sleep_ms": 2.0},
                        trainer={"max_steps": 250, "log_every": 5, "checkpoint": {"every": 250}},
                        monitors=["system", "breakdown"])
    env = env_for(tmp_path)
    run = subprocess.Popen([sys.executable, "-m", "trainkit.cli", "run", str(recipe)], cwd=tmp_path, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    run_dir = tmp_path / "runs" / "watched"
    pid, fd = None, None
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "recipe.yaml").is_file() and time.monotonic() < deadline:
            time.sleep(0.2)
        pid, fd = pty.fork()
        if pid == 0:  # the child: `trainkit top` on a terminal 120 columns wide
            os.environ.update(env, COLUMNS="140", LINES="40", TERM="xterm")
            os.execv(sys.executable, [sys.executable, "-m", "trainkit.cli", "top", str(run_dir), "--interval", "0.3"])
        screen = b""
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:  # the child exited (the run finished)
                    break
                if not chunk:
                    break
                screen += chunk
        text = screen.decode(errors="replace")
    finally:
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
        try:
            run.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 0
    assert "watched" in text and "training" in text, text[-3000:]
    assert "per rank" in text and "data wait" in text and "backward" in text
    assert "per node" in text and "CPU %" in text
    assert "finished" in text  # it follows the run to its end and exits


def test_top_on_a_folder_that_is_not_a_run(tmp_path):
    result = trainkit(tmp_path, "top", str(tmp_path), timeout=60)
    assert result.returncode == 2
    assert f"{tmp_path} is not a trainkit run directory (no recipe.yaml" in result.stderr


def test_tensorboard_monitor_writes_scalars_tensorboard_reads_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recipe = mlp_recipe(tmp_path, "boarded", launch={"nproc_per_node": 1}, trainer={"max_steps": 8, "log_every": 2},
                        monitors=["tensorboard", "breakdown", {"name": "profiler", "wait": 1, "warmup": 1, "active": 2}])
    result = trainkit(tmp_path, "run", str(recipe))
    assert result.returncode == 0, result.output
    logdir = tmp_path / "runs" / "boarded" / "tensorboard"
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"train/loss", "breakdown/total_s", "time/train_share"} <= set(tags), tags
    assert [e.step for e in acc.Scalars("train/loss")] == [2, 4, 6, 8]
    traces = list((logdir / "plugins" / "profile").glob("*/*.pt.trace.json"))
    assert traces, "profiler traces in TensorBoard's profile-plugin layout"
