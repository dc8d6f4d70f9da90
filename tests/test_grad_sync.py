"""Gradient accumulation communicates once per optimizer step: micro-steps before the last run
under the strategy's no_sync, so their gradients stay local.

The loss-trajectory test of accumulation (test_run_ddp) checks the arithmetic only: it passes
with no_sync replaced by a null context, because all-reducing every micro-step gives the same
averaged gradient. These tests count the reductions themselves (tests/fault_injection.py,
TRAINKIT_FAULT_COUNT_COLLECTIVES)."""

from __future__ import annotations

import json

import pytest

from run_helpers import merged
from strategy_runs import SEEDED_MLP

pytestmark = pytest.mark.distributed
STEPS = 3


@pytest.fixture(scope="module")
def counted(tmp_path_factory) -> dict[str, dict[int, list[dict]]]:
    """DDP, then FSDP (one unit per Linear), accumulating 4 micro-steps, trained in one launch; per run and
    rank, the counted reductions of each optimizer step (rank files hold both runs' rows, DDP's first)."""
    from cell_launch import train_cells

    tmp = tmp_path_factory.mktemp("accum")
    out = tmp / "counts"
    out.mkdir()
    accumulating = merged(SEEDED_MLP, {"data": {"batch_size": 2}, "trainer": {
        "max_steps": STEPS, "grad_accum_steps": 4, "checkpoint": {"every": 100}}})
    train_cells(tmp, {"ddp": merged(accumulating, {"strategy": {"name": "ddp"}}),
                      "fsdp": merged(accumulating, {"strategy": {"name": "fsdp", "wrap": ["Linear"]}})},
                timeout=240, resume=False, TRAINKIT_FAULT_COUNT_COLLECTIVES=str(out))
    rows = {r: [json.loads(line) for line in (out / f"collectives-rank{r}.jsonl").read_text().splitlines()]
            for r in (0, 1)}
    return {"ddp": {r: rows[r][:STEPS] for r in rows}, "fsdp": {r: rows[r][STEPS:] for r in rows}}


def test_ddp_all_reduces_gradients_once_per_optimizer_step_with_accumulation_4(counted):
    """Guards DDPStrategy.no_sync: with grad_accum_steps 4 the gradient buckets are all-reduced on
    the last micro-step only (1 round per step; without no_sync, 4)."""
    for rank, rows in counted["ddp"].items():
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        assert [r["rounds"] for r in rows] == [1] * STEPS, (rank, rows)
        assert len({r["calls"] for r in rows}) == 1  # the same buckets each step


def test_fsdp_reduce_scatters_gradients_once_per_optimizer_step_with_accumulation_4(counted):
    """Guards FSDPStrategy.no_sync (set_requires_gradient_sync): with grad_accum_steps 4 each of the
    4 FSDP units (the MLP's Linear layers) reduce-scatters its gradients once per optimizer step:
    4 calls per step (without no_sync, 16)."""
    for rank, rows in counted["fsdp"].items():
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        assert [r["calls"] for r in rows] == [4] * STEPS, (rank, rows)
