"""torch, CUDA, NCCL and DeepSpeed: installed versions against what the recipe will use."""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version
from typing import Optional

from .check import Check, failed, passed, warned

TORCH_MIN = (2, 6)  # pyproject.toml: torch>=2.6
DEEPSPEED_MIN = (0, 15)  # pyproject.toml: deepspeed>=0.15


def _numbers(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:2])


def _wants_cuda(resolved) -> Optional[str]:
    """Why the recipe cannot run without CUDA, or None."""
    if resolved is None:
        return None
    r = resolved.recipe
    if r.launch.backend == "nccl":
        return "launch.backend: nccl"
    return None  # fp16 runs on the CPU too (slowly: for testing loss scaling)


def torch_version(resolved) -> Check:
    import torch

    v = torch.__version__
    if _numbers(v) < TORCH_MIN:
        return failed("torch", f"torch {v} is older than trainkit supports ({'.'.join(map(str, TORCH_MIN))})",
                      "pip install 'torch>=2.6' 'torchvision>=0.21'")
    try:
        tv = f", torchvision {version('torchvision')}"
    except PackageNotFoundError:
        return failed("torch", f"torch {v}, but torchvision is not installed",
                      "pip install torchvision (matching your torch)")
    return passed("torch", f"torch {v}{tv}")


def cuda(resolved) -> Check:
    import torch

    built = torch.version.cuda
    need = _wants_cuda(resolved)
    if torch.cuda.is_available():
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        return passed("CUDA", f"CUDA {built}, {torch.cuda.device_count()} device(s): {', '.join(names)}")
    what = "torch is a CPU-only build" if built is None else f"torch built for CUDA {built}, but no usable GPU/driver"
    if need:
        fix = "install a CUDA build of torch" if built is None else "run on a GPU node (check nvidia-smi)"
        return failed("CUDA", f"{what}; the recipe needs CUDA ({need})",
                      f"{fix}, or change {need.split(':')[0]} (e.g. backend: auto)")
    return passed("CUDA", f"{what}: ranks run on CPU with gloo")


def nccl(resolved) -> Check:
    import torch
    import torch.distributed as dist

    backend = resolved.recipe.launch.backend if resolved else "auto"
    if torch.cuda.is_available() and dist.is_nccl_available():
        v = ".".join(map(str, torch.cuda.nccl.version()))
        return passed("NCCL", f"NCCL {v}" + (" (not used: launch.backend: gloo)" if backend == "gloo" else ""))
    gloo = "gloo available" if dist.is_gloo_available() else "gloo NOT available"
    if backend == "nccl":
        return failed("NCCL", f"launch.backend: nccl, but NCCL is unusable here (no CUDA GPU or a build without "
                      f"NCCL); {gloo}", "set launch.backend: auto (gloo on CPU) or run on a GPU node")
    if not dist.is_gloo_available():
        return failed("NCCL", "neither NCCL nor gloo is available: no distributed backend",
                      "install the official torch wheel (it includes gloo)")
    return passed("NCCL", f"not used (no CUDA); {gloo}")


def deepspeed(resolved) -> Check:
    """From package metadata: importing DeepSpeed takes seconds and may JIT-compile."""
    uses = resolved is not None and "deepspeed" in resolved.recipe.strategy.requires_packages
    try:
        v = version("deepspeed")
    except PackageNotFoundError:
        if uses:
            return failed("DeepSpeed", "strategy: deepspeed, but DeepSpeed is not installed",
                          "pip install 'deepspeed>=0.15', or choose strategy: fsdp")
        return passed("DeepSpeed", "not installed (only strategy: deepspeed needs it)")
    if _numbers(v) < DEEPSPEED_MIN:
        check = failed if uses else warned
        return check("DeepSpeed", f"DeepSpeed {v} is older than trainkit supports (0.15)", "pip install 'deepspeed>=0.15'")
    return passed("DeepSpeed", f"DeepSpeed {v}" + ("" if uses else " (not used by this recipe)" if resolved else ""))
