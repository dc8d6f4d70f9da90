"""The `wide_mlp` model factory (an entry point; the mark also lets recipes name it by import path,
`trainkit_example_plugin.models:wide_mlp`)."""

import trainkit


@trainkit.model_factory
def wide_mlp(in_features: int = 32, width: int = 1024, num_classes: int = 4):
    import torch.nn as nn

    return nn.Sequential(nn.Flatten(), nn.Linear(in_features, width), nn.ReLU(), nn.Linear(width, num_classes))
