"""FSDP2's options: what `validate`, `plan` and `tune` know about it (the component: trainkit.strategies.fsdp)."""

from __future__ import annotations

from typing import Any, ClassVar, Iterator, Literal

from pydantic import Field

from .base import Finding
from .knobs import Knob, flip
from .strategy import Capabilities, MemoryLayout, ParallelDims, StrategyOptions


class FSDPOptions(StrategyOptions):
    """FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded across ranks."""

    component: ClassVar[str] = "trainkit.strategies.fsdp:FSDPStrategy"
    name: Literal["fsdp"]
    reshard_after_forward: bool = Field(default=True, description="free gathered parameters after forward")
    cpu_offload: bool = Field(default=False, description="keep sharded parameters on the CPU")
    wrap: list[str] = Field(default_factory=list, description="module class names sharded as units (empty: automatic)")
    activation_checkpointing: bool = Field(default=False, description="deprecated: use performance."
                                                                      "activation_checkpointing: full (recomputes "
                                                                      "the wrapped units)")
    init_order: ClassVar[int] = 1

    @classmethod
    def init_note(cls, world_size: int) -> str:
        return "FSDP2: parameters, gradients and optimizer state sharded across GPUs (models that do not fit one GPU)"

    def capabilities(self) -> Capabilities:
        # cpu_offload: sharded parameters and gradients live on the CPU as DTensors, so clipping's
        # full_tensor(), the GradScaler's found-inf all-reduce and the replica digests are collectives
        # over CPU tensors, which nccl cannot carry (torchtitan adds cpu:gloo for its CPU offload too).
        # host memory: retain fragments the heap around FSDP's buffers (peak RSS 2x, bench).
        effect = ("per-rank model state (parameters, gradients, optimizer) ~ 1/dp_shard, one unit (block) "
                  "gathered at a time")
        if self.cpu_offload:
            effect += "; the shards and the optimizer step on the CPU, off the device"
        # QLoRA: torchao's NF4 tensor implements FSDP2's sharding (its chunk along dim 0) and all-gather
        # extension (fsdp_pre/post_all_gather), so each rank keeps its rows of the 4-bit base
        quantized_base_refusal = ("not verified: the NF4 base's shards on the CPU beside the offloaded optimizer; "
                                  "set cpu_offload: false") if self.cpu_offload else ""
        return Capabilities(shards_parameters=True, background_save_refusal="", cpu_collectives=self.cpu_offload, host_memory_on_cpu="release",
                            quantized_base_refusal=quantized_base_refusal,
                            effect=effect,
                            contiguous_parameters=True, mesh_dims=frozenset({"dp_replicate", "dp_shard", "tp"}),
                            unsupported_performance={"sync_batchnorm": (
                                "FSDP2 does not synchronise BatchNorm buffers through SyncBatchNorm's process "
                                "group; set it to false, or use strategy ddp")})

    def parallel_dims(self, world_size: int) -> ParallelDims:
        return ParallelDims(dp_shard=world_size)

    def memory_layout(self, world_size: int) -> MemoryLayout:
        # everything sharded; each unit gathered whole for its forward and backward. cpu_offload keeps the
        # shards, their gradients and the optimizer step on the host (CPUOffloadPolicy).
        return MemoryLayout(parameters=world_size, gradients=world_size, optimizer=world_size, gathers_units=True,
                            unit_gradients_whole=True, offload_parameters=self.cpu_offload, offload_optimizer=self.cpu_offload)

    def memory_layout_on(self, dims: ParallelDims) -> MemoryLayout:
        # fully_shard on the (dp_replicate, dp_shard) mesh shards over dp_shard only; dp_replicate ranks hold
        # copies (HSDP), and tensor parallel's slice is divided by the memory plan
        return self.memory_layout(dims.dp_shard)

    def rules(self, recipe: Any) -> Iterator[Finding]:
        ac = recipe.performance.checkpointing
        if self.activation_checkpointing and ac.mode != "none":
            yield ("strategy", "activation_checkpointing"), (
                "set either the deprecated strategy.activation_checkpointing or "
                "performance.activation_checkpointing, not both")

    @classmethod
    def tune_knobs(cls) -> list[Knob]:
        return [Knob("reshard_after_forward", "strategy.reshard_after_forward",
                     flip("strategy.reshard_after_forward", False), owner=FSDPOptions)]
