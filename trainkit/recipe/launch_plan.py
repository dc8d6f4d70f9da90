"""Facts a launch derives from a recipe alone: its run directory and the torchrun command line.

They live in the recipe layer (no torch import) because `plan`, `doctor` and the launcher all need
them and none of those may import another for it.
"""

from __future__ import annotations

from pathlib import Path

from ..processes import WORKER
from ..run_dir import FATAL, LOGS
from .schema import Recipe

WORKER_MODULE = WORKER  # what torchrun runs on every rank
FATAL_FILE = FATAL  # kept for callers that import it from here; the name lives in trainkit.run_dir


def run_dir_for(recipe: Recipe) -> Path:
    """RUN_DIR = <launch.run_dir>/<name>: stable per recipe name, so `resume: auto` finds it again."""
    return Path(recipe.launch.run_dir) / recipe.name


def torchrun_command(recipe: Recipe, run_dir: str | Path) -> list[str]:
    """The exact torchrun command line a launch uses (printed by `trainkit plan`)."""
    la = recipe.launch
    cmd = ["torchrun", f"--nnodes={la.nnodes}", f"--nproc-per-node={la.nproc_per_node}"]
    if la.nnodes in (1, "1") and la.rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        cmd += [f"--rdzv-backend={la.rdzv_backend}", f"--rdzv-id={la.rdzv_id or recipe.name}"]
        if la.rdzv_endpoint:
            cmd.append(f"--rdzv-endpoint={la.rdzv_endpoint}")
        if la.rdzv_backend == "c10d":  # how long the agents wait for the other nodes
            cmd.append(f"--rdzv-conf=join_timeout={la.join_timeout_s}")
        if la.node_rank is not None:
            cmd.append(f"--node-rank={la.node_rank}")
    cmd += [f"--max-restarts={la.max_restarts}", f"--monitor-interval={la.monitor_interval:g}",
            f"--log-dir={Path(run_dir) / LOGS}"]
    quiet = [f"{r}:3" for r in range(1, la.nproc_per_node)]  # local rank 0 keeps the console
    if quiet:
        cmd.append(f"--redirects={','.join(quiet)}")
    return cmd + ["-m", WORKER_MODULE, str(run_dir)]
