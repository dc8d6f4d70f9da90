"""Combinations that crashed at run time on a CNN with BatchNorm (issue 26): each now trains.

A torchvision ResNet-18 (BatchNorm buffers) on small synthetic images, a real `trainkit run` of one
process (the crashes were in each rank's own build and compute, so one in-process rank reproduces
them at a fraction of a 2-rank launch's cost): bf16 under FSDP (with and without CPU offload) and
DeepSpeed ZeRO-1 ("expected scalar type BFloat16 but found Float" in batch_norm), FSDP with
channels_last ("FSDP does not support non-contiguous parameters"), ZeRO-3 with the default init
("Signature mismatch ... tensor_pynew": torch._dynamo imported under zero.Init), and FSDP with compile
("InductorError: Cannot convert expression to float"). Each asserts the run
finishes with a finite loss and writes its checkpoint."""

from __future__ import annotations

import math

import pytest

from run_helpers import mlp_recipe, summary, trainkit

RESNET = {"model": {"name": "torchvision.resnet18", "args": {"num_classes": 4}},
          "data": {"name": "synthetic", "shape": [3, 16, 16], "num_classes": 4, "batch_size": 2, "num_samples": 16},
          "optimizer": {"name": "adamw", "lr": 0.001},
          "trainer": {"max_steps": 2, "log_every": 1, "checkpoint": {"every": 2, "keep": 1}},
          "launch": {"nproc_per_node": 1}}

CASES = {
    "fsdp-bf16": {"strategy": {"name": "fsdp"}, "precision": "bf16"},
    "fsdp-offload-bf16": {"strategy": {"name": "fsdp", "cpu_offload": True}, "precision": "bf16"},
    "zero1-bf16": {"strategy": {"name": "deepspeed", "zero_stage": 1}, "precision": "bf16"},
    "fsdp-channels-last": {"strategy": {"name": "fsdp"}, "performance": {"channels_last": True}},
    "zero3-default-init": {"strategy": {"name": "deepspeed", "zero_stage": 3}},
    # blocks of one class, different shapes: recompiled, then dynamic, then an Inductor error (~1 min: compiles)
    "fsdp-compile-seeded": {"strategy": {"name": "fsdp"}, "performance": {"compile": True},
                            "model": {**RESNET["model"], "init": "seeded"}},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_resnet_trains_where_the_combination_crashed(tmp_path, case):
    recipe = mlp_recipe(tmp_path, case, **{**RESNET, **CASES[case]})
    result = trainkit(tmp_path, "run", str(recipe), timeout=300)
    assert result.returncode == 0, result.output
    run_dir = tmp_path / "runs" / case
    final = summary(run_dir)["final_loss"]
    assert final is not None and math.isfinite(final), final
    folder = run_dir / "checkpoints" / "step-00000002"
    assert folder.is_dir(), sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def test_a_traced_pipeline_trains_in_bf16(tmp_path):
    """A ResNet cut by the tracer, bf16 (issue 26): the receiving stage's buffers are typed from the fp32
    trace, so bf16 activations sent under autocast were read as garbage and the loss reached NaN by
    step 3. Now every logged loss is finite and no step blows up."""
    import json

    recipe = mlp_recipe(tmp_path, "traced-bf16", **{
        **RESNET, "data": {**RESNET["data"], "shape": [3, 32, 32], "batch_size": 4, "num_samples": 64},
        "strategy": {"name": "pipeline", "microbatches": 2, "split_points": ["layer3"]}, "precision": "bf16",
        "optimizer": {"name": "sgd", "lr": 0.005}, "trainer": {"max_steps": 8, "log_every": 1},
        "launch": {"nproc_per_node": 2}})
    result = trainkit(tmp_path, "run", str(recipe), timeout=300)
    assert result.returncode == 0, result.output
    rows = [json.loads(line) for line in (tmp_path / "runs" / "traced-bf16" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 8 and all(math.isfinite(v) and v < 5 for v in losses), losses
