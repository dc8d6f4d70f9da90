"""A full disk is a message, not a torch assertion (issue 10, finding 6): the run dir on a small tmpfs.

Mounting a tmpfs needs root, which the test machines and CI have (`.ci/run` runs as root)."""

from __future__ import annotations

import pytest
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager


from run_helpers import env_for, mlp_recipe, trainkit

from trainkit.launch import failures
from trainkit.runtime.checkpoint import newest_valid, problem_with


pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)


@contextmanager
def tmpfs(path, size: str):
    path.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_too_small_a_disk_is_refused_before_start(tmp_path):
    """Guards the preflight refusal: 1 MiB cannot hold (keep + 1) checkpoints of this model (estimated on
    the meta device), so `trainkit run` exits 2 before any worker starts, naming free space and need."""
    with tmpfs(tmp_path / "small", "1m") as small:
        recipe = mlp_recipe(tmp_path, "big", model={"name": "mlp", "args": {"in_features": 48, "hidden": 1024,
                                                                            "num_classes": 4}},
                            launch={"nproc_per_node": 2, "run_dir": str(small), "timeout_s": 60})
        result = trainkit(tmp_path, "run", str(recipe))
        assert result.returncode == 2, result.output
        assert "disk" in result.output and "checkpoints (keep 3 + 1 being written)" in result.output, result.output
        assert "not started" in result.output
        assert not (small / "big" / "checkpoints").exists()


def fill_after_the_first_checkpoint(tmp_path, disk, name: str, *, leave: int, max_restarts: int) -> tuple[int, str]:
    """Run a 2-rank recipe on `disk` (checkpoints every 4 steps), fill the disk to `leave` free bytes once
    the step-4 checkpoint is complete, and return the launch's exit code and output."""
    recipe = mlp_recipe(tmp_path, name, data={"name": "synthetic", "batch_size": 8, "num_samples": 256,
                                              "shape": [3, 4, 4], "num_classes": 4, "sleep_ms": 15.0},
                        trainer={"max_steps": 12, "log_every": 1, "checkpoint": {"every": 4, "keep": 3}},
                        launch={"nproc_per_node": 2, "run_dir": str(disk), "timeout_s": 60,
                                "max_restarts": max_restarts})
    proc = subprocess.Popen([sys.executable, "-m", "trainkit.cli", "run", str(recipe)], cwd=tmp_path,
                            env=env_for(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        first = disk / name / "checkpoints" / "step-00000004"
        deadline = time.monotonic() + 120
        while not (first / "meta.json").exists():
            assert time.monotonic() < deadline and proc.poll() is None, "no first checkpoint"
            time.sleep(0.02)
        _fill(disk, leave)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return proc.returncode, out


def test_enospc_during_a_save_names_the_folder_keeps_the_previous_checkpoint_and_spends_no_restart(tmp_path):
    """Guards the mid-run message: the disk fills after the step-4 checkpoint; the step-8 save fails with
    a message naming the folder, the bytes needed and free; step 4 stays complete; the allowed restart
    does not redo the training ("not restarting")."""
    with tmpfs(tmp_path / "disk", "4m") as disk:
        first = disk / "filling" / "checkpoints" / "step-00000004"
        # 12 KiB left: metric lines fit, a checkpoint does not
        returncode, out = fill_after_the_first_checkpoint(tmp_path, disk, "filling", leave=12 * 1024, max_restarts=1)
        assert returncode != 0, out
        assert "no space left on the disk holding" in out and "step-00000008" in out, out
        assert "bytes are free" in out and "the previous checkpoint" in out
        assert "not restarting" in out, out
        assert newest_valid(disk / "filling" / "checkpoints", warn=False) == first
        assert problem_with(first) is None
        assert "unexpected pos" not in out.split("trainkit: training failed")[-1].split("also failed")[0]


def _fill(disk, leave: int = 0) -> None:
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    with open(disk / "filler", "wb") as fh:
        fh.write(b"\0" * max(0, free - leave))


def test_the_launcher_names_the_full_disk_when_no_rank_could_report_it(tmp_path):
    """Guards the launcher's own report: on a disk too full for any rank's error.json or console log,
    what is left (the abandoned `.tmp-step-...` folder, the free space) still names the failed save, the
    bytes needed and free, and the checkpoint kept; with room on the disk, no such claim is made."""
    with tmpfs(tmp_path / "disk", "4m") as disk:
        ckpts = disk / "checkpoints"
        (ckpts / "step-00000004").mkdir(parents=True)
        (ckpts / "step-00000004" / "model.pt").write_bytes(b"w" * 300_000)
        assert failures.disk_full_note(ckpts) is None  # nothing abandoned
        (ckpts / ".tmp-step-00000008").mkdir()
        assert failures.disk_full_note(ckpts) is None  # abandoned, but ~3.7 MB are free: not a full disk
        _fill(disk)
        note = failures.disk_full_note(ckpts)
        assert note is not None and "while writing step-00000008" in note, note
        assert "needs about 300,000 bytes" in note and " 0 bytes are free" in note, note
        assert f"the previous checkpoint {ckpts / 'step-00000004'} is kept" in note, note


def test_an_error_report_that_does_not_fit_is_left_out_not_left_half_written(tmp_path, monkeypatch):
    """Guards the agent against a truncated error.json (it crashed on one with JSONDecodeError and every
    rank's report was lost): on a full disk the rank's error file is absent, never empty."""
    from trainkit.runtime import error_file as rank_error

    with tmpfs(tmp_path / "disk", "64k") as disk:
        error_file = disk / "error.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        _fill(disk)
        try:
            raise RuntimeError("x" * 20_000)  # a report bigger than any page left
        except RuntimeError as exc:
            rank_error.record(exc, error_file)
        assert not error_file.exists()
        os.remove(disk / "filler")
        try:
            raise RuntimeError("fits")
        except RuntimeError as exc:
            rank_error.record(exc, error_file)
        assert "RuntimeError: fits" in error_file.read_text()


def test_a_rank_s_failure_report_masks_the_recipe_s_secrets(tmp_path, monkeypatch, capsys):
    """Guards error_file.report_and_exit: an exception whose message holds a secret of the recipe (a
    token in a tracking URI, say) reaches neither the error file the launcher reports from nor the console."""
    from trainkit.recipe import secrets
    from trainkit.runtime import error_file as rank_error

    token = "hunter2-secret-token-value"
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("LOCAL_RANK", "0")
    try:
        raise ConnectionError(f"cannot reach https://user:{token}@mlflow.example/api")
    except ConnectionError as exc:
        try:
            rank_error.report_and_exit(exc, lambda text: secrets.redact_text(text, [token]))
        except SystemExit as stop:
            assert stop.code == 1
    recorded = error_file.read_text()
    assert token not in recorded and "cannot reach" in recorded and secrets.MASK in recorded
    err = capsys.readouterr().err
    assert token not in err and "rank 0 failed" in err


def test_a_completely_full_disk_still_gets_its_fatal_marker_and_spends_no_restart(tmp_path):
    """Issue 25, case 10: with not one byte free, fatal.json used to be created empty; every restart then
    died on reading it (JSONDecodeError) and all restarts were spent. The launch reserves the marker's
    blocks, so it is written whole on a full disk, and the launcher stops torchrun's agent instead of
    letting it restart into the same failure."""
    with tmpfs(tmp_path / "disk", "4m") as disk:
        returncode, out = fill_after_the_first_checkpoint(tmp_path, disk, "full", leave=0, max_restarts=3)
        marker = (disk / "full" / "fatal.json").read_text()
        assert returncode != 0, out
        import json

        assert json.loads(marker)["error"] == "DiskFullError", marker  # whole, not empty
        assert "not restarting" in out and "JSONDecodeError" not in out, out
        assert "trainkit: restart" not in out, out  # the agent stopped at the first failure: no restart spent


def test_a_damaged_fatal_marker_means_fatal_with_an_unknown_cause(tmp_path):
    from trainkit.runtime.fatal import NonRetryableError, raise_if_restart_would_repeat

    (tmp_path / "fatal.json").write_text("")
    try:
        raise_if_restart_would_repeat(tmp_path, tmp_path / "checkpoints")
    except NonRetryableError as exc:
        assert "not restarting" in str(exc) and "cause is unknown" in str(exc)
    else:
        raise AssertionError("an empty marker let the restart run")
