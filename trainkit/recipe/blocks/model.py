"""The `model:` block."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from .base import Block


class ModelSpec(Block):
    """`torchvision.<name>`, an import path `pkg.module:factory`, or a registered model plugin."""

    name: str = Field(description="torchvision.<model>, 'pkg.module:factory', or a registered model plugin name")
    args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the model factory")
    weights: Optional[str] = Field(default=None, description="local state_dict file to load (never downloaded)")
    init: Literal["auto", "constructor", "seeded"] = Field(
        default="auto",
        description="initial weights: 'constructor' (the factory's own init; every rank builds the whole model), "
                    "'seeded' (built on the meta device, each rank fills only what it keeps, each parameter from "
                    "(seed, its module's name): identical across strategies and world sizes), 'auto' (seeded "
                    "for strategies that shard parameters -- FSDP, ZeRO-3 -- when every parameter can be "
                    "seeded and no weights file is given; constructor otherwise)")
