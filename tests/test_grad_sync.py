"""Gradient accumulation communicates once per optimizer step: micro-steps before the last run
under the strategy's no_sync, so their gradients stay local.

The loss-trajectory test of accumulation (test_run_ddp) checks the arithmetic only: it passes
with no_sync replaced by a null context, because all-reducing every micro-step gives the same
averaged gradient. These tests count the reductions themselves (tests/fault_injection.py,
TRAINKIT_FAULT_COUNT_COLLECTIVES)."""

from __future__ import annotations

import json

import pytest

from run_helpers import write_recipe
from strategy_runs import SEEDED_MLP, run

pytestmark = pytest.mark.distributed
STEPS = 3


def counts(tmp_path, strategy: dict) -> dict[int, list[dict]]:
    path = write_recipe(tmp_path, "accum", SEEDED_MLP, strategy=strategy, data={"batch_size": 2},
                        trainer={"max_steps": STEPS, "grad_accum_steps": 4, "checkpoint": {"every": 100}})
    out = tmp_path / "counts"
    out.mkdir()
    run(tmp_path, path, TRAINKIT_FAULT_COUNT_COLLECTIVES=str(out))
    return {r: [json.loads(line) for line in (out / f"collectives-rank{r}.jsonl").read_text().splitlines()]
            for r in (0, 1)}


def test_ddp_all_reduces_gradients_once_per_optimizer_step_with_accumulation_4(tmp_path):
    """Guards DDPStrategy.no_sync: with grad_accum_steps 4 the gradient buckets are all-reduced on
    the last micro-step only (1 round per step; without no_sync, 4)."""
    for rank, rows in counts(tmp_path, {"name": "ddp"}).items():
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        assert [r["rounds"] for r in rows] == [1] * STEPS, (rank, rows)
        assert len({r["calls"] for r in rows}) == 1  # the same buckets each step


def test_fsdp_reduce_scatters_gradients_once_per_optimizer_step_with_accumulation_4(tmp_path):
    """Guards FSDPStrategy.no_sync (set_requires_gradient_sync): with grad_accum_steps 4 each of the
    4 FSDP units (the MLP's Linear layers) reduce-scatters its gradients once per optimizer step:
    4 calls per step (without no_sync, 16)."""
    for rank, rows in counts(tmp_path, {"name": "fsdp", "wrap": ["Linear"]}).items():
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        assert [r["calls"] for r in rows] == [4] * STEPS, (rank, rows)
