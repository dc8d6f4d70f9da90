"""Non-finite loss and gradient-norm detection: a NaN must never reach a checkpoint.

`stop` mode costs no device sync per step: each step folds "is this value finite?" into a small
tensor on the device (the first bad step of the loss and of the gradient norm), and the loop reads
it — one collective, all ranks together — only at log steps and before each checkpoint. Before a
checkpoint the weights themselves are checked too (an inf gradient with a finite loss poisons the
weights one step before the loss shows it).

`skip_step` mode must decide before the optimizer step, so it syncs once per step (one all-reduce
of one flag): that is its documented cost. A skipped step also restores the buffers its forward
changed (BatchNorm running statistics), and both modes check buffers as well as weights before a
checkpoint: a BatchNorm that saw one inf input would otherwise carry it into every later checkpoint.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from .quantized import frozen_quantized

NEVER = 2**62  # "no bad step yet" for the MIN-by-MAX encoding below


class NonFiniteError(RuntimeError):
    """Training produced a NaN/inf; raised so the run ends FAILED with this message."""


def _max_over_ranks(strategy, value: torch.Tensor) -> torch.Tensor:
    return strategy.all_reduce_max(value)


class NonFiniteGuard:
    def __init__(self, device: torch.device):
        self.device = device
        # first bad optimizer step of [loss, grad_norm], stored as NEVER - step so MAX over ranks gives the MIN step
        self._first_bad = torch.zeros(2, dtype=torch.int64, device=device)

    def observe(self, step: int, loss: torch.Tensor, grad_norm: Optional[torch.Tensor],
                overflow: Optional[torch.Tensor] = None) -> None:
        """Fold this step's values in, on the device (no sync). `overflow` (nonzero: the fp16 loss
        scaler skipped this step) excuses an inf gradient norm: that step changed nothing."""
        values = [loss.detach().float().reshape(()).to(self.device),
                  (grad_norm.detach().float().reshape(()).to(self.device) if grad_norm is not None
                   else torch.zeros((), device=self.device))]
        bad = ~torch.isfinite(torch.stack(values))
        if overflow is not None:
            excused = torch.stack([torch.zeros((), dtype=torch.bool, device=self.device),
                                   overflow.reshape(()).to(self.device) > 0])
            bad = bad & ~excused
        fresh = bad & (self._first_bad == 0)
        self._first_bad = torch.where(fresh, torch.full_like(self._first_bad, NEVER - step), self._first_bad)

    def first_bad(self, strategy) -> Optional[tuple[int, str]]:
        """(step, 'loss' or 'gradient norm') of the earliest non-finite value on any rank, or None.
        A collective: every rank calls it at the same step."""
        encoded = _max_over_ranks(strategy, self._first_bad).tolist()
        found = [(NEVER - v, what) for v, what in zip(encoded, ("loss", "gradient norm")) if v]
        return min(found) if found else None

    @staticmethod
    def weights_finite(strategy, tensors: Iterable[torch.Tensor], device: torch.device) -> bool:
        """Whether every rank's weights are finite (a collective)."""
        bad = torch.zeros((), dtype=torch.int64, device=device)
        for t in tensors:
            if frozen_quantized(t):  # QLoRA's NF4 base: no float values to check, and training never writes it
                continue
            if t.is_floating_point() and t.numel():
                bad = bad | (~torch.isfinite(t)).any().to(device=device, dtype=torch.int64)
        return int(_max_over_ranks(strategy, bad).item()) == 0

    @staticmethod
    def step_is_finite(strategy, loss: torch.Tensor, parameters: Iterable[torch.Tensor], check_grads: bool,
                       device: torch.device, buffers: Iterable[torch.Tensor] = ()) -> bool:
        """skip_step: whether this step's loss, the buffers its forward updated (BatchNorm statistics)
        and, unless a loss scaler owns that, its gradients are finite on every rank. One all-reduce and
        one device sync."""
        bad = (~torch.isfinite(loss.detach())).any().to(dtype=torch.int64, device=device)
        for b in buffers:
            if b.is_floating_point() and b.numel():
                bad = bad | (~torch.isfinite(b)).any().to(dtype=torch.int64, device=device)
        if check_grads:
            for p in parameters:
                g = p.grad
                if g is not None:
                    local = g.to_local() if hasattr(g, "to_local") else g
                    bad = bad | (~torch.isfinite(local)).any().to(dtype=torch.int64, device=device)
        return int(_max_over_ranks(strategy, bad).item()) == 0


def snapshot_buffers(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(buffer, a copy) for every buffer of the model: what a skipped step restores. BatchNorm's
    running statistics and counters are a few kilobytes per layer, copied on the device."""
    with torch.no_grad():
        return [(b, b.detach().clone()) for b in model.buffers()]


def restore_buffers(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for buffer, copy in saved:
            buffer.copy_(copy)

