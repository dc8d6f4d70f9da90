"""Optimizers and learning-rate schedules by name (the recipe's `optimizer` and `scheduler`)."""

from __future__ import annotations

import math

import torch

from ..recipe.blocks import AdamOptions, SchedulerOptions, SGDOptions


def trainable(params) -> list:
    """The parameters (or param groups, as the pipeline passes them) that train: a frozen base gets no
    optimizer state."""
    out = []
    for p in params:
        if isinstance(p, dict):
            out.append({**p, "params": [q for q in p["params"] if q.requires_grad]})
        elif p.requires_grad:
            out.append(p)
    return out


def build_optimizer(options: SGDOptions | AdamOptions, params) -> torch.optim.Optimizer:
    """The optimizer over the trainable parameters (a frozen base -- LoRA -- gets no state at all)."""
    params = trainable(params)
    if options.name == "sgd":
        return torch.optim.SGD(params, lr=options.lr, momentum=options.momentum,
                               weight_decay=options.weight_decay, nesterov=options.nesterov)
    cls = torch.optim.Adam if options.name == "adam" else torch.optim.AdamW
    return cls(params, lr=options.lr, betas=tuple(options.betas), eps=options.eps,
               weight_decay=options.weight_decay)


def lr_factor(options: SchedulerOptions, step: int, max_steps: int) -> float:
    """Multiplier of the base lr after `step` optimizer steps: linear warm-up, then the decay shape."""
    warm = options.warmup_steps
    if warm and step < warm:
        return (step + 1) / warm
    floor = options.min_lr_ratio
    if options.name == "constant":
        return 1.0
    if options.name == "step":
        size = options.step_size or max(1, max_steps // 3)
        return max(floor, options.gamma ** ((step - warm) // size))
    progress = min(1.0, (step - warm) / max(1, max_steps - warm))
    if options.name == "cosine":
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return floor + (1 - floor) * (1 - progress)  # linear


def build_scheduler(options: SchedulerOptions, optimizer: torch.optim.Optimizer, max_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(options, step, max_steps))
