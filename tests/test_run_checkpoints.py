"""Checkpoints and resume as a user sees them (world size 1: in-process, fast)."""

from __future__ import annotations

import pytest
import json
import shutil

import torch

from run_helpers import mlp_recipe, summary, trainkit


pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)


def test_corrupt_or_partial_newest_checkpoints_are_skipped_with_a_warning(tmp_path):
    recipe = mlp_recipe(tmp_path, "ckpt", launch={"nproc_per_node": 1})
    first = trainkit(tmp_path, "run", str(recipe))
    assert first.returncode == 0, first.output
    ckpts = tmp_path / "runs" / "ckpt" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000004", "step-00000008", "step-00000012"]
    meta = json.loads((ckpts / "step-00000012" / "meta.json").read_text())
    assert {"model.pt", "optimizer.pt", "trainer.pt", "rng-rank00000.pt"} <= set(meta["files"])
    expected = torch.load(ckpts / "step-00000012" / "model.pt", weights_only=True)

    (ckpts / "step-00000012" / "meta.json").unlink()  # a write interrupted before sealing
    model_8 = ckpts / "step-00000008" / "model.pt"
    data = bytearray(model_8.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    model_8.write_bytes(bytes(data))

    again = trainkit(tmp_path, "run", str(recipe))
    assert again.returncode == 0, again.output
    assert f"skipping checkpoint {ckpts / 'step-00000012'}: incomplete" in again.stderr
    assert f"skipping checkpoint {ckpts / 'step-00000008'}: model.pt is corrupt" in again.stderr
    assert f"resumed from {ckpts / 'step-00000004'}" in again.stdout
    assert "resuming from step-00000004: the newer checkpoint(s) step-00000012, step-00000008 cannot be used" \
        in again.stderr  # announced as what it is: a rewind forced by broken checkpoints
    steps = [json.loads(line)["step"] for line in (tmp_path / "runs" / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))  # the redone steps replaced the first launch's lines
    # mid-epoch resume continues the same data order and RNG: the redone steps match bit for bit
    redone = torch.load(ckpts / "step-00000012" / "model.pt", weights_only=True)
    assert all(torch.equal(redone[k], expected[k]) for k in expected)


def test_no_intact_checkpoint_restarts_from_step_0_and_says_so(tmp_path):
    """Guards the step-0 announcement and the rewind of metrics.jsonl to nothing: every checkpoint of a
    finished run is unusable, so the relaunch trains from scratch, says why, and logs each step once."""
    recipe = mlp_recipe(tmp_path, "scratch", launch={"nproc_per_node": 1},
                        trainer={"max_steps": 4, "log_every": 1, "checkpoint": {"every": 2, "keep": 2}})
    assert trainkit(tmp_path, "run", str(recipe)).returncode == 0
    ckpts = tmp_path / "runs" / "scratch" / "checkpoints"
    for folder in ckpts.iterdir():
        (folder / "meta.json").unlink()
    again = trainkit(tmp_path, "run", str(recipe))
    assert again.returncode == 0, again.output
    assert "resuming from step 0 (no intact checkpoint): the newer checkpoint(s) step-00000004, step-00000002" \
        in again.stderr
    steps = [json.loads(line)["step"] for line in (ckpts.parent / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_resume_auto_continues_a_finished_run_to_a_higher_step_count(tmp_path):
    recipe = mlp_recipe(tmp_path, "more", launch={"nproc_per_node": 1},
                        trainer={"max_steps": 6, "checkpoint": {"every": 3, "keep": 1}})
    assert trainkit(tmp_path, "run", str(recipe)).returncode == 0
    longer = trainkit(tmp_path, "run", str(recipe), "trainer.max_steps=9")
    assert longer.returncode == 0, longer.output
    assert "resumed from" in longer.stdout and "step-00000006" in longer.stdout
    run = tmp_path / "runs" / "more"
    assert summary(run)["steps"] == 9
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-00000009"]  # keep: 1
    assert len(list((run / "launches").iterdir())) == 2  # one record per launch


def test_resume_never_starts_over_and_keeps_the_old_checkpoints_aside(tmp_path):
    recipe = mlp_recipe(tmp_path, "fresh", launch={"nproc_per_node": 1}, trainer={"max_steps": 4})
    assert trainkit(tmp_path, "run", str(recipe)).returncode == 0
    again = trainkit(tmp_path, "run", str(recipe), "trainer.resume=never")
    assert again.returncode == 0, again.output
    assert "resumed from" not in again.stdout
    run = tmp_path / "runs" / "fresh"
    assert list(run.glob("checkpoints.before-*/step-00000004"))
    shutil.rmtree(run)
