"""`trainkit slurm`: an sbatch script for a recipe.

One srun task per node runs `trainkit run`; trainkit's launcher starts that node's workers and
detection (detect.py) takes nnodes, node_rank and the c10d endpoint (the allocation's first node)
from SLURM's variables. `--requeue` plus `resume: auto` continue a preempted job from its newest
checkpoint. Logs go into the run directory.
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

from ..recipe.launch_plan import run_dir_for
from ..run_dir import SLURM
from . import gpus
from .node_resources import NodeResources, cpus_per_node
from .quoting import comment_text, shell_join, shell_word


class SlurmError(Exception):
    """The request cannot make a working job (exit 2)."""


def _directive_value(value: str, flag: str) -> str:
    """A value for an `#SBATCH` line, which cannot be quoted: refused unless it is one plain word."""
    if not value or any(not ch.isprintable() or ch.isspace() for ch in value):
        raise SlurmError(f"{flag} {value!r}: an #SBATCH value must be one word without spaces or control characters")
    return value


def sbatch_script(resolved, recipe_path: str, overrides: Sequence[str] = (), *, partition: Optional[str] = None,
                  time: Optional[str] = None, gpus_per_node: Optional[int] = None,
                  cpus_per_task: Optional[int] = None, resources: Optional[NodeResources] = None,
                  mem: str = "auto", trainkit: Sequence[str] = ("trainkit",)) -> str:
    """The script text. Raises SlurmError for GPUs on a gloo recipe, an elastic node count or a bad `mem`.

    `resources`: what a node needs (node_resources.py: CPUs, and with `mem` "auto" the memory written as
    `--mem`); without it the CPUs by the same rule and no `--mem`. `mem`: "auto", "none" (the site's
    default), or a size for `--mem` as given (e.g. 200G)."""
    recipe = resolved.recipe
    la = recipe.launch
    if isinstance(la.nnodes, str):
        raise SlurmError(f"launch.nnodes {la.nnodes!r} is elastic; a SLURM allocation has a fixed node count: "
                         f"pass launch.nnodes=N")
    gpus_per_node = gpus.gpus_per_node(la, gpus_per_node, SlurmError)
    pinned = [f"launch.{k}={v}" for k, v in gpus.pinned_backend(la, gpus_per_node).items()]  # no CUDA: fail
    nproc = gpus.nproc_for(la, gpus_per_node)  # the ranks the launcher starts on each node
    if gpus_per_node and nproc > gpus_per_node:
        raise SlurmError(f"launch.nproc_per_node {nproc} exceeds --gpus-per-node {gpus_per_node}")
    run_dir = run_dir_for(recipe)
    logs = run_dir / SLURM
    cpus = cpus_per_task or (resources.cpus if resources else cpus_per_node(nproc, recipe.data.num_workers))
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name={recipe.name}",
             f"#SBATCH --nodes={la.nnodes}",
             "#SBATCH --ntasks-per-node=1",
             f"#SBATCH --cpus-per-task={cpus}"]
    memory = _mem_value(mem, resources)
    if memory:
        lines.append(f"#SBATCH --mem={memory}")
    if gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    if partition:
        lines.append(f"#SBATCH --partition={_directive_value(partition, '--partition')}")
    if time:
        lines.append(f"#SBATCH --time={_directive_value(time, '--time')}")
    lines += ["#SBATCH --requeue",
              f"#SBATCH --output={recipe.name}-%j.out",  # the folder must exist at submission: the current one
              "#SBATCH --open-mode=append",
              "#",
              *([f"# {comment_text(resources.how)}"] if resources and memory and mem == "auto" else []),
              f"# Written by `trainkit slurm {comment_text(shell_join([recipe_path, *overrides]))}`. One task per node: trainkit's",
              "# launcher starts that node's workers; nnodes, node_rank and the c10d rendezvous (the first node of",
              "# the allocation) come from SLURM's variables (docs/clusters.md). --requeue + trainer.resume: auto",
              "# continue a preempted job from its newest checkpoint. The run directory must be on shared storage.",
              "set -euo pipefail",
              f"mkdir -p {shell_word(str(logs))}",
              "# since Slurm 22.05 a job step does not inherit --cpus-per-task from the allocation: where CPUs",
              "# are bound it would get one, shared by the node's ranks and DataLoader workers",
              "export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK",
              f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 --output={shell_word(str(logs))}/%j.%t.log "
              + shell_join([*trainkit, "run", recipe_path, *overrides, *pinned]),
              ""]
    return "\n".join(lines)


def _mem_value(mem: str, resources: Optional[NodeResources]) -> Optional[str]:
    """`--mem`'s value: the node's need in MiB ("auto", when sized), none ("none"), or a size as given."""
    if mem == "auto":
        return f"{resources.memory >> 20}M" if resources else None
    if mem == "none":
        return None
    if not re.fullmatch(r"[1-9][0-9]*[KMGT]?", mem):
        raise SlurmError(f"--mem {mem!r}: auto, none, or a size Slurm reads, a whole number with an optional unit "
                         f"K, M, G or T (e.g. 200G)")
    return mem
