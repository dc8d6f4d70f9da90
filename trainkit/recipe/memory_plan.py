"""The memory plan: each rank's predicted memory for a recipe, and the changes that would make it fit.

Arithmetic only (no torch), so that `trainkit plan`, `doctor`, the launch's quick checks and the OOM
report share one model. Its inputs are the model's sizes, measured by a meta-device trace
(`trainkit.runtime.memory_trace`), and the strategy's `MemoryLayout` (its options own how they divide
parameters, gradients and optimizer state over the ranks; no strategy names here).

The accounting is ZeRO's (Rajbhandari et al. 2020, section 3: mixed-precision Adam keeps 2 + 2 + 12 =
16 bytes per parameter; DeepSpeed's `estimate_zero3_model_states_mem_needs_all_live` and
`accelerate estimate-memory` stop there). Beyond them it counts what a measured rank also holds: the
gathered unit under FSDP/ZeRO-3, DDP's gradient buckets, the activations of one micro-batch (traced) and
the process itself (the runtime: torch, gloo/NCCL, the strategy's libraries; measured, see
docs/memory.md), and it compares the total with the machine (doctor's `memory` check).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

from .blocks.strategy import MemoryLayout
from .nccl_memory import Communicator, communicators_of_mesh

MiB = 1 << 20
GiB = 1 << 30
FP32 = 4
LOW_PRECISION = {"bf16": 2, "fp16": 2}  # bytes per element in the training precision (fp32 otherwise)
OPTIMIZER_TENSORS = {"adam": 2, "adamw": 2}  # fp32 state tensors per parameter (SGD: its momentum, if any)
# a rank before its model: on the CPU measured (docs/benchmarks.md, "Memory plan"); on CUDA the context's
# typical size (not measured on this project's machines yet)
RUNTIME_BYTES = {"cpu": 560 * MiB, "cuda": 600 * MiB}


@dataclass(frozen=True, kw_only=True)
class ModelSizes:
    """What the trace measured on the meta device (no memory used)."""

    parameters: int  # elements
    buffer_bytes: int
    largest_unit: int  # parameter elements of the largest block a sharding strategy gathers at once
    activation_bytes: Optional[int]  # saved for backward, one micro-batch, fp32; None: could not trace
    checkpointed_activation_bytes: Optional[int] = None  # the same with every repeated block recomputed
    micro_batch: int = 1  # the batch size the activations were traced with
    largest_unit_name: str = ""  # the class of the largest unit (TransformerBlock, Bottleneck, ...)
    blocks: int = 0  # how many blocks the model has (units FSDP shards, blocks checkpointing recomputes)
    trainable: Optional[int] = None  # elements that train (LoRA: the adapters); None: all of them
    quantized: int = 0  # frozen elements held in 4 bits (QLoRA's NF4 base), among `parameters`
    largest_parameter: int = 0  # elements of the largest trainable parameter (what Adam steps at once)


@dataclass(frozen=True)
class Part:
    """One line of the plan: what, how many bytes, where (device or host), and how it was computed."""

    name: str
    bytes: int
    where: str
    how: str


@dataclass(frozen=True, kw_only=True)
class Setting:
    """The recipe settings the plan depends on; an alternative is this with some of them changed."""

    layout: MemoryLayout
    world_size: int
    precision: str
    optimizer_tensors: int
    micro_batch: int
    grad_accum_steps: int
    activation_checkpointing: bool
    device_type: str
    async_save: bool = False  # trainer.checkpoint.async_save: a staged host copy of the state while a save writes
    tensor_parallel: int = 1  # parallel.tp: the layout's divisors include it; a gathered unit is a 1/tp slice
    nccl_communicators: tuple[Communicator, ...] = ()  # the groups a rank holds an NCCL communicator for
    ranks_per_node: int = 0  # launch.nproc_per_node: which of a group's ranks share a node (0: all of them)


@dataclass(frozen=True)
class MemoryPlan:
    setting: Setting
    parts: tuple[Part, ...]

    def total(self, where: str = "device") -> int:
        return sum(p.bytes for p in self.parts if p.where == where)

    @property
    def per_rank(self) -> int:
        """What one rank needs of the memory it is checked against (on the CPU, everything is host memory)."""
        return self.total("device") + (self.total("host") if self.setting.device_type == "cpu" else 0)

    def lines(self) -> list[str]:
        s = self.setting
        out = [f"memory per rank: {gib(self.per_rank)} predicted ({s.device_type}, {s.precision}, world size "
               f"{s.world_size}, micro-batch {s.micro_batch})"]
        for p in self.parts:
            place = "" if s.device_type == "cpu" or p.where == "device" else " (host)"
            out.append(f"  {p.name + place + ':':<28}{gib(p.bytes):>10}  {p.how}")
        return out


@dataclass(frozen=True)
class MemoryAdvice:
    """A change that would make the recipe fit, as data: the recipe keys and values, and the plan with them."""

    changes: dict[str, Any]
    plan: MemoryPlan
    fits: bool
    what: str = ""

    @property
    def text(self) -> str:
        keys = ", ".join(f"{k}={_show(v)}" for k, v in self.changes.items())
        verdict = "fits" if self.fits else "still too big"
        return f"{keys}: {gib(self.plan.per_rank)} per rank ({verdict}){'; ' + self.what if self.what else ''}"

    def as_dict(self) -> dict:
        return {"changes": dict(self.changes), "per_rank_bytes": self.plan.per_rank, "fits": self.fits,
                "text": self.text}


def _show(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


# --------------------------------------------------------------------------- the arithmetic
def setting_of(recipe: Any, device_type: str) -> Setting:
    """The plan's inputs, read from a resolved recipe."""
    ws = recipe.world_size or recipe.launch.nproc_per_node
    return Setting(layout=layout_of(recipe, ws), world_size=ws, precision=recipe.precision,
                   optimizer_tensors=optimizer_tensors(recipe.optimizer), micro_batch=recipe.data.batch_size,
                   grad_accum_steps=recipe.trainer.grad_accum_steps,
                   activation_checkpointing=checkpoints_activations(recipe),
                   tensor_parallel=recipe.parallel_dims(ws).tp if recipe.parallel is not None else 1,
                   device_type=device_type, async_save=recipe.trainer.checkpoint.async_save,
                   nccl_communicators=nccl_communicators(recipe, ws, device_type),
                   ranks_per_node=recipe.launch.nproc_per_node)


def nccl_communicators(recipe: Any, world_size: int, device_type: str) -> tuple[Communicator, ...]:
    """The process groups of 2 or more ranks a rank of this recipe holds an NCCL communicator for
    (`nccl_memory.communicators_of_mesh`); none on the CPU, under gloo or on one GPU."""
    if device_type != "cuda" or world_size < 2 or recipe.launch.backend == "gloo":
        return ()
    return communicators_of_mesh(recipe.parallel_dims(world_size).degrees(), world_size, recipe.launch.nproc_per_node)


def checkpoints_activations(recipe: Any) -> bool:
    """Activation checkpointing in either spelling: `performance.activation_checkpointing`, or the
    deprecated `strategy.activation_checkpointing` of FSDP (which recomputes every unit)."""
    return (recipe.performance.checkpointing.mode != "none"
            or bool(getattr(recipe.strategy, "activation_checkpointing", False)))


def layout_of(recipe: Any, world_size: int) -> MemoryLayout:
    """The strategy's layout, on the recipe's `parallel:` mesh when it has one: the strategy divides over
    its dimensions (HSDP: dp_shard only), and tensor parallel divides parameters, gradients and optimizer
    state by tp (each rank holds its slice of every layer; `plan` gathers a 1/tp slice of a unit, see
    `Setting.tensor_parallel`). Not counted (so over-estimated): activations split by tp inside attention
    and MLP."""
    if recipe.parallel is None:
        return recipe.strategy.memory_layout(world_size)
    dims = recipe.parallel_dims(world_size)
    return split_by_tp(recipe.strategy.memory_layout_on(dims), dims.tp)


def split_by_tp(layout: MemoryLayout, tp: int) -> MemoryLayout:
    """`layout` with each rank holding 1/tp of every layer's parameters, gradients and optimizer state
    (the plan's `Setting.tensor_parallel` then gathers 1/tp of a unit)."""
    return replace(layout, parameters=layout.parameters * tp, gradients=layout.gradients * tp,
                   optimizer=layout.optimizer * tp)


def optimizer_tensors(optimizer: Any) -> int:
    """fp32 state tensors per parameter: Adam's two moments, SGD's momentum buffer (none without momentum)."""
    if optimizer.name in OPTIMIZER_TENSORS:
        return OPTIMIZER_TENSORS[optimizer.name]
    return 1 if getattr(optimizer, "momentum", 0) else 0


def plan(sizes: ModelSizes, s: Setting) -> MemoryPlan:
    """Bytes per rank, part by part."""
    L, P = s.layout, sizes.parameters
    low = LOW_PRECISION.get(s.precision)
    stored = low if (low and L.low_precision_parameters) else FP32  # parameters' and gradients' dtype
    offloaded_params = "host" if L.offload_parameters else "device"
    offloaded_state = "host" if L.offload_optimizer else "device"
    T = P if sizes.trainable is None else sizes.trainable  # frozen weights have no gradients or optimizer state
    frozen = "" if T == P else " (trainable only)"
    Q = sizes.quantized  # NF4: 4 bits, an int8 scale per 64 elements, an fp32 scale per 64 x 256
    held = (P - Q) * stored + Q // 2 + Q // 64 + Q // 4096
    in_4_bits = f" ({Q:,} of them in 4 bits: NF4, ~0.52 B each)" if Q else ""
    parts = [
        Part("parameters", held // L.parameters, offloaded_params,
             f"{P - Q:,} x {stored} B / {L.parameters}{in_4_bits}" if Q else f"{P:,} x {stored} B / {L.parameters}"),
        Part("gradients", T * stored // L.gradients, offloaded_state,
             f"{T:,} x {stored} B / {L.gradients}{frozen}"),
    ]
    if L.gradient_partition:
        parts.append(Part("reduced gradients", T * stored // L.gradient_partition, offloaded_state,
                          f"{T:,} x {stored} B / {L.gradient_partition} (the rank's averaged partition){frozen}"))
    if L.master_copy and (stored != FP32 or L.master_copy_in_fp32):
        parts.append(Part("fp32 master weights", T * FP32 // L.optimizer, offloaded_state,
                          f"{T:,} x 4 B / {L.optimizer} (the optimizer's own fp32 copy){frozen}"))
    if s.optimizer_tensors:
        parts.append(Part("optimizer state", T * FP32 * s.optimizer_tensors // L.optimizer, offloaded_state,
                          f"{T:,} x {s.optimizer_tensors} x 4 B / {L.optimizer}{frozen}"))
    if L.gradient_bucket_elements:  # only what trains has gradients to bucket (LoRA: the adapters)
        bucket = min(T, max(L.gradient_bucket_elements, min(sizes.largest_unit, 500_000_000))
                     if L.gradient_bucket_per_unit and s.device_type == "cuda" else L.gradient_bucket_elements)
        parts.append(Part("gradient buckets", bucket * stored, "device",
                          f"{bucket:,} x {stored} B (gradients copied into communication buckets)"))
    if L.gathers_units and L.parameters // s.tensor_parallel > 1:  # sharded over more than its tp group
        parts.append(_gathered_unit(sizes.largest_unit, low or FP32, s.tensor_parallel, sizes.largest_unit_name,
                                    L.unit_gradients_whole))
    if L.builds_whole_model:
        parts.append(Part("whole model at build", P * FP32, "host",
                          f"{P:,} x 4 B: every rank builds the whole model, then keeps its stage"))
    activations = _activations(sizes, s)
    step = _step_temporaries(sizes, s, T, stored, activations.bytes if activations is not None else 0)
    if step is not None:
        parts.append(step)
    if sizes.buffer_bytes:
        parts.append(Part("buffers", sizes.buffer_bytes, "device", "the model's buffers (not sharded)"))
    if activations is not None:
        parts.append(activations)
    if s.async_save:
        parts.append(_staged_checkpoint(parts))
    if s.nccl_communicators:
        n = len(s.nccl_communicators)
        each = ", ".join(f"{c.name} {c.bytes / MiB:.0f} MiB" for c in s.nccl_communicators)
        parts.append(Part("NCCL buffers", sum(c.bytes for c in s.nccl_communicators), "device",
                          f"{n} communicator{'s' if n > 1 else ''} ({each}; NCCL 2.30 on an NVSwitch node of "
                          f"H100/H200 class, an upper estimate: far less on PCIe)"))
    parts.append(Part("runtime", RUNTIME_BYTES.get(s.device_type, RUNTIME_BYTES["cpu"]) + L.runtime_bytes,
                      "host" if s.device_type == "cpu" else "device",
                      "the process before the model (measured)" if s.device_type == "cpu" else
                      "CUDA context and kernels (a typical figure)"))
    return MemoryPlan(s, tuple(parts))


def _gathered_unit(largest_unit: int, unit_bytes: int, tp: int, name: str = "", whole_gradients: bool = False) -> Part:
    """The largest unit gathered, and the next prefetched; where a unit's gradients are computed whole
    (FSDP2), also those gradients: at the end of a unit's backward a rank holds its gathered parameters,
    their whole gradients and the next unit's prefetch, then, the parameters resharded, the gradients and
    their reduce-scatter input -- three copies of the unit either way (measured: one unit for a 28 M
    parameter stack costs 2.7-2.9 copies more than per-block units, tests/test_effects_transformer.py).
    Under tensor parallel each rank gathers its 1/tp slice of it (FSDP shards the DTensor's local slice
    over dp_shard), on one dp_shard rank nothing."""
    elements = largest_unit // tp
    slice_ = f" / tp {tp}: each rank's slice" if tp > 1 else ""
    which = f"largest unit: {name}" if name else "largest unit"
    if whole_gradients:
        return Part("gathered unit", 3 * elements * unit_bytes, "device",
                    f"3 x {elements:,} x {unit_bytes} B ({which}{slice_}: its parameters, their whole gradients, "
                    f"and the reduce-scatter input or the next unit prefetched)")
    return Part("gathered unit", 2 * elements * unit_bytes, "device",
                f"2 x {elements:,} x {unit_bytes} B ({which}{slice_}, and the next prefetched)")


def _step_temporaries(sizes: ModelSizes, s: Setting, trainable: int, stored: int, held: int) -> Optional[Part]:
    """What a step allocates for a moment beyond the state, the larger of:
    - Adam's step: `exp_avg_sq.sqrt()` and its division by the bias correction are new tensors the size
      of what it steps at once. torch's single-tensor Adam (its choice for CPU tensors) steps one parameter
      (or shard) at a time: two temporaries of the largest; its foreach Adam (its default on CUDA) steps a
      whole list at once: one temporary of all the rank's trainable elements (not measured on a GPU
      yet); DeepSpeed steps its flat fp32 partition, whole (ZeRO-1/2) or by sub-group (ZeRO-3); its CPU
      Adam (optimizer offload) steps in place. SGD steps in place.
    - DeepSpeed ZeRO-1/2's reduce: the bucket's gradient slices copied into one flat tensor.
    Both come after the backward has freed the activations, so only what exceeds them is added. Not
    counted: SGD's temporaries with weight decay or Nesterov, and a torch optimizer stepping offloaded
    (host) shards.
    Measured on the CPU (2 ranks, a 31.5 M MLP, AdamW): a DDP rank's peak is its first optimizer step,
    72 MiB above its state (two temporaries of the 36 MiB largest parameter); a ZeRO-2 rank's is its reduce,
    122 MiB above (docs/memory.md)."""
    L = s.layout
    candidates = []
    if s.optimizer_tensors == 2 and not L.offload_optimizer:  # Adam's two moments: the sqrt temporaries
        rank_elements = trainable // L.optimizer
        if L.optimizer_flat_elements:
            flat = L.optimizer_flat_elements
            if L.gradient_bucket_per_unit and s.device_type == "cuda":  # ZeRO-3's sub-groups follow the blocks
                flat = max(flat, min(sizes.largest_unit, 1_000_000_000))  # there (strategies/deepspeed.py)
            at_once, copies = min(rank_elements, flat), 1 if s.device_type == "cuda" else 2
            how = f"Adam's step over {'its fp32 partition' if at_once == rank_elements else 'sub-groups'} of " \
                  f"{at_once:,} elements"
        elif s.device_type == "cuda":
            at_once, copies, how = rank_elements, 1, "torch's foreach Adam: the rank's trainable elements at once"
        else:
            shards = max(1, L.optimizer // L.parameters_split)  # a pipeline stage holds its weights whole
            at_once, copies = max(1, sizes.largest_parameter // shards), 2
            how = "torch's Adam, one parameter at a time: the largest" + (" (its shard)" if shards > 1 else "")
        candidates.append((copies * at_once * FP32, f"{copies} x {at_once:,} x 4 B ({how})"))
    if L.reduce_flat_copy_elements:
        bucket = min(trainable, L.reduce_flat_copy_elements)
        candidates.append((bucket * stored, f"{bucket:,} x {stored} B (the reduce's flat copy of the bucket)"))
    if not candidates or not sizes.largest_parameter:
        return None
    size, how = max(candidates)
    # the step comes after the backward has freed the activations (`held`): only what exceeds them adds
    if held >= size:
        return None
    if held >= MiB:
        how += f"; the {(size - held) / MiB:.0f} MiB beyond the activations, freed by then"
    return Part("step temporaries", size - held, "device", how)


STAGED = ("parameters", "fp32 master weights", "optimizer state", "buffers")  # what a checkpoint holds


def _staged_checkpoint(parts: list[Part]) -> Part:
    """`async_save`: the stager copies every tensor of the rank's state dict (its parameters, optimizer
    state and buffers, as the rank holds them: its shards under FSDP, all of it under DDP) into host
    memory and holds the copy until the background write is done: through the steps that follow the
    save, so it adds to their peak. On the CPU DCP's default stager makes a fresh copy per save; on a GPU
    trainkit's stager keeps its pinned buffers from the first save to the end of the run
    (runtime/checkpoint_async.py): the same bytes, held for longer."""
    staged = [p for p in parts if p.name in STAGED]
    return Part("checkpoint staging", sum(p.bytes for p in staged), "host",
                f"async_save: a host copy of this rank's {' + '.join(p.name for p in staged)} while a save "
                "writes (pinned and kept for the run on a GPU)")


def _activations(sizes: ModelSizes, s: Setting) -> Optional[Part]:
    traced = sizes.checkpointed_activation_bytes if s.activation_checkpointing else sizes.activation_bytes
    if traced is None:
        return None
    low = LOW_PRECISION.get(s.precision)
    scale = (low / FP32 if low else 1.0) * s.micro_batch / max(1, sizes.micro_batch) / s.layout.parameters_split
    how = (f"traced: {traced / MiB:.0f} MiB at batch {sizes.micro_batch}, scaled to micro-batch {s.micro_batch}"
           + (f", {s.precision}" if low else "") + (", blocks recomputed" if s.activation_checkpointing else "")
           + (f", / {s.layout.parameters_split} stages" if s.layout.parameters_split > 1 else ""))
    return Part("activations", int(traced * scale), "device", how)


# --------------------------------------------------------------------------- the changes that fit
def alternatives(sizes: ModelSizes, s: Setting, available: int, sharded_layouts: dict[str, tuple[dict, MemoryLayout]]
                 ) -> list[MemoryAdvice]:
    """Each change on its own, with its predicted figure, then the smallest combination that fits.

    `sharded_layouts`: what the strategies that shard would lay out at this world size (label ->
    (recipe changes, layout)); the caller builds them from the strategies' own options.
    """
    options: list[tuple[dict, Setting, str]] = []
    for label, (changes, layout) in sharded_layouts.items():
        if layout.parameters > s.layout.parameters or layout.optimizer > s.layout.optimizer or \
                layout.offload_optimizer > s.layout.offload_optimizer:
            options.append((changes, replace(s, layout=layout), f"{label}: shards parameters, gradients and "
                                                                 f"optimizer state over {s.world_size} ranks"))
    if not s.activation_checkpointing and (sizes.checkpointed_activation_bytes or 0) < (sizes.activation_bytes or 0):
        options.append(({"performance.activation_checkpointing": "full"},
                        replace(s, activation_checkpointing=True), "recompute the blocks in backward (~1 more forward)"))
    if s.micro_batch > 1:
        smaller = s.micro_batch
        while smaller > 1 and plan(sizes, replace(s, micro_batch=smaller)).per_rank > available:
            smaller //= 2
        if smaller < s.micro_batch:
            accum = s.grad_accum_steps * (s.micro_batch // smaller)
            options.append(({"data.batch_size": smaller, "trainer.grad_accum_steps": accum},
                            replace(s, micro_batch=smaller, grad_accum_steps=accum), "the same global batch"))
    out = [_advice(sizes, changes, setting, available, what) for changes, setting, what in options]
    if out and not any(a.fits for a in out):  # the leanest sharding with every other change
        sharded = [o for o in options if o[1].layout != s.layout]
        leanest = min(sharded, key=lambda o: plan(sizes, o[1]).per_rank, default=None)
        combined, setting = {}, s
        for changes, option, _ in [o for o in options if o[1].layout == s.layout] + ([leanest] if leanest else []):
            combined.update(changes)
            setting = _merge(setting, option, s)
        out.append(_advice(sizes, combined, setting, available, "all of them together"))
    return sorted(out, key=lambda a: (not a.fits, a.plan.per_rank))


def sharding_strategies(world_size: int, device_type: str) -> dict[str, tuple[dict, MemoryLayout]]:
    """The built-in strategies that shard, as the alternatives a plan proposes (their own layouts);
    DeepSpeed only where it is installed, offload only where a device has memory of its own."""
    from importlib.util import find_spec

    from .blocks.deepspeed import DeepSpeedOptions
    from .blocks.fsdp import FSDPOptions

    out = {"FSDP": ({"strategy.name": "fsdp"}, FSDPOptions(name="fsdp").memory_layout(world_size))}
    if all(find_spec(p) for p in DeepSpeedOptions.requires_packages):
        out["ZeRO-3"] = ({"strategy.name": "deepspeed", "strategy.zero_stage": 3},
                         DeepSpeedOptions(name="deepspeed", zero_stage=3).memory_layout(world_size))
    if device_type != "cpu":
        out["FSDP, CPU offload"] = ({"strategy.name": "fsdp", "strategy.cpu_offload": True},
                                    FSDPOptions(name="fsdp", cpu_offload=True).memory_layout(world_size))
    return out


def fitting_changes(sizes: ModelSizes, s: Setting, available: int) -> list[MemoryAdvice]:
    """The changes that would bring one rank under `available` bytes, each with its figure (only
    those that lower the plan)."""
    now = plan(sizes, s).per_rank
    return [a for a in alternatives(sizes, s, available, sharding_strategies(s.world_size, s.device_type))
            if a.plan.per_rank < now]


def _merge(current: Setting, option: Setting, base: Setting) -> Setting:
    """`current` with whatever `option` changed from `base`."""
    changed = {f: getattr(option, f) for f in Setting.__dataclass_fields__ if getattr(option, f) != getattr(base, f)}
    return replace(current, **changed)


def _advice(sizes: ModelSizes, changes: dict, setting: Setting, available: int, what: str) -> MemoryAdvice:
    planned = plan(sizes, setting)
    return MemoryAdvice(changes, planned, planned.per_rank <= available, what)


__all__ = ["MemoryAdvice", "MemoryLayout", "MemoryPlan", "ModelSizes", "Part", "Setting", "alternatives", "gib",
           "layout_of", "optimizer_tensors", "plan", "setting_of",
           "split_by_tp"]
