"""One recipe for every rank: values that would differ by rank are refused before launch.

The workers resolve the composed recipe's `${oc.env:...}` references from their own environment
(so secrets are never written to disk: run_dir.RECIPE). A reference to a variable torchrun sets per
worker (RANK, LOCAL_RANK, ...) would then give each rank a value nobody validated or logged -- a
combination `validate` refuses, or one rank training at another learning rate than MLflow records.
So before launch the recipe is resolved once more as a worker of another rank would resolve it, and
any value that differs is refused, naming it.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from ..recipe.flat import flatten

# what torchrun's agent sets for each worker (torch.distributed.elastic.agent.server.local_elastic_agent)
# and differs between them or between attempts
PER_WORKER = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "NODE_RANK", "TORCHELASTIC_RESTART_COUNT")


@contextmanager
def environment_set(values: dict[str, str]) -> Iterator[None]:
    """`values` in os.environ for the block, the previous values (or their absence) back after it."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def worker_environments(world_size: int, nproc: int) -> list[dict[str, str]]:
    """The first rank's environment and the last rank's on a restart: enough for any value computed from
    a per-worker variable to differ."""
    last = max(0, world_size - 1)
    first = {k: "0" for k in PER_WORKER}
    other = {"RANK": str(last), "LOCAL_RANK": str(last % max(1, nproc)), "GROUP_RANK": str(last // max(1, nproc)),
             "ROLE_RANK": str(last), "NODE_RANK": str(last // max(1, nproc)), "TORCHELASTIC_RESTART_COUNT": "1"}
    return [first, other]


def values_differing_by_rank(recipe_path: str, overrides: Sequence[str], resolved: Any) -> list[str]:
    """'path: value on rank 0 / on rank N' for every recipe value a worker's environment changes (shown
    redacted); empty when the recipe interpolates nothing per worker."""
    if "${" not in repr(resolved.raw):
        return []
    from ..recipe import resolve

    recipe = resolved.recipe
    world = recipe.world_size or recipe.launch.nproc_per_node
    from ..recipe import RecipeError

    views = []
    for env in worker_environments(world, recipe.launch.nproc_per_node):
        with environment_set(env):
            try:
                views.append(flatten(resolve(recipe_path, overrides).redacted()))
            except RecipeError as err:  # valid as validated, refused as a worker would resolve it
                return [f"as rank {env['RANK']} resolves it, the recipe is refused: "
                        + "; ".join(f"{p.path}: {p.message}" for p in err.problems)]
    first, other = views
    return [f"{path}: {first.get(path)!r} on rank 0, {other.get(path)!r} on rank {world - 1}"
            for path in sorted(set(first) | set(other)) if first.get(path) != other.get(path)]
