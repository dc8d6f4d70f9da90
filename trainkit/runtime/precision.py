"""Numeric precision: fp32, bf16 autocast, fp16 autocast with loss scaling (CPU or CUDA).

The loop only calls `autocast()`, `backward()`, `unscale()`, `step()`; loss scaling is a no-op
outside fp16, so the loop has no precision branches.

fp16 loss scaling (`trainer.loss_scale`):
- ``"dynamic"``: torch's GradScaler. A step whose gradients overflow (inf/nan) is skipped and the
  scale halves; after 2000 clean steps it doubles.
- a number: a fixed scale. The scale never changes: an overflowing step is still skipped, but the
  scale stays exactly where it is. torch's GradScaler refuses growth 1.0 / backoff 1.0, so the
  scaler keeps its default factors and `step()` puts the fixed value back with
  ``update(new_scale=...)`` after every step.
- ``None``: no scaling (the recipe rules warn; small gradients underflow).

A strategy that scales the loss itself (DeepSpeed: `Capabilities.owns_loss_scaling`) gets
``Precision(..., scaler=False)``: autocast and dtype as usual, no torch scaler.

fp16 on CPU works (torch >= 2.3 has a CPU GradScaler and CPU fp16 autocast); it is slow and meant
for testing the scaling paths without a GPU.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Union

import torch

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """Autocast and loss scaling for one process.

    Args:
        name: fp32 | bf16 | fp16.
        device: the device the model computes on (its type picks the autocast/scaler device).
        loss_scale: fp16 only: "dynamic", a fixed positive scale, or None (no scaling).
        scaler: False when the strategy scales the loss itself (no torch GradScaler is built).
    """

    def __init__(self, name: str, device: torch.device, loss_scale: Union[str, float, None] = "dynamic", *,
                 scaler: bool = True):
        if name not in DTYPES:
            raise ValueError(f"unknown precision '{name}'; use one of {', '.join(DTYPES)}")
        self.name, self.device = name, device
        self.dtype = DTYPES[name]
        self.fixed_scale: Optional[float] = None
        self.scaler: Optional[torch.amp.GradScaler] = None
        # after step(): nonzero when the scaler found inf/NaN gradients and skipped the step (a device
        # tensor, read without a sync); None without a scaler
        self.overflow: Optional[torch.Tensor] = None
        if name == "fp16" and loss_scale is not None and scaler:
            if loss_scale == "dynamic":
                self.scaler = torch.amp.GradScaler(device.type)
            else:
                self.fixed_scale = float(loss_scale)
                if not self.fixed_scale > 0:
                    raise ValueError(f"loss_scale must be 'dynamic' or a positive number, got {loss_scale!r}")
                self.scaler = torch.amp.GradScaler(device.type, init_scale=self.fixed_scale)

    @property
    def scale(self) -> Optional[float]:
        """The current loss scale (None without a torch scaler). Reading it syncs with the device."""
        return self.scaler.get_scale() if self.scaler else None

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Make gradients real-valued before clipping."""
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step, skipped when the (scaled) gradients overflowed; then the scale update:
        dynamic backs off or grows, fixed is put back to its value."""
        if self.scaler:
            self.scaler.step(optimizer)
            # what step() decided, kept before update() forgets it: torch documents these early
            # overflows as expected (amp/grad_scaler.py), so the loop must not count them as divergence.
            # _found_inf_per_device is the scaler's own record of them (no public accessor exists).
            found = self.scaler._found_inf_per_device(optimizer)
            self.overflow = sum(v.to(self.device) for v in found.values()) if found else None
            self.scaler.update(new_scale=self.fixed_scale)  # None: torch's dynamic update
        else:
            optimizer.step()

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict(state)
