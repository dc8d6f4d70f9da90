"""The `regression` task: a complete custom task (see docs/plugins.md, "Tasks").

Two halves, like every plugin: `RegressionOptions` is the light options model `trainkit validate`
imports (pydantic only); `RegressionTask` is the runtime piece its `component` names, built once
per rank as ``RegressionTask(options, *, device, model_spec, data)``: what `run_inputs` takes from
the recipe.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional

from pydantic import Field

from trainkit.recipe.blocks import TaskOptions


class RegressionOptions(TaskOptions):
    """Mean squared error on (features, target) batches; eval reports MSE and MAE."""

    component: ClassVar[str] = "trainkit_example_plugin.tasks:RegressionTask"
    name: Literal["regression"]
    huber_delta: Optional[float] = Field(default=None, gt=0, description="Huber loss with this delta (null: MSE)")


class RegressionTask:
    num_eval_sums = 3  # squared error, absolute error, count

    def __init__(self, options: RegressionOptions, *, device, model_spec: Any, data: Any):
        import torch

        self.options, self.device, self.model_spec, self.data = options, device, model_spec, data
        self.loss_fn = (torch.nn.HuberLoss(delta=options.huber_delta) if options.huber_delta
                        else torch.nn.MSELoss())

    @classmethod
    def run_inputs(cls, recipe) -> dict:
        """What the task takes from the resolved recipe beyond its own block (the FLOPs count builds
        the model at the data's input size)."""
        return {"model_spec": recipe.model, "data": recipe.data}

    def to_device(self, batch):
        x, y = batch[0], batch[1]
        return x.to(self.device), y.to(self.device).float().reshape(len(y), -1)

    def eval_sums(self, outputs, targets):
        import torch

        err = outputs.float() - targets
        return torch.stack([err.pow(2).sum().double(), err.abs().sum().double(),
                            torch.tensor(float(targets.numel()), dtype=torch.float64, device=self.device)])

    def eval_metrics(self, sums) -> dict:
        n = max(sums[2].item(), 1.0)
        return {"eval_mse": sums[0].item() / n, "eval_mae": sums[1].item() / n}

    def log_metrics(self, metrics: dict) -> dict:
        return {"rmse": metrics["loss"] ** 0.5} if not self.options.huber_delta else {}

    def flops_per_microbatch(self) -> Optional[float]:
        """Counted by FlopCounterMode on a meta-device copy of the model (as classification does)."""
        import torch
        from torch.utils.flop_counter import FlopCounterMode

        from trainkit.runtime.model import build_model

        with torch.device("meta"):
            model = build_model(self.model_spec.model_copy(update={"weights": None}))
            x = torch.empty(self.data.batch_size, self.data.dim)
        counter = FlopCounterMode(display=False)
        with counter:
            model(x).float().sum().backward()
        return float(counter.get_total_flops())
