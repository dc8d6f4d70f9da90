"""What `tracking.log_checkpoints` / `tracking.log_model` add to a run's MLflow record.

Built here, on the training side of the house: finding the newest valid checkpoint and
consolidating any strategy's files into one model both belong to the runtime, which tracking
must not import.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Optional

import torch

from ..recipe.schema import Recipe
from ..run_dir import CHECKPOINTS, MODEL
from ..runtime.checkpoint import newest_valid
from ..runtime.export import consolidated_state_dict
from ..runtime.export_hf import export_hf
from ..runtime.materialize import parameters_on_meta
from ..runtime.model import build_model
from ..tracking.mlflow_model import save_pytorch_model, save_transformers_model


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
            artifacts.append((_saved_model(recipe, run_dir, newest), "model"))
        except Exception as exc:  # a model that cannot be saved must not hold back the run's status
            return artifacts, {"trainkit.log_model_error": f"{type(exc).__name__}: {exc}"[:5000]}
    return artifacts, {}


def _saved_model(recipe: Recipe, run_dir: Path, checkpoint: Path) -> Path:
    """The checkpoint's model as an MLflow model folder: a Hugging Face model (one that writes itself as a
    Hugging Face directory, `save_merged`: LoRA adapters folded in) in the transformers flavour, any
    other as a PyTorch model."""
    with parameters_on_meta():  # the consolidated tensors become the parameters: one copy, not two
        model = build_model(recipe.model.model_copy(update={"weights": None}))
    if hasattr(model, "save_merged"):  # `trainkit export --hf`'s directory, then MLflow's flavour reads it
        del model
        with tempfile.TemporaryDirectory(dir=run_dir) as hf_dir:
            export_hf(checkpoint, Path(hf_dir) / "hf")
            return save_transformers_model(Path(hf_dir) / "hf", run_dir / MODEL, getattr(recipe.data, "tokenizer", None))
    model.load_state_dict(consolidated_state_dict(checkpoint)[1], assign=True)
    model.eval()
    return save_pytorch_model(model, run_dir / MODEL, example_input(recipe))
