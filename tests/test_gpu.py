"""GPU tier (`pytest -m gpu`): what the monitors measure on real CUDA devices. Every test skips
cleanly without CUDA (and the 2-rank one with fewer than 2 GPUs); run them on a GPU node with

    pytest -m gpu tests/test_gpu.py
"""

from __future__ import annotations

import json

import pytest
import torch

from run_helpers import mlp_recipe, trainkit

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")

WIDE = {"name": "mlp", "args": {"in_features": 1024, "hidden": 4096, "depth": 6, "num_classes": 10}}
DATA = {"batch_size": 64, "num_samples": 4096, "shape": [1024], "num_classes": 10}


def metrics(tmp_path, name) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]


@needs_cuda
@needs_two
def test_nccl_ddp_comm_time_is_positive_and_exposed_at_most_in_flight(tmp_path):
    """Guards device-timed communication under nccl: comm measured from CUDA events is > 0 (a host
    timestamp in the future callback measured ~0) and exposed comm never exceeds in-flight comm."""
    recipe = mlp_recipe(tmp_path, "nccl", model=WIDE, data=DATA, strategy={"name": "ddp", "bucket_cap_mb": 4},
                        launch={"backend": "nccl"}, trainer={"max_steps": 20, "log_every": 5},
                        monitors=["breakdown"])
    result = trainkit(tmp_path, "run", str(recipe))
    assert result.returncode == 0, result.output
    per_rank = json.loads((tmp_path / "runs" / "nccl" / "reports" / "breakdown.json").read_text())["per_rank"]
    assert len(per_rank) == 2
    for r in per_rank:
        assert r["comm"] > 1e-5, r
        assert 0.0 <= r["comm_exposed"] <= r["comm"] + 1e-6, r
    rows = metrics(tmp_path, "nccl")
    assert any("breakdown/comm_exposed_s" in row for row in rows)


@needs_cuda
def test_nvml_metrics_are_sampled_between_log_steps(tmp_path):
    """Guards the gpu monitor's NVML sampler on a real GPU: utilisation, memory and their min/max
    over the interval's samples reach the metric log."""
    recipe = mlp_recipe(tmp_path, "nvml", model=WIDE, data=DATA, launch={"nproc_per_node": 1},
                        trainer={"max_steps": 30, "log_every": 10}, monitors=[{"name": "gpu", "interval_s": 0.05}])
    result = trainkit(tmp_path, "run", str(recipe))
    assert result.returncode == 0, result.output
    row = metrics(tmp_path, "nvml")[-1]
    for key in ("utilization_percent", "utilization_percent_max", "memory_used_mb"):
        assert f"gpu/rank0/{key}" in row, sorted(row)
    assert row["gpu/rank0/memory_used_mb"] > 0


@needs_cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_mfu_is_between_0_and_1(tmp_path, precision):
    """Guards MFU's peak table on this GPU: the device name matches a peak for what runs (fp32 without
    TF32, bf16 tensor cores), so MFU is reported and is a fraction in (0, 1]."""
    recipe = mlp_recipe(tmp_path, f"mfu{precision}", model=WIDE, data=DATA, precision=precision,
                        launch={"nproc_per_node": 1}, trainer={"max_steps": 30, "log_every": 10},
                        monitors=["throughput"])
    result = trainkit(tmp_path, "run", str(recipe))
    assert result.returncode == 0, result.output
    row = metrics(tmp_path, f"mfu{precision}")[-1]
    assert "throughput/mfu" in row, f"no peak known for {torch.cuda.get_device_name()}: {sorted(row)}"
    assert 0.0 < row["throughput/mfu"] <= 1.0


@needs_cuda
def test_fsdp_cpu_offload_with_a_seeded_batchnorm_model_trains_on_the_gpu(tmp_path):
    """Issue 26 (GPU only): seeded init under FSDP cpu_offload left BatchNorm buffers on the CPU
    (`to_empty(device=cpu)` after fully_shard had moved them to CUDA), and the first forward failed.
    The buffers now live on the compute device; the run trains in bf16."""
    recipe = mlp_recipe(tmp_path, "offload-bn", model={"name": "torchvision.resnet18", "args": {"num_classes": 4},
                                                       "init": "seeded"},
                        data={"name": "synthetic", "shape": [3, 32, 32], "num_classes": 4, "batch_size": 8},
                        strategy={"name": "fsdp", "cpu_offload": True}, precision="bf16",
                        launch={"nproc_per_node": 1, "backend": "nccl"}, trainer={"max_steps": 3, "log_every": 1})
    result = trainkit(tmp_path, "run", str(recipe))
    assert result.returncode == 0, result.output
    assert all(r["loss"] == r["loss"] for r in metrics(tmp_path, "offload-bn") if "loss" in r)
