"""Tasks: what a run learns. The loop asks the task to move a batch to the device and for the loss
function it hands to the strategy; evaluation sums and metrics come from the task too.

`ClassificationTask` is trainkit's behaviour for `(image, label[, unreadable flag])` batches and
cross-entropy; other tasks implement the same `runtime.protocols.Task` interface.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .performance import channels_last_input


class ClassificationTask:
    """Cross-entropy on `(inputs, labels)` batches; evaluation reports loss and accuracy."""

    def __init__(self, device: torch.device, *, channels_last: bool = False):
        self.device = device
        self.channels_last = channels_last  # performance.channels_last: 4-D inputs in NHWC, like the model
        self.loss_fn = nn.CrossEntropyLoss()

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
