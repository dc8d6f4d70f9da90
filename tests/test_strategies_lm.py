"""The built-in transformer (task causal_lm, 2 gloo processes) under FSDP2 sharding each TransformerBlock
with activation checkpointing per block, and under FSDP x TP compiled: both follow the one-process
trajectory of the same global batch of 8 sequences. The pipeline split at `layers.1` and ZeRO-3 on it
are grid cells (pipeline-traced__transformer__fp32__none__seeded, zero3__transformer__fp32__none__seeded:
losses at fp32's 1e-5, resume, export), not launches here.

Tolerance: see lm_runs (strategy_runs.RTOL, fp32 summation order only).
"""

from __future__ import annotations

import pytest

from lm_runs import tiny_lm
from run_helpers import losses, summary, write_recipe
from strategy_runs import RTOL, run

pytestmark = pytest.mark.distributed



def test_fsdp_sharding_each_block_with_activation_checkpointing_matches(tmp_path, corpus, one_rank):
    path = write_recipe(tmp_path, "fsdp", tiny_lm(corpus),
                        strategy={"name": "fsdp", "wrap": ["TransformerBlock"], "activation_checkpointing": True})
    run_dir = run(tmp_path, path)
    assert losses(run_dir) == pytest.approx(one_rank, rel=RTOL)
    assert summary(run_dir)["replicas_identical"]


def test_fsdp_x_tp_with_each_block_split_checkpointed_then_compiled_matches(tmp_path, corpus, one_rank):
    """Issue 40: compile with activation checkpointing under FSDP x TP on 2 ranks, torchtitan's order
    (each TransformerBlock split over both ranks, checkpointed, compiled, then sharded; one data-parallel
    rank, so it reads the one-process run's batch of 8). Every rank captured graphs -- which the grid's
    compile cells, comparing losses only, would not notice missing -- and the losses follow the
    one-process eager run within 1e-4 (inductor reorders fp32 reductions; a wrong graph moves them
    > 1e-2). The grid's compile+checkpointing cells (DDP, FSDP, HSDP, FSDP x TP) hold fp32's 1e-5, which a
    missed wait before the first compiled TP block exceeds (strategies/tensor_parallel.py)."""
    import json

    path = write_recipe(tmp_path, "fsdp-tp-ac-compile", tiny_lm(corpus), strategy={"name": "fsdp"},
                        performance={"activation_checkpointing": "full", "compile": True},
                        parallel={"tp": 2}, data={"batch_size": 8})
    probe = tmp_path / "probe"
    probe.mkdir()
    run_dir = run(tmp_path, path, TRAINKIT_FAULT_PROBE_PERF=str(probe))
    rows = [json.loads(line) for r in range(2) for line in (probe / f"perf-rank{r}.jsonl").read_text().splitlines()]
    last = max(r["step"] for r in rows)
    assert all(r["dynamo"]["stats"].get("unique_graphs", 0) >= 1 for r in rows if r["step"] == last), rows[-1]
    assert losses(run_dir) == pytest.approx(one_rank, rel=1e-4)
    assert summary(run_dir)["replicas_identical"]
