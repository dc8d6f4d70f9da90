"""GPUs this launch will see, against one process per GPU (`launch.nproc_per_node`)."""

from __future__ import annotations

import os
import re
from typing import Optional

from ..runtime.accelerator import accelerator_for
from .check import Check, failed, passed, warned


def visible_devices() -> Optional[list[str]]:
    """CUDA_VISIBLE_DEVICES as the CUDA runtime reads it: None when unset; otherwise the entries up
    to the first invalid one (CUDA ignores the rest, which is why `-1` hides every GPU)."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    out: list[str] = []
    for item in (part.strip() for part in raw.split(",")):
        if not (re.fullmatch(r"\d+", item) or item.startswith(("GPU-", "MIG-"))):
            break
        out.append(item)
    return out


def gpus(resolved) -> Check:
    import torch

    available = torch.cuda.is_available()
    count = torch.cuda.device_count() if available else 0
    nproc = resolved.recipe.launch.nproc_per_node if resolved else None
    named = visible_devices()
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    here = f"{count} usable GPU(s) here" if available else "no usable CUDA GPU here"
    if named is not None and 0 < len(named) and nproc and len(named) < nproc:
        example = ",".join(map(str, range(nproc)))
        return failed("GPUs", f"CUDA_VISIBLE_DEVICES={raw} names {len(named)} device(s) but launch.nproc_per_node is "
                      f"{nproc} (one process per GPU; {here})",
                      f"set CUDA_VISIBLE_DEVICES to {nproc} devices (e.g. {example}) or launch.nproc_per_node: "
                      f"{len(named)} ({resolved.locate(('launch', 'nproc_per_node'))})")
    if available and resolved and accelerator_for(resolved.recipe, cuda_available=True).device_type == "cpu":
        # the worker's own decision: backend gloo runs every rank on the CPU, GPUs or not
        return passed("GPUs", f"{count} GPU(s) visible, but launch.backend: gloo runs the ranks on the CPU")
    if available and nproc and count < nproc:
        return failed("GPUs", f"launch.nproc_per_node is {nproc} but only {count} GPU(s) are visible "
                      f"(one process per GPU)", f"launch.nproc_per_node: {count}, or use a node with {nproc} GPUs")
    if named is not None and not named:
        return passed("GPUs", f"CUDA_VISIBLE_DEVICES={raw!r} hides every GPU: ranks run on CPU with gloo")
    if available:
        detail = f"{count} GPU(s) visible" + (f" (CUDA_VISIBLE_DEVICES={raw})" if raw is not None else "")
        return passed("GPUs", detail + (f", nproc_per_node {nproc}" if nproc else ""))
    cores = os.cpu_count() or 1
    if named:
        return warned("GPUs", f"CUDA_VISIBLE_DEVICES={raw} names {len(named)} device(s) but {here}: ranks will run "
                      f"on CPU with gloo", "run on a GPU node (check nvidia-smi), or unset CUDA_VISIBLE_DEVICES")
    if nproc and nproc > cores:
        return warned("GPUs", f"no CUDA GPU: {nproc} CPU processes (gloo) will share {cores} core(s)",
                      f"launch.nproc_per_node: {cores} or fewer")
    return passed("GPUs", "no CUDA GPU: ranks run on CPU with gloo"
                  + (f" ({nproc} process(es) on {cores} cores)" if nproc else ""))
