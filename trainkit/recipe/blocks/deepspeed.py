"""DeepSpeed ZeRO's options: what `validate`, `plan` and `tune` know about it (the component:
trainkit.strategies.deepspeed)."""

from __future__ import annotations

from typing import Any, ClassVar, Iterator, Literal, Optional

from pydantic import Field

from .base import Finding
from .knobs import Knob
from .strategy import (ALL_GRADIENTS, FLOAT8_NOT_VERIFIED, SYNC_BATCHNORM_NEEDS_DDP, Capabilities, MemoryLayout,
                       ParallelDims, StrategyOptions)
from .training import AdamOptions

# ds_config keys the recipe sets itself: -> the recipe key to use instead
OWNED_BY_THE_RECIPE = {
    "train_batch_size": "data.batch_size and trainer.grad_accum_steps",
    "train_micro_batch_size_per_gpu": "data.batch_size",
    "gradient_accumulation_steps": "trainer.grad_accum_steps",
    "gradient_clipping": "trainer.grad_clip",
    "fp16": "precision", "bf16": "precision",
    "optimizer": "optimizer", "scheduler": "scheduler",
}


DEEPSPEED_REDUCE_BUCKET = 500_000_000  # DeepSpeed's default zero_optimization.reduce_bucket_size (elements)
ZERO3_BUFFER_NUMEL = 5_000_000  # the floor of ZeRO-3's buffers, which are sized from the model's largest block
#                                (strategies/deepspeed.py zero3_buffers)
DEEPSPEED_RUNTIME = 20 << 20  # importing DeepSpeed (without MLflow) adds this to a rank's process (measured, docs/memory.md)


class DeepSpeedOptions(StrategyOptions):
    """DeepSpeed ZeRO, launched under torchrun like every other strategy."""

    component: ClassVar[str] = "trainkit.strategies.deepspeed:DeepSpeedStrategy"
    name: Literal["deepspeed"]
    zero_stage: int = Field(default=3, ge=0, le=3, description="ZeRO stage 0-3")
    offload_optimizer: Literal["none", "cpu", "nvme"] = Field(default="none", description="optimizer state offload")
    offload_param: Literal["none", "cpu", "nvme"] = Field(default="none", description="parameter offload (stage 3)")
    config: dict[str, Any] = Field(default_factory=dict, description="passed through to the DeepSpeed config")
    requires_packages: ClassVar[tuple[str, ...]] = ("deepspeed",)
    init_order: ClassVar[int] = 2

    @classmethod
    def init_note(cls, world_size: int) -> str:
        return "DeepSpeed ZeRO-3: everything sharded; zero_stage 1 or 2 shard less and communicate less"

    @classmethod
    def init_block(cls, world_size: int, model: str) -> str:
        return f"{{name: {cls.plugin_name()}, zero_stage: 3}}"

    def capabilities(self) -> Capabilities:
        # ZeRO partitions are per rank (DeepSpeed's universal checkpoint is not used): no resharding on load.
        # The engine owns the optimizer step and fp16 loss scaling (ds_config's fp16.loss_scale).
        # host memory: retain fragments the heap around DeepSpeed's flat buffers (bench).
        # mesh: one data-parallel dimension, the one `parallel_dims` lays the world out on (ZeRO 1-3
        # partition over every rank: dp_shard; ZeRO 0 replicates); DeepSpeed builds its own groups.
        effect = {0: "", 1: "per-rank optimizer state ~ 1/dp", 2: "per-rank optimizer state and gradients ~ 1/dp",
                  3: "per-rank model state (parameters, gradients, optimizer) ~ 1/dp, one module gathered at a time"
                  }[self.zero_stage]
        offloaded = [what for what, where in (("optimizer", self.offload_optimizer), ("parameters", self.offload_param))
                     if where != "none"]
        if offloaded:
            effect += ("; " if effect else "") + f"the {' and '.join(offloaded)} off the device"
        return Capabilities(shards_parameters=self.zero_stage == 3, owns_optimizer_step=True, effect=effect,
                            # the engine takes its fp32 master copy from the model at set-up: the weights are
                            # read into the built model before that -- ZeRO 0-2 (and ZeRO-3 with
                            # `model.init: constructor`) build it whole; ZeRO-3 under zero.Init partitions each
                            # module as it is built, and `materialize` fills it one gathered module at a time
                            pretrained_before_setup=True, pretrained_read_at_materialize=self.zero_stage == 3,
                            background_save_refusal="DeepSpeed writes its checkpoints through its engine's own "
                                                    "save, which has no background write here",
                            owns_loss_scaling=True, reshards_on_load=False, host_memory_on_cpu="release",
                            unsupported_performance={**SYNC_BATCHNORM_NEEDS_DDP, "float8": FLOAT8_NOT_VERIFIED},
                            contiguous_parameters=True, mesh_dims=frozenset(
                                {"dp_replicate" if self.zero_stage == 0 else "dp_shard"}))

    def parallel_dims(self, world_size: int) -> ParallelDims:
        if self.zero_stage == 0:
            return ParallelDims(dp_replicate=world_size)
        return ParallelDims(dp_shard=world_size)

    def memory_layout(self, world_size: int) -> MemoryLayout:
        # ZeRO's stages (the ZeRO paper, Figure 1): 1 partitions the optimizer state (with DeepSpeed's fp32
        # master copy of it), 2 also the gradients, 3 also the parameters, gathered per module. DeepSpeed
        # casts the module to bf16/fp16; gradients go through its reduce bucket (reduce_bucket_size).
        # Stage 1 (deepspeed/runtime/zero/stage_1_and_2.py `reduce_gradients`) keeps each rank's whole
        # gradients until the accumulation boundary, then copies them into the contiguous reduce bucket
        # (they become views of it: no second copy) and keeps the averaged partition: whole gradients plus
        # a partition, the same peak as stage 2 when the bucket holds the whole model (measured: 122 MiB
        # saved against DDP by both on a 31.5 M MLP); stage 2 holds less once the model outgrows its bucket.
        n, stage = world_size, self.zero_stage
        offloads = self.offload_optimizer != "none" or self.offload_param != "none"
        zero = self.config.get("zero_optimization", {}) if isinstance(self.config.get("zero_optimization"), dict) else {}
        bucket = int(zero.get("reduce_bucket_size", ZERO3_BUFFER_NUMEL if stage == 3 else DEEPSPEED_REDUCE_BUCKET))
        per_unit = stage == 3 and "reduce_bucket_size" not in zero  # sized from the model's largest block
        return MemoryLayout(optimizer=n if stage >= 1 else 1, gradients=n if stage >= 2 else 1,
                            gradient_partition=n if stage == 1 else 0,
                            parameters=n if stage == 3 else 1, gathers_units=stage == 3,
                            low_precision_parameters=True, master_copy=stage >= 1,
                            master_copy_in_fp32=stage != 3 or offloads,  # strategies/deepspeed_master.py
                            gradient_bucket_elements=bucket if stage >= 2 else 0, gradient_bucket_per_unit=per_unit,
                            offload_parameters=self.offload_param != "none",
                            offload_optimizer=self.offload_optimizer != "none", runtime_bytes=DEEPSPEED_RUNTIME,
                            # stage 1/2 steps the rank's whole fp32 partition as one tensor; stage 3 in sub-groups
                            optimizer_flat_elements=(int(zero.get("sub_group_size", ZERO3_BUFFER_NUMEL)) if stage == 3
                                                     else ALL_GRADIENTS) if stage >= 1 else 0,
                            reduce_flat_copy_elements=bucket if stage in (1, 2) else 0)

    def rules(self, recipe: Any) -> Iterator[Finding]:
        if self.offload_param != "none" and self.zero_stage != 3:
            yield ("strategy", "offload_param"), (
                f"parameter offload needs zero_stage 3 (got zero_stage {self.zero_stage})")
        if self.offload_optimizer != "none" and self.zero_stage == 0:
            yield ("strategy", "offload_optimizer"), "optimizer offload needs zero_stage 1, 2 or 3 (got 0)"
        for key in self.config:
            if key in OWNED_BY_THE_RECIPE:
                yield ("strategy", "config", key), (f"set by the recipe, not the pass-through config: use "
                                                    f"{OWNED_BY_THE_RECIPE[key]}")
        zero = self.config.get("zero_optimization", {})
        if isinstance(zero, dict) and "stage" in zero:
            yield ("strategy", "config", "zero_optimization", "stage"), "use strategy.zero_stage"

    def runs_cpu_adam(self, optimizer: Any) -> bool:
        """Optimizer offload steps in DeepSpeed's CPU Adam (DeepSpeedCPUAdam) unless `torch_optimizer_reason`
        (`optimizer`: the recipe's optimizer block)."""
        return self.offload_optimizer != "none" and self.torch_optimizer_reason(optimizer) is None

    def torch_optimizer_reason(self, optimizer: Any) -> Optional[str]:
        """Why an offloaded optimizer step runs in trainkit's torch optimizer instead of DeepSpeed's CPU Adam
        (None: no offload, or CPU Adam runs it). CPU Adam is Adam/AdamW only: adam maps to its L2 mode
        (adamw_mode false), adamw to decoupled weight decay, lr/betas/eps/weight_decay one to one."""
        if self.offload_optimizer == "none":
            return None
        if self.config.get("zero_force_ds_cpu_optimizer") is False:
            return "strategy.config sets zero_force_ds_cpu_optimizer: false"
        if not isinstance(optimizer, AdamOptions):
            return f"DeepSpeed's CPU optimizer is Adam/AdamW only; optimizer {optimizer.name} has none"
        return None

    @classmethod
    def tune_knobs(cls) -> list[Knob]:
        return [Knob("zero_stage", "strategy.zero_stage",
                     lambda r, f: [r.strategy.zero_stage - 1] if r.strategy.zero_stage > 0 else [],
                     owner=DeepSpeedOptions)]
