"""Names other frameworks use for trainkit's keys and values: used only to suggest the right one.

A recipe that writes an alias is still rejected (a recipe means one thing, whoever reads it); the
error says what trainkit calls it. docs/recipes.md lists this table; a test keeps them in step.
"""

from __future__ import annotations

from typing import Optional

# value aliases: path of the field -> {alias: what to write instead}
STRATEGY_NAMES = {
    "DDP": "ddp", "ddp_spawn": "ddp", "ddp_find_unused_parameters_true": "ddp",
    "FSDP": "fsdp", "fsdp2": "fsdp", "fully_sharded": "fsdp", "fully_shard": "fsdp",
    "zero0": "{name: deepspeed, zero_stage: 0}", "zero1": "{name: deepspeed, zero_stage: 1}",
    "zero2": "{name: deepspeed, zero_stage: 2}", "zero3": "{name: deepspeed, zero_stage: 3}",
    "deepspeed_stage_1": "{name: deepspeed, zero_stage: 1}", "deepspeed_stage_2": "{name: deepspeed, zero_stage: 2}",
    "deepspeed_stage_3": "{name: deepspeed, zero_stage: 3}",
    "deepspeed_stage_3_offload": "{name: deepspeed, zero_stage: 3, offload_optimizer: cpu, offload_param: cpu}",
    "DeepSpeed": "deepspeed",
    "pipe": "pipeline", "pippy": "pipeline", "pipeline_parallel": "pipeline", "PP": "pipeline",
}
PRECISIONS = {
    "amp": "fp16", "16": "fp16", "16-mixed": "fp16", "float16": "fp16", "half": "fp16", "fp16-mixed": "fp16",
    "bf16-mixed": "bf16", "bfloat16": "bf16", "bf16-true": "bf16",
    "32": "fp32", "32-true": "fp32", "float32": "fp32", "full": "fp32",
}
VALUES: dict[tuple, dict[str, str]] = {("strategy", "name"): STRATEGY_NAMES, ("precision",): PRECISIONS}

# key aliases: section -> {alias: (trainkit key as written from the recipe's top level, how to convert)}
_EPOCHS = ("trainer.max_steps", "trainkit counts optimizer steps, not epochs: max_steps = epochs x steps per "
                                "epoch, which `trainkit plan` prints")
_ACCUM = ("trainer.grad_accum_steps", "")
KEYS: dict[tuple, dict[str, tuple[str, str]]] = {
    ("optimizer",): {"learning_rate": ("optimizer.lr", ""), "lr0": ("optimizer.lr", ""),
                     "weight_decay_rate": ("optimizer.weight_decay", "")},
    ("trainer",): {"max_epochs": _EPOCHS, "num_epochs": _EPOCHS, "epochs": _EPOCHS,
                   "gradient_accumulation_steps": _ACCUM, "accumulate_grad_batches": _ACCUM,
                   "gradient_clip_val": ("trainer.grad_clip", ""), "max_grad_norm": ("trainer.grad_clip", "")},
    ("data",): {"micro_batch_size": ("data.batch_size", ""), "train_micro_batch_size_per_gpu": ("data.batch_size", "")},
    ("launch",): {"gpus": ("launch.nproc_per_node", ""), "devices": ("launch.nproc_per_node", ""),
                  "num_nodes": ("launch.nnodes", "")},
    ("strategy",): {"stage": ("strategy.zero_stage", "")},
}
# at the top level, every alias above and every key of a section (max_steps -> trainer.max_steps)
SECTIONS = ("trainer", "data", "optimizer", "scheduler", "launch", "tracking", "strategy", "model")


def key_hint(section: tuple, key: str, section_fields: dict[str, list[str]]) -> Optional[str]:
    """What to write instead of the unknown `key` under `section` (() is the top level), or None.

    `section_fields` maps each top-level section to its accepted keys (from the schema).
    """
    key = str(key)
    if section in KEYS and key in KEYS[section]:
        return _say(*KEYS[section][key], relative_to=section)
    if section != ():
        return None
    for aliases in KEYS.values():
        if key in aliases:
            return _say(*aliases[key], relative_to=())
    owners = [s for s in SECTIONS if key in section_fields.get(s, []) and key != "name"]
    if owners:
        return _say(f"{owners[0]}.{key}", "", relative_to=())
    return None


def value_hint(path: tuple, value: object) -> Optional[str]:
    """What to write instead of the rejected `value` at `path`, or None."""
    table = VALUES.get(tuple(path))
    if table is None or str(value) not in table:
        return None
    right = table[str(value)]
    if right.startswith("{"):
        return f"did you mean {path[0]}: {right}?"
    return f"did you mean '{right}'?"


def _say(target: str, how: str, relative_to: tuple) -> str:
    prefix = ".".join(relative_to) + "." if relative_to else ""
    shown = target[len(prefix):] if target.startswith(prefix) else target
    return f"did you mean '{shown}'?" + (f" ({how})" if how else "")
