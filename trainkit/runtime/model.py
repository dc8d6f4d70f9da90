"""Build the model a recipe names: `torchvision.<name>`, `pkg.module:factory`, or a plugin."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .. import registry
from ..recipe.blocks import ModelSpec


def factory(name: str):
    """The callable behind a model name (raises ImportError/KeyError/PluginError with context)."""
    if name.startswith("torchvision."):
        import torchvision

        short = name.split(".", 1)[1]
        if short not in torchvision.models.list_models(module=torchvision.models):
            raise KeyError(f"torchvision has no classification model '{short}'")
        return lambda **kw: torchvision.models.get_model(short, weights=None, **kw)
    if ":" in name:
        return registry.import_path(name)
    return registry.load("models", name)


def build_model(spec: ModelSpec) -> nn.Module:
    """Instantiate the model; load `spec.weights` (a local state_dict file) if given, never download."""
    model = factory(spec.name)(**spec.args)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model factory {spec.name} returned {type(model).__name__}, not a torch.nn.Module")
    if spec.weights:
        state = torch.load(Path(spec.weights).expanduser(), map_location="cpu", weights_only=True)
        for key in ("model", "state_dict"):
            if isinstance(state, dict) and key in state and isinstance(state[key], dict):
                state = state[key]
        model.load_state_dict(state)
    return model
