"""The interface the training loop talks to; one file per strategy implements it.

The loop never branches on a strategy's name: the forward/backward of a micro-batch, gradient
sync during accumulation, the optimizer step (with clipping), the loss it reports, the
data-parallel shape of the job, and the model / optimizer part of checkpoints all go through
these methods (like Lightning Fabric's strategies). The defaults are plain data parallelism;
each strategy overrides what differs.
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import Callable, ContextManager, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..recipe.blocks import PerformanceOptions
from ..runtime.materialize import materialize, parameters_on_meta
from ..runtime.quantized import frozen_quantized, stored_parts


def replicated_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The buffers every rank must hold identically at the end of a run: all but the running
    statistics of a (non-synchronised) BatchNorm, which each rank updates from its own batches (DDP
    broadcasts them only at the start of the next forward; FSDP2 never). SyncBatchNorm's statistics
    come from the global batch and must agree."""
    local_stats = set()
    for prefix, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm):
            local_stats |= {f"{prefix}.{n}" if prefix else n for n in ("running_mean", "running_var",
                                                                       "num_batches_tracked")}
    for name, b in model.named_buffers():
        if name not in local_stats:
            yield name, b


def hash_tensor(h, name: str, t: torch.Tensor) -> None:
    """Add a named tensor's exact bytes (as this process holds them) to a hash, read in place (no
    bytes copy of a host tensor that is already contiguous)."""
    h.update(name.encode())
    if frozen_quantized(t):  # QLoRA's NF4 base: its stored parts
        for inner, part in stored_parts(t).items():
            part = part.detach().reshape(-1).clone(memory_format=torch.contiguous_format)
            hash_tensor(h, f"{name}.{inner}", part)  # (a part may be a one-element view with a large stride)
        return
    h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())


def digest_of(name: str, t: torch.Tensor) -> str:
    h = hashlib.sha256()
    hash_tensor(h, name, t)
    return h.hexdigest()


class Strategy:
    """Default behaviour is plain data parallel bookkeeping; subclasses override what differs.

    Args:
        options: the recipe's strategy block.
        device: this process's device.
        precision: the run's `runtime.precision.Precision` (autocast, loss scaling).
        performance: the recipe's `performance:` block (compile, activation checkpointing), applied by
            each strategy where its wrapping allows (runtime.performance); None: the defaults.
        dims: the run's `ParallelDims` (`recipe.parallel_dims(world_size)`); None: plain data
            parallel over the world.
        mesh: the run's `runtime.mesh.RunMesh` over ("pp", "dp_replicate", "dp_shard", "tp"), built from `dims`
            (runtime.mesh.RunMesh: the one owner of the degrees, the DeviceMesh and its named views and
            groups); None without a process group.
    """

    comm_timer = None  # a runtime.timing.CommTimer, set before setup() when a monitor measures communication

    def __init__(self, options, *, device: torch.device, precision=None, performance=None, dims=None, mesh=None):
        self.options, self.device, self.precision = options, device, precision
        self.performance = performance if performance is not None else PerformanceOptions()
        self.dims, self.run_mesh = dims, mesh
        self.device_mesh = mesh.device_mesh if mesh is not None else None  # the DeviceMesh itself (monitors)

    @classmethod
    def run_inputs(cls, recipe) -> dict:
        """The constructor keywords this strategy takes from the resolved recipe beyond its own options
        block: the one place a strategy reads the recipe, so that its constructor's signature shows what
        it depends on (the worker passes options, device, precision, dims and mesh itself)."""
        return {"performance": recipe.performance}

    # ---- what the strategy declares (its options class: recipe.blocks.strategy.Capabilities)
    @property
    def capabilities(self):
        return self.options.capabilities()

    @property
    def reshards_on_load(self) -> bool:
        """A checkpoint saved by N ranks loads on M ranks."""
        return self.capabilities.reshards_on_load

    @property
    def float8_all_gather(self) -> bool:
        """float8 linears' weights are cast to float8 before this strategy all-gathers them (FSDP)."""
        return False

    @property
    def splits_model(self) -> bool:
        """Ranks hold different parts of the model (pipeline stages): MFU credits each rank's own FLOPs."""
        return self.capabilities.splits_model

    # ---- the shape of the job
    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    @property
    def data_parallel_rank(self) -> int:
        """Which shard of the data this rank reads (ranks with the same value read the same batches:
        the tensor-parallel and pipeline ranks of one data-parallel group)."""
        if self.run_mesh is None:
            return self.rank
        return self.run_mesh.data_parallel_rank

    @property
    def data_parallel_size(self) -> int:
        """How many different batches one micro-step consumes across the job."""
        if self.run_mesh is None:
            return self.world_size
        return self.run_mesh.data_parallel_size

    @property
    def ranks_per_batch(self) -> int:
        """How many ranks read each batch (tp x pp): one data-parallel group's loss and evaluation sums
        are held that many times, so the job's values are reduced over the data-parallel ranks only."""
        return self.world_size // self.data_parallel_size

    def data_parallel_group(self):
        """The process group of the ranks that read different batches with this one (the mesh's
        ("dp_replicate", "dp_shard") sub-mesh, flattened); None: the whole world."""
        if self.ranks_per_batch == 1:
            return None
        return self.run_mesh.group("batch")

    # ---- build
    def empty_init(self) -> ContextManager:
        """Where a seeded model is built: parameters on the meta device, no memory."""
        return parameters_on_meta()

    def materialize(self, model: nn.Module, seed: int, filled: frozenset = frozenset()) -> nn.Module:
        """Give a model built in `empty_init` its values before `setup`. Plain strategies keep every
        parameter, so the whole model is filled here (on the CPU; `setup` moves it as usual);
        sharding strategies fill only their shards, after sharding, and override this. The parameters
        named in `filled` are read from a pretrained directory later (runtime.pretrained): only allocated."""
        return materialize(model, seed, filled=filled)

    def setup(self, model: nn.Module, optimizer_factory) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Wrap the model for this strategy and build the optimizer over the wrapped parameters."""
        raise NotImplementedError

    # ---- one optimizer step = grad_accum_steps x forward_backward, then optimizer_step
    def forward_backward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable,
                         precision, *, grad_accum_steps: int, last_micro_step: bool) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns its loss / grad_accum_steps (detached,
        fp32), the value whose sum over the micro-steps is the step's loss."""
        sync = contextlib.nullcontext() if last_micro_step else self.no_sync(model)
        with sync:
            with precision.autocast():
                loss = loss_fn(model(x), y) / grad_accum_steps
            precision.backward(loss)
        return loss.detach().float()

    def no_sync(self, model: nn.Module) -> ContextManager:
        """Context for accumulation micro-steps whose gradients need not be synchronised yet."""
        return contextlib.nullcontext()

    def optimizer_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, precision,
                       max_norm: Optional[float]) -> Optional[torch.Tensor]:
        """Unscale, clip (if max_norm), step and zero the gradients; returns the pre-clip gradient norm
        when clipping, else None."""
        precision.unscale(optimizer)
        grad_norm = self.clip_grad_norm(model, max_norm) if max_norm else None
        precision.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def loss_scale_overflow(self) -> Optional[torch.Tensor]:
        """After `optimizer_step`: nonzero when fp16 loss scaling found inf/NaN gradients and skipped
        the step (its gradient norm is then inf by design, not a divergence); None without scaling."""
        return getattr(self.precision, "overflow", None)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def eval_forward(self, model: nn.Module, x: torch.Tensor, precision) -> torch.Tensor:
        """Logits for an evaluation batch (under torch.no_grad, set by the caller)."""
        with precision.autocast():
            return model(x)

    # ---- collectives
    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The step's loss as the whole job sees it (mean over data-parallel ranks), elementwise: the
        loop passes the losses of all steps since the last log step as one vector."""
        return self.all_reduce_mean(loss)  # a tensor-parallel group's ranks hold the same loss: the mean is kept

    def all_reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Mean of a tensor over all ranks (a copy; the input is unchanged)."""
        out = value.detach().clone().float()
        if self.world_size > 1:
            dist.all_reduce(out, op=dist.ReduceOp.SUM)
            out /= self.world_size
        return out

    def all_reduce_max(self, value: torch.Tensor) -> torch.Tensor:
        out = value.detach().clone()
        if self.world_size > 1:
            dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return out

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """A per-batch count or sum over the job: summed over the data-parallel ranks (the ranks of one
        tensor-parallel group hold the same value once)."""
        out = value.detach().clone()
        if self.world_size > 1:
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.data_parallel_group())
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def local_tensors(self, model: nn.Module) -> Iterator[torch.Tensor]:
        """The parameters as this rank holds them (replicas: the whole model)."""
        for p in self.unwrap(model).parameters():
            yield p.detach()

    def replica_digests(self, model: nn.Module) -> list[str]:
        """sha256 per rank of what this rank holds that the other ranks must hold identically: here
        (replicas) every parameter and buffer of its own copy of the model, as it is in its own
        memory. An end-of-run check (a collective): `replicas_agree` says whether the digests match.
        Sharded strategies override this with what is replicated there."""
        h = hashlib.sha256()
        for i, t in enumerate(self.local_tensors(model)):  # ZeRO-3 gathers here: see docs/strategies.md
            hash_tensor(h, f"param{i}", t)
        for name, t in replicated_buffers(self.unwrap(model)):
            hash_tensor(h, name, t)
        return self.gather_digests(h.hexdigest())

    def sharded_digests(self, replicated: Iterator[tuple[str, torch.Tensor]],
                        shards: Iterator[tuple[str, torch.Tensor]]) -> list[str]:
        """`replica_digests` of a sharded model (FSDP, ZeRO-3), gathering digests, never tensors: each
        rank hashes its replicated state and, one parameter at a time, its own shard of each parameter;
        the ranks exchange these hex strings, and each rank's digest is its replicated state plus the
        shard digests of every rank of its replica (HSDP: the ranks of its "dp_replicate" coordinate,
        whose shards together are one whole model; one replica without HSDP). So the digests agree iff
        the replicated state and the replicas do, and each names the whole model; no rank holds more
        than one shard's bytes for it."""
        h = hashlib.sha256()
        for name, t in replicated:
            hash_tensor(h, name, t)
        mine = (h.hexdigest(), [digest_of(name, t) for name, t in shards], self.replica_index)
        every = [mine]
        if self.world_size > 1:
            every = [None] * self.world_size
            dist.all_gather_object(every, mine)

        def model(replica: int) -> str:
            return "".join(d for _, shard_digests, r in every if r == replica for d in shard_digests)

        return [hashlib.sha256((replicated_hex + model(r)).encode()).hexdigest() for replicated_hex, _, r in every]

    @property
    def replica_index(self) -> int:
        """Which copy of the sharded model this rank holds a part of (its "dp_replicate" coordinate)."""
        if self.run_mesh is None:
            return 0
        return self.run_mesh.replica_index

    def replicas_agree(self, digests: list[str]) -> Optional[bool]:
        """Whether the ranks' `replica_digests` show the same model (None: nothing is replicated)."""
        return len(set(digests)) == 1

    def gather_digests(self, mine: str) -> list[str]:
        digests = [None] * self.world_size
        if self.world_size > 1:
            dist.all_gather_object(digests, mine)
        else:
            digests = [mine]
        return digests

    # ---- checkpoints: the strategy writes/reads the model and optimizer files in a checkpoint folder
    def save_checkpoint(self, folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        raise NotImplementedError

    def load_checkpoint(self, folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        raise NotImplementedError

    def flops_of_rank(self, model: nn.Module, x: torch.Tensor) -> Optional[float]:
        """FLOPs of one forward + backward of one micro-batch on this rank, where ranks do different
        work (`splits_model`); None means every rank runs the whole model. `model` is the unsplit
        model (e.g. on the meta device)."""
        return None

    # ---- class-level hooks used before launch and after training
    @classmethod
    def preflight(cls, recipe) -> Iterator[tuple[tuple, str, str]]:
        """Strategy-specific checks before launch: (recipe path, message, severity) findings."""
        return iter(())

    @classmethod
    def owns_checkpoint(cls, folder: Path) -> bool:
        """Whether a checkpoint folder was written by this strategy (for `trainkit export`)."""
        return False

    @classmethod
    def consolidated_state_dict(cls, folder: Path) -> dict:
        """The whole model's state_dict from a checkpoint folder, on the CPU, in one process."""
        raise NotImplementedError

    def teardown(self) -> None:
        pass
