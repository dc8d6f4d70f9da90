"""Clusters: detect the scheduler that started `trainkit run` (Kubeflow PyTorchJob, Kubeflow Trainer
v2, SLURM) and write the job files that start it there (`trainkit k8s`, `trainkit slurm`).

Recipe layer (no torch import): `plan`, `doctor` and the launcher all show the same detection."""

from __future__ import annotations

import dataclasses
import glob
import os
import shutil
import subprocess
from typing import Mapping, Optional

from .detect import ClusterError, Detected, apply, detect, first_host, visible_gpus

__all__ = ["ClusterError", "Detected", "detect", "apply", "detect_here", "applied", "overridden_keys"]


def overridden_keys(resolved) -> frozenset[str]:
    """Launch keys whose value was set by a command-line override."""
    return frozenset(path[1] for path, loc in resolved.positions.items()
                     if len(path) == 2 and path[0] == "launch" and isinstance(path[1], str)
                     and getattr(loc, "override", None) is not None)


def _scontrol_first_host(nodelist: str) -> str:
    """`scontrol show hostnames LIST | head -1`, the parser's answer when scontrol is not there."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                                 timeout=10).stdout.split()
            if out:
                return out[0]
        except (OSError, subprocess.SubprocessError):
            pass
    return first_host(nodelist)


def light_device_count() -> int:
    """NVIDIA GPUs on this machine without importing torch (for plan and doctor)."""
    return len([p for p in glob.glob("/dev/nvidia*") if p[len("/dev/nvidia"):].isdigit()])


def detect_here(resolved, gpus: Optional[int] = None, env: Optional[Mapping[str, str]] = None) -> Detected:
    """`detect` for this process: its environment, its GPUs, the command line's overrides."""
    env = os.environ if env is None else env
    count = visible_gpus(env, light_device_count() if gpus is None else gpus)
    return detect(env, resolved.recipe, gpus=count, overridden=overridden_keys(resolved),
                  first_host_of=_scontrol_first_host)


def applied(resolved, detected: Detected):
    """The Resolved with the detected launch values in its recipe, its data (recipe.resolved.yaml,
    MLflow params) and its raw composed recipe (what the workers read). node_rank stays out of the
    data: it differs per node, and every node's launcher logs the same job's params."""
    if not detected.found:
        return resolved
    recipe = apply(resolved.recipe, detected)
    shared = {k: getattr(recipe.launch, k) for k in ("nnodes", "nproc_per_node", "rdzv_endpoint", "rdzv_id")
              if getattr(recipe.launch, k) is not None}

    def with_launch(data: dict) -> dict:
        launch = dict(data.get("launch") or {})
        launch.update(shared)
        return dict(data, launch=launch)

    return dataclasses.replace(resolved, recipe=recipe, data=with_launch(resolved.data), raw=with_launch(resolved.raw))
