"""DeepSpeed with the `performance:` options (issue 15: activation checkpointing and compile for every
strategy), through `trainkit run` on 2 gloo processes: each shown in effect, and training still
follows the one-process run.

Tolerance: see strategy_runs (RTOL 1e-5) for both. Activation checkpointing reruns the same
operations on the same (gathered) weights, so it changes no number. Compile (inductor on CPU) may
fuse and reorder fp32 arithmetic, which stays at the 1e-7 level per step like the strategies' own
reordering: on this MLP the compiled trajectory holds RTOL too (checked)."""

from __future__ import annotations

import json

import pytest

from run_helpers import losses, summary, write_recipe
from strategy_runs import RTOL, SEEDED_MLP, deepspeed_env, run

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def ext(request, tmp_path_factory) -> dict:
    return deepspeed_env(request, tmp_path_factory)


def _probe(folder, ranks=2) -> list[dict]:
    return [json.loads(line) for r in range(ranks) for line in (folder / f"perf-rank{r}.jsonl").read_text().splitlines()]


def test_zero3_with_activation_checkpointing_recomputes_every_block_and_keeps_the_trajectory(single, tmp_path, ext):
    """Guards that DeepSpeed runs get checkpointing at all: every Linear block's forward runs twice per
    step (once more in backward, with ZeRO-3 gathering its partitioned weight again), and the losses
    equal the one-process run's (checkpointing is exact)."""
    path = write_recipe(tmp_path, "zero3-ac", SEEDED_MLP, strategy={"name": "deepspeed", "zero_stage": 3},
                        performance={"activation_checkpointing": {"mode": "full", "blocks": ["Linear"]}})
    probe = tmp_path / "probe"
    probe.mkdir()
    run_dir = run(tmp_path, path, TRAINKIT_FAULT_PROBE_PERF=str(probe), TRAINKIT_FAULT_PROBE_BLOCKS="Linear", **ext)
    rows = _probe(probe)
    assert rows and all(list(r["forwards"].values()) == [2, 2, 2, 2] for r in rows), rows[0]["forwards"]
    assert losses(run_dir) == pytest.approx(single, rel=RTOL)
    assert summary(run_dir)["replicas_identical"]


def test_zero2_with_compile_compiles_the_engine_module_and_keeps_the_trajectory(single, tmp_path, ext):
    """Guards `performance.compile` on DeepSpeed (the engine's own `compile`): dynamo captured a graph
    in every rank, and the losses follow the one-process run."""
    path = write_recipe(tmp_path, "zero2-compile", SEEDED_MLP, strategy={"name": "deepspeed", "zero_stage": 2},
                        performance={"compile": True})
    probe = tmp_path / "probe"
    probe.mkdir()
    run_dir = run(tmp_path, path, TRAINKIT_FAULT_PROBE_PERF=str(probe), **ext)
    last = [r for r in _probe(probe) if r["step"] == max(x["step"] for x in _probe(probe))]
    assert len(last) == 2 and all(r["dynamo"]["stats"].get("unique_graphs", 0) >= 1 for r in last), last
    ours = losses(run_dir)
    assert ours[0] == pytest.approx(single[0], rel=RTOL)
    assert ours == pytest.approx(single, rel=RTOL), max(abs(a - b) / abs(b) for a, b in zip(ours, single))
