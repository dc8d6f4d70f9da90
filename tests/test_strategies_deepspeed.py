"""DeepSpeed ZeRO through `trainkit run` under torchrun (2 gloo processes, DeepSpeed's CPU
accelerator here), with trainkit's torch optimizer and DeepSpeed's own checkpoints.

Tolerance: see strategy_runs (RTOL 1e-5). ZeRO reduce-scatters / all-reduces the per-rank mean
gradients of 2 x 8 samples -- the one-process gradient of 16 up to fp32 summation order -- once
DeepSpeed's default gradient clipping of 1.0 is turned off (ds_config_for writes 0.0 when
trainer.grad_clip is null). Resume is compared bit for bit.

DeepSpeed JIT-compiles its shared-memory comm op on first use (~40 s): every launch here shares
one TORCH_EXTENSIONS_DIR in pytest's cache folder, so that happens once, not per test (or session).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from run_helpers import losses, summary, trainkit, write_recipe
from strategy_runs import RTOL, SEEDED_MLP, STEPS, deepspeed_env, resume_from_step_10, run

pytestmark = pytest.mark.distributed
RECIPES = Path(__file__).resolve().parent.parent / "recipes"


@pytest.fixture(scope="module")
def ext(request, tmp_path_factory) -> dict:
    return deepspeed_env(request, tmp_path_factory)


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory, ext):
    tmp = tmp_path_factory.mktemp("zero3")
    path = write_recipe(tmp, "zero3", SEEDED_MLP, strategy={"name": "deepspeed", "zero_stage": 3},
                        model={"init": "auto"})  # resolves to seeded
    return tmp, path, run(tmp, path, **ext)


def test_zero3_follows_the_one_process_loss_trajectory(single, zero3_run):
    """Also guards the sharded init: the model is built under DeepSpeed's zero.Init (partitioned as
    each layer is built) and given the one-process run's seeded values one gathered module at a time."""
    _, _, run_dir = zero3_run
    assert summary(run_dir)["model_init"] == "seeded"
    assert losses(run_dir) == pytest.approx(single, rel=RTOL)
    assert summary(run_dir)["replicas_identical"]
    assert (run_dir / "checkpoints" / "step-00000020" / "zero").is_dir()


def test_deprecation_warnings_are_printed_once_per_rank(zero3_run):
    """Issue 26: DeepSpeed's ZeRO-3 collectives warn on every call (`all_gather_into_tensor` /
    `reduce_scatter_tensor` are deprecated): a 440-step run printed ~1,760 lines. Each rank's log holds
    each warning once."""
    _, _, run_dir = zero3_run
    logs = sorted((run_dir / "logs").rglob("stderr.log"))
    assert logs
    for log in logs:
        lines = [line for line in log.read_text().splitlines() if "Warning: " in line]
        assert len(lines) == len(set(lines)), (log, lines)


def test_zero3_resume_repeats_the_uninterrupted_run_exactly(zero3_run, ext):
    tmp, path, run_dir = zero3_run
    uninterrupted = losses(run_dir)[:STEPS]
    assert resume_from_step_10(tmp, run_dir, path, **ext) == uninterrupted[10:]


def test_export_reassembles_fp32_weights_from_the_zero3_partitions(zero3_run, tmp_path, ext):
    _, _, run_dir = zero3_run
    out = tmp_path / "model.pt"
    result = trainkit(tmp_path, "export", str(run_dir / "checkpoints" / "step-00000010"), str(out), **ext)
    assert result.returncode == 0, result.output
    from trainkit.models import mlp

    state = torch.load(out, weights_only=True)
    mlp(in_features=48, hidden=64, num_classes=4, depth=3).load_state_dict(state)
    assert all(v.dtype == torch.float32 for v in state.values())


def test_plan_shows_the_ds_config_and_deepspeed_parses_it_before_launch(tmp_path, ext):
    good = write_recipe(tmp_path, "good", SEEDED_MLP, strategy={"name": "deepspeed", "zero_stage": 2},
                        trainer={"grad_accum_steps": 4})
    result = trainkit(tmp_path, "plan", str(good), **ext)
    assert result.returncode == 0, result.output
    assert '"gradient_accumulation_steps": 4' in result.stdout and '"gradient_clipping": 0.0' in result.stdout
    assert '"train_micro_batch_size_per_gpu": 8' in result.stdout and '"stage": 2' in result.stdout
    bad = write_recipe(tmp_path, "bad", SEEDED_MLP, strategy={
        "name": "deepspeed", "zero_stage": 2, "config": {"zero_optimization": {"overlap_comm": "sometimes"}}})
    result = trainkit(tmp_path, "run", str(bad), **ext)
    assert result.returncode == 2, result.output
    assert "DeepSpeed rejects the config built from this recipe" in result.stderr
    assert "overlap_comm" in result.stderr and not (tmp_path / "runs").exists()


def test_deepspeed_recipe_runs_end_to_end(tmp_path, ext):
    result = trainkit(tmp_path, "run", str(RECIPES / "deepspeed-zero3-mlp.yaml"), "trainer.max_steps=4",
                      "trainer.log_every=2", f"launch.run_dir={tmp_path / 'runs'}", "tracking.enabled=false",
                      "data.num_samples=256", "scheduler.warmup_steps=1", **ext)
    assert result.returncode == 0, result.output[-6000:]
    s = summary(tmp_path / "runs" / "deepspeed-zero3-mlp")
    assert s["steps"] == 4 and s["world_size"] == 2


IMPORT_IN_A_RANK = """
import sys
from trainkit.strategies.deepspeed_import import import_deepspeed
import_deepspeed()
print("mlflow after deepspeed:", "mlflow" in sys.modules)
import mlflow  # the mark is taken away again: a later import works
print("mlflow importable:", mlflow.__name__ == "mlflow")
"""


def test_a_rank_imports_deepspeed_without_mlflow_and_can_import_it_after(ext):
    """DeepSpeed's autotuner imports MLflow (~110 MiB a rank, docs/benchmarks.md); a rank imports DeepSpeed
    with MLflow marked absent, then a later `import mlflow` still works (a fresh process, as a rank is)."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", IMPORT_IN_A_RANK], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **ext})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "mlflow after deepspeed: False" in done.stdout and "mlflow importable: True" in done.stdout, done.stdout
