"""The interface the training loop talks to; one file per strategy implements it.

The loop never branches on a strategy's name: wrapping, gradient sync, clipping and the model /
optimizer part of checkpoints all go through these methods (like Lightning Fabric's strategies).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import ContextManager

import torch
import torch.distributed as dist
from torch import nn


class Strategy:
    """Default behaviour is plain data parallel bookkeeping; subclasses override what differs."""

    def __init__(self, options, *, device: torch.device):
        self.options, self.device = options, device

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    def setup(self, model: nn.Module, optimizer_factory) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Wrap the model for this strategy and build the optimizer over the wrapped parameters."""
        raise NotImplementedError

    def no_sync(self, model: nn.Module) -> ContextManager:
        """Context for accumulation micro-steps whose gradients need not be synchronised yet."""
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def all_reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Mean of a tensor over all ranks (a copy; the input is unchanged)."""
        out = value.detach().clone().float()
        if self.world_size > 1:
            dist.all_reduce(out, op=dist.ReduceOp.SUM)
            out /= self.world_size
        return out

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        out = value.detach().clone()
        if self.world_size > 1:
            dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def replica_digests(self, model: nn.Module) -> list[str]:
        """sha256 of each rank's parameters (replicas must agree): a cheap end-of-run sanity check."""
        import hashlib

        h = hashlib.sha256()
        for p in self.unwrap(model).parameters():
            h.update(p.detach().cpu().contiguous().numpy().tobytes())
        digests = [None] * self.world_size
        if self.world_size > 1:
            dist.all_gather_object(digests, h.hexdigest())
        else:
            digests = [h.hexdigest()]
        return digests

    # ---- checkpoints: the strategy writes/reads the model and optimizer files in a checkpoint folder
    def save_checkpoint(self, folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        raise NotImplementedError

    def load_checkpoint(self, folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        raise NotImplementedError

    def teardown(self) -> None:
        pass
