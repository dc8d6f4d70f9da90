"""The small interfaces the training loop talks to. Implementations live elsewhere (strategies,
monitors, tracking, tasks); the loop depends only on these, so it never imports them.

This is the loop's boundary that later features build on: a *task* says how a batch reaches the
device and what the loss is; a *strategy* owns the forward/backward and the optimizer step (the
pipeline computes the loss on its last stage, DeepSpeed's engine runs its own backward).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, ContextManager, Optional, Protocol, runtime_checkable

import torch
from torch import nn

from .timing import StepTimes


@runtime_checkable
class Precision(Protocol):
    """Autocast and loss scaling (runtime.precision.Precision)."""

    scaler: Any  # a torch GradScaler when fp16 loss scaling is on (it skips overflowing steps itself), else None

    def autocast(self) -> ContextManager: ...
    def backward(self, loss: torch.Tensor) -> None: ...
    def unscale(self, optimizer: torch.optim.Optimizer) -> None: ...
    def step(self, optimizer: torch.optim.Optimizer) -> None: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class Strategy(Protocol):
    """What the loop asks of a parallel strategy (strategies.base.Strategy implements it)."""

    comm_timer: Any

    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def data_parallel_size(self) -> int: ...
    def forward_backward(self, model: nn.Module, x: Any, y: Any, loss_fn: Callable, precision: Precision, *,
                         grad_accum_steps: int, last_micro_step: bool) -> torch.Tensor: ...
    def optimizer_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, precision: Precision,
                       max_norm: Optional[float]) -> Optional[torch.Tensor]: ...
    def loss_scale_overflow(self) -> Optional[torch.Tensor]:
        """After optimizer_step: nonzero when fp16 loss scaling skipped the step (inf gradients)."""
    def eval_forward(self, model: nn.Module, x: Any, precision: Precision) -> torch.Tensor: ...
    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor: ...
    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor: ...
    def all_reduce_max(self, value: torch.Tensor) -> torch.Tensor: ...
    def local_tensors(self, model: nn.Module) -> Any:
        """This rank's view of the weights (a collective for sharded strategies)."""


@runtime_checkable
class Task(Protocol):
    """What is being learned: how a batch reaches the device, the loss, the evaluation metrics."""

    loss_fn: Callable[[Any, Any], torch.Tensor]  # (outputs, targets) -> mean loss of a micro-batch
    num_eval_sums: int  # length of the eval_sums vector

    def to_device(self, batch: Any) -> tuple[Any, Any]:
        """(inputs, targets) on the run's device, with any input transform applied."""
    def eval_sums(self, outputs: torch.Tensor, targets: Any) -> torch.Tensor:
        """Per-batch sums (float64, on the device, `num_eval_sums` long) that add up across batches and ranks."""
    def eval_metrics(self, sums: torch.Tensor) -> dict:
        """Metrics from the all-reduced sums."""
    def log_metrics(self, metrics: dict) -> dict:
        """Extra metrics at a log step, from the loop's (`loss` is already the mean over ranks)."""
    def flops_per_microbatch(self) -> Optional[float]:
        """Forward+backward FLOPs of one micro-batch on one rank (for MFU), or None if unknown."""


@runtime_checkable
class Checkpointer(Protocol):
    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict) -> Path: ...
    def take_sealed(self) -> list[tuple[int, Path]]:
        """(step, folder) of the checkpoints complete since the last call (a background save's come later)."""


@runtime_checkable
class MetricSink(Protocol):
    """Rank 0's consumers of logged metrics (metrics.jsonl, the MLflow spool, the progress bar)."""

    def log(self, metrics: dict, step: int) -> None: ...
    def rewind(self, step: int) -> None:
        """Training (re)starts at `step`: anything recorded after it belongs to an abandoned timeline."""
    def close(self) -> None: ...


@runtime_checkable
class Progress(Protocol):
    def due(self, step: int) -> bool: ...
    def update(self, step: int, loss: float) -> None: ...
    def rate(self, step: int) -> float: ...
    def close(self) -> None: ...


@runtime_checkable
class MonitorHooks(Protocol):
    """The enabled monitors as one object (monitors.base.MonitorSet implements it)."""

    def call(self, hook: str, *args: Any) -> None: ...
    def log_step(self, step: int) -> dict: ...
    def finish(self) -> list[str]: ...


class NoMonitors:
    """A recipe without monitors: every hook is free and nothing is gathered."""

    def __bool__(self) -> bool:
        return False

    def call(self, hook: str, *args: Any) -> None:
        pass

    def log_step(self, step: int) -> dict:
        return {}

    def finish(self) -> list[str]:
        return []


__all__ = ["Checkpointer", "MetricSink", "MonitorHooks", "NoMonitors", "Precision", "Progress", "StepTimes",
           "Strategy", "Task"]
