"""Pipeline parallel (torch.distributed.pipelining) through `trainkit run` on 2 gloo processes.

Every rank reads the same batch of 16 (data-parallel size 1), so the one-process reference is
batch 16. Tolerance: see strategy_runs (RTOL 1e-5): the pipeline sums per-micro-batch means / 4
instead of one mean over 16 samples -- the same value up to fp32 summation order. Resume is
compared bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from run_helpers import losses, summary, trainkit
from strategy_runs import RTOL, STEPS, recipe, resume_from_step_10, run, single_process_losses

pytestmark = pytest.mark.distributed
RECIPES = Path(__file__).resolve().parent.parent / "recipes"


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> list[float]:
    return single_process_losses(tmp_path_factory.mktemp("single"))


@pytest.fixture(scope="module")
def gpipe_run(tmp_path_factory):
    """Split by name: stage 0 = blocks 0-3 (Flatten, Linear, ReLU, Linear), stage 1 = the rest."""
    tmp = tmp_path_factory.mktemp("gpipe")
    path = recipe(tmp, "gpipe", {"name": "pipeline", "schedule": "gpipe", "microbatches": 4, "split_points": ["4"]},
                  data={"batch_size": 16})
    return tmp, path, run(tmp, path)


def test_gpipe_with_named_split_follows_the_one_process_trajectory(single, gpipe_run):
    _, _, run_dir = gpipe_run
    assert losses(run_dir) == pytest.approx(single, rel=RTOL)
    ckpt = run_dir / "checkpoints" / "step-00000020"
    assert sorted(p.name for p in ckpt.glob("pipeline-stage-*")) == ["pipeline-stage-000.pt", "pipeline-stage-001.pt"]


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_1f1b_and_interleaved_with_balanced_stages_follow_the_one_process_trajectory(single, tmp_path, schedule):
    """No split points: stages balanced by parameter count (2 stages, or 4 -- two per rank --
    for interleaved 1F1B); gradient accumulation of 2 micro-steps of 8 over 4 micro-batches each."""
    path = recipe(tmp_path, schedule, {"name": "pipeline", "schedule": schedule, "microbatches": 4},
                  data={"batch_size": 8}, trainer={"grad_accum_steps": 2})
    assert losses(run(tmp_path, path)) == pytest.approx(single, rel=RTOL)


def test_pipeline_resume_repeats_the_uninterrupted_run_exactly(gpipe_run):
    tmp, path, run_dir = gpipe_run
    uninterrupted = losses(run_dir)[:STEPS]
    assert resume_from_step_10(tmp, run_dir, path) == uninterrupted[10:]


def test_export_merges_the_stages_into_the_plain_model(gpipe_run, tmp_path):
    _, _, run_dir = gpipe_run
    out = tmp_path / "model.pt"
    result = trainkit(tmp_path, "export", str(run_dir / "checkpoints" / "step-00000010"), str(out))
    assert result.returncode == 0, result.output
    from trainkit.models import mlp

    mlp(in_features=48, hidden=64, num_classes=4, depth=3).load_state_dict(torch.load(out, weights_only=True))


def test_a_split_point_that_does_not_exist_is_rejected_before_launch(tmp_path):
    path = recipe(tmp_path, "badsplit", {"name": "pipeline", "microbatches": 4, "split_points": ["layer9"]},
                  data={"batch_size": 16})
    result = trainkit(tmp_path, "run", str(path))
    assert result.returncode == 2, result.output
    assert "split point 'layer9' is not a module of mlp" in result.stderr
    assert "not started" in result.stderr and not (tmp_path / "runs").exists()


def test_a_batch_not_divisible_by_microbatches_is_rejected_before_launch(tmp_path):
    path = recipe(tmp_path, "badmb", {"name": "pipeline", "microbatches": 3}, data={"batch_size": 16})
    result = trainkit(tmp_path, "run", str(path))
    assert result.returncode == 2, result.output
    assert "not divisible by strategy.microbatches 3" in result.output


def test_pipeline_recipe_runs_end_to_end(tmp_path):
    result = trainkit(tmp_path, "run", str(RECIPES / "pipeline-mlp.yaml"), "trainer.max_steps=4",
                      "trainer.log_every=2", f"launch.run_dir={tmp_path / 'runs'}", "tracking.enabled=false",
                      "data.num_samples=256", "scheduler.warmup_steps=1")
    assert result.returncode == 0, result.output[-6000:]
    s = summary(tmp_path / "runs" / "pipeline-mlp")
    assert s["steps"] == 4 and s["world_size"] == 2 and s["global_batch"] == 16
