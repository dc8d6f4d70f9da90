"""What a strategy declares about itself, so that nothing outside its own two files asks its name.

A strategy plugin is two files: its options class (here, in the recipe layer: light, no torch)
and its component (`trainkit.strategies.<name>`). The options class owns what is known before
anything runs: its capabilities, how it lays the world out (`ParallelDims`, the one data-parallel
size behind every global-batch figure), its cross-field rules, its lines in `trainkit plan` and
its `trainkit tune` knobs. Everything else asks these, never `strategy.name`, so a plugin that
subclasses a built-in strategy inherits all of it (Lightning Fabric's strategies keep working under
`isinstance` the same way). `ParallelDims` follows torchtitan's: one object that knows the degrees
of each parallel dimension; a recipe's `parallel:` block (blocks/parallel.py) may give them instead.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, Mapping, Optional

from .base import Finding, PluginBlock
from .knobs import Knob

PRECISIONS = frozenset({"fp32", "fp16", "bf16"})
# the mesh's dimensions in torchtitan's order, the order of `init_device_mesh` and of the rank layout
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """How `world_size` ranks are laid out; the degrees multiply to the world size.

    dp_replicate: ranks holding the same parameters and reading different data (DDP, pipeline replicas).
    dp_shard: ranks sharding the parameters and reading different data (FSDP, ZeRO).
    tp: tensor-parallel ranks, splitting every layer (they read the same data).
    pp: pipeline stages, ranks of one pipeline (they read the same data).
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel size: how many different micro-batches one micro-step consumes across the job."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def degrees(self) -> dict[str, int]:
        """Each mesh dimension's degree, in mesh order (`MESH_DIMS`)."""
        return {d: getattr(self, d) for d in MESH_DIMS}


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What a strategy does, asked instead of its name.

    bucketed_allreduce: gradients are all-reduced in buckets during backward by DDP's reducer, so
        bucket size, communication hooks and a static graph apply (the options carry bucket_cap_mb,
        comm_hook, static_graph, find_unused_parameters).
    shards_parameters: each rank keeps only part of every parameter (`model.init: auto` builds on meta).
    splits_model: ranks hold different layers (MFU counts each rank's own FLOPs; the model must split).
    owns_optimizer_step: the strategy's engine runs the optimizer step (the loop cannot skip one).
    owns_loss_scaling: the strategy scales fp16 losses itself (no torch GradScaler beside it).
    reshards_on_load: a checkpoint saved by N ranks loads on M.
    cpu_collectives: on GPUs it also runs collectives over CPU tensors (needs `cpu:gloo` beside nccl).
    contiguous_parameters: it keeps parameters in flat contiguous storage (FSDP's shards, ZeRO's flat
        groups), so `performance.channels_last` converts the inputs only, not the parameters (a
        channels_last input is enough for the NHWC convolution kernels).
    host_memory_on_cpu: `performance.host_allocator: auto` on the CPU, measured per strategy
        (bench/strategies_memory.py): "retain" or "release".
    precisions: the `precision` values it trains in.
    mesh_dims: the mesh dimensions (`MESH_DIMS`) a `parallel:` block may give a degree above 1.
    unsupported_performance: performance option -> why this strategy cannot apply it, with the fix.
    pretrained_load_refusal: why the strategy cannot read a pretrained directory's weights into the model it
        holds ("": its model's state dict is plain tensors or DTensors, which DCP's Hugging Face reader fills).
    pretrained_before_setup: the weights are read into the model as built, before `setup` (an engine that
        copies the model's weights when it is set up: DeepSpeed's fp32 master partitions); otherwise into
        the model `setup` returns (FSDP's DTensor shards: each rank reads only its own slices).
    pretrained_read_at_materialize: a model built partitioned (`empty_init`) gets the directory's weights in
        `materialize`, module by module, instead of a later read (ZeRO-3: its partitions are not tensors a
        state-dict reader can fill; each module is gathered once, as for seeded values).
    quantized_base_refusal: why the strategy cannot train adapters on a 4-bit frozen base (QLoRA,
        `model.args.lora.quantize_base`: torchao NF4 tensors) ("": it keeps each rank's whole model as built
        and never broadcasts the frozen base (DDP), or shards it as NF4 (FSDP2)).
    background_save_refusal: why `trainer.checkpoint.async_save` cannot save this strategy's checkpoint
        ("": its checkpoint is the model's and optimizer's DCP state dicts, which the background write saves).
    effect: what a user picks the strategy for (docs/compatibility.md, "Effects", lists it with the measured
        figure where one is recorded: recipe.compatibility.effects); "" for plain data parallelism, the
        reference the others are measured against.
    """

    bucketed_allreduce: bool = False
    shards_parameters: bool = False
    splits_model: bool = False
    owns_optimizer_step: bool = False
    owns_loss_scaling: bool = False
    reshards_on_load: bool = True
    cpu_collectives: bool = False
    contiguous_parameters: bool = False
    host_memory_on_cpu: str = "retain"
    precisions: frozenset = PRECISIONS
    mesh_dims: frozenset = frozenset({"dp_replicate"})
    unsupported_performance: Mapping[str, str] = field(default_factory=lambda: dict(SYNC_BATCHNORM_NEEDS_DDP))
    pretrained_load_refusal: str = ""
    pretrained_before_setup: bool = False
    pretrained_read_at_materialize: bool = False
    quantized_base_refusal: str = ("not verified: an NF4 base must be sharded or partitioned as NF4 (FSDP2's "
                                   "all-gather extension, which trainkit does not wire)")
    background_save_refusal: str = ("its checkpoint is not declared to be the model's and optimizer's DCP state "
                                    "dicts (Capabilities.background_save_refusal), which is what a background "
                                    "write saves")
    effect: str = ""


@dataclass(frozen=True, kw_only=True)
class MemoryLayout:
    """How a strategy divides a model's memory over the ranks: the factors of the memory plan
    (trainkit.recipe.memory_plan), owned by each strategy's options instead of a switch on its name.

    parameters / gradients / optimizer: ranks each of them is divided over (ZeRO's stages, FSDP: all).
    parameters_split: ranks holding different layers (pipeline stages), which divides activations too.
    gathers_units: a unit's whole parameters are gathered for its forward and backward (FSDP, ZeRO-3).
    unit_gradients_whole: a unit's gradients are computed whole, then copied into a reduce-scatter
        buffer of the same size before they are sharded (FSDP2's post-backward), so a unit's backward
        holds its gathered parameters, their whole gradients and the reduce-scatter input or the next
        unit's prefetched parameters at once; without it (ZeRO-3's reduce buckets) a unit's gathered
        parameters and the next one's prefetch.
    gradient_partition: ranks the reduced gradients are divided over when they are kept beside the whole
        ones (ZeRO-1: each rank's whole gradients live until the accumulation boundary, then become views
        of the reduce bucket, and the averaged gradients of the rank's partition are kept for the step);
        0: none.
    gradient_bucket_elements: gradient elements copied into communication buckets (DDP without
        gradient_as_bucket_view: all of them; ZeRO: its reduce bucket), counted up to the model's size.
    gradient_bucket_per_unit: on GPUs the bucket is at least the model's largest unit (ZeRO-3's buffers
        are sized from the model's blocks there: strategies/deepspeed.py `zero3_buffers`).
    low_precision_parameters: parameters and gradients are kept in the training precision (bf16/fp16)
        beside an fp32 master copy (DeepSpeed); otherwise they stay fp32 and autocast casts.
    master_copy: the optimizer keeps its own fp32 copy of its partition (DeepSpeed).
    master_copy_in_fp32: that copy is kept when the parameters are fp32 too (False: the optimizer steps
        the fp32 parameter partition itself, as trainkit has ZeRO-3 do without offload).
    offload_parameters / offload_optimizer: kept in host memory instead of the device's.
    builds_whole_model: every rank builds the whole model before keeping its part (the pipeline's
        stages): host memory the process has held once, and on the CPU still holds (a retaining host
        allocator keeps freed blocks resident; bench/memory_plan.py).
    runtime_bytes: what the strategy's libraries add to a rank's process before the model (measured).
    optimizer_flat_elements: the optimizer steps flat tensors of up to this many elements (DeepSpeed: the
        rank's fp32 partition, ZeRO-1/2 in one piece -- `ALL_GRADIENTS` --, ZeRO-3 in sub-groups); 0: the
        parameters as they are (torch's optimizers over the model's own tensors or their shards). Adam's
        step makes temporaries the size of what it steps at once (the plan's "step temporaries").
    reduce_flat_copy_elements: the gradient reduce first copies up to this many of the bucket's elements
        into one flat tensor (DeepSpeed ZeRO-1/2's `allreduce_bucket`, its reduce_bucket_size): a second
        copy of the bucket while it reduces; 0: none.
    """

    parameters: int = 1
    gradients: int = 1
    optimizer: int = 1
    parameters_split: int = 1
    gathers_units: bool = False
    unit_gradients_whole: bool = False
    gradient_partition: int = 0
    gradient_bucket_elements: int = 0
    gradient_bucket_per_unit: bool = False
    low_precision_parameters: bool = False
    master_copy: bool = False
    master_copy_in_fp32: bool = True
    offload_parameters: bool = False
    offload_optimizer: bool = False
    builds_whole_model: bool = False
    runtime_bytes: int = 0
    optimizer_flat_elements: int = 0
    reduce_flat_copy_elements: int = 0


ALL_GRADIENTS = sys.maxsize  # gradient_bucket_elements: every gradient has a bucket copy

SYNC_BATCHNORM_NEEDS_DDP = {"sync_batchnorm": "torch's SyncBatchNorm synchronises statistics through DDP's process "
                                              "group; set it to false, or use strategy ddp"}
# where float8 linears have not been verified: DeepSpeed's engine casts the model to its own bf16 copy,
# and the pipeline splits (or traces) the model, neither of which has been run with torchao's Float8Linear
FLOAT8_NOT_VERIFIED = ("float8 linears (torchao) have not been verified with this strategy; set "
                       "performance.float8: false, or use strategy ddp or fsdp")


class StrategyOptions(PluginBlock):
    """Base of every strategy's options; the defaults describe plain data parallelism."""

    # distributions its component needs beyond torch (`trainkit doctor` checks their versions)
    requires_packages: ClassVar[tuple[str, ...]] = ()

    def capabilities(self) -> Capabilities:
        return Capabilities()

    def parallel_dims(self, world_size: int) -> ParallelDims:
        """The layout of `world_size` ranks (plain data parallel: every rank a replica)."""
        return ParallelDims(dp_replicate=world_size)

    def data_parallel_size(self, world_size: int) -> int:
        """Different batches one micro-step consumes: the one factor of every global-batch figure."""
        return self.parallel_dims(world_size).dp

    def memory_layout(self, world_size: int) -> MemoryLayout:
        """How this strategy divides the model's memory over `world_size` ranks (replicas: not at all)."""
        return MemoryLayout()

    def memory_layout_on(self, dims: ParallelDims) -> MemoryLayout:
        """How this strategy divides the model's memory on a `parallel:` mesh, before tensor parallel's own
        split (the memory plan divides by tp): its layout over the whole world, which holds wherever its mesh
        dimensions are the ones it lays the world out on itself (DDP, ZeRO, the pipeline)."""
        return self.memory_layout(dims.world_size)

    def rules(self, recipe: Any) -> Iterator[Finding]:
        """This strategy's cross-field rules on the whole recipe, checked by `validate` (no torch)."""
        return iter(())

    def plan_lines(self, recipe: Any) -> list[str]:
        """What `trainkit plan` shows about this strategy beyond the world size and global batch."""
        return []

    @classmethod
    def tune_knobs(cls) -> list[Knob]:
        """The strategy's own `trainkit tune` knobs (each with `owner` set to the class that defines it)."""
        return []

    # `trainkit init` offers the strategies that have an init_order, in that order (None: not offered)
    init_order: ClassVar[Optional[int]] = None

    @classmethod
    def init_note(cls, world_size: int) -> str:
        """The comment `trainkit init` writes above this strategy's block: what it does, when to choose it."""
        return cls.__doc__.splitlines()[0] if cls.__doc__ else cls.plugin_name()

    @classmethod
    def init_block(cls, world_size: int, model: str) -> str:
        """The `strategy:` block `trainkit init` writes, as flow YAML, for `world_size` ranks training
        `model`; ValueError (why, and what to do) where it cannot write one."""
        return f"{{name: {cls.plugin_name()}}}"
