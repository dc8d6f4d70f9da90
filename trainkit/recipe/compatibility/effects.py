"""What each strategy and option exists for, and the figure that shows it has that effect (issue 37).

The compatibility grid proves cells train *equal* to one process; equality does not prove that FSDP
saved memory or that checkpointing freed activations. Each strategy declares its effect next to its
capabilities (`Capabilities.effect`), each performance option in `PerformanceOptions.EFFECTS`; the
effect tests (tests/test_effects_transformer.py, tests/test_sharded_memory.py) measure it per model
family -- each worker's resident high-water mark over its whole run, above its baseline before the
model -- beside the memory plan's prediction, and with TRAINKIT_EFFECT_RECORD set write what they
measured to docs/effect-results.json. docs/compatibility.md shows the declarations and the records
("Effects"); a declared effect with no record says so.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

EFFECT_RESULTS = Path(__file__).resolve().parents[3] / "docs" / "effect-results.json"
MiB = 2**20


@dataclass(frozen=True)
class EffectCase:
    """One measured effect: `choice` on `family`, against `reference`, by `test`."""

    id: str
    choice: str
    family: str
    reference: str
    test: str


CASES = (
    EffectCase("fsdp/transformer", "fsdp (default units: the TransformerBlocks)", "transformer (16 blocks, 30 M)",
               "fsdp with the whole stack as one unit (`wrap: [Sequential]`, the default before issue 37)",
               "tests/test_effects_transformer.py::test_fsdp_gathers_one_transformer_block_at_a_time"),
    EffectCase("fsdp/hf-llama", "fsdp (default units: the LlamaDecoderLayers)", "hf-llama (8 layers, 27.7 M)",
               "the same run under DDP", "tests/test_effects_transformer.py::test_fsdp_shards_a_hugging_face_models_"
               "state_against_ddp"),
    EffectCase("tp/hf-llama", "parallel: {tp: 2} (the model's tp plan: each decoder layer's projections split)",
               "hf-llama (8 layers, 27.7 M)", "the same run under DDP",
               "tests/test_effects_transformer.py::test_tensor_parallel_splits_a_hugging_face_models_layers_against_ddp"),
    EffectCase("pretrained-build/hf-llama", "model.init: auto (a pretrained directory under FSDP: built on the meta "
               "device, each rank allocates its shards)", "hf-llama + LoRA (8 layers, 27.7 M)",
               "the same run with `model.init: constructor` (the whole fp32 model built on every rank first)",
               "tests/test_effects_transformer.py::test_a_pretrained_model_under_fsdp_is_built_without_a_whole_copy_"
               "per_rank"),
    EffectCase("weights-build/resnet50", "model.init: auto (a `model.weights` file under FSDP: built on the meta "
               "device, each rank copies its slices out of the memory-mapped file)", "resnet50 (23.5 M, BatchNorm)",
               "the same build with `model.init: constructor` (the whole model built and loaded on every rank first)",
               "tests/test_effects_transformer.py::test_a_weights_file_under_fsdp_is_read_into_shards_without_a_whole_"
               "copy_per_rank"),
    EffectCase("fsdp/resnet18", "fsdp (default units: the BasicBlocks)", "resnet18 (11.2 M, BatchNorm)",
               "the same run under DDP", "tests/test_effects_transformer.py::test_fsdp_shards_a_cnns_state_against_ddp"),
    EffectCase("fsdp/mlp", "fsdp", "mlp (31.5 M)", "the same run under DDP",
               "tests/test_sharded_memory.py::test_fsdp_no_rank_holds_a_full_copy_over_the_whole_run"),
    EffectCase("hsdp/mlp", "fsdp with parallel: {dp_replicate: 2, dp_shard: 2} (HSDP, 4 ranks)", "mlp (31.5 M)",
               "the same model under DDP (a DDP rank's state does not depend on the world size)",
               "tests/test_sharded_memory.py::test_hsdp_shards_over_its_shard_dimension"),
    EffectCase("zero3/mlp", "deepspeed zero_stage 3", "mlp (31.5 M)", "the same run under DDP",
               "tests/test_sharded_memory.py::test_zero3_no_rank_holds_a_full_copy_over_the_whole_run"),
    EffectCase("zero2/mlp", "deepspeed zero_stage 2", "mlp (31.5 M)", "the same run under DDP",
               "tests/test_sharded_memory.py::test_zero_1_and_2_shard_the_optimizer_state[2]"),
    EffectCase("zero1/mlp", "deepspeed zero_stage 1", "mlp (31.5 M)", "the same run under DDP",
               "tests/test_sharded_memory.py::test_zero_1_and_2_shard_the_optimizer_state[1]"),
    EffectCase("pipeline/mlp", "pipeline (2 stages, split by parameters)", "mlp (31.5 M)", "the same run under DDP",
               "tests/test_sharded_memory.py::test_the_pipeline_holds_its_own_stage_per_rank"),
    EffectCase("activation_checkpointing/transformer", "activation_checkpointing: full", "transformer (8 blocks, T=512)",
               "the same DDP run without checkpointing",
               "tests/test_effects_transformer.py::test_activation_checkpointing_frees_the_transformer_blocks_"
               "activations[transformer]"),
    EffectCase("activation_checkpointing/hf-llama", "activation_checkpointing: full", "hf-llama (8 layers, T=512)",
               "the same DDP run without checkpointing",
               "tests/test_effects_transformer.py::test_activation_checkpointing_frees_the_transformer_blocks_"
               "activations[hf_causal_lm]"),
    EffectCase("activation_checkpointing/resnet18", "activation_checkpointing: full", "resnet18 (224 px, 16 images)",
               "the same DDP run without checkpointing",
               "tests/test_effects_transformer.py::test_activation_checkpointing_frees_a_resnets_activations"),
)
CASE_IDS = {c.id for c in CASES}


def load_effects(path: Path = EFFECT_RESULTS) -> dict[str, Any]:
    """{case id: record}: what the last recording run measured for each case."""
    return json.loads(path.read_text())["cases"] if path.is_file() else {}


def record_effect(case_id: str, *, reference: list[int], chosen: list[int],
                  predicted_saving: Union[None, int, Callable[[], int]], holds: bool, criterion: str,
                  path: Path = EFFECT_RESULTS) -> None:
    """Write one case's figures (per-rank peaks above the pre-model baseline, bytes) when
    TRAINKIT_EFFECT_RECORD is set; a no-op otherwise, so the suite never rewrites the docs.
    `predicted_saving` may be a function: the plan's trace is then paid only when recording."""
    if not os.environ.get("TRAINKIT_EFFECT_RECORD"):
        return
    if callable(predicted_saving):
        predicted_saving = predicted_saving()
    if case_id not in CASE_IDS:
        raise KeyError(f"{case_id}: not a declared effect case (recipe.compatibility.effects.CASES)")
    import torch

    data = json.loads(path.read_text()) if path.is_file() else {"cases": {}}
    data["cases"][case_id] = {
        "reference_mib": [round(b / MiB) for b in reference], "chosen_mib": [round(b / MiB) for b in chosen],
        "saved_mib": round((min(reference) - max(chosen)) / MiB),
        "predicted_saving_mib": None if predicted_saving is None else round(predicted_saving / MiB),
        "holds": bool(holds), "criterion": criterion,
        "device": f"CPU ({platform.machine()}), gloo, 2 processes", "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def declared() -> list[tuple[str, str]]:
    """(choice, what it exists for) for each built-in strategy setting and performance option."""
    from ..blocks import DeepSpeedOptions, FSDPOptions, PerformanceOptions, PipelineOptions

    strategies = [("fsdp", FSDPOptions(name="fsdp")), ("fsdp cpu_offload", FSDPOptions(name="fsdp", cpu_offload=True)),
                  *((f"deepspeed zero_stage {n}", DeepSpeedOptions(name="deepspeed", zero_stage=n)) for n in (1, 2, 3)),
                  ("deepspeed zero_stage 3 + offload_optimizer cpu",
                   DeepSpeedOptions(name="deepspeed", zero_stage=3, offload_optimizer="cpu")),
                  ("pipeline", PipelineOptions(name="pipeline"))]
    rows = [(name, options.capabilities().effect) for name, options in strategies]
    rows += [(f"performance.{option}", effect) for option, effect in PerformanceOptions.EFFECTS.items()]
    return rows


def section(effects: dict[str, Any]) -> list[str]:
    """The "Effects" part of docs/compatibility.md."""
    lines = ["## Effects: what each choice is for, and the figure that shows it", "",
             "Equal losses prove a cell trains; they do not prove it does what it is chosen for. Each strategy "
             "declares its effect (`Capabilities.effect`), each performance option in `PerformanceOptions.EFFECTS`:",
             "", "| choice | exists for |", "|---|---|"]
    lines += [f"| {choice} | {effect} |" for choice, effect in declared()]
    lines += ["", "Measured (each worker's resident high-water mark over its whole run -- build, steps, a "
              "checkpoint, the end-of-run checks -- above its baseline before the model; 2 CPU ranks, fp32, "
              "AdamW or SGD; recorded with `TRAINKIT_EFFECT_RECORD=1 pytest TEST`). *Predicted* is what the "
              "memory plan says the choice saves per rank (`trainkit plan`: its trace of the model's "
              "activations, its division of the model state; for a sharded strategy against the same recipe "
              "under DDP):", "",
              "| choice | family | compared with | reference, per rank | with the choice | saved | predicted | plan off by "
              "| holds | recorded |", "|---|---|---|---|---|---|---|---|---|---|"]
    for case in CASES:
        r = effects.get(case.id)
        if r is None:
            lines.append(f"| {case.choice} | {case.family} | {case.reference} | not recorded | | | | | | "
                         f"`{case.test}` |")
            continue
        predicted = "-" if r["predicted_saving_mib"] is None else f"{r['predicted_saving_mib']} MiB"
        off = "-" if r["predicted_saving_mib"] is None or r["saved_mib"] <= 0 else \
            f"{(r['predicted_saving_mib'] - r['saved_mib']) / r['saved_mib']:+.0%}"
        holds = "yes" if r["holds"] else "**no**"
        lines.append(f"| {case.choice} | {case.family} | {case.reference} | {_mib(r['reference_mib'])} | "
                     f"{_mib(r['chosen_mib'])} | {r['saved_mib']} MiB | {predicted} | {off} | {holds} ({r['criterion']}) | "
                     f"{r['date']}, torch {r['torch']} |")
    lines += ["", "*Plan off by* is the prediction against the measured saving. The MLP rows' reference is a real "
              "DDP run, with its buckets, every run there returning freed host memory at once (`host_allocator: "
              "release`, the sharded strategies' CPU default; DDP's `retain` let one rank keep up to 35 MiB more). "
              "The plan's \"step temporaries\" line counts what a step allocates for a moment: a DDP rank's "
              "peak is its first AdamW step (two temporaries of the largest weight, 72 MiB here), a ZeRO-1/2 "
              "rank's is its reduce (DeepSpeed copies the bucket flat first, 122 MiB here); without it the plan "
              "over-predicted ZeRO-1/2's saving by ~38% (docs/memory.md). FSDP's "
              "prediction counts a unit's gathered parameters, their whole gradients and the reduce-scatter input "
              "(FSDP2 computes a unit's gradients whole before sharding them): with the parameters and the "
              "prefetch alone it under-predicted the transformer's units by 31%.",
              "", "Not measured here, and why: step-time effects (compile, channels_last, cudnn_benchmark, tf32, "
              "float8) show on GPUs; their figures, with device and command, are in docs/benchmarks.md (GPU tier) "
              "and CPU step times are noise-bound at these sizes. Offload (FSDP's cpu_offload, DeepSpeed's offload_optimizer/"
              "offload_param) frees *device* memory, which a CPU run does not have. ZeRO-1 and ZeRO-2 hold the "
              "same peak here: DeepSpeed's reduce bucket (5e8 elements) holds the whole model, and stage 1's whole "
              "gradients become views of it; stage 2 holds less once a model outgrows its bucket. HSDP runs 4 "
              "processes on this machine's 2 cores: slow steps, the same memory per rank.", ""]
    return lines


def _mib(values: list[int]) -> str:
    return " / ".join(f"{v}" for v in values) + " MiB"
