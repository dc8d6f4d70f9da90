"""Pipeline parallel with `torch.distributed.pipelining`: the model cut into stages, stages placed
round-robin on the ranks, micro-batches driven by a GPipe, 1F1B or interleaved-1F1B schedule.

Two ways to cut a model:

- an `nn.Sequential` (nested Sequentials are flattened): its forward is the composition of its
  blocks, so a stage is a run of consecutive blocks, cut at named blocks or balanced by parameters;
- any other model (torchvision's ResNets, ...) is traced with `torch.distributed.pipelining.pipeline`
  and cut before each named split point (`SplitPoint.BEGINNING`). The tracer records the functional
  calls between children (ResNet's `torch.flatten` between avgpool and fc) that a chain of
  children would lose. Named split points are required there.

Where and how a model is cut is stage planning (`pipeline_stages`); this module is the strategy: process
groups, schedules, the loss and gradients across stages, checkpoints. Either way a stage keeps the
original parameter names -- checkpoints and `trainkit export` use the
unpipelined model's keys.

Within one pipeline every rank reads the same batch; the first stage consumes the inputs, the
last stage the labels, and the loss it computes is broadcast so every rank reports it.

Pipeline x data parallel (`data_parallel: D`, 2-D): the ranks form a ("pp", "dp") device mesh of
(world / D) x D, torchtitan's order (data-parallel peers are neighbouring ranks, on one node where
possible; a pipeline spans the mesh's outer dimension). Each of the D pipelines reads its own share of
the data; before each optimizer step every stage's gradients are averaged over its "dp" group (one
coalesced all-reduce per step, see `_average_gradients_over_pipelines`).

Sharded stages (a `parallel:` block with pp > 1 and dp_shard and/or tp above 1, 3-D): the run's 4-D
mesh; each stage keeps the model's own names, is split by the model's tensor-parallel plan on "tp" and
`fully_shard`ed over "dp_shard" (`pipeline_sharded`), FSDP reduces the gradients, and checkpoints are
DCP's (they load on another mesh).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..recipe.blocks import PipelineOptions
from ..recipe.blocks.pipeline import sharded_stages
from ..recipe.problems import did_you_mean
from ..runtime.files import fsync_save
from ..runtime.model import build_model
from ..runtime.performance import checkpoint_blocks, compile_module
from .base import Strategy, hash_tensor
from .fsdp import FSDPStrategy
from .pipeline_sharded import clip_grad_norm_across_stages, load_sharded, save_sharded, shard_stage
from .pipeline_stages import (
    SplitError,
    StageModule,
    TracedStage,
    boundaries_from_names,
    checkpointed_names,
    example_inputs,
    flatten_blocks,
    is_sequential,
    nested_stage,
    plan_stages,
    stage_count,
    stage_flops,
    stages_of_rank,
    traced_split_problems,
)

BATCHNORM_LOCAL_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")
MAX_LOGITS_DIMS = 8  # evaluation logits broadcast from the last stage: at most this many dimensions
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B"}


# --------------------------------------------------------------------------- the strategy
class PipelineStrategy(Strategy):
    options: PipelineOptions

    pp_group = dp_group = None  # None: the world (one pipeline); set by setup() for data_parallel > 1
    _evaluating = False  # eval_forward's schedule.eval: the loss of its placeholder target is not computed

    def __init__(self, options, *, data, **common):
        """`data`: the recipe's data block: the micro-batch shape the tracer runs the model on and that
        evaluation pads a short last batch to."""
        super().__init__(options, **common)
        self.data = data

    @classmethod
    def run_inputs(cls, recipe) -> dict:
        return {**super().run_inputs(recipe), "data": recipe.data}

    @property
    def sharded(self) -> bool:
        """Stages split by tensor parallel and/or sharded by FSDP on the run's mesh (3-D)."""
        return self.dims is not None and sharded_stages(self.dims)

    @property
    def data_parallel_rank(self) -> int:
        if self.sharded:
            return super().data_parallel_rank  # the mesh's ("dp_replicate", "dp_shard") coordinate
        return self.rank % self.replicas  # the mesh's inner "dp" coordinate

    @property
    def data_parallel_size(self) -> int:
        return super().data_parallel_size if self.sharded else self.replicas

    @property
    def pipeline_rank(self) -> int:
        """This rank's place in its pipeline (the mesh's outer "pp" coordinate)."""
        return self.rank // (self.world_size // self.pipeline_size)

    @property
    def pipeline_size(self) -> int:
        """Ranks per pipeline."""
        return self.dims.pp if self.sharded else self.world_size // self.replicas

    def _global_rank(self, pipeline_rank: int) -> int:
        """The global rank holding place `pipeline_rank` of this rank's pipeline."""
        return pipeline_rank * self.replicas + self.data_parallel_rank

    @property
    def replicas(self) -> int:
        """Pipeline replicas: the run mesh's dp_replicate (`strategy.data_parallel` is its alias in the
        recipe); the options' own value only where no dims were given (a strategy built alone)."""
        return self.dims.dp_replicate if self.dims is not None else self.options.data_parallel

    def _mesh_groups(self) -> None:
        """The run mesh's groups (runtime.mesh.RunMesh): "pp" for the stages, and, for pipeline replicas
        without sharding, "dp_replicate" for the gradient average (the mesh lays ranks out as
        pp x dp_replicate, `data_parallel` being the recipe's dp_replicate)."""
        if self.sharded:  # FSDP reduces over the data-parallel ranks (no dp_group)
            self.pp_group = self.run_mesh.group("pp")
            return
        if self.replicas == 1:
            return
        if self.world_size % self.replicas:
            raise SplitError(f"{self.replicas} pipeline replicas do not divide the world size {self.world_size}")
        self.pp_group, self.dp_group = self.run_mesh.group("pp"), self.run_mesh.group("dp_replicate")

    def _average_gradients_over_pipelines(self) -> None:
        """The mean of each stage's accumulated gradients over its data-parallel peers: one coalesced
        all-reduce over the "dp" group per optimizer step.

        Hand-written, not DDP around each stage: `PipelineStage` can drive a DDP-wrapped stage, but
        in torch 2.14 DDP's reducer fails its bucket rebuild after the first step when a schedule runs
        several backward passes in one step ("rebuilt parameter indices size is not same as original
        model parameters size", seen here with 1F1B). The arithmetic is DDP's: sum, then / peers."""
        if self.dp_group is None:
            return
        grads = [p.grad for m in self.modules for p in m.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.dp_group)
        flat /= self.replicas
        for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            grad.copy_(synced)

    def optimizer_step(self, model, optimizer, precision, max_norm):
        self._average_gradients_over_pipelines()
        return super().optimizer_step(model, optimizer, precision, max_norm)

    def setup(self, model: nn.Module, optimizer_factory):
        from torch.distributed.pipelining import PipelineStage

        perf = self.performance
        self._mesh_groups()
        if self.sharded:
            return self._setup_sharded(model, optimizer_factory)
        ac_names = checkpointed_names(model, perf.checkpointing)
        stage = lambda m, i: PipelineStage(m, i, self.num_stages, self.device, group=self.pp_group)  # noqa: E731
        if is_sequential(model):
            plan = plan_stages(model, self.options, self.pipeline_size)
            self.num_stages = len(plan)
            self.stage_ids = stages_of_rank(self.pipeline_rank, self.num_stages, self.pipeline_size)
            self.modules = [StageModule(plan[i]).to(self.device) for i in self.stage_ids]
            build = stage
            lookup = lambda m: dict(zip(m.names, m.blocks))  # noqa: E731
        else:
            from torch.distributed.pipelining import SplitPoint, pipeline

            pipe = pipeline(model, mb_args=(example_inputs(self.data, self.options.microbatches),),
                            split_spec={p: SplitPoint.BEGINNING for p in self.options.split_points})
            self.num_stages = pipe.num_stages
            self.stage_ids = stages_of_rank(self.pipeline_rank, self.num_stages, self.pipeline_size)
            self.modules = [TracedStage(pipe.get_stage_module(i)) for i in self.stage_ids]
            build = lambda m, i: pipe.build_stage(i, self.device, group=self.pp_group)  # noqa: E731
            lookup = lambda m: dict(m.module.named_modules())  # noqa: E731
        for m in self.modules:
            if ac_names:
                named = lookup(m)
                if is_sequential(model):  # blocks of a StageModule keep their own submodules
                    named = {f"{n}.{k}" if k else n: sub for n, b in named.items() for k, sub in b.named_modules()}
                checkpoint_blocks([named[n] for n in ac_names if n in named])
            compile_module(m.module if isinstance(m, TracedStage) else m, perf.compile_options)
        self.stages = [build(m, i) for m, i in zip(self.modules, self.stage_ids)]
        for m in self.modules:
            m.to(self.device)
        self.schedule = None
        self.eval_schedule = None
        container = nn.ModuleList(self.modules)
        groups = [{"params": list(m.parameters())} for m in self.modules]
        self.groups_of_stage = {}  # stage index -> optimizer param group index (stages without parameters have none)
        kept = []
        for stage_id, group in zip(self.stage_ids, groups):
            if group["params"]:
                self.groups_of_stage[stage_id] = len(kept)
                kept.append(group)
        if not kept:
            raise SplitError(f"rank {self.rank} holds stages {self.stage_ids} without parameters; "
                             f"choose split points that give every rank some layers")
        return container, optimizer_factory(kept)

    def _setup_sharded(self, model: nn.Module, optimizer_factory):
        """Stages that keep the model's names, split on "tp" and sharded on "dp_shard" (`shard_stage`), one
        optimizer over this rank's part of the model (its stages' blocks, the original names)."""
        from torch.distributed.pipelining import PipelineStage

        if not is_sequential(model):
            raise SplitError(f"sharded pipeline stages need an nn.Sequential model; got {type(model).__name__}")
        self.model_names = [n for n, _ in model.named_parameters()]  # the whole model's, for checkpoints
        plan = plan_stages(model, self.options, self.pipeline_size)
        self.num_stages = len(plan)
        self.stage_ids = stages_of_rank(self.pipeline_rank, self.num_stages, self.pipeline_size)
        precision = self.precision.name if self.precision else "fp32"
        self.modules = [shard_stage(nested_stage(plan[i]).to(self.device), model, self.run_mesh, precision,
                                    self.performance) for i in self.stage_ids]
        self.stages = [PipelineStage(m, i, self.num_stages, self.device, group=self.pp_group)
                       for m, i in zip(self.modules, self.stage_ids)]
        self.schedule = self.eval_schedule = None
        part = nested_stage([block for i in self.stage_ids for block in plan[i]])  # shares the stages' modules
        return part, optimizer_factory(part.parameters())

    def flops_of_rank(self, model: nn.Module, x: torch.Tensor) -> float:
        """FLOPs of one forward + backward of this rank's stages only (for MFU: a rank is credited
        with the work it does, not the whole model's). `model` is the unsplit model, e.g. on meta."""
        if not is_sequential(model):
            return None  # traced stages: counted as the whole model (not split on the meta device)
        plan = plan_stages(model, self.options, self.pipeline_size)
        per_stage = stage_flops([StageModule(blocks) for blocks in plan], x)
        mine = sum(per_stage[i] for i in stages_of_rank(self.pipeline_rank, len(plan), self.pipeline_size))
        return mine / (self.dims.tp if self.sharded else 1)  # a tensor-parallel rank does 1/tp of its stage

    @property
    def last_stage_rank(self) -> int:
        """Global rank of the last stage of this rank's pipeline."""
        if self.sharded:
            return dist.get_global_rank(self.pp_group, (self.num_stages - 1) % self.pipeline_size)
        return self._global_rank((self.num_stages - 1) % self.pipeline_size)

    def _build_schedule(self, loss_fn, grad_accum_steps: int):
        from torch.distributed.pipelining import schedules

        m = self.options.microbatches
        scale = m * grad_accum_steps

        def stage_loss(out, target):  # mean over the micro-batch, / micro-batches and accumulation
            if self._evaluating:  # schedule.eval runs it on a placeholder target: a zero, whatever the task
                return out.float().sum() * 0.0
            return loss_fn(out.float(), target) / scale

        cls = getattr(schedules, SCHEDULES[self.options.schedule])
        if self.options.schedule == "interleaved_1f1b":
            return cls(self.stages, n_microbatches=m, loss_fn=stage_loss, scale_grads=False)
        if len(self.stages) != 1:
            raise SplitError(f"schedule {self.options.schedule} runs one stage per rank; rank {self.rank} has "
                             f"{len(self.stages)} (use interleaved_1f1b for several)")
        return cls(self.stages[0], n_microbatches=m, loss_fn=stage_loss, scale_grads=False)

    def forward_backward(self, model, x, y, loss_fn, precision, *, grad_accum_steps, last_micro_step):
        if self.schedule is None:
            self.schedule = self._build_schedule(loss_fn, grad_accum_steps)
        first, last = 0 in self.stage_ids, self.num_stages - 1 in self.stage_ids
        losses: list = []
        args = (x,) if first else ()
        kwargs = {"target": y, "losses": losses} if last else {}
        with self._autocast(precision):
            self.schedule.step(*args, **kwargs)
        loss = torch.stack([l.detach().float() for l in losses]).sum() if last else torch.zeros((), device=self.device)
        if self.pipeline_size > 1:
            dist.broadcast(loss, src=self.last_stage_rank, group=self.pp_group)
        return loss

    def _autocast(self, precision):
        """Autocast, except on sharded stages: there FSDP's MixedPrecisionPolicy casts (as in the FSDP strategy)."""
        return contextlib.nullcontext() if self.sharded else precision.autocast()

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Every rank holds its pipeline's batch loss; with data_parallel > 1, the mean over pipelines (sharded
        stages: over every rank, as the base strategy; a pipeline's pp x tp ranks hold the same loss)."""
        if self.sharded:
            return super().reduce_loss(loss)
        loss = loss.detach().clone().float()
        if self.dp_group is not None:
            dist.all_reduce(loss, group=self.dp_group)
            loss /= self.replicas
        return loss

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """The norm over all stages: each rank's squared sum, all-reduced along its pipeline (the
        data-parallel replicas of a stage hold the same, already averaged, gradients). Sharded stages:
        each stage's norm over its DTensor meshes, then summed in squares along the pipeline."""
        if self.sharded:
            return clip_grad_norm_across_stages(list(model.parameters()), max_norm, self.pp_group)
        params = [p for p in model.parameters() if p.grad is not None]
        sq = torch.zeros((), device=self.device, dtype=torch.float32)
        for p in params:
            sq += p.grad.detach().float().pow(2).sum()
        if self.pipeline_size > 1:
            dist.all_reduce(sq, group=self.pp_group)
        total = sq.sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def eval_forward(self, model, x, precision):
        """Forward-only pass of the schedule (`schedule.eval`); the last stage's logits are broadcast
        so every rank computes the same evaluation sums (see `all_reduce_sum`)."""
        if self.schedule is None:
            raise RuntimeError("pipeline evaluation runs after the first training step (it reuses its schedule)")
        first, last = 0 in self.stage_ids, self.num_stages - 1 in self.stage_ids
        # the schedule's loss_fn runs on the last stage whenever it is set: a placeholder target
        # (the loss is discarded; the loop computes the evaluation sums from the logits)
        n, full = x.shape[0], self.data.batch_size
        if n < full:  # a short last batch: the stages exchange micro-batches of the training shape, so pad
            x = torch.cat([x, x.new_zeros((full - n,) + tuple(x.shape[1:]))])
        kwargs = {"target": torch.zeros(x.shape[0], dtype=torch.long, device=self.device)} if last else {}
        self._evaluating = True
        try:
            with self._autocast(precision):
                out = self.schedule.eval(*((x,) if first else ()), **kwargs)
        finally:
            self._evaluating = False
        if last:
            out = out[:n]
        if self.pipeline_size == 1:
            return out
        # the number of dimensions first, then the sizes: a classifier's logits are 2-D, a language model's 3-D
        shape = torch.zeros(MAX_LOGITS_DIMS + 1, device=self.device, dtype=torch.long)
        if last:
            shape[0], shape[1:out.dim() + 1] = out.dim(), torch.tensor(out.shape)
        dist.broadcast(shape, src=self.last_stage_rank, group=self.pp_group)
        sizes = shape[1:int(shape[0]) + 1].tolist()
        logits = out.detach().float().contiguous() if last else torch.empty(sizes, device=self.device)
        dist.broadcast(logits, src=self.last_stage_rank, group=self.pp_group)
        return logits

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """The ranks of one pipeline read the same batches and hold the same evaluation logits: the
        job's sum is the sum over the pipelines (data-parallel peers), not over all ranks."""
        if self.sharded:
            return super().all_reduce_sum(value)  # over the mesh's data-parallel group
        value = value.detach().clone()
        if self.dp_group is not None:
            dist.all_reduce(value, group=self.dp_group)
        return value

    def local_tensors(self, model: nn.Module) -> Iterator[torch.Tensor]:
        """What this rank holds: its stages' parameters; of sharded stages, its own pieces (`to_local()`)."""
        for p in model.parameters():
            yield p.to_local().detach() if hasattr(p, "to_local") else p.detach()

    def replica_digests(self, model: nn.Module) -> list[str]:
        """Each rank's digest of the stages it owns (stage index, names and bytes). Every stage has
        exactly one owner, so the digests differ by design and nothing is compared (see
        `replicas_agree`); they identify each stage's final weights in summary.json."""
        import hashlib

        h = hashlib.sha256()
        if self.sharded:  # this rank's own pieces of its stages (tensor-parallel slices, FSDP shards)
            for name, t in sorted(self.unwrap(model).state_dict().items()):
                hash_tensor(h, name, t.to_local() if hasattr(t, "to_local") else t)
            return self.gather_digests(h.hexdigest())
        for stage_id, m in zip(self.stage_ids, self.modules):
            for k, v in sorted(m.model_state_dict().items()):
                if k.rsplit(".", 1)[-1] in BATCHNORM_LOCAL_STATISTICS:  # each replica's own batches: may differ
                    continue
                hash_tensor(h, f"{stage_id}:{k}", v)
        return self.gather_digests(h.hexdigest())

    def replicas_agree(self, digests: list[str]):
        """Stages are not copies of each other; with data_parallel > 1 the ranks at the same place
        of each pipeline are (same stages, same weights), and their digests must match."""
        d = self.replicas
        if d == 1 or self.sharded:  # sharded stages: every piece has one owner
            return None
        places = [digests[p * d:(p + 1) * d] for p in range(len(digests) // d)]  # global rank = p * d + dp
        return all(len(set(peers)) == 1 for peers in places)

    # ---- checkpoints: one file per stage (its blocks and its optimizer state), written by its rank
    def save_checkpoint(self, folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self.sharded:  # DCP, every rank its pieces, the original names
            return save_sharded(folder, model, optimizer, self.model_names)
        if self.data_parallel_rank != 0:  # replicas of the first pipeline's stages: one copy is written
            return
        full = optimizer.state_dict()
        for stage_id, m in zip(self.stage_ids, self.modules):
            g = self.groups_of_stage.get(stage_id)
            group = state = None
            if g is not None:
                pg = full["param_groups"][g]
                group = {k: v for k, v in pg.items() if k != "params"}
                state = [full["state"].get(i) for i in pg["params"]]
            fsync_save({"stage": stage_id, "num_stages": self.num_stages, "blocks": m.names,
                        "model": m.model_state_dict(), "optimizer_group": group, "optimizer_state": state},
                       folder / f"pipeline-stage-{stage_id:03d}.pt")

    def load_checkpoint(self, folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Each rank reads its stages' files; the optimizer state is renumbered to this placement. Sharded
        stages read DCP's checkpoint of any mesh."""
        if self.sharded:
            return load_sharded(folder, model, optimizer)
        current = optimizer.state_dict()
        groups, state = [dict(pg) for pg in current["param_groups"]], {}
        for stage_id, m in zip(self.stage_ids, self.modules):
            path = folder / f"pipeline-stage-{stage_id:03d}.pt"
            if not path.is_file():
                raise FileNotFoundError(f"{path} missing: the checkpoint was written with a different stage layout")
            saved = torch.load(path, map_location=self.device, weights_only=False)
            if saved["num_stages"] != self.num_stages or saved["blocks"] != m.names:
                raise ValueError(f"{path}: stage {stage_id} held blocks {saved['blocks']} of {saved['num_stages']} "
                                 f"stages; this run's stage {stage_id} holds {m.names} of {self.num_stages}. "
                                 f"Resume with the same split points and world size")
            m.load_model_state_dict(saved["model"])
            g = self.groups_of_stage.get(stage_id)
            if g is not None:
                ids = groups[g]["params"]
                groups[g] = dict(saved["optimizer_group"], params=ids)
                state.update({i: s for i, s in zip(ids, saved["optimizer_state"]) if s is not None})
        optimizer.load_state_dict({"state": state, "param_groups": groups})

    # ---- class-level hooks
    @classmethod
    def preflight(cls, recipe) -> Iterator[tuple[tuple, str, str]]:
        """Split points must exist (the model is built on the meta device), stages must fit the world
        size and the schedule, and what the strategy cannot do yet is said before launch."""
        o = recipe.strategy
        try:
            with torch.device("meta"):
                model = build_model(recipe.model.model_copy(update={"weights": None}))
        except Exception:  # the model check reports it
            return
        if not is_sequential(model):
            modal = sorted({type(m).__name__ for m in model.modules()
                            if isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.Dropout))})
            if recipe.trainer.eval_every and modal:
                yield ("trainer", "eval_every"), (
                    f"evaluation of a traced pipeline ({recipe.model.name}) is not supported: the traced stages keep "
                    f"the training behaviour of {', '.join(modal)} (model.eval() does not reach them); set "
                    f"trainer.eval_every: null"), "error"
            for i, message in traced_split_problems(model, o.split_points):
                yield ("strategy", "split_points") + ((i,) if i >= 0 else ()), message, "error"
            return  # the stage count against the ranks is a rule (PipelineOptions.rules)
        blocks = flatten_blocks(model)
        names = [n for n, _ in blocks]
        if o.split_points:
            for i, point in enumerate(o.split_points):
                if not any(n == point or n.startswith(point + ".") for n in names):
                    yield ("strategy", "split_points", i), (
                        f"split point '{point}' is not a module of {recipe.model.name}{did_you_mean(point, names)} "
                        f"(blocks in forward order: {', '.join(names)})"), "error"
            try:
                boundaries_from_names(names, o.split_points)
            except SplitError as exc:
                if "not a module" not in str(exc):
                    yield ("strategy", "split_points"), str(exc), "error"
        if recipe.world_size is None or recipe.world_size % o.replicas(recipe):
            return  # the rules report a data_parallel that does not divide the world size
        ws = recipe.parallel_dims(recipe.world_size).pp  # ranks per pipeline
        stages = stage_count(o, ws)
        if len(blocks) < stages:
            yield ("strategy", "split_points"), f"{stages} stages need at least {stages} blocks; " \
                f"{recipe.model.name} has {len(blocks)}", "error"
        if o.schedule in ("1f1b", "interleaved_1f1b") and o.microbatches < (stages if o.schedule == "1f1b" else ws):
            yield ("strategy", "microbatches"), f"schedule {o.schedule} needs at least as many micro-batches as " \
                f"{'stages' if o.schedule == '1f1b' else 'ranks'} ({stages if o.schedule == '1f1b' else ws}); " \
                f"got {o.microbatches}", "error"
        if o.schedule == "interleaved_1f1b":
            rounds = max(1, o.microbatches // ws)
            if o.microbatches % rounds:
                yield ("strategy", "microbatches"), f"interleaved_1f1b on {ws} ranks needs microbatches divisible " \
                    f"by {rounds} (microbatches // ranks); got {o.microbatches}", "error"

    @classmethod
    def owns_checkpoint(cls, folder: Path) -> bool:
        """Stage files, or DCP's sharded state dicts (sharded stages write those, as FSDP does)."""
        return any(folder.glob("pipeline-stage-*.pt")) or FSDPStrategy.owns_checkpoint(folder)

    @classmethod
    def consolidated_state_dict(cls, folder: Path) -> dict:
        """The stages' blocks merged back into the unpipelined model's state_dict (DCP's folder: the FSDP
        strategy's reader, the names are already the model's)."""
        if FSDPStrategy.owns_checkpoint(folder):
            return FSDPStrategy.consolidated_state_dict(folder)
        files = sorted(folder.glob("pipeline-stage-*.pt"))
        saved = [torch.load(f, map_location="cpu", weights_only=False) for f in files]
        expected = saved[0]["num_stages"] if saved else 0
        if len(saved) != expected:
            raise FileNotFoundError(f"{folder}: {len(saved)} stage files for {expected} stages")
        out: dict = {}
        for s in saved:
            out.update(s["model"])
        return out
