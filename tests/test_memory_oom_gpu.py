"""GPU tier (`pytest -m gpu`): a CUDA out-of-memory is explained and leaves the allocator's history
(issue 28, item 3). Skips without CUDA.

The model's forward allocates a temporary far larger than the GPU (a bug a user meets: a
materialised attention matrix, an accidental outer product). The memory plan cannot see it (it is
not kept for backward), so the run starts, and the rank meets torch.OutOfMemoryError at step 1.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from run_helpers import mlp_recipe, trainkit

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class HungryMLP(nn.Module):
    """A small MLP whose forward asks, on a GPU, for a temporary of twice the device's memory."""

    def __init__(self, in_features: int = 48, num_classes: int = 4):
        super().__init__()
        self.layer = nn.Linear(in_features, num_classes)

    def forward(self, x):
        x = torch.flatten(x, 1)
        if x.is_cuda:
            total = torch.cuda.get_device_properties(x.device).total_memory
            torch.empty(2 * total, dtype=torch.uint8, device=x.device)
        return self.layer(x)


@needs_cuda
def test_cuda_oom_is_explained_with_a_memory_snapshot_that_report_points_to(tmp_path):
    """Guards: a CUDA OOM is reported as out of memory with its phase (step 1), peak and the GPU's
    memory; it is not restarted (the fatal marker); the allocator history is dumped to
    reports/cuda-oom-rank0.pickle and `trainkit report` names that file."""
    recipe = mlp_recipe(tmp_path, "cuda-oom", model={"name": "test_memory_oom_gpu:HungryMLP", "args": {}},
                        launch={"nproc_per_node": 1, "backend": "nccl"}, trainer={"max_steps": 3})
    here = str(Path(__file__).resolve().parent)  # the model factory lives in this file
    result = trainkit(tmp_path, "run", str(recipe),
                      PYTHONPATH=os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p))
    assert result.returncode != 0, result.output
    assert "out of memory on rank 0 during step 1" in result.output and "OutOfMemoryError" in result.output, \
        result.output
    run_dir = tmp_path / "runs" / "cuda-oom"
    snapshot = run_dir / "reports" / "cuda-oom-rank0.pickle"
    assert snapshot.is_file() and snapshot.stat().st_size > 0
    report = trainkit(tmp_path, "report", str(run_dir))
    assert "Out of memory" in report.stdout and str(snapshot) in report.stdout, report.output
