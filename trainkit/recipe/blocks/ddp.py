"""DDP's options: what `validate`, `plan` and `tune` know about it (the component: trainkit.strategies.ddp)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, PositiveFloat, PositiveInt

from .knobs import Knob, flip
from .strategy import ALL_GRADIENTS, Capabilities, MemoryLayout, StrategyOptions


class DDPOptions(StrategyOptions):
    """torch DistributedDataParallel: every rank holds the whole model; gradients are all-reduced."""

    component: ClassVar[str] = "trainkit.strategies.ddp:DDPStrategy"
    name: Literal["ddp"]
    bucket_cap_mb: PositiveFloat = Field(default=25.0, description="gradient bucket size for all-reduce")
    static_graph: bool = Field(default=False, description="the graph is the same every step (enables optimisations)")
    gradient_as_bucket_view: bool = Field(default=False, description="gradients alias the buckets (saves memory)")
    find_unused_parameters: bool = Field(default=False, description="tolerate parameters without gradients (slower)")
    comm_hook: Literal["none", "fp16_compress", "bf16_compress", "powersgd"] = Field(
        default="none", description="gradient compression hook"
    )
    powersgd_rank: PositiveInt = Field(default=1, description="matrix approximation rank for comm_hook: powersgd")
    init_order: ClassVar[int] = 0  # `trainkit init`'s first choice and its default

    @classmethod
    def init_note(cls, world_size: int) -> str:
        return "DDP: every GPU holds the whole model; gradients are averaged (the fastest when the model fits)"

    def capabilities(self) -> Capabilities:
        return Capabilities(bucketed_allreduce=True, unsupported_performance={}, background_save_refusal="",
                            quantized_base_refusal="")

    def memory_layout(self, world_size: int) -> MemoryLayout:
        # every rank a whole replica; the reducer's buckets copy the gradients unless they are its views
        return MemoryLayout(gradient_bucket_elements=0 if self.gradient_as_bucket_view else ALL_GRADIENTS)

    @classmethod
    def tune_knobs(cls) -> list[Knob]:
        return [
            Knob("bucket_cap_mb", "strategy.bucket_cap_mb",
                 lambda r, f: [25.0] if r.strategy.bucket_cap_mb < 25 else [r.strategy.bucket_cap_mb * 4],
                 owner=DDPOptions),
            Knob("static_graph", "strategy.static_graph", flip("strategy.static_graph", True), owner=DDPOptions),
            Knob("gradient_as_bucket_view", "strategy.gradient_as_bucket_view",
                 flip("strategy.gradient_as_bucket_view", True), owner=DDPOptions),
            Knob("comm_hook", "strategy.comm_hook",
                 lambda r, f: ["bf16_compress"] if r.strategy.comm_hook == "none" else [],
                 owner=DDPOptions, semantic="precision",
                 note=lambda r, v: f"gradients are all-reduced in {v.split('_')[0]} (fewer mantissa bits)"),
        ]
