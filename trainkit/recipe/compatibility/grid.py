"""The declared compatibility grid: each axis value is a recipe fragment, each cell their merge.

Axes (issue 26): strategy x precision x performance option x model family x init. A cell is what a
user would write -- a recipe -- and its status comes from the product, not from a list kept here:
`trainkit validate`'s rules (owned by the strategy and option classes) refuse it, or it is expected
to train (and the verification runner checks that it does). Sizes are tiny on purpose: the grid is
run in CI on 2 CPU cores, 3 optimizer steps per cell.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional

from ... import registry
from .meshes import MESH_ROWS, data_parallel, mesh_block, mesh_world
from .pairwise import Covering, covering_rows
from .results import load_results, refused_on
from .status import refusals

STEPS = 3  # checkpoints at step 2 and 3: the resume check restarts from step 2
WORLD = 2  # ranks of every cell (the one-process reference runs the same recipe on 1)
CORPUS = {"files": ["lm/train.txt"], "eval_files": ["lm/eval.txt"], "tokenizer": "lm/tokenizer.json",
          "generate": {"documents": 200, "seed": 0, "vocab_size": 300}}
LM_DATA = {"name": "text", **CORPUS, "seq_len": 16, "batch_size": 4, "shuffle": True}

# model family -> the recipe's model, data and task (and where a traced pipeline cuts it)
MODELS: dict[str, dict[str, Any]] = {
    "mlp": {"model": {"name": "mlp", "args": {"in_features": 48, "hidden": 32, "num_classes": 4, "depth": 3}},
            "data": {"name": "synthetic", "shape": [3, 4, 4], "num_classes": 4, "batch_size": 4,
                     "num_samples": 64}},
    # 64x64, not smaller: below it a stride-2 3x3 convolution of layer3/layer4 meets a 1x1 or 2x2 map, some
    # of its taps see only padding, and the CPU's bf16 weight gradient of those taps came back non-finite
    # now and then (torch 2.14.1; on 8x8 and 16x16 images, reproduced in plain torch on 8x8): the taps never
    # touch the output, but trainkit's non-finite check stopped the run
    "resnet18": {"statistics_per_rank": True,  # BatchNorm: each rank normalises over its own samples
                 "model": {"name": "torchvision.resnet18", "args": {"num_classes": 4}},
                 "optimizer": {"lr": 0.002},  # a random-init ResNet at batch 4 blows up at 0.05
                 "data": {"name": "synthetic", "shape": [3, 64, 64], "num_classes": 4, "batch_size": 4,
                          "num_samples": 64}},
    "transformer": {"model": {"name": "transformer", "args": {"vocab_size": 320, "dim": 32, "layers": 2,
                                                              "heads": 2, "seq_len": 16}},
                    "data": LM_DATA, "task": {"name": "causal_lm"}},
    "hf-llama": {"core_init": "constructor",  # transformers' norms have no reset_parameters (not seedable)
                 "model": {"name": "hf_causal_lm", "args": {"config": {
        "model_type": "llama", "vocab_size": 320, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 32}}},
                 "data": LM_DATA, "task": {"name": "causal_lm"}},
}
# where the traced pipeline cuts each family (a module name of the model)
TRACED_SPLIT = {"mlp": "2", "resnet18": "layer3", "transformer": "layers.1", "hf-llama": "model.model.layers.1"}

# strategy -> its recipe block, or a function of the model family giving it (where the pipeline cuts)
STRATEGIES: dict[str, Any] = {
    "ddp": {"name": "ddp"},
    "fsdp": {"name": "fsdp"},
    "fsdp+cpu_offload": {"name": "fsdp", "cpu_offload": True},
    "zero1": {"name": "deepspeed", "zero_stage": 1},
    "zero2": {"name": "deepspeed", "zero_stage": 2},
    "zero3": {"name": "deepspeed", "zero_stage": 3},
    "zero3+offload": {"name": "deepspeed", "zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
    "pipeline": {"name": "pipeline", "microbatches": 2},  # an nn.Sequential cut at its blocks
    # any model, traced (a Sequential: cut) at a named module
    "pipeline-traced": lambda model: {"name": "pipeline", "microbatches": 2, "split_points": [TRACED_SPLIT[model]]},
    "pipeline+dp": {"name": "pipeline", "microbatches": 2, "data_parallel": 2},  # 2 one-stage replicas
}

PRECISIONS: dict[str, dict[str, Any]] = {
    "fp32": {"precision": "fp32"},
    "bf16": {"precision": "bf16"},
    "fp16-dynamic": {"precision": "fp16", "trainer": {"loss_scale": "dynamic"}},
    "fp16-fixed": {"precision": "fp16", "trainer": {"loss_scale": 1024.0}},
}

OPTIONS: dict[str, dict[str, Any]] = {
    "none": {},
    "compile": {"performance": {"compile": True}},
    "channels_last": {"performance": {"channels_last": True}},
    "checkpointing-full": {"performance": {"activation_checkpointing": "full"}},
    "checkpointing-selective": {"performance": {"activation_checkpointing": {"mode": "selective",
                                                                             "every_n_blocks": 2}}},
    "sync_batchnorm": {"performance": {"sync_batchnorm": True}},
    "grad_accum": {"trainer": {"grad_accum_steps": 2}},
    "grad_clip": {"trainer": {"grad_clip": 0.5}},
    # PEFT LoRA adapters on a Hugging Face model, its base frozen (issue 39): FSDP units holding frozen and
    # trainable parameters, DDP's unused-parameter rules, ZeRO's partitions of a partly frozen model
    "lora": {"model": {"args": {"lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}}}},
    # torchtitan's order (issue 40): each block checkpointed, then compiled, then wrapped or sharded
    "compile+checkpointing": {"performance": {"compile": True, "activation_checkpointing": "full"}},
}
# options that are several options together: declared in the cells where users combine them (COMBINED),
# not paired with every value of the other axes (the all-pairs set pairs each single option)
COMBINED_OPTIONS = ("compile+checkpointing",)
PAIRED_OPTIONS = [name for name in OPTIONS if name not in COMBINED_OPTIONS]

INITS: dict[str, dict[str, Any]] = {
    "seeded": {"model": {"init": "seeded"}},
    "constructor": {"model": {"init": "constructor"}},
}

BASE: dict[str, Any] = {
    "seed": 5,
    "optimizer": {"name": "sgd", "lr": 0.05},
    "trainer": {"max_steps": STEPS, "log_every": 1, "checkpoint": {"every": 2, "keep": 2}},
    "launch": {"nproc_per_node": WORLD, "timeout_s": 60},
    "tracking": {"enabled": False},
}


@dataclass(frozen=True, order=True)
class Cell:
    """One combination: a value of each axis."""

    strategy: str
    model: str
    precision: str
    option: str = "none"
    init: str = "seeded"
    mesh: str = "none"  # a parallel: block (meshes.mesh_block)

    @property
    def id(self) -> str:
        mesh = () if self.mesh == "none" else (self.mesh,)
        return "__".join((self.strategy, self.model, self.precision, self.option, self.init, *mesh))

    @property
    def world(self) -> int:
        """The ranks this cell runs on: the grid's WORLD, or more for a multi-dimensional mesh."""
        return mesh_world(self.mesh, WORLD)

    def recipe(self) -> dict[str, Any]:
        """The whole recipe this cell is: the base, then each axis's fragment merged in."""
        out = merge(BASE, {"name": self.id.replace("+", "-")})
        model = {k: v for k, v in MODELS[self.model].items() if k not in ("statistics_per_rank", "core_init")}
        for fragment in (model, {"strategy": strategy_block(self.strategy, self.model)},
                         PRECISIONS[self.precision], OPTIONS[self.option], INITS[self.init],
                         mesh_block(self.mesh, WORLD)):
            out = merge(out, fragment)
        return out


    def reference(self) -> tuple[dict[str, Any], int]:
        """(recipe, ranks) of the run this cell's loss trajectory must follow: the same recipe under
        DDP, every sample in the same group of samples per forward pass as in the cell.

        One process with the global batch, where a forward over several ranks' samples equals one over
        their union (no per-batch statistics). A model with BatchNorm normalises over each rank's (and
        each pipeline micro-batch's) own samples, so its reference is DDP on as many ranks as the cell
        has data-parallel replicas, each micro-batch a gradient-accumulation step. Compile is left
        out of the reference (the same arithmetic, and a compile costs more than the cell)."""
        recipe = self.recipe()
        block, batch = recipe["strategy"], recipe["data"]["batch_size"]
        microbatches = block.get("microbatches", 1)
        replicas = data_parallel(recipe, WORLD) if "parallel" in recipe else \
            registry.load("strategies", block["name"]).model_validate(block).data_parallel_size(WORLD)
        ranks = replicas if MODELS[self.model].get("statistics_per_rank") else 1
        accum = recipe["trainer"].get("grad_accum_steps", 1) * microbatches
        reference = merge(recipe, {"strategy": {"name": "ddp"}, "launch": {"nproc_per_node": ranks},
                                   "data": {"batch_size": batch * replicas // (microbatches * ranks)},
                                   "trainer": {"grad_accum_steps": accum},
                                   "performance": {"compile": False}})
        reference["strategy"] = {"name": "ddp"}
        reference.pop("parallel", None)
        return reference, ranks


def strategy_block(strategy: str, model: str) -> dict[str, Any]:
    block = STRATEGIES[strategy]
    return dict(block(model) if callable(block) else block)


def merge(base: dict, top: dict) -> dict:
    """`top` over `base`, dicts merged key by key (neither modified)."""
    out = dict(base)
    for key, value in top.items():
        out[key] = merge(out[key], value) if isinstance(out.get(key), dict) and isinstance(value, dict) else value
    return out


def core_cells() -> list[Cell]:
    """Every strategy x model family x precision (no performance option; seeded init where the family
    can be seeded)."""
    return [Cell(s, m, p, init=MODELS[m].get("core_init", "seeded")) for s in STRATEGIES for m in MODELS
            for p in PRECISIONS]


def pairwise_cells() -> list[Cell]:
    """Accepted cells that, with the core grid, hold every pair of (strategy, option, precision, model,
    init) values that any combination `validate` accepts holds (pairwise.covering_rows)."""
    return [Cell(**row) for row in _pair_covering().rows]


def refused_pairs() -> dict[tuple[str, str, str, str], Cell]:
    """(axis, value, axis, value) -> a refused cell holding it, for each pair every combination holding
    it is refused: nothing of it can train, and the cell's refusals say why."""
    return {pair: Cell(**row) for pair, row in _pair_covering().refused.items()}


@lru_cache(maxsize=None)
def _pair_covering() -> Covering:
    # the option's pairs first: tried orders gave 60 rows (9 of them compile, one per strategy that takes it
    # beside the FSDP regression) against 62 (10) for strategy first
    axes = {"option": PAIRED_OPTIONS, "precision": list(PRECISIONS), "strategy": list(STRATEGIES),
            "model": list(MODELS), "init": list(INITS)}
    def row(c: Cell) -> dict[str, str]:
        return {"strategy": c.strategy, "option": c.option, "precision": c.precision, "model": c.model,
                "init": c.init}

    core = [row(c) for c in core_cells()]
    # pairs the CI's CPU refused in every core cell holding them (DeepSpeed's fp16): trained on the CPU in
    # no row, so other rows hold the option pairs where they can
    on_cpu = refused_on("cpu", core, [c.id for c in core_cells()], load_results())
    return covering_rows(axes, lambda r: refusals(Cell(**r)), given=core + [row(c) for c in REGRESSIONS],
                         avoid=lambda r: any((a, r[a], b, r[b]) in on_cpu for a in r for b in r))


# combinations that crashed at run time on a ResNet (issue 26) and that neither set above holds
REGRESSIONS = [
    Cell("fsdp", "resnet18", "fp32", "channels_last"),  # "FSDP does not support non-contiguous parameters"
    Cell("fsdp", "resnet18", "fp32", "compile"),  # blocks of one class, different shapes: InductorError
]

# every combination a parallel: block makes (issue 30; meshes.py says which and why)
MESH_CELLS = [Cell(*row) for row in MESH_ROWS]

# compile with activation checkpointing where users run it (issue 40): DDP, FSDP, HSDP's replicate
# dimension and FSDP x TP, on the transformer whose blocks torchtitan checkpoints and compiles this way
COMBINED = [
    Cell("ddp", "transformer", "fp32", "compile+checkpointing"),
    Cell("fsdp", "transformer", "fp32", "compile+checkpointing"),
    Cell("fsdp", "transformer", "fp32", "compile+checkpointing", mesh="replicate"),
    Cell("fsdp", "transformer", "fp32", "compile+checkpointing", mesh="tp"),
]


def declared_cells() -> list[Cell]:
    """The grid: the core cells, then the pairwise ones and the regressions not already among them."""
    out: list[Cell] = []
    for cell in core_cells() + pairwise_cells() + REGRESSIONS + MESH_CELLS + COMBINED:
        if cell not in out:
            out.append(cell)
    return out


def find(cell_id: str) -> Optional[Cell]:
    return next((c for c in declared_cells() if c.id == cell_id), None)


# relative tolerance of each step's loss against the reference run, per precision, and why
TOLERANCE: dict[str, tuple[float, str]] = {
    "fp32": (1e-5, "the same arithmetic in another summation order (per-rank means averaged, shards "
                   "reduced): ~1e-7 per step; a missed reduction or a wrong sample split moves the loss "
                   "by 1e-3 or more"),
    "bf16": (3e-2, "autocast rounds each matmul/convolution output to 8 significant bits (2^-8 = 0.4%); "
                   "the cell and its reference round partial sums of different shapes (half-batches, "
                   "shards), and those differences pass through 3 optimizer steps"),
    "fp16-dynamic": (1e-2, "11 significant bits (2^-11 = 0.05% per rounding), the same reasoning as bf16; "
                           "BatchNorm over 2-4 samples amplifies it (a ResNet cell measured 5.1e-3)"),
    "fp16-fixed": (1e-2, "as fp16 dynamic: a fixed scale changes no arithmetic while nothing overflows"),
}
# strategies whose bf16 is not autocast: DeepSpeed casts the model's parameters to bf16 (fp32 master
# weights in the optimizer) and keeps BatchNorm statistics in bf16, so its losses are not those of the
# autocast reference rounded differently. Compared with the bf16 tolerance where no BatchNorm is involved;
# with BatchNorm over 4 samples of 1x1 maps the rounding of bf16 weights is amplified step by step
# (ZeRO-1 measured 0.33 relative at step 2, and ZeRO-3 with and without offload differed from each other
# by as much), so those cells are checked for training, resume and export only.
BF16_PARAMETERS = {"zero1", "zero2", "zero3", "zero3+offload"}


# after the first step, a BatchNorm model's losses amplify any difference in summation order: the
# statistics of 4 samples of 1x1 maps (layer4 of a ResNet on small images) turned a 6e-7 difference at
# step 1 (an FSDP channels_last ResNet in fp32 on 8x8 images: NHWC inputs, NCHW weights; the reference
# converts both) into 8.6e-3 at step 2, and compile's reordering into 1.4e-2 at step 3
LATER_STEPS_WITH_BATCHNORM = 5e-2


def tolerance(cell: "Cell") -> tuple[Optional[float], Optional[float], str]:
    """(relative tolerance of step 1's loss, of the later steps', why); None: not compared."""
    tol, why = TOLERANCE[cell.precision]
    batchnorm = MODELS[cell.model].get("statistics_per_rank")
    if cell.precision == "bf16" and cell.strategy in BF16_PARAMETERS and batchnorm:
        return None, None, ("DeepSpeed trains bf16 parameters (not autocast) and keeps BatchNorm statistics in bf16; "
                            "over BatchNorm of 4 samples the difference to the autocast reference is not a rounding "
                            "tolerance")
    if batchnorm:
        return tol, max(tol, LATER_STEPS_WITH_BATCHNORM), why + "; later steps of a BatchNorm model: see grid.py"
    return tol, tol, why
