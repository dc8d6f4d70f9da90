"""The monitor plugin interface and the set the training loop drives.

Monitors see every rank's hooks; at log steps each rank's `collect()` values are gathered to rank 0
in ONE collective for all monitors, where `report()` turns them into metrics. A recipe without
monitors pays nothing: the set is empty and no gather happens.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import registry
from ..runtime.timing import StepTimes

__all__ = ["Monitor", "MonitorContext", "MonitorSet", "RunFacts", "StepTimes", "build_monitors", "context"]


@dataclass(frozen=True)
class RunFacts:
    """The few facts of the run that monitors read, instead of the whole recipe."""

    precision: str  # fp32 | bf16 | fp16
    tf32: bool  # performance.tf32: fp32 matmuls on tensor cores (the peak MFU is measured against)
    samples_per_replica: int  # samples one data-parallel replica takes per optimizer step (Recipe.global_batch_at(1))
    grad_accum_steps: int
    model_spec: Any  # the model block: built on the meta device to count a pipeline stage's FLOPs
    data: Any  # the data block: its input shape
    task: Any  # the run's task (runtime.protocols.Task): its FLOPs estimate

    def global_batch_at(self, data_parallel_size: int) -> int:
        """Samples per optimizer step with `data_parallel_size` replicas (`Recipe.global_batch_at`, the one
        formula, taken at one replica)."""
        return self.samples_per_replica * data_parallel_size

    @classmethod
    def of(cls, recipe, task) -> "RunFacts":
        return cls(precision=recipe.precision, tf32=recipe.performance.tf32,
                   samples_per_replica=recipe.global_batch_at(1), grad_accum_steps=recipe.trainer.grad_accum_steps,
                   model_spec=recipe.model, data=recipe.data, task=task)


@dataclass
class MonitorContext:
    rank: int
    local_rank: int
    world_size: int
    node_rank: int
    hostname: str
    device: torch.device
    run_dir: Path
    run: RunFacts
    strategy: Any
    model: torch.nn.Module
    facts: dict = field(default_factory=dict)  # measured once, shared: e.g. flops_per_step


class Monitor:
    """Override what you need; every hook is optional."""

    def __init__(self, options, ctx: MonitorContext):
        self.options, self.ctx = options, ctx

    @property
    def name(self) -> str:
        return self.options.name

    def on_run_start(self) -> None: ...

    def on_step_start(self, step: int) -> None: ...

    def on_step_end(self, step: int, times: StepTimes) -> None: ...

    def on_eval(self, step: int, metrics: dict) -> None: ...

    def on_checkpoint(self, step: int, path: Path) -> None: ...

    def on_log(self, step: int, metrics: dict) -> None:
        """Every rank, at log steps, with what the loop logs (rank 0: including every monitor's metrics)."""

    def on_exception(self, exc: BaseException) -> None: ...

    def collect(self, step: int) -> dict:
        """This rank's values since the last log step (every rank calls this at log steps)."""
        return {}

    def report(self, step: int, per_rank: list[dict]) -> dict:
        """Rank 0: metrics to log from every rank's `collect()` values."""
        return {}

    def finish(self, per_rank: list[dict]) -> Optional[str]:
        """Rank 0, at the end: a markdown section for the run report (or None)."""
        return None

    def close(self) -> None: ...


class MonitorSet:
    """The enabled monitors of a run; the loop calls these and never a monitor directly."""

    def __init__(self, monitors: list[Monitor], ctx: MonitorContext):
        self.monitors, self.ctx = monitors, ctx

    def __bool__(self) -> bool:
        return bool(self.monitors)

    def wants(self, attr: str) -> bool:
        return any(getattr(m, attr, False) for m in self.monitors)

    def call(self, hook: str, *args) -> None:
        for m in self.monitors:
            fn = getattr(m, hook, None)  # a third-party monitor written before a hook existed lacks it
            if fn is not None:
                fn(*args)

    def _gather(self, local: dict) -> list[dict]:
        if self.ctx.world_size == 1:
            return [local]
        out: list = [None] * self.ctx.world_size
        dist.all_gather_object(out, local)
        return out

    def log_step(self, step: int) -> dict:
        """Every rank; returns the metrics to log (non-empty on rank 0 only)."""
        if not self.monitors:
            return {}
        gathered = self._gather({m.name: m.collect(step) for m in self.monitors})
        if self.ctx.rank != 0:
            return {}
        metrics: dict = {}
        for m in self.monitors:
            metrics.update(m.report(step, [g[m.name] for g in gathered]))
        return metrics

    def finish(self) -> list[str]:
        """Every rank; the report sections (rank 0)."""
        if not self.monitors:
            return []
        gathered = self._gather({m.name: m.collect(-1) for m in self.monitors})
        sections = []
        if self.ctx.rank == 0:
            for m in self.monitors:
                text = m.finish([g[m.name] for g in gathered])
                if text:
                    sections.append(text)
        for m in self.monitors:
            m.close()
        return sections


def build_monitors(monitors: list, ctx: MonitorContext) -> MonitorSet:
    """The recipe's `monitors:` options, each built with the shared context."""
    return MonitorSet([registry.component(options)(options, ctx) for options in monitors], ctx)


def context(run: RunFacts, strategy, model, device, run_dir: Path) -> MonitorContext:
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    return MonitorContext(rank=rank, local_rank=int(os.environ.get("LOCAL_RANK", "0")), world_size=world,
                          node_rank=int(os.environ.get("GROUP_RANK", "0")), hostname=socket.gethostname(),
                          device=device, run_dir=run_dir, run=run, strategy=strategy, model=model)
