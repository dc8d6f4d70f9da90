"""Accepted recipe changes to the optimizer, the scheduler or `trainer.max_steps` take effect on resume.

Why it is needed: the launcher lets such a change through (`--accept-changes`, an explicit
`trainer.resume: PATH`, or a `max_steps` a constant schedule does not depend on), but the
checkpoint's optimizer and scheduler state carry the old hyperparameters and, loaded as they are,
would win. This sets the new ones and replays the learning-rate schedule to the resumed step.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.distributed as dist

from ..recipe import drift
from ..recipe.schema import Recipe
from .optim import build_optimizer, build_scheduler


def changes_hyperparameters(saved: Optional[dict], now: dict) -> bool:
    """Does the recipe now differ from the checkpoint's in what the optimizer or the schedule use?"""
    return saved is not None and any(c.key.startswith(("optimizer.", "scheduler.")) or c.key == "trainer.max_steps"
                                     for c in drift.changes(saved, now))


def apply_to_optimizer(saved: Optional[dict], now: dict, recipe: Recipe, optimizer, scheduler, step: int):
    """Set the recipe's hyperparameters on every param group and return a schedule rebuilt and
    replayed to `step`; the loaded `scheduler` unchanged when nothing it depends on changed."""
    if not changes_hyperparameters(saved, now):
        return scheduler
    defaults = build_optimizer(recipe.optimizer, [torch.nn.Parameter(torch.zeros(1))]).defaults
    for group in optimizer.param_groups:
        group.update({k: v for k, v in defaults.items() if k in group})
        group["initial_lr"] = defaults["lr"]
    fresh = build_scheduler(recipe.scheduler, optimizer, recipe.trainer.max_steps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()": a replay, on purpose
        for _ in range(step):
            fresh.step()
    if dist.get_rank() == 0:
        print(f"trainkit: accepted recipe changes take effect at step {step}: lr {optimizer.param_groups[0]['lr']:.6g}",
              flush=True)
    return fresh
