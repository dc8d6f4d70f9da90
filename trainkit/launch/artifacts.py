"""What `tracking.log_checkpoints` / `tracking.log_model` add to a run's MLflow record.

Built here, on the training side of the house: finding the newest valid checkpoint and
consolidating any strategy's files into one model both belong to the runtime, which tracking
must not import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from ..recipe.schema import Recipe
from ..run_dir import CHECKPOINTS, MODEL
from ..runtime.checkpoint import newest_valid
from ..runtime.export import consolidated_state_dict
from ..runtime.materialize import parameters_on_meta
from ..runtime.model import build_model
from ..tracking.mlflow_model import save_pytorch_model


def example_input(recipe: Recipe) -> torch.Tensor:
    """Two zero samples shaped like the recipe's data (MLflow records the signature from them)."""
    data = recipe.data
    size = getattr(data, "image_size", None) or 224
    shape = getattr(data, "shape", None) or [3, size, size]
    return torch.zeros(2, *shape)


def model_artifacts(recipe: Recipe, run_dir: Path, status: str) -> tuple[list[tuple[Path, Optional[str]]], dict]:
    """(artifacts as (path, artifact folder), tags) for the run's close."""
    t = recipe.tracking
    if not (t.log_checkpoints or t.log_model):
        return [], {}  # finding the newest valid checkpoint re-hashes its files: only when asked
    newest = newest_valid(run_dir / CHECKPOINTS, warn=False)
    if newest is None:
        return [], {}
    artifacts: list[tuple[Path, Optional[str]]] = []
    if t.log_checkpoints:
        artifacts.append((newest, f"checkpoints/{newest.name}"))
    if t.log_model and status == "FINISHED":
        try:
            with parameters_on_meta():  # the consolidated tensors become the parameters: one copy, not two
                model = build_model(recipe.model.model_copy(update={"weights": None}))
            model.load_state_dict(consolidated_state_dict(newest)[1], assign=True)
            model.eval()
            artifacts.append((save_pytorch_model(model, run_dir / MODEL, example_input(recipe)), "model"))
        except Exception as exc:  # a model that cannot be saved must not hold back the run's status
            return artifacts, {"trainkit.log_model_error": f"{type(exc).__name__}: {exc}"[:5000]}
    return artifacts, {}
