"""Save a trained model as an MLflow PyTorch model folder (`mlflow.pytorch.load_model` gives it back).

Takes a built module: the training side (the launcher) rebuilds and loads the model, so tracking
never imports the runtime's model code.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch


def save_pytorch_model(model: torch.nn.Module, folder: Path, example_input: torch.Tensor) -> Path:
    """Write `model` to `folder` (replaced if present); returns it."""
    import mlflow.pytorch

    folder = Path(folder)
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        try:  # MLflow 3's default: a torch.export graph, which needs an example input
            mlflow.pytorch.save_model(model, f"{tmp}/model", input_example=example_input.numpy())
        except Exception:  # models torch.export cannot trace: the pickled module
            shutil.rmtree(f"{tmp}/model", ignore_errors=True)
            mlflow.pytorch.save_model(model, f"{tmp}/model", serialization_format="pickle")
        shutil.rmtree(folder, ignore_errors=True)
        Path(f"{tmp}/model").rename(folder)
    return folder
