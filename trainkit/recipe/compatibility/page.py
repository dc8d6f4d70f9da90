"""docs/compatibility.md, generated from the declared cells, validate's verdict on each and the
recorded verification results (docs/compatibility-results.json, written by the grid test with
TRAINKIT_GRID_RECORD set) and the recorded effects (docs/effect-results.json: recipe.compatibility.effects).
`python -m trainkit.recipe.compatibility --markdown` prints it;
tests/test_compatibility.py checks the committed page equals it."""

from __future__ import annotations

from typing import Any, Optional

from .grid import BF16_PARAMETERS, COMBINED, LATER_STEPS_WITH_BATCHNORM, MESH_CELLS, MODELS, OPTIONS, PRECISIONS, REGRESSIONS, STEPS, STRATEGIES, TOLERANCE, WORLD, core_cells, \
    pairwise_cells, refused_pairs
from .effects import load_effects, section as effect_section
from .results import RESULTS, load_results
from .status import Status, statuses

COMMAND = "python -m trainkit.recipe.compatibility --markdown > docs/compatibility.md"


def markdown(results: dict[str, Any], effects: Optional[dict[str, Any]] = None) -> str:
    """The page, from the verification results and the recorded effects (docs/effect-results.json when
    `effects` is None)."""
    core, pairs, regressions = statuses(core_cells()), statuses(pairwise_cells()), statuses(REGRESSIONS)
    meshes = statuses(MESH_CELLS)
    refused_pairs_ = refused_pairs()
    only_refused = dict(zip(refused_pairs_, statuses(refused_pairs_.values())))
    refusals: dict[str, int] = {}
    for status in core + pairs + regressions + list(only_refused.values()):
        for message in status.refusals:
            refusals.setdefault(message, len(refusals) + 1)
    for status in core + pairs + regressions:  # then what `trainkit run`'s preflight refused on a device
        for record in results.get(status.cell.id, {}).values():
            for message in record.get("why", []):
                refusals.setdefault(message, len(refusals) + 1)
    for status in meshes:  # the meshes' (issue 30), numbered after the rest so that their numbers stay put
        for message in status.refusals + tuple(m for r in results.get(status.cell.id, {}).values()
                                               for m in r.get("why", [])):
            refusals.setdefault(message, len(refusals) + 1)
    lines = [*_intro(results), "", "## Core grid: strategy x model family x precision", "",
             f"No performance option, `model.init: seeded` (constructor for hf-llama: not seedable), {WORLD} "
             f"ranks, {STEPS} steps.", ""]
    for model in MODELS:
        lines += _core_table(model, [s for s in core if s.cell.model == model], results, refusals)
    lines += ["## Pairs: strategy x performance option x precision x model family x init", "",
              "Every pair of values of any two of these axes (option `none` included) that some combination "
              "`trainkit validate` accepts holds is held by at least one accepted cell: a core cell above or a "
              "row here (a deterministic, refusal-aware all-pairs set, "
              "`trainkit/recipe/compatibility/pairwise.py`, with as few rows as its greedy search finds). The "
              "pairs that every combination holding them is refused are listed after the table.", "",
              "| strategy | option | precision | model | init | status |", "|---|---|---|---|---|---|"]
    lines += _rows(pairs, results, refusals)
    lines += ["", "### Pairs that only refused combinations hold", "",
              "Every combination holding one of these pairs is refused by `trainkit validate`; the cell shown "
              "is one of them, refused for the fewest reasons.", "",
              "| pair | cell | status |", "|---|---|---|"]
    lines += [f"| {a} {va} x {b} {vb} | {s.cell.id} | {_verdict(s, results, refusals)} |"
              for (a, va, b, vb), s in only_refused.items()]
    lines += ["", *_lora_section(pairs, only_refused, results, refusals)]
    lines += ["", "## Combinations that crashed before (issue 26)", "",
              "| strategy | option | precision | model | init | status |", "|---|---|---|---|---|---|"]
    lines += _rows(regressions, results, refusals)
    lines += ["", "## Meshes (`parallel:`, issue 30)", "",
              f"Each mesh puts the {WORLD} ranks on one dimension of a `parallel:` block "
              "(`trainkit/recipe/compatibility/meshes.py`): `tp` tensor parallel, `replicate` HSDP's replicate "
              "dimension, `pp` the pipeline's stages. Meshes of several dimensions run on their own ranks: "
              "`dp_replicate-dp_shard` (HSDP) and `dp_shard-tp` (FSDP x TP) 2 x 2 on 4 ranks "
              "(tests/test_parallel_mesh_runs.py; docs/strategies.md, 'Meshes'), `pp-dp_shard-tp` the 3-D mesh "
              "pp 2 x dp_shard 2 x tp 2 on 8 ranks (tests/test_pipeline_3d_runs.py).", "",
              "| strategy | mesh | option | precision | model | init | status |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {s.cell.strategy} | {s.cell.mesh} | {s.cell.option} | {s.cell.precision} | {s.cell.model} | "
              f"{s.cell.init} | {_verdict(s, results, refusals)} |" for s in meshes]
    lines += ["", "## Options together: compile with activation checkpointing (issue 40)", "",
              "`performance: {compile: true, activation_checkpointing: full}`: each block checkpointed, then "
              "compiled, then wrapped or sharded (torchtitan's order), on the strategies and meshes users run it "
              "on. Its reference is the same recipe eager (checkpointing changes no arithmetic).", "",
              "| strategy | mesh | option | precision | model | init | status |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {s.cell.strategy} | {s.cell.mesh} | {s.cell.option} | {s.cell.precision} | {s.cell.model} | "
              f"{s.cell.init} | {_verdict(s, results, refusals)} |" for s in statuses(COMBINED)]
    lines += ["", *effect_section(load_effects() if effects is None else effects)]
    lines += ["## Refused, and what to use instead", "",
              "Each refusal is `trainkit validate`'s own message, from the rule the strategy, option or model "
              "owns, or (device refusals) the message `trainkit run`'s preflight stops with.", ""]
    lines += [f"{n}. {message}" for message, n in refusals.items()]
    return "\n".join(lines) + "\n"


def _intro(results: dict[str, Any]) -> list[str]:
    runs = sorted({(kind, r["device"], r["date"], r["command"]) for cell in results.values()
                   for kind, r in cell.items()})
    return ["# Compatibility", "",
            f"<!-- generated: {COMMAND} -- do not edit -->", "",
            "Which combinations of strategy, precision, performance option, model family and initial "
            "weights train, and which `trainkit validate` refuses before anything starts. Each cell is a "
            "recipe (`trainkit/recipe/compatibility/grid.py`); its status is what `trainkit validate` "
            "says of it, and every cell it accepts was trained by the verification runner "
            "(`tests/test_compatibility.py`): its loss at every step follows a reference run within "
            "the tolerance of its precision, a checkpoint resumes to the same losses, and `trainkit "
            "export`'s state dict loads (strict) into the plain model.", "",
            "The reference is the same recipe under DDP, every sample in the same group per forward "
            "pass: one process with the global batch; for a model with BatchNorm (statistics of each "
            "rank's and each pipeline micro-batch's own samples), DDP on as many ranks as the cell has "
            "replicas, one gradient-accumulation step per micro-batch (so DDP's own BatchNorm cells are "
            "their own reference: they are checked for training, resume and export).", "",
            "| precision | tolerance (relative, each step's loss) | why |", "|---|---|---|",
            *[f"| {p} | {tol:g} | {why} |" for p, (tol, why) in TOLERANCE.items()], "",
            f"A model with BatchNorm (resnet18) is held to its precision's tolerance at step 1 and to "
            f"{LATER_STEPS_WITH_BATCHNORM:g} after it: BatchNorm over 4 samples of 1x1 maps amplifies "
            "any change of summation order from step to step (measured in fp32 on 8x8 images: 6e-7 at step "
            "1, 8.6e-3 at step 2 for FSDP with channels_last; 1.4e-2 at step 3 with compile).", "",
            "Not compared: bf16 cells of " + ", ".join(sorted(BF16_PARAMETERS)) + " with a BatchNorm model "
            "(DeepSpeed trains bf16 parameters, not autocast, and keeps BatchNorm statistics in bf16; over "
            "BatchNorm of 4 samples the difference to the autocast reference is not a rounding tolerance): "
            "they are checked for training without divergence, resume and export.", "",
            "Verification runs recorded here:", "",
            *[f"- {kind}: {device}, {date}: `{command}`" for kind, device, date, command in runs], "",
            "Legend: **CPU** verified on CPU (gloo), **GPU** verified on CUDA (nccl), **GPU-1** trained, "
            "resumed and exported in one process on one CUDA device (no reference, no collectives), **refused (n)** "
            "refused by `trainkit validate` with message n below, **CPU: refused (n)** accepted by validate "
            "but refused by `trainkit run`'s preflight on that device (before anything starts), **not "
            "verified** accepted but not run there; **(2nd try)**: the first attempt stopped (recorded in "
            "docs/compatibility-results.json) and a second one from scratch passed."]


def _lora_section(pairs: list[Status], only_refused: dict, results: dict[str, Any],
                  refusals: dict[str, int]) -> list[str]:
    """The LoRA column (issue 39): for each strategy, the cell of the pairs above that trains it with LoRA
    adapters, or the refused pair and why."""
    lines = ["## LoRA (PEFT adapters on a Hugging Face model, issue 39)", "",
             "The `lora` option (`model.args.lora`: r 4 on q_proj and v_proj, the base frozen) is an axis value "
             "like the others; these are its cells from the tables above, one per strategy. The frozen base "
             "meets each strategy's own rules: FSDP units holding frozen and trainable parameters, DDP's "
             "unused-parameter check, ZeRO's partitions of a partly frozen model, and `trainkit export` of a "
             "checkpoint that holds optimizer state for the adapters only. Starting from a pretrained directory "
             "is verified separately (tests/test_pretrained_lora.py: FSDP, DDP, ZeRO-3, tensor parallel; "
             "docs/models.md). LoRA under HSDP (dp_replicate 2 x dp_shard 2) is the `lora` row of the Meshes "
             "table below.", "", "| strategy | cell | status |", "|---|---|---|"]
    for strategy in STRATEGIES:
        cells = [s for s in pairs if s.cell.option == "lora" and s.cell.strategy == strategy]
        refused = only_refused.get(("option", "lora", "strategy", strategy))
        for status in cells or ([refused] if refused is not None else []):
            lines.append(f"| {strategy} | {status.cell.id} | {_verdict(status, results, refusals)} |")
        if not cells and refused is None:
            lines.append(f"| {strategy} | - | no cell |")
    return lines


def _rows(rows: list[Status], results: dict[str, Any], refusals: dict[str, int]) -> list[str]:
    return [f"| {s.cell.strategy} | {s.cell.option} | {s.cell.precision} | {s.cell.model} | {s.cell.init} | "
            f"{_verdict(s, results, refusals)} |" for s in rows]


def _core_table(model: str, rows: list[Status], results: dict[str, Any], refusals: dict[str, int]) -> list[str]:
    head = ["", f"### {model}", "", "| strategy | " + " | ".join(PRECISIONS) + " |",
            "|---|" + "---|" * len(PRECISIONS)]
    by_cell = {(s.cell.strategy, s.cell.precision): s for s in rows}
    body = [f"| {strategy} | " + " | ".join(_verdict(by_cell[strategy, p], results, refusals)
                                            for p in PRECISIONS) + " |" for strategy in STRATEGIES]
    return head + body + [""]


def _verdict(status: Status, results: dict[str, Any], refusals: dict[str, int]) -> str:
    if status.refused:
        return "refused (" + ", ".join(str(refusals[m]) for m in status.refusals) + ")"
    recorded = results.get(status.cell.id, {})
    kinds = []
    for kind in ("cpu", "gpu", "gpu-1"):
        record = recorded.get(kind, {})
        if record.get("result") == "verified":
            kinds.append(kind.upper() + (" (2nd try)" if "retried_after" in record else ""))
        elif record.get("result") == "refused":
            kinds.append(f"{kind.upper()}: refused (" + ", ".join(str(refusals[m]) for m in record["why"]) + ")")
    return " + ".join(kinds) or "not verified"


__all__ = ["COMMAND", "RESULTS", "load_results", "markdown", "OPTIONS"]
