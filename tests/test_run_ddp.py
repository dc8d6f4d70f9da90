"""`trainkit run` with DDP on 2 gloo processes: the numbers a user relies on.

One 2-rank reference run (batch 8 per rank, 12 steps, checkpoints every 4) is shared by the
tests below; each compares it with another real launch.

Tolerance: DDP averages per-rank mean gradients with an all-reduce, while one process takes the
mean over the whole batch; the two are equal in exact arithmetic and differ only in fp32 summation
order (~1e-7 relative per step). Over 12 SGD-momentum steps that stays far below 1e-5 relative,
which is the bound used; a real bug (wrong sample split, missing averaging, a skipped sync) moves
the loss by 1e-2 or more after one step.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from trainkit.runtime import host_allocator

from run_helpers import losses, mlp_recipe, summary, trainkit

pytestmark = pytest.mark.distributed
RTOL = 1e-5


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """2 ranks x batch 8, no accumulation, uninterrupted: the run directory."""
    tmp = tmp_path_factory.mktemp("reference")
    recipe = mlp_recipe(tmp, "reference")
    result = trainkit(tmp, "run", str(recipe))
    assert result.returncode == 0, result.output
    return tmp / "runs" / "reference"


def test_two_ranks_follow_the_one_process_loss_trajectory(reference, tmp_path):
    recipe = mlp_recipe(tmp_path, "single", data={"batch_size": 16}, launch={"nproc_per_node": 1})
    result = trainkit(tmp_path, "run", str(recipe))
    assert result.returncode == 0, result.output
    assert "in-process" in result.stdout  # world size 1 runs without torchrun
    single = losses(tmp_path / "runs" / "single")
    ddp = losses(reference)
    assert len(single) == len(ddp) == 12
    assert single[-1] < single[0]  # it actually learns
    assert ddp == pytest.approx(single, rel=RTOL)


def test_replicas_hold_identical_parameters_after_training(reference):
    s = summary(reference)
    assert s["world_size"] == 2 and s["steps"] == 12
    assert len(s["replica_digests"]) == 2 and s["replicas_identical"], s["replica_digests"]


def test_a_cpu_run_keeps_freed_host_memory_for_reuse(reference):
    """performance.host_allocator: auto is `retain` on the CPU, set in each worker (the value is what
    runtime.host_allocator.apply reports; tests/test_host_allocator.py shows it in effect)."""
    applied = summary(reference)["host_allocator"]
    assert applied == "retain" if host_allocator.is_glibc() else applied.startswith("system ("), applied


def test_grad_accumulation_matches_the_larger_batch(reference, tmp_path):
    """4 micro-steps of batch 2 per rank (no_sync on the first 3) == one step of batch 8 per rank."""
    recipe = mlp_recipe(tmp_path, "accum", data={"batch_size": 2},
                        trainer={"grad_accum_steps": 4})
    result = trainkit(tmp_path, "run", str(recipe))
    assert result.returncode == 0, result.output
    assert losses(tmp_path / "runs" / "accum") == pytest.approx(losses(reference), rel=RTOL)


def test_a_rank_killed_mid_run_is_restarted_and_nothing_is_lost(reference, tmp_path):
    """Rank 1 os._exit(1)s after step 7 (first attempt only); torchrun restarts the group, which
    resumes from the step-4 checkpoint. Final weights must equal the uninterrupted run bit for bit."""
    recipe = mlp_recipe(tmp_path, "faulty", launch={"max_restarts": 1})
    result = trainkit(tmp_path, "run", str(recipe), TRAINKIT_FAULT_INJECT="rank=1,step=7")
    assert result.returncode == 0, result.output
    run = tmp_path / "runs" / "faulty"
    assert "TRAINKIT_FAULT_INJECT: rank 1 exits at step 7" in "".join(
        p.read_text() for p in (run / "logs").rglob("stderr.log"))
    assert "resumed from" in result.stdout and "step-00000004" in result.stdout
    ours = torch.load(run / "checkpoints" / "step-00000012" / "model.pt", weights_only=True)
    theirs = torch.load(reference / "checkpoints" / "step-00000012" / "model.pt", weights_only=True)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    assert summary(run)["final_loss"] == summary(reference)["final_loss"]


def test_exhausted_restarts_name_the_rank_that_failed_first(tmp_path):
    recipe = mlp_recipe(tmp_path, "doomed", trainer={"max_steps": 6, "checkpoint": {"every": 100}})
    result = trainkit(tmp_path, "run", str(recipe), TRAINKIT_FAULT_INJECT="rank=1,step=3")
    assert result.returncode == 1, result.output
    assert "rank 1 (local rank 1" in result.stderr and "failed first" in result.stderr
    assert "exits at step 3" in result.stderr  # the last lines of its log
    assert "Traceback" not in result.output


class FailsOnRankOne(torch.nn.Module):
    """An MLP whose forward on rank 1 raises at its second call, as a rank meets a missing file."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(48, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 2 and os.environ.get("RANK") == "1":
            raise FileNotFoundError("[Errno 2] No such file or directory: 'shards/part-00003.bin'")
        return self.layer(torch.flatten(x, 1))


def test_a_rank_that_raises_is_reported_with_its_own_exception(tmp_path):
    """Issue 38 #10: the failure report names the exception the rank raised (type and message, from
    its error file), not "exited without a Python exception", and the console shows no traceback."""
    recipe = mlp_recipe(tmp_path, "raises", model={"name": "test_run_ddp:FailsOnRankOne", "args": {}},
                        trainer={"max_steps": 4, "checkpoint": {"every": 100}})
    here = str(Path(__file__).resolve().parent)
    result = trainkit(tmp_path, "run", str(recipe),
                      PYTHONPATH=os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p))
    assert result.returncode == 1, result.output
    assert "rank 1 (local rank 1" in result.stderr and "failed first" in result.stderr, result.stderr
    error = next(line for line in result.stderr.splitlines() if line.strip().startswith("error:"))
    assert "FileNotFoundError" in error and "part-00003.bin" in error, result.stderr
    assert "without a Python exception" not in result.stderr
    assert "Traceback" not in result.output
