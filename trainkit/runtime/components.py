"""Build a run's strategy and task from the resolved recipe.

Each component class names the recipe facts it takes beyond its own block (`run_inputs(recipe)`, a
classmethod returning constructor keywords), so a component's constructor signature shows what it
depends on and nothing below this module reads the whole recipe. A task plugin written before
`run_inputs` existed is still built as ``Task(options, *, device, recipe)`` (docs/plugins.md).
"""

from __future__ import annotations

import torch

from .. import registry


def build_strategy(recipe, *, device: torch.device, precision, dims=None, mesh=None):
    """The recipe's strategy for this process: its options, the device, the run's precision, dims and
    mesh, and what its class takes from the recipe (`Strategy.run_inputs`)."""
    cls = registry.component(recipe.strategy)
    return cls(recipe.strategy, device=device, precision=precision, dims=dims, mesh=mesh, **cls.run_inputs(recipe))


def build_task(recipe, device: torch.device):
    """The recipe's task on `device` (the meta device for a FLOPs estimate)."""
    cls = registry.component(recipe.task)
    run_inputs = getattr(cls, "run_inputs", None)
    inputs = run_inputs(recipe) if run_inputs is not None else {"recipe": recipe}
    return cls(recipe.task, device=device, **inputs)
