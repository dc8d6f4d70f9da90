"""Pipeline parallel (torch.distributed.pipelining) on 2 gloo processes: through `trainkit run`, and, for
the runs checked only by what they leave, in one launch of several runs (the `trained` fixture).

Every rank reads the same batch of 16 (data-parallel size 1), so the one-process reference is
batch 16. Tolerance: see strategy_runs (RTOL 1e-5): the pipeline sums per-micro-batch means / 4
instead of one mean over 16 samples -- the same value up to fp32 summation order. Resume is
compared bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from run_helpers import RESNET, losses, merged, summary, trainkit, write_recipe
from strategy_runs import RTOL, SEEDED_MLP, STEPS, resume_from_step_10, run

pytestmark = pytest.mark.distributed
RECIPES = Path(__file__).resolve().parent.parent / "recipes"


@pytest.fixture(scope="module")
def gpipe_run(tmp_path_factory):
    """Split by name: stage 0 = blocks 0-3 (Flatten, Linear, ReLU, Linear), stage 1 = the rest."""
    tmp = tmp_path_factory.mktemp("gpipe")
    path = write_recipe(tmp, "gpipe", SEEDED_MLP,
                        strategy={"name": "pipeline", "schedule": "gpipe", "microbatches": 4, "split_points": ["4"]},
                        data={"batch_size": 16})
    return tmp, path, run(tmp, path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    """The pipelines checked below only for what their runs leave (losses, evaluation rows, stage files)
    and their one-process references: one 2-rank and one 1-process launch (tests/cell_launch.py), not
    one each. name -> run directory."""
    from cell_launch import train_cells

    tmp = tmp_path_factory.mktemp("pipelines")
    evals = {"max_steps": 4, "eval_every": 2, "eval_steps": 2, "checkpoint": {"every": 100}}
    pipelines = {
        "pipe-resnet": merged(RESNET, {"strategy": {"name": "pipeline", "schedule": "gpipe", "microbatches": 4,
                                                    "split_points": ["layer3"]}}),
        "pipe-eval": merged(SEEDED_MLP, {"strategy": {"name": "pipeline", "microbatches": 4, "split_points": ["4"]},
                                         "data": {"batch_size": 16}, "trainer": evals}),
        "interleaved": merged(SEEDED_MLP, {"strategy": {"name": "pipeline", "schedule": "interleaved_1f1b",
                                                        "microbatches": 4},
                                           "data": {"batch_size": 8}, "trainer": {"grad_accum_steps": 2}}),
    }
    one_process = {
        "ref-resnet": merged(RESNET, {"strategy": {"name": "ddp"}, "data": {"batch_size": 2},
                                      "trainer": {"grad_accum_steps": 4}, "launch": {"nproc_per_node": 1}}),
        "one-eval": merged(SEEDED_MLP, {"strategy": {"name": "ddp"}, "data": {"batch_size": 16},
                                        "launch": {"nproc_per_node": 1}, "trainer": evals}),
        # the reference of the 4-process pipeline x data-parallel run's evaluation
        "one-20": merged(SEEDED_MLP, {"strategy": {"name": "ddp"}, "data": {"batch_size": 16},
                                      "launch": {"nproc_per_node": 1},
                                      "trainer": {"eval_every": 10, "eval_steps": 2}}),
    }
    runs = {**train_cells(tmp / "2", pipelines, timeout=300, resume=False),
            **train_cells(tmp / "1", one_process, timeout=300, resume=False, nproc=1)}
    return {name: result["run_dir"] for name, result in runs.items()}


def test_gpipe_with_named_split_follows_the_one_process_trajectory(single, gpipe_run):
    _, _, run_dir = gpipe_run
    assert losses(run_dir) == pytest.approx(single, rel=RTOL)
    ckpt = run_dir / "checkpoints" / "step-00000020"
    assert sorted(p.name for p in ckpt.glob("pipeline-stage-*")) == ["pipeline-stage-000.pt", "pipeline-stage-001.pt"]


def test_interleaved_1f1b_with_balanced_stages_follows_the_one_process_trajectory(single, trained):
    """No split points: stages balanced by parameter count, 4 of them, two per rank; gradient
    accumulation of 2 micro-steps of 8 over 4 micro-batches each. Plain 1F1B with balanced stages and
    accumulation is a grid cell (pipeline__mlp__fp32__grad_accum__seeded), not a launch here."""
    assert losses(trained["interleaved"]) == pytest.approx(single, rel=RTOL)


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
    path = write_recipe(tmp_path, "badsplit", SEEDED_MLP,
                        strategy={"name": "pipeline", "microbatches": 4, "split_points": ["layer9"]},
                        data={"batch_size": 16})
    result = trainkit(tmp_path, "run", str(path))
    assert result.returncode == 2, result.output
    assert "split point 'layer9' is not a module of mlp" in result.stderr
    assert "not started" in result.stderr and not (tmp_path / "runs").exists()


def test_a_batch_not_divisible_by_microbatches_is_rejected_before_launch(tmp_path):
    path = write_recipe(tmp_path, "badmb", SEEDED_MLP, strategy={"name": "pipeline", "microbatches": 3},
                        data={"batch_size": 16})
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


# --------------------------------------------------------------------------- any model: the tracer
def test_resnet18_pipeline_split_at_layer3_matches_one_process_accumulating_the_micro_batches(trained):
    """torchvision's ResNet-18 is not a Sequential (its forward flattens between avgpool and fc):
    the tracer cuts it before layer3. Reference: one process with batch 2 accumulating 4
    micro-steps -- the same 8 samples per step in the same micro-batches of 2, so BatchNorm sees
    the same micro-batches as in the pipeline. Tolerance RTOL (1e-5): the same operations on the
    same micro-batches, summed in another order. The checkpoint keeps the plain model's parameter
    names."""
    pipe = trained["pipe-resnet"]
    assert losses(pipe) == pytest.approx(losses(trained["ref-resnet"]), rel=RTOL)
    ckpt = pipe / "checkpoints" / "step-00000004"
    stage1 = torch.load(ckpt / "pipeline-stage-001.pt", weights_only=False)["model"]
    assert "layer3.0.conv1.weight" in stage1 and "fc.weight" in stage1


def eval_rows(run_dir: Path) -> list[dict]:
    import json

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k.startswith("eval")} for r in rows if "eval_loss" in r]


def test_resnet18_pipeline_recipe_trains_end_to_end(tmp_path):
    """recipes/pipeline-resnet18.yaml as a user runs it (fewer steps): 2 traced stages on 2
    processes, a checkpoint whose stage files hold the plain model's names."""
    result = trainkit(tmp_path, "run", str(RECIPES / "pipeline-resnet18.yaml"), "trainer.max_steps=6",
                      "trainer.log_every=1", "trainer.checkpoint.every=6", f"launch.run_dir={tmp_path / 'runs'}",
                      "tracking.enabled=false", "scheduler.warmup_steps=1")
    assert result.returncode == 0, result.output[-6000:]
    run_dir = tmp_path / "runs" / "pipeline-resnet18"
    s = summary(run_dir)
    assert s["steps"] == 6 and s["world_size"] == 2 and s["global_batch"] == 16
    stage0 = torch.load(run_dir / "checkpoints" / "step-00000006" / "pipeline-stage-000.pt", weights_only=False)
    assert "conv1.weight" in stage0["model"] and "layer3.0.conv1.weight" not in stage0["model"]


def test_resnet18_pipeline_bad_split_points_are_refused_with_a_suggestion(tmp_path):
    """Three recipes in one `validate --deep` (as CI validates a folder of recipes): each refusal is
    printed against its own file."""
    pipeline = {"name": "pipeline", "microbatches": 4}
    bad = write_recipe(tmp_path, "bad", RESNET, strategy={**pipeline, "split_points": ["layer33"]})
    order = write_recipe(tmp_path, "order", RESNET, strategy={**pipeline, "split_points": ["layer3", "layer1"]},
                         launch={"nproc_per_node": 3})
    evals = write_recipe(tmp_path, "evals", RESNET, strategy={**pipeline, "split_points": ["layer3"]},
                         trainer={"eval_every": 2})
    result = trainkit(tmp_path, "validate", "--deep", str(bad), str(order), str(evals))
    assert result.returncode == 2, result.output
    said = {path.name: [line for line in result.output.splitlines() if path.name in line] for path in (bad, order, evals)}
    assert any("did you mean" in line.lower() and "layer3" in line for line in said[bad.name]), result.output
    assert any("forward order" in line for line in said[order.name]), result.output
    assert any("BatchNorm2d" in line for line in said[evals.name]), result.output


def test_pipeline_evaluation_matches_the_one_process_evaluation(trained):
    """A Sequential MLP pipeline evaluates through the schedule's forward-only pass; its eval loss
    and accuracy equal one process's (the same held-out samples, RTOL: summation order only)."""
    pipe, one = trained["pipe-eval"], trained["one-eval"]
    ours, ref = eval_rows(pipe), eval_rows(one)
    assert len(ours) == 2 and [r["eval_accuracy"] for r in ours] == [r["eval_accuracy"] for r in ref]
    assert [r["eval_loss"] for r in ours] == pytest.approx([r["eval_loss"] for r in ref], rel=RTOL)


def test_pipeline_times_data_parallel_on_4_processes_follows_the_one_process_trajectory(single, tmp_path, trained):
    """2-D: 2 pipelines of 2 stages (4 processes), batch 8 per pipeline, so the global batch is the
    one-process 16. The replicas are given by the `parallel:` block alone (pp 2 x dp_replicate 2;
    `strategy.data_parallel` is its alias and left out: the runtime reads the mesh's degree; the grid's
    pipeline-dp cells run the `data_parallel: 2` spelling). Guards, at once: each pipeline reads its own
    half of the data (the same half twice would not follow batch 16), each stage's gradients are
    averaged over the two pipelines (without it the replicas drift apart and so does the loss), one
    copy of each stage is written, and evaluation sums over the pipelines, not the ranks."""
    evals = {"eval_every": 10, "eval_steps": 2}
    path = write_recipe(tmp_path, "pp2dp2", SEEDED_MLP,
                        strategy={"name": "pipeline", "schedule": "1f1b", "microbatches": 2, "split_points": ["4"]},
                        parallel={"pp": 2, "dp_replicate": 2, "dp_shard": 1, "tp": 1},
                        data={"batch_size": 8}, launch={"nproc_per_node": 4}, trainer=evals)
    run_dir = run(tmp_path, path)
    assert losses(run_dir) == pytest.approx(single, rel=RTOL)
    result = summary(run_dir)
    assert result["replicas_identical"] is True and len(set(result["replica_digests"])) == 2  # 2 stages x 2 copies
    ckpt = run_dir / "checkpoints" / "step-00000020"
    assert sorted(p.name for p in ckpt.glob("pipeline-stage-*")) == ["pipeline-stage-000.pt", "pipeline-stage-001.pt"]
    ours, ref = eval_rows(run_dir), eval_rows(trained["one-20"])
    assert len(ours) == 2 and [r["eval_accuracy"] for r in ours] == [r["eval_accuracy"] for r in ref]
    assert [r["eval_loss"] for r in ours] == pytest.approx([r["eval_loss"] for r in ref], rel=RTOL)
