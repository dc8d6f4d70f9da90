"""Which device a rank computes on and which process-group backend it joins: decided here, once.

The worker (device + `init_process_group`) and preflight (does this recipe need GPUs here?) both
call `accelerator_for`, so they cannot disagree: a gloo recipe on a GPU machine runs on the CPU in
the worker exactly as preflight assumed.

A leaf module: it reads a Recipe's fields and imports nothing from strategies, monitors or the
worker; torch is imported only by `Accelerator.device`.
"""

from __future__ import annotations

from dataclasses import dataclass


class AcceleratorError(ValueError):
    """The recipe asks for a device/backend this machine does not have."""


@dataclass(frozen=True)
class Accelerator:
    """Where one rank runs.

    Attributes:
        device_type: "cuda" or "cpu".
        backend: the exact string for `torch.distributed.init_process_group`: "gloo", "nccl", or
            "cuda:nccl,cpu:gloo" when CPU tensors also cross the group (see `needs_cpu_collectives`).
        local_rank: this process's index on its node (its GPU with CUDA).
    """

    device_type: str
    backend: str
    local_rank: int = 0

    @property
    def device(self):
        import torch

        return torch.device("cuda", self.local_rank) if self.device_type == "cuda" else torch.device("cpu")

    @property
    def device_backend(self) -> str:
        """The backend that carries this device's tensors: "nccl" or "gloo"."""
        return "nccl" if self.device_type == "cuda" else "gloo"


def needs_cpu_collectives(recipe) -> bool:
    """Whether CPU tensors go through collectives even when the model is on a GPU.

    - FSDP with `cpu_offload`: sharded parameters and gradients live on the CPU as DTensors, so
      the gradient-norm `full_tensor()` when clipping and the GradScaler's found-inf all-reduce
      (fp16) are collectives over CPU tensors (the end-of-run replica check exchanges only digests), which nccl cannot carry (torchtitan adds `cpu:gloo` for its CPU offload too).
    - Not needed by DDP, FSDP without offload, pipeline or DeepSpeed: their collectives move
      device tensors (the pipeline's loss broadcast and norm all-reduce are on the device,
      DeepSpeed's offload reduces on the GPU before copying to the CPU), and
      `all_gather_object` (replica digests, monitors) pickles into a tensor on the current CUDA
      device under nccl.
    """
    return recipe.strategy.capabilities().cpu_collectives


def accelerator_for(recipe, *, cuda_available: bool, local_rank: int = 0) -> Accelerator:
    """The device and backend a recipe gets on a machine with (or without) usable CUDA.

    launch.backend: auto -> nccl on CUDA, else gloo; gloo -> the CPU even on a GPU machine;
    nccl -> CUDA, or AcceleratorError when no GPU is usable.

    Raises:
        AcceleratorError: backend nccl without CUDA.
    """
    wanted = recipe.launch.backend
    if wanted == "nccl" and not cuda_available:
        raise AcceleratorError("launch.backend: nccl needs CUDA GPUs and none is visible here; "
                               "use backend: gloo (CPU) or auto")
    if wanted == "gloo" or not cuda_available:
        return Accelerator("cpu", "gloo", local_rank)
    backend = "cuda:nccl,cpu:gloo" if needs_cpu_collectives(recipe) else "nccl"
    return Accelerator("cuda", backend, local_rank)
