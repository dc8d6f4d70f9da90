"""FSDP2 (`torch.distributed.fsdp.fully_shard`): parameters, gradients and optimizer state sharded
over the mesh's "dp_shard" ranks; on the 2-D ("dp_replicate", "dp_shard") mesh (HSDP) when the
recipe's `parallel:` block has replicas, and after tensor parallel on "tp" when it has `tp` > 1.

Thin functions in the torchtitan style: `blocks_to_wrap` picks the units, `apply_fsdp` composes
activation checkpointing and `fully_shard`; the strategy class only adapts them to the loop.
Checkpoints go through torch.distributed.checkpoint (every rank writes its shards in parallel), so
a checkpoint saved with N ranks loads with M, and on another mesh (HSDP 2x2 -> FSDP 4, TP 2 -> 1 are tested).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import ContextManager, Iterator, Optional

import torch
from torch import nn

from ..recipe.blocks import FSDPOptions
from ..recipe.blocks import ActivationCheckpointingOptions, CompileOptions, PerformanceOptions
from ..runtime.materialize import after_seeded_init, check_seedable, has_meta_parameters, owners, parameter_name, \
    seeded_values
from ..runtime.model import build_model
from ..runtime.performance import checkpoint_blocks, checkpointed_blocks, compile_module, precompute_float8_scales, \
    repeated_blocks
from ..runtime.dcp_state import load_dcp, state_for_dcp
from ..runtime.quantized import frozen_quantized, shard_problem, whole_from_dcp
from .base import Strategy, replicated_buffers
from .tensor_parallel import apply_tensor_parallel, full_tensor, loss_context, settle_collectives_before_compiled_blocks

def blocks_to_wrap(model: nn.Module, class_names: list[str]) -> list[nn.Module]:
    """The modules sharded as units: `runtime.performance.repeated_blocks` (the classes named, or the
    repeated children of Sequential/ModuleList containers)."""
    return repeated_blocks(model, class_names)


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def unknown_wrap_classes(model: nn.Module, class_names: list[str]) -> list[str]:
    present = {type(m).__name__ for m in model.modules()}
    return [n for n in class_names if n not in present]


def mixed_precision_policy(precision_name: str, *, root: bool = False):
    """bf16/fp16 parameters in compute, fp32 gradient reduction (torchtitan's policy).

    Outputs are cast to fp32 only at the root (`root=True`): a block's output stays in the compute
    dtype and goes straight into the next block. Casting every block's output to fp32 (as
    `output_dtype` on each unit would) costs a round trip per boundary -- an fp32 copy of each
    activation, kept for backward, then cast back by the next unit's `cast_forward_inputs` -- and
    hands fp32 activations to layers the root owns whose parameters are in the compute dtype.
    torchtitan sets no output dtype on its blocks either and casts the logits once, for the loss.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision_name)
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32,
                                output_dtype=torch.float32 if root else None)


def batchnorm_policy():
    """fp32 parameters and gradient reduction, the input left in the compute dtype (mixed-dtype
    batch_norm: low-precision input, fp32 weights and statistics)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)


def block_compile_options(options: Optional[CompileOptions]) -> Optional[CompileOptions]:
    """Compile options for FSDP's per-block compile. Blocks of one class but different shapes (a CNN's
    stages) share one code object, so dynamo recompiles per block and soon marks the shapes dynamic;
    Inductor then fails on a ResNet's symbolic BatchNorm shapes ("InductorError: Cannot convert
    expression to float", torch 2.14). Unless the recipe chooses, each block is compiled static."""
    if options is None or options.dynamic is not None:
        return options
    return options.model_copy(update={"dynamic": False})


def apply_fsdp(model: nn.Module, mesh, options: FSDPOptions, precision_name: str,
               performance: Optional[PerformanceOptions] = None) -> nn.Module:
    """Activation checkpointing and torch.compile per block (optional), fully_shard on each block,
    then on the root. Checkpointing and compile go on before a block is sharded, so FSDP's
    all-gather hooks stay outside the compiled region of the block's own computation."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    performance = performance or PerformanceOptions()
    ac = performance.checkpointing
    if options.activation_checkpointing and ac.mode == "none":  # the deprecated strategy flag: every unit
        ac = ActivationCheckpointingOptions(mode="full", blocks=list(options.wrap))
    checkpoint_blocks(checkpointed_blocks(model, ac))  # composable: recompute in backward, names unchanged
    kwargs = {"mesh": mesh, "reshard_after_forward": options.reshard_after_forward}
    if options.cpu_offload:
        # pinned host memory only helps copies to a GPU: the mesh's device, not "is CUDA visible"
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
    if mixed_precision_policy(precision_name).param_dtype is not None:
        # BatchNorm in fp32, as autocast keeps it: FSDP would cast its weights to bf16/fp16 beside its fp32
        # running statistics, which batch_norm refuses. Each its own unit (its input stays low-precision).
        for norm in (m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)):
            fully_shard(norm, mp_policy=batchnorm_policy(), **kwargs)
    compile_options = block_compile_options(performance.compile_options)
    for block in blocks_to_wrap(model, options.wrap):
        compile_module(block, compile_options)
        fully_shard(block, mp_policy=mixed_precision_policy(precision_name), **kwargs)
    fully_shard(model, mp_policy=mixed_precision_policy(precision_name, root=True), **kwargs)
    return model


def fill_shards(model: nn.Module, seed: int, device: torch.device, filled: frozenset = frozenset()) -> None:
    """After `fully_shard` on a model built on the meta device: allocate this rank's shards
    (`to_empty`, as torchtitan does) and fill each from its parameter's seeded full value. Every rank
    computes the same full value of one module at a time and keeps its own slice of it
    (`distribute_tensor(src_data_rank=None)`: no communication), so the shards are exactly the
    unsharded init, whatever the world size."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    buffers = {name: b.to(device) for name, b in model.named_buffers()}  # real: to_empty would lose them
    model.to_empty(device=device)
    with torch.no_grad():
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)
        for name, module in owners(model):
            wanted = {p for p, v in module._parameters.items() if v is not None and parameter_name(name, p) not in filled}
            if not wanted:  # every one is read from the pretrained directory after set-up
                continue
            for pname, full in seeded_values(module, name, seed).items():
                if pname not in wanted:
                    continue
                param = module._parameters[pname]
                if isinstance(param, DTensor):
                    mine = distribute_tensor(full.to(device), param.device_mesh, param.placements, src_data_rank=None)
                    param.to_local().copy_(mine.to_local())
                else:
                    param.copy_(full)
    after_seeded_init(model)


def by_mesh(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Tensors grouped by their DTensor mesh (plain tensors in a group of their own): a foreach op or a
    norm over DTensors needs one mesh, and under FSDP x TP a parameter the plan leaves whole (a norm
    of transformers' Llama) lives on the data-parallel mesh while the split ones live on ("dp_shard",
    "tp")."""
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for t in tensors:
        groups.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
    return list(groups.values())


def grad_norm_on_meshes(params: list[nn.Parameter]) -> tuple[list[list[nn.Parameter]], torch.Tensor]:
    """(the parameters with gradients grouped by mesh, the 2-norm of all their gradients): one norm per
    gradient mesh, each reduced over its own mesh (`full_tensor()` of the partial result), combined."""
    from torch.distributed.tensor import DTensor

    groups = by_mesh([p for p in params if p.grad is not None])
    norms = []
    for group in groups:
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], 2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return groups, torch.zeros(())
    return groups, norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms), 2.0)


def clip_grad_norm_on_meshes(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """torchtitan's `clip_grad_norm_` (`get_total_norm` of the DTensor gradients, `full_tensor()` of
    the partial result, `clip_grads_with_norm_`) done per gradient mesh (`grad_norm_on_meshes`), each
    mesh's gradients scaled by the global norm."""
    groups, total = grad_norm_on_meshes(params)
    for group in groups:
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def _move_buffers(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = b.to(device)


class FSDPStrategy(Strategy):
    options: FSDPOptions
    _seed: Optional[int] = None  # set by materialize(): the shards are filled in setup, after sharding
    _filled: frozenset = frozenset()  # ... except the parameters a pretrained directory fills after setup

    def materialize(self, model: nn.Module, seed: int, filled: frozenset = frozenset()) -> nn.Module:
        check_seedable(model, filled)
        self._seed, self._filled = seed, filled
        return model

    def setup(self, model: nn.Module, optimizer_factory):
        home = torch.device("cpu") if self.options.cpu_offload else self.device  # where the shards live
        seeded = has_meta_parameters(model)
        if seeded:
            if self._seed is None:
                raise RuntimeError("a model on the meta device reached FSDP setup without materialize(model, seed)")
            _move_buffers(model, home)
        elif not self.options.cpu_offload:
            model = model.to(self.device)
        if self.options.activation_checkpointing and self.rank == 0:
            print("trainkit: strategy.activation_checkpointing is deprecated: use performance.activation_checkpointing: "
                  "full", flush=True)
        if self.tensor_parallel > 1:  # TP inside the layers first, then FSDP over the data-parallel ranks
            model = apply_tensor_parallel(model, self.mesh_owner.view("tp"), loss_parallel=self.loss_parallel)
            if self.performance.compile_options is not None:
                settle_collectives_before_compiled_blocks(model, blocks_to_wrap(model, self.options.wrap))
        self.mesh = self.shard_mesh()
        unsplittable = [why for name, p in model.named_parameters() if frozen_quantized(p)
                        for why in [shard_problem(name, p, self.mesh.size())] if why]
        if unsplittable:  # QLoRA: torchao's NF4 split would fail inside fully_shard with a bare assertion
            raise ValueError(unsplittable[0])
        if self.tensor_parallel > 1:
            # a flattened (data-parallel..., "tp") group: DTensor then reduces a norm over both in one
            # all-reduce instead of one per dimension (and stops warning each rank that it does not)
            self.mesh_owner.view("fsdp_tp")
        apply_fsdp(model, self.mesh, self.options, self.precision.name if self.precision else "fp32", self.performance)
        if seeded:
            fill_shards(model, self._seed, home, self._filled)
            # buffers compute where the inputs are: fill_shards' `to_empty(device=home)` put them on the CPU
            # under cpu_offload, and FSDP2 moves inputs but never buffers (a BatchNorm's statistics)
            _move_buffers(model, self.device)
        return model, optimizer_factory(model.parameters())

    # ---- the mesh: FSDP shards over ("dp_replicate", "dp_shard"), tensor parallel inside "tp"
    @property
    def mesh_owner(self):
        """The run's mesh (runtime.mesh.RunMesh); plain FSDP over the world for a strategy constructed
        without one (a bench's in-process strategy)."""
        if self.run_mesh is None:
            from ..recipe.blocks.strategy import ParallelDims
            from ..runtime.mesh import RunMesh

            self.run_mesh = RunMesh.build(ParallelDims(dp_shard=self.world_size), self.device.type)
            self.device_mesh = self.run_mesh.device_mesh
        return self.run_mesh

    @property
    def float8_all_gather(self) -> bool:
        """With `performance.float8`, FSDP gathers the float8 linears' weights in float8 (torchao), half
        a bf16 all-gather's bytes. Not with tensor parallel (the weights are DTensors over tp, which
        torchao's float8 all-gather does not split) or cpu_offload (the cast would run on the host's
        shard each step): not verified there."""
        return self.performance.float8 and self.tensor_parallel == 1 and not self.options.cpu_offload

    def optimizer_step(self, model, optimizer, precision, max_norm):
        grad_norm = super().optimizer_step(model, optimizer, precision, max_norm)
        if self.float8_all_gather:
            precompute_float8_scales(model)
        return grad_norm

    @property
    def tensor_parallel(self) -> int:
        return self.mesh_owner.degree("tp")

    @property
    def loss_parallel(self) -> bool:
        """The cross-entropy on vocabulary-sharded logits (no gather of the logits) under tensor parallel."""
        return self.tensor_parallel > 1

    def shard_mesh(self):
        """FSDP's mesh, the run mesh's "fsdp" view: "dp_shard", or ("dp_replicate", "dp_shard") for HSDP."""
        return self.mesh_owner.view("fsdp")

    def forward_backward(self, model, x, y, loss_fn, precision, *, grad_accum_steps, last_micro_step):
        """The MixedPrecisionPolicy casts parameters and inputs, so no autocast here. Under loss parallel
        the logits are vocabulary-sharded and torch's context encloses the loss and its backward."""
        with (contextlib.nullcontext() if last_micro_step else self.no_sync(model)), self._loss_context():
            loss = loss_fn(model(x).float(), y) / grad_accum_steps
            precision.backward(loss)
        return full_tensor(loss.detach().float())

    def eval_forward(self, model, x, precision):
        return full_tensor(model(x))

    def _loss_context(self) -> ContextManager:
        return loss_context(self.loss_parallel)

    def no_sync(self, model: nn.Module) -> ContextManager:
        """Accumulate unsharded gradients locally; reduce-scatter only on the last micro-step."""
        @contextlib.contextmanager
        def off():
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)

        return off()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Global norm over the DTensor gradient shards of every mesh (`clip_grad_norm_on_meshes`)."""
        return clip_grad_norm_on_meshes(list(model.parameters()), max_norm)

    def local_tensors(self, model: nn.Module) -> Iterator[torch.Tensor]:
        """What this rank holds: its shard of each sharded parameter (never a gathered one), and the
        parameters FSDP left whole."""
        from torch.distributed.tensor import DTensor

        for p in model.parameters():
            yield p.to_local().detach() if isinstance(p, DTensor) else p.detach()

    def replica_digests(self, model: nn.Module) -> list[str]:
        """FSDP keeps one copy of each parameter element (rank r holds chunk r of dim 0), so there is
        no parameter replica to compare. What must agree is the replicated state: parameters that are
        not sharded and every buffer (FSDP2 does not synchronise buffers such as BatchNorm
        statistics). The shards are hashed where they lie, one per parameter, and only their digests
        travel (`sharded_digests`): gathering the parameters to compare them would put the whole
        model on a rank at the end of every run (issue 28)."""
        from torch.distributed.tensor import DTensor

        params = list(model.named_parameters())
        replicated = [(n, p) for n, p in params if not isinstance(p, DTensor)] + list(replicated_buffers(model))
        shards = ((n, p.to_local()) for n, p in params if isinstance(p, DTensor))
        return self.sharded_digests(replicated, shards)

    # ---- checkpoints: torch.distributed.checkpoint, every rank writes its own shards
    def save_checkpoint(self, folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(state_for_dcp(model, optimizer)[0], checkpoint_id=str(folder))

    def load_checkpoint(self, folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Loads whatever world size wrote it: DCP reshards to this run's mesh."""
        load_dcp(folder, model, optimizer)

    # ---- class-level hooks
    @classmethod
    def preflight(cls, recipe) -> Iterator[tuple[tuple, str, str]]:
        if recipe.strategy.activation_checkpointing:
            yield ("strategy", "activation_checkpointing"), (
                "deprecated: use performance.activation_checkpointing: full (the same units are recomputed); "
                "this flag still works for now"), "warning"
        names = recipe.strategy.wrap
        if not names:
            return
        try:
            with torch.device("meta"):
                model = build_model(recipe.model.model_copy(update={"weights": None}))
        except Exception:  # the model check reports it
            return
        missing = unknown_wrap_classes(model, names)
        if missing:
            present = sorted({type(m).__name__ for m in model.modules() if _has_params(m)})
            yield ("strategy", "wrap"), (f"no module of class {', '.join(missing)} in {recipe.model.name}; "
                                         f"classes with parameters: {', '.join(present)}"), "error"

    @classmethod
    def owns_checkpoint(cls, folder: Path) -> bool:
        return (folder / ".metadata").is_file()

    @classmethod
    def consolidated_state_dict(cls, folder: Path) -> dict:
        """The model's shards merged into plain tensors, without a process group. DCP's own loader
        (as `dcp_to_torch_save` uses it) reads only the "model" entries: the optimizer's state, twice
        the model under Adam, stays on disk."""
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        state: dict = {}
        _load_state_dict(state, storage_reader=FileSystemReader(str(folder)),
                         planner=_EmptyStateDictLoadPlanner(keys=["model"]), no_dist=True)
        return whole_from_dcp(state["model"])
