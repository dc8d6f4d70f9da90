"""Numeric precision: fp32, bf16 autocast (CPU or CUDA), fp16 autocast with a GradScaler (CUDA).

The loop only calls `autocast()`, `backward()`, `unscale()`, `step()`; loss scaling is a no-op
outside fp16, so the loop has no precision branches.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Union

import torch


class Precision:
    def __init__(self, name: str, device: torch.device, loss_scale: Union[str, float, None] = "dynamic"):
        if name == "fp16" and device.type != "cuda":
            raise ValueError("precision fp16 needs CUDA (GradScaler); use bf16 or fp32 on CPU")
        self.name, self.device = name, device
        self.dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
        self.scaler: Optional[torch.amp.GradScaler] = None
        if name == "fp16" and loss_scale is not None:
            if loss_scale == "dynamic":
                self.scaler = torch.amp.GradScaler(device.type)
            else:  # a fixed scale: never grows, never backs off
                self.scaler = torch.amp.GradScaler(device.type, init_scale=float(loss_scale),
                                                   growth_factor=1.0, backoff_factor=1.0)

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
        if self.scaler:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict(state)
