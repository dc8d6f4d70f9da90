"""DistributedDataParallel: every rank holds the whole model; gradients are all-reduced in buckets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import ContextManager, Iterator

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..recipe.blocks import DDPOptions
from ..runtime.files import fsync_save
from ..runtime.quantized import frozen_quantized
from ..runtime.performance import apply_activation_checkpointing, compile_module
from ..runtime.timing import timed_hook
from .base import Strategy


class DDPStrategy(Strategy):
    options: DDPOptions

    @classmethod
    def preflight(cls, recipe) -> Iterator[tuple[tuple, str, str]]:
        """Communication hooks this torch cannot run on gloo (CPU runs): probed, not assumed."""
        from ..runtime.accelerator import AcceleratorError, accelerator_for

        hook = recipe.strategy.comm_hook
        try:
            backend = accelerator_for(recipe, cuda_available=torch.cuda.is_available()).device_backend
        except AcceleratorError:  # reported by preflight's device checks
            return
        if hook == "bf16_compress" and backend == "gloo":
            error = probe_hook_on_gloo("bf16_compress_hook")
            if error:
                yield ("strategy", "comm_hook"), f"bf16_compress does not work on gloo with this torch " \
                    f"({error}); use fp16_compress or none", "error"
        if hook == "powersgd" and backend == "gloo":
            yield ("strategy", "comm_hook"), "powersgd on gloo is known to fail or hang with several gradient " \
                "buckets (pytorch#58467); it is only reliable here for small models", "warning"

    def setup(self, model: nn.Module, optimizer_factory):
        model = model.to(self.device)
        perf = self.performance
        apply_activation_checkpointing(model, perf.checkpointing)  # hooks on the blocks, before any wrapper
        compile_module(model, perf.compile_options)  # DDP(compiled): torch.compile(DDP(m)) compiles nothing
        ids = [self.device.index] if self.device.type == "cuda" else None
        o = self.options
        # a frozen 4-bit base (QLoRA: torchao NF4 tensors) is neither broadcast nor reduced: c10d cannot
        # broadcast a tensor subclass, and every rank read the same weights and quantized them alike
        DDP._set_params_and_buffers_to_ignore_for_model(model, [
            name for name, p in model.named_parameters() if frozen_quantized(p)])
        ddp = DDP(model, device_ids=ids, bucket_cap_mb=o.bucket_cap_mb, static_graph=o.static_graph,
                  gradient_as_bucket_view=o.gradient_as_bucket_view,
                  find_unused_parameters=o.find_unused_parameters)
        self._register_hook(ddp)
        return ddp, optimizer_factory(ddp.parameters())

    def _register_hook(self, ddp: DDP) -> None:
        """The recipe's comm hook; timed when a monitor measures communication (`comm_timer`)."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        hook, state = self.options.comm_hook, None
        if self.comm_timer is not None:
            self.comm_timer.bind(self.device)  # CUDA events on a GPU: a host timestamp in the hook's
            # future callback is taken when the collective is queued, not when it has finished
        if hook == "fp16_compress":
            fn = default_hooks.fp16_compress_hook
        elif hook == "bf16_compress":
            fn = default_hooks.bf16_compress_hook
        elif hook == "powersgd":
            state = powerSGD_hook.PowerSGDState(process_group=None,
                                                matrix_approximation_rank=self.options.powersgd_rank,
                                                start_powerSGD_iter=2)
            fn = powerSGD_hook.powerSGD_hook
        elif self.comm_timer is not None:
            fn = default_hooks.allreduce_hook  # the built-in all-reduce, as a hook we can time
        else:
            return  # DDP's built-in C++ all-reduce: nothing to wrap
        ddp.register_comm_hook(state, timed_hook(fn, self.comm_timer))

    def no_sync(self, model: nn.Module) -> ContextManager:
        return model.no_sync()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DDP) else model

    def save_checkpoint(self, folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Replicas are identical: rank 0 writes one copy."""
        if self.rank == 0:
            fsync_save(self.unwrap(model).state_dict(), folder / "model.pt")
            fsync_save(optimizer.state_dict(), folder / "optimizer.pt")

    def load_checkpoint(self, folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        where = self.device
        self.unwrap(model).load_state_dict(torch.load(folder / "model.pt", map_location=where, weights_only=True))
        optimizer.load_state_dict(torch.load(folder / "optimizer.pt", map_location=where, weights_only=True))

    @classmethod
    def owns_checkpoint(cls, folder: Path) -> bool:
        return (folder / "model.pt").is_file()

    @classmethod
    def consolidated_state_dict(cls, folder: Path) -> dict:
        """DDP already writes one whole-model file."""
        return torch.load(folder / "model.pt", map_location="cpu", weights_only=True)


_PROBE = """
import sys, tempfile, torch, torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
model = DDP(torch.nn.Linear(4, 2))
model.register_comm_hook(None, getattr(default_hooks, sys.argv[1]))
model(torch.ones(2, 4)).sum().backward()
dist.barrier(); dist.destroy_process_group()
"""


def probe_hook_on_gloo(name: str) -> str:
    """Run one backward through a 1-process gloo DDP with the hook (in a child process, so this
    process never joins a process group); '' if it works, else the error's last line."""
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE, name], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "the probe timed out"
    if proc.returncode == 0:
        return ""
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else f"exit code {proc.returncode}"
