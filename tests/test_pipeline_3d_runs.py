"""3-D: pipeline x FSDP x tensor parallel on 8 ranks (issue 30), the compatibility cell
`pipeline__transformer__fp32__grad_clip__seeded__pp-dp_shard-tp`.

The tiny transformer (dim 32, 2 layers, 2 heads, vocab 320, seq 16) on `parallel: {pp: 2, dp_shard: 2,
tp: 2}`: 2 stages, each split over 2 tensor-parallel ranks and sharded over 2 data-parallel ranks, 3 SGD
steps with `grad_clip: 0.5` acting on every step (the norm across stages and meshes). One 8-rank launch
trains it, resumes it from its own step-2 checkpoint and exports it (the grid's cell runner), then a
variant with what else sharded stages combine with (the interleaved schedule, two stages per rank;
full activation checkpointing; evaluation); then one plain process trains the references and resumes
the cell's 8-rank step-2 checkpoint under FSDP on one process (another mesh, another strategy).
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import pytest
import yaml

from grid_runs import Outcome, _launch_all, _result, _write_corpus, problems_of, record
from trainkit.recipe.compatibility.grid import STEPS, Cell, merge

CELL = Cell("pipeline", "transformer", "fp32", "grad_clip", "seeded", "pp-dp_shard-tp")
RTOL = 1e-5  # fp32, as tests/test_parallel_mesh_runs.py and the grid's fp32 cells
LAUNCH_TIMEOUT_S = 300


def _write_run(folder: Path, name: str, recipe: dict) -> Path:
    run_dir = folder / name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "recipe.yaml").write_text(yaml.safe_dump({**recipe, "name": name}, sort_keys=False))
    return run_dir


# the variant: interleaved 1F1B (4 stages, 2 per rank), full activation checkpointing, evaluation
VARIANT = merge(CELL.recipe(), {"strategy": {"schedule": "interleaved_1f1b"},
                                "performance": {"activation_checkpointing": "full"},
                                "trainer": {"eval_every": STEPS, "eval_steps": 2}})


def on_one_process(recipe: dict, strategy: str, **trainer) -> dict:
    """`recipe` under `strategy` on one process, reading the same global batch (and evaluation batches)."""
    out = merge(recipe, {"launch": {"nproc_per_node": 1}, "performance": {"activation_checkpointing": "none"},
                         "data": {"batch_size": recipe["data"]["batch_size"] * recipe["parallel"]["dp_shard"]},
                         "trainer": trainer})
    out["strategy"] = {"name": strategy}
    out.pop("parallel")
    return out


def train_3d(folder: Path, *, device_env: dict) -> dict[str, Path]:
    """The 8-rank launch (train, resume, export), then the one process (reference, resume on FSDP 1)."""
    _write_corpus(folder)
    reference, _ = CELL.reference()
    step2 = folder / "3d" / "checkpoints" / "step-00000002"
    recipes = {"3d": CELL.recipe(), "variant": VARIANT, "reference": reference,
               "variant-reference": on_one_process(VARIANT, "ddp"),
               "3d-to-fsdp-1": on_one_process(CELL.recipe(), "fsdp", resume=str(step2))}
    dirs = {name: _write_run(folder, name, recipe) for name, recipe in recipes.items()}
    _launch_all(folder, {CELL.world: [dirs["3d"], dirs["variant"]]}, LAUNCH_TIMEOUT_S, device_env,
                keep_checkpoints=True)
    _launch_all(folder, {1: [dirs[n] for n in ("reference", "variant-reference", "3d-to-fsdp-1")]}, LAUNCH_TIMEOUT_S,
                device_env, resume=False)
    return dirs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    return train_3d(tmp_path_factory.mktemp("pipeline-3d"), device_env={"CUDA_VISIBLE_DEVICES": ""})


def _losses(run_dir: Path) -> dict[int, float]:
    result = _result(run_dir)
    assert "error" not in result and "refused" not in result, f"{run_dir.name}: {result}"
    return {int(k): v for k, v in result["losses"].items()}


def _metric(run_dir: Path, key: str) -> dict[int, float]:
    """metrics.jsonl's `key` at each step that has it."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if key in r}


def _assert_close(got: dict[int, float], want: dict[int, float], what: str) -> None:
    assert sorted(got) == sorted(want) and want, f"{what}: steps {sorted(got)}, one process {sorted(want)}"
    for step in want:
        assert abs(got[step] - want[step]) <= RTOL * abs(want[step]), (
            f"{what} {got[step]} at step {step}, one process {want[step]}")


@pytest.mark.distributed
def test_3d_trains_like_one_process_resumes_on_another_mesh_and_exports(runs):
    """Every step's loss equals the one-process reference's (grid tolerance of fp32); the cell runner's
    checks pass (exact resume on the same mesh, `trainkit export` loading strict into the plain
    transformer); each sharded weight was stored in dp_shard x tp = 4 pieces; and the step-2 checkpoint
    resumed by FSDP on one process redoes step 3 with the same loss."""
    from torch.distributed.checkpoint import FileSystemReader

    outcome = Outcome(CELL, _result(runs["3d"]), _result(runs["reference"]))
    problems = problems_of(outcome)
    if os.environ.get("TRAINKIT_GRID_RECORD") and not problems:
        record([outcome], {}, kind="cpu", device=f"CPU ({platform.machine()}), gloo, {CELL.world} processes",
               command="TRAINKIT_GRID_RECORD=1 pytest tests/test_pipeline_3d_runs.py")
    assert not problems, problems
    losses = _losses(runs["3d"])
    # the norm before clipping: over both stages, both meshes, every rank's pieces
    _assert_close(_metric(runs["3d"], "grad_norm"), _metric(runs["reference"], "grad_norm"), "3d grad_norm")

    metadata = FileSystemReader(str(runs["3d"] / "checkpoints" / f"step-{STEPS:08d}")).read_metadata()
    for stage_weight in ("model.layers.0.attention.wq.weight", "model.layers.1.feed_forward.w1.weight"):
        chunks = metadata.state_dict_metadata[stage_weight].chunks
        assert len(chunks) == 4, f"{stage_weight}: {[tuple(c.sizes) for c in chunks]}"

    resumed = _losses(runs["3d-to-fsdp-1"])
    assert sorted(resumed) == [STEPS], f"3d-to-fsdp-1 trained steps {sorted(resumed)}: it did not resume"
    off = abs(resumed[STEPS] - losses[STEPS]) / abs(losses[STEPS])
    assert off <= RTOL, f"FSDP 1 resumed the 3-D step-2 checkpoint to {resumed[STEPS]}, 3-D had {losses[STEPS]}"


@pytest.mark.distributed
def test_3d_with_the_interleaved_schedule_checkpointing_and_evaluation_trains_like_one_process(runs):
    """Two stages per rank (interleaved 1F1B), every block recomputed in backward, and the final
    evaluation: losses, gradient norms and the evaluation equal one process's, every evaluation token
    counted once (the pp x tp ranks of a pipeline read the same batch)."""
    for key in ("loss", "grad_norm", "eval_loss", "eval_tokens"):
        _assert_close(_metric(runs["variant"], key), _metric(runs["variant-reference"], key), f"variant {key}")
