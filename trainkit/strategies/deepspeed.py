"""DeepSpeed ZeRO (stages 0-3), launched under torchrun like every other strategy.

`ds_config_for(recipe)` is the single place the DeepSpeed config is made: the strategy block
(zero_stage, offloads, pass-through `config`) plus precision, grad_accum_steps, grad_clip and the
batch size. `trainkit plan` prints it and preflight runs it through DeepSpeed's own parser
(`DeepSpeedConfig`) before anything starts. The optimizer is trainkit's own torch optimizer, except
under optimizer offload, where DeepSpeed's CPU Adam steps the offloaded state (`cpu_adam`);
DeepSpeed owns accumulation, clipping and its checkpoints.
"""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path
from typing import Iterator, Optional

import torch
from torch import nn

from ..recipe.blocks import DeepSpeedOptions
from ..recipe.blocks.deepspeed import ZERO3_BUFFER_NUMEL
from ..runtime.files import fsync_save
from ..runtime.materialize import after_seeded_init, check_seedable, owners, parameter_name, seeded_values
from ..runtime.memory_trace import largest_unit_of
from ..runtime.performance import apply_activation_checkpointing, compile_kwargs
from ..runtime.pretrained import pretrained_source
from .base import Strategy, replicated_buffers
from .deepspeed_checkpoint import load_mapped, settle
from .deepspeed_import import import_deepspeed
from .deepspeed_master import share_fp32_partitions
from .deepspeed_ops import CPU_ADAM_OP, announce_build, announce_cpu_adam_build, pending_build

TAG = "zero"  # the sub-folder DeepSpeed writes inside a trainkit checkpoint folder


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


ZERO3_CPU_BUFFERS = {key: ZERO3_BUFFER_NUMEL for key in (
    "reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_max_reuse_distance",
    "sub_group_size")}


def zero3_buffers(largest_unit: int, device_type: str) -> dict:
    """ZeRO-3's buffers for the device the ranks run on, from the model's largest block (`largest_unit`,
    elements).

    On GPUs: DeepSpeed prefetches the next module's parameters only while fewer than
    `stage3_max_live_parameters` are gathered (`partitioned_param_coordinator.py`), so a live limit below
    one block switches prefetch off and puts every all-gather on the critical path. So: two blocks live (the
    one computing and the next, prefetched: FSDP's own schedule, and what the memory plan's "gathered unit"
    counts), one block per prefetch, per gradient reduce-scatter and per optimizer sub-group; floored at
    5e6 elements (small blocks would make many tiny collectives) and capped at DeepSpeed's own defaults
    (prefetch 5e7, live 1e9, reduce bucket 5e8, sub-group 1e9), which exceed a whole model of a few
    hundred million parameters.

    On the CPU (gloo): 5e6 elements each (DDP's 25 MB bucket). gloo's collectives are synchronous, so
    prefetch cannot overlap communication there: measured side by side (bench/zero3_buffers.py,
    docs/benchmarks.md "ZeRO-3's buffers"), the model-sized buffers cost +139 MiB per rank for a step time
    within the noise, so the CPU keeps the lean ones.
    """
    if device_type != "cuda":
        return dict(ZERO3_CPU_BUFFERS)
    unit = max(ZERO3_BUFFER_NUMEL, int(largest_unit))
    return {"stage3_prefetch_bucket_size": min(unit, 50_000_000),
            "stage3_max_live_parameters": min(2 * unit, 1_000_000_000),
            "stage3_max_reuse_distance": min(unit, 1_000_000_000),
            "reduce_bucket_size": min(unit, 500_000_000),
            "sub_group_size": min(unit, 1_000_000_000)}


def _device_type(recipe) -> str:
    """Where the ranks run: the decision preflight, doctor and the worker make (runtime.accelerator)."""
    from ..runtime.accelerator import accelerator_for

    return accelerator_for(recipe, cuda_available=torch_cuda_available()).device_type


def ds_config_for(recipe) -> dict:
    """The DeepSpeed config a recipe implies (train_batch_size is left for DeepSpeed to derive:
    micro batch x accumulation x data-parallel world size)."""
    s: DeepSpeedOptions = recipe.strategy
    t = recipe.trainer
    buffers = {}
    if s.zero_stage == 3:
        device = _device_type(recipe)  # the model is built (on meta) only where its block sizes the buffers
        buffers = zero3_buffers(largest_unit_of(recipe) if device == "cuda" else 0, device)
    zero: dict = {"stage": s.zero_stage, **buffers}  # `config` may override
    if s.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": s.offload_optimizer, "pin_memory": torch_cuda_available()}
    if s.offload_param != "none":
        zero["offload_param"] = {"device": s.offload_param, "pin_memory": torch_cuda_available()}
    config: dict = {
        "train_micro_batch_size_per_gpu": recipe.data.batch_size,
        "gradient_accumulation_steps": t.grad_accum_steps,
        "gradient_clipping": float(t.grad_clip) if t.grad_clip else 0.0,  # DeepSpeed's default is 1.0, not off
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # trainkit's torch optimizer
        # offload: DeepSpeed's CPU Adam, or (its reason printed) the torch optimizer DeepSpeed would refuse
        "zero_force_ds_cpu_optimizer": s.runs_cpu_adam(recipe.optimizer),
        "steps_per_print": 2**31 - 1,
    }
    if recipe.precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif recipe.precision == "fp16":
        scale = t.loss_scale
        config["fp16"] = {"enabled": True, "loss_scale": 0 if scale == "dynamic" else float(scale)}
    return _merge(config, s.config)


def match_batchnorm_buffers(module: nn.Module, dtype: Optional[torch.dtype]) -> None:
    """bf16/fp16 engines cast parameters but keep buffers in fp32 (DeepSpeed >= 0.18), so a BatchNorm
    would compute with low-precision weights beside fp32 running statistics, which batch_norm refuses
    ("expected scalar type BFloat16 but found Float"). DeepSpeed's `keep_in_fp32_modules` keeps only
    buffers, not parameters, in fp32; so BatchNorm statistics follow the parameters' dtype, as they did
    under DeepSpeed's earlier blanket `module.bfloat16()` (docs/strategies.md states the trade)."""
    if dtype is None:
        return
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            for name in ("running_mean", "running_var"):
                b = getattr(m, name, None)
                if b is not None and b.is_floating_point():
                    b.data = b.data.to(dtype)


def torch_cuda_available() -> bool:
    return torch.cuda.is_available()


class DeepSpeedStrategy(Strategy):
    options: DeepSpeedOptions

    def __init__(self, options, *, config: dict, optimizer_options, **common):
        """`config`: the DeepSpeed config the recipe implies (`ds_config_for`: batch, accumulation,
        clipping, precision, ZeRO buffers); `optimizer_options`: the recipe's optimizer block, which an
        offloaded optimizer step runs as DeepSpeed's CPU Adam when it can."""
        super().__init__(options, **common)
        self.config, self.optimizer_options = config, optimizer_options

    @classmethod
    def run_inputs(cls, recipe) -> dict:
        return {**super().run_inputs(recipe), "config": ds_config_for(recipe), "optimizer_options": recipe.optimizer}

    def empty_init(self):
        """ZeRO-3: DeepSpeed's own `zero.Init` partitions each module's parameters as soon as the
        module is built, so no rank ever holds the whole model."""
        if self.options.zero_stage != 3:
            return super().empty_init()
        # zero.Init patches torch.Tensor.__new__ while the model is built; torch._dynamo, imported lazily by
        # model code (torchvision's models), registers polyfills that check Tensor.__new__'s signature
        # and fail on the patched one ("Signature mismatch ... tensor_pynew"). Imported first, it sees
        # the original.
        import torch._dynamo  # noqa: F401

        deepspeed = import_deepspeed()
        announce_build()  # zero.Init starts DeepSpeed's comm: its CPU op may be compiled first
        return deepspeed.zero.Init(config_dict_or_path=copy.deepcopy(self.config))  # the engine gets it unread

    def materialize(self, model: nn.Module, seed: int, filled: frozenset = frozenset()) -> nn.Module:
        """ZeRO-3: one module at a time, gather its partitioned parameters, set their seeded values
        (every rank computes the same; rank 0's are kept) -- or, for the parameters a pretrained
        directory holds (`filled`), rank 0 copies them from its safetensors -- and let DeepSpeed
        re-partition them. No rank holds more than one module whole."""
        if self.options.zero_stage != 3:
            return super().materialize(model, seed, filled)
        deepspeed = import_deepspeed()
        check_seedable(model, filled)
        stored = pretrained_source(model) if filled else None
        for name, module in owners(model):
            own = {pname: p for pname, p in module._parameters.items() if p is not None}
            pretrained = {pname for pname in own if parameter_name(name, pname) in filled}
            values = seeded_values(module, name, seed, full_shape=lambda p: p.ds_shape) if pretrained < set(own) else {}
            with deepspeed.zero.GatheredParameters(list(own.values()), modifier_rank=0), torch.no_grad():
                for pname, parameter in own.items():
                    if pname not in pretrained:
                        parameter.copy_(values[pname])
                    elif self.rank == 0:  # rank 0's values are the ones DeepSpeed keeps
                        parameter.copy_(stored.read(stored.checkpoint_name(parameter_name(name, pname))))
        if filled:  # what the checkpoint does not hold (LoRA's adapters: small) gathered at once for the model's hook
            rest = [p for pname, p in model.named_parameters() if pname not in filled]
            with deepspeed.zero.GatheredParameters(rest, modifier_rank=0), torch.no_grad():
                after_seeded_init(model)
                stored_names = stored.names()
                for bname, buffer in model.named_buffers():  # not partitioned: every rank reads its own
                    if stored.checkpoint_name(bname) in stored_names:
                        buffer.copy_(stored.read(stored.checkpoint_name(bname)))
        return model

    def setup(self, model: nn.Module, optimizer_factory):
        deepspeed = import_deepspeed()
        apply_activation_checkpointing(model, self.performance.checkpointing)  # hooks: ZeRO-3 gathers on recompute
        optimizer = self._optimizer(model, optimizer_factory)
        announce_build()  # the engine starts DeepSpeed's comm: its CPU op may be compiled first
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=self.config,
                                               dist_init_required=False)
        compile_options = self.performance.compile_options
        if compile_options is not None:  # DeepSpeed's documented way: the engine compiles its module
            engine.compile(compile_kwargs=compile_kwargs(compile_options))
        self.engine = engine
        share_fp32_partitions(engine.optimizer)  # fp32 ZeRO-3: no second copy of the parameter partition
        load_mapped(engine)  # a resume without a second copy of the optimizer state
        self.input_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision.name)
        match_batchnorm_buffers(engine.module, self.input_dtype)
        # The scheduler steps the torch optimizer's param_groups, which the ZeRO optimizer shares.
        return engine, optimizer

    def _optimizer(self, model: nn.Module, optimizer_factory) -> torch.optim.Optimizer:
        """Optimizer offload steps in DeepSpeed's CPU Adam (its warning: a torch optimizer there 'in most
        cases will yield poor performance'); what it cannot run stays a torch optimizer, with the reason."""
        optimizer = self.optimizer_options
        if self.options.runs_cpu_adam(optimizer):
            if self.rank == 0:
                print(f"trainkit: optimizer offload steps in DeepSpeed's CPU Adam ({optimizer.name})", flush=True)
            return cpu_adam(optimizer, model.parameters())
        reason = self.options.torch_optimizer_reason(optimizer)
        if reason and self.rank == 0:
            print(f"trainkit: note: optimizer offload steps in torch's {optimizer.name}, not "
                  f"DeepSpeed's CPU Adam: {reason}", flush=True)
        return optimizer_factory(model.parameters())

    def _cast(self, x: torch.Tensor) -> torch.Tensor:
        """DeepSpeed's bf16/fp16 modules need inputs of their dtype (the caller's job)."""
        return x.to(self.input_dtype) if self.input_dtype is not None and x.is_floating_point() else x

    def forward_backward(self, model, x, y, loss_fn, precision, *, grad_accum_steps, last_micro_step):
        """engine.backward scales by 1/accumulation itself; engine.step() on non-boundary micro-steps
        only advances DeepSpeed's micro-step counter."""
        loss = loss_fn(model(self._cast(x)).float(), y)
        model.backward(loss)
        if not model.is_gradient_accumulation_boundary():
            model.step()
        return loss.detach().float() / grad_accum_steps

    def optimizer_step(self, model, optimizer, precision, max_norm):
        model.step()  # clipping (gradient_clipping), loss scaling, step and zero_grad happen inside
        # DeepSpeed's fp16 optimizers record a skipped overflow step as `overflow` (a Python bool)
        self._overflow = torch.tensor(float(bool(getattr(model.optimizer, "overflow", False))))
        if not max_norm:
            return None
        norm = model.get_global_grad_norm()  # a device tensor or a float: read at log steps, no sync here
        if norm is None:
            return None
        return norm.detach() if isinstance(norm, torch.Tensor) else torch.as_tensor(norm)

    def loss_scale_overflow(self) -> Optional[torch.Tensor]:
        return getattr(self, "_overflow", None)

    def eval_forward(self, model, x, precision):
        return model(self._cast(x)).float()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return getattr(model, "module", model)

    def local_tensors(self, model: nn.Module) -> Iterator[torch.Tensor]:
        """What this rank holds: under ZeRO-3 its partition of each parameter (`ds_tensor`), never a
        gathered parameter; ZeRO-0/1/2 keep whole parameters on every rank."""
        for p in self.unwrap(model).parameters():
            yield (p.ds_tensor if self.options.zero_stage == 3 else p).detach()

    def replica_digests(self, model: nn.Module) -> list[str]:
        """ZeRO-3: each parameter element has one owner, so only the buffers are replicas; the
        partitions are hashed where they lie and only their digests travel (`sharded_digests`).
        Gathering the parameters to hash them put the whole model on every rank at the end of
        each run (issue 28). ZeRO-0/1/2: every rank's own whole copy, as for DDP."""
        if self.options.zero_stage != 3:
            return super().replica_digests(model)
        module = self.unwrap(model)
        shards = ((name, p.ds_tensor) for name, p in module.named_parameters())
        return self.sharded_digests(replicated_buffers(module), shards)

    # ---- checkpoints: DeepSpeed's own (every rank writes its partitions) in FOLDER/zero/
    def save_checkpoint(self, folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        model.save_checkpoint(str(folder), tag=TAG, save_latest=False)
        # top-level marker (hashed into meta.json with the other top-level files)
        if self.rank == 0:
            fsync_save({"tag": TAG, "zero_stage": self.options.zero_stage, "world_size": self.world_size},
                       folder / "deepspeed.pt")

    def load_checkpoint(self, folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        path, _ = model.load_checkpoint(str(folder), tag=TAG, load_optimizer_states=True,
                                        load_lr_scheduler_states=False)
        if path is None:
            raise FileNotFoundError(f"{folder / TAG}: DeepSpeed found no checkpoint to load")
        settle(model, optimizer)

    # ---- class-level hooks
    @classmethod
    def preflight(cls, recipe) -> Iterator[tuple[tuple, str, str]]:
        """The config through DeepSpeed's own parser, and the pieces this machine cannot run."""
        try:
            deepspeed = import_deepspeed()
            from deepspeed.runtime.config import DeepSpeedConfig
        except Exception as exc:
            yield ("strategy", "name"), f"deepspeed cannot be imported here ({type(exc).__name__}: {exc}); " \
                "install it with the README's set-up command", "error"
            return
        config = ds_config_for(recipe)
        try:
            DeepSpeedConfig(copy.deepcopy(config))
        except Exception as exc:
            yield ("strategy", "config"), f"DeepSpeed rejects the config built from this recipe: " \
                f"{type(exc).__name__}: {exc}", "error"
        s = recipe.strategy
        if "nvme" in (s.offload_optimizer, s.offload_param):
            from deepspeed.ops.op_builder import AsyncIOBuilder

            if not AsyncIOBuilder().is_compatible(verbose=False):
                key = "offload_optimizer" if s.offload_optimizer == "nvme" else "offload_param"
                yield ("strategy", key), "nvme offload needs DeepSpeed's async_io op, which cannot be built on " \
                    "this machine (libaio development files missing); use cpu or none", "error"
        accel = deepspeed.accelerator.get_accelerator()
        if accel.device_name() == "cpu":
            if recipe.precision == "fp16":
                yield ("precision",), "DeepSpeed's CPU accelerator has no fp16 training; use bf16 or fp32", "error"
            if shutil.which("ninja") is None and not _have_ninja_module():
                yield ("strategy", "name"), "DeepSpeed on CPU JIT-compiles its shared-memory comm op and needs " \
                    "ninja and a C++ compiler, which are missing here", "error"
            elif shutil.which(os.environ.get("CXX", "c++")) is None:
                yield ("strategy", "name"), "DeepSpeed on CPU JIT-compiles its shared-memory comm op and needs " \
                    "a C++ compiler (c++), which is missing here", "error"
        if s.runs_cpu_adam(recipe.optimizer) and shutil.which(os.environ.get("CXX", "c++")) is None \
                and pending_build(CPU_ADAM_OP) is not None:
            yield ("strategy", "offload_optimizer"), "optimizer offload steps in DeepSpeed's CPU Adam, which is " \
                "compiled on first use and needs a C++ compiler (c++), missing here; install one (g++)", "error"

    @classmethod
    def plan_lines(cls, recipe) -> list[str]:
        """For `trainkit plan`: the DeepSpeed config exactly as the engine will get it."""
        import json

        ws = recipe.world_size
        derived = recipe.global_batch_at(recipe.parallel_dims(ws).dp) if ws else "?"
        return [f"ds_config:       {json.dumps(ds_config_for(recipe), sort_keys=True)}",
                f"                 (train_batch_size derived by DeepSpeed: {derived})"]

    @classmethod
    def owns_checkpoint(cls, folder: Path) -> bool:
        return (folder / "deepspeed.pt").is_file()

    @classmethod
    def consolidated_state_dict(cls, folder: Path) -> dict:
        """fp32 weights reassembled from the ZeRO partitions (stage 0: the module file)."""
        info = torch.load(folder / "deepspeed.pt", weights_only=False)
        tag = info["tag"]
        if info["zero_stage"] == 0:
            return torch.load(folder / tag / "mp_rank_00_model_states.pt", map_location="cpu",
                              weights_only=False)["module"]
        import_deepspeed()
        if info["zero_stage"] == 3:  # one copy of the model, without every rank's partition mapped besides it
            from .deepspeed_export import zero3_state_dict

            return zero3_state_dict(folder / tag)
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = dict(get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag))
        if info["zero_stage"] == 1:
            # ZeRO-1 checkpoints record no frozen parameters beside the optimizer's partitions (DeepSpeed saves
            # them only where it partitions gradients: engine.py `save_frozen_param`), so zero_to_fp32 leaves
            # a LoRA run's frozen base out; every rank holds the whole module at stage 1, and rank 0's module
            # file has it (found by the compatibility grid's LoRA cells)
            module = torch.load(folder / tag / "mp_rank_00_model_states.pt", map_location="cpu",
                                weights_only=False)["module"]
            state.update({name: value for name, value in module.items() if name not in state})
        return state


def cpu_adam(options, params) -> torch.optim.Optimizer:
    """The recipe's adam/adamw as DeepSpeed's CPU Adam: lr, betas, eps and weight_decay one to one;
    adam's weight decay is an L2 term on the gradient (adamw_mode false), adamw's is decoupled."""
    import_deepspeed()
    announce_cpu_adam_build()
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(params, lr=options.lr, betas=tuple(options.betas), eps=options.eps,
                            weight_decay=options.weight_decay, adamw_mode=options.name == "adamw")


def _have_ninja_module() -> bool:
    try:
        import ninja  # noqa: F401

        return True
    except ImportError:
        return False
