"""How many GPUs a written job asks for, and how a job written for GPUs refuses to run without them.

A scheduler that exposes only requested GPUs gives a job that asked for none no CUDA at all, and
`launch.backend: auto` then trains on the CPU without a word. So a job writer never guesses: nccl
means one GPU per process, gloo none, and auto needs the user's explicit `--gpus-per-node`
(0 for CPU nodes). A job that asks for GPUs pins `launch.backend: nccl`, so a worker that finds no
CUDA fails at start ("launch.backend: nccl needs CUDA GPUs and none is visible here").
"""

from __future__ import annotations

from typing import Optional


def gpus_per_node(launch, requested: Optional[int], error: type[Exception]) -> int:
    """GPUs per node (pod, SLURM node) for the job; `error` is raised for an impossible or unsaid choice."""
    if requested is None:
        if launch.backend == "nccl":
            return launch.nproc_per_node
        if launch.backend == "gloo":
            return 0
        raise error(f"launch.backend is auto, so the recipe does not say whether the nodes have GPUs: pass "
                    f"--gpus-per-node {launch.nproc_per_node} (one per process) to request them, or "
                    f"--gpus-per-node 0 for CPU nodes")
    if requested and launch.backend == "gloo":
        raise error(f"--gpus-per-node {requested} but launch.backend is gloo (a CPU recipe): the GPUs would "
                    f"sit idle; drop --gpus-per-node, or set launch.backend=nccl (or auto)")
    return requested


def pinned_backend(launch, gpus: int) -> dict:
    """The launch keys a job that requests GPUs ships with: backend nccl where the recipe said auto."""
    return {"backend": "nccl"} if gpus and launch.backend == "auto" else {}


def nproc_for(launch, gpus: int) -> int:
    """Ranks per node (pod, SLURM node): launch.nproc_per_node when the recipe sets it, else one per GPU
    (at least one), as the launcher starts them where it detects the GPUs."""
    return launch.nproc_per_node if "nproc_per_node" in launch.model_fields_set else (gpus or 1)
