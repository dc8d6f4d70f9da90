"""`task: classification` (the default): cross-entropy on `(inputs, labels[, unreadable flag])`
batches; evaluation reports loss and accuracy. FLOPs are counted by FlopCounterMode on a meta-device
copy of the model (no memory, no effect on training)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..runtime.model import build_model
from ..runtime.performance import channels_last_input


class ClassificationTask:
    """Cross-entropy on `(inputs, labels)` batches; evaluation reports loss and accuracy."""

    num_eval_sums = 3

    def __init__(self, options: Any = None, *, device: torch.device, model_spec: Any = None, data: Any = None,
                 channels_last: bool = False):
        """`model_spec` and `data`: the recipe's model and data blocks (the FLOPs count builds the model on
        the meta device at the data's input shape); `channels_last`: performance.channels_last, 4-D inputs
        in NHWC like the model's weights."""
        self.options, self.device, self.model_spec, self.data = options, device, model_spec, data
        self.channels_last = channels_last
        self.loss_fn = nn.CrossEntropyLoss()

    @classmethod
    def run_inputs(cls, recipe) -> dict:
        """The constructor keywords taken from the resolved recipe beyond the task's own block."""
        return {"model_spec": recipe.model, "data": recipe.data, "channels_last": recipe.performance.channels_last}

    def to_device(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch[0], batch[1]
        x = x.to(self.device, non_blocking=True)
        if self.channels_last:
            x = channels_last_input(x)
        return x, y.to(self.device, non_blocking=True)

    def eval_sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """[loss sum, correct, count] in float64, so sums over batches and ranks stay exact."""
        return torch.stack([nn.functional.cross_entropy(outputs.float(), targets, reduction="sum").double(),
                            (outputs.argmax(1) == targets).sum().double(),
                            torch.tensor(float(len(targets)), device=self.device, dtype=torch.float64)])

    def eval_metrics(self, sums: torch.Tensor) -> dict:
        n = max(sums[2].item(), 1.0)
        return {"eval_loss": sums[0].item() / n, "eval_accuracy": sums[1].item() / n}

    def log_metrics(self, metrics: dict) -> dict:
        return {}

    def flops_per_microbatch(self) -> Optional[float]:
        """FLOPs of one forward+backward of one micro-batch per rank, counted on the meta device."""
        from torch.utils.flop_counter import FlopCounterMode

        data = self.data
        if data is None or self.model_spec is None:
            return None
        shape = getattr(data, "shape", None)
        if shape is None and hasattr(data, "image_size"):
            shape = [3, data.image_size, data.image_size]
        if shape is None:
            return None
        with torch.device("meta"):
            model = build_model(self.model_spec.model_copy(update={"weights": None}))
            x = torch.empty(data.batch_size, *shape)
        counter = FlopCounterMode(display=False)
        with counter:
            model(x).float().sum().backward()
        return float(counter.get_total_flops())
