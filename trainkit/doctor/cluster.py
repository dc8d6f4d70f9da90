"""The scheduler this node runs under (PyTorchJob pod, Trainer v2 pod, SLURM step): what it decides
for the launch and where each value came from (docs/clusters.md)."""

from __future__ import annotations

import os
from typing import Optional

from .. import cluster
from ..cluster.detect import DESCRIPTIONS, kind_of
from .check import Check, failed, passed


def applied(resolved):
    """The recipe as `trainkit run` would launch it here (the other checks look at that one)."""
    if resolved is None:
        return None
    try:
        return cluster.applied(resolved, cluster.detect_here(resolved))
    except cluster.ClusterError:
        return resolved  # reported by `environment` below


def environment(resolved) -> Optional[Check]:
    name = "cluster"
    if resolved is None:
        kind = kind_of(os.environ)
        return passed(name, f"environment: {DESCRIPTIONS.get(kind, 'no PyTorchJob or SLURM variables')}")
    try:
        detected = cluster.detect_here(resolved)
    except cluster.ClusterError as err:
        return failed(name, str(err), "fix the job's environment or the command line (docs/clusters.md)")
    if not detected.found:
        return passed(name, detected.description)
    values = "; ".join(f"{k}={detected.values[k]} from {detected.sources.get(k, '?')}" for k in
                       ("nnodes", "node_rank", "nproc_per_node", "rdzv_endpoint", "rdzv_id") if k in detected.values)
    notes = "".join(f"; note: {n}" for n in detected.notes)
    return passed(name, f"{detected.description}: {values}{notes}")
