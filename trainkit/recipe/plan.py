"""`trainkit plan`: the resolved recipe and what it implies, before anything runs."""

from __future__ import annotations

import shlex
from typing import Sequence

import yaml

from .. import cluster, registry
from . import rules
from .launch_plan import torchrun_command
from .mesh_layout import degrees_text, mesh_lines
from .resolver import Resolved


def _cluster_lines(resolved: Resolved) -> tuple[Resolved, list[str]]:
    """What `trainkit run` would take from this environment (a PyTorchJob pod, a SLURM step)."""
    try:
        detected = cluster.detect_here(resolved)
    except cluster.ClusterError as err:
        return resolved, [f"cluster:         cannot start here: {err}"]
    applied = cluster.applied(resolved, detected)
    refused = rules.check(applied.recipe) if detected.found else []  # the world this cluster gives the recipe
    return applied, detected.lines() + [
        f"cluster:         cannot start here: not valid with this cluster's world ({applied.recipe.world_size} "
        f"ranks): {'.'.join(map(str, path))}: {message}" for path, message in refused]


def describe(resolved: Resolved, recipe_path: str, overrides: Sequence[str], memory: Sequence[str] = ()) -> str:
    """`memory`: the memory plan's lines (`memory_lines`), computed by the caller (it needs torch)."""
    resolved, detected = _cluster_lines(resolved)
    r = resolved.recipe
    lines = ["# resolved recipe (secrets from the environment shown as ***)",
             yaml.safe_dump(resolved.redacted(), sort_keys=False).rstrip(), "", "# what it implies"]
    ws = r.world_size
    lines.append(f"world size:      {ws if ws is not None else 'elastic ' + str(r.launch.nnodes) + ' nodes'}"
                 f"  ({r.launch.nproc_per_node} per node x {r.launch.nnodes} node(s))")
    lines += r.strategy.plan_lines(r)
    lines += _mesh_lines(r)
    gb = r.global_batch
    lines.append(f"global batch:    {gb if gb is not None else '?'}  (batch_size {r.data.batch_size} x "
                 f"data-parallel {r.data_parallel_size} x grad_accum_steps {r.trainer.grad_accum_steps})")
    samples = r.data.train_size()
    if samples and gb:
        per_epoch = samples // gb
        lines.append(f"steps per epoch: {per_epoch}  ({samples} samples); max_steps {r.trainer.max_steps} = "
                     f"{r.trainer.max_steps / max(per_epoch, 1):.2f} epochs")
    else:
        lines.append("steps per epoch: unknown until the data is read")
    lines.append(f"precision:       {r.precision}   strategy: {r.strategy.name}")
    lines += detected
    lines += _strategy_lines(r)
    lines.append(f"files:           {', '.join(resolved.files)}")
    lines += [*memory, "", *_launch_lines(r)]
    return resolved.redact_text("\n".join(lines))


def memory_lines(verdict) -> list[str]:
    """The memory plan (doctor.resources.MemoryVerdict) as `trainkit plan` shows it: the parts of one
    rank, the memory it has here, and when it will not fit, the changes that would (docs/memory.md)."""
    if verdict is None:
        return ["memory per rank: unknown (the model does not build on the meta device)"]
    fits = "fits" if verdict.fits else "WILL NOT FIT: `trainkit run` refuses to start"
    lines = [*verdict.plan.lines(), f"  {'available:':<28}{verdict.budget / (1 << 30):>6.2f} GiB  "
                                    f"{verdict.budget_how} -> {fits}"]
    if verdict.advice and not verdict.fits:
        head = "what would fit" if any(a.fits for a in verdict.advice) else "nothing single fits here; closest"
        lines += [f"  {head} (predicted per rank):", *[f"  {line}" for line in verdict.advice_lines()]]
    return lines


def _mesh_lines(r) -> list[str]:
    """The `parallel:` block's mesh: degrees and rank groups (nothing without the block, so a recipe
    without one plans as before); an elastic launch knows its world size only at rendezvous."""
    if r.parallel is None:
        return []
    if r.world_size is None:
        return [f"mesh:            {degrees_text(r.parallel.degrees())} (-1 inferred from the world size at "
                f"rendezvous; groups as init_device_mesh lays them out)"]
    return mesh_lines(r.parallel_dims(r.world_size))


def _launch_lines(r) -> list[str]:
    """What `trainkit run` starts: one in-process worker for world size 1 (no torchrun, so no
    restarts), else the torchrun command."""
    if r.world_size == 1:
        restarts = (f"; launch.max_restarts {r.launch.max_restarts} does not apply" if r.launch.max_restarts else "")
        again = " (trainer.resume: auto continues from the last checkpoint)" if r.trainer.resume == "auto" else ""
        return ["# what `trainkit run` does",
                "world size 1: the worker runs inside the `trainkit run` process, without torchrun",
                f"no restarts{restarts}: a failure ends the run; run the same command again to resume{again}"]
    return ["# command (run by `trainkit run`)", shlex.join(torchrun_command(r, "<run dir>"))]


def _strategy_lines(r) -> list[str]:
    """What the strategy's component adds to the plan from its runtime knowledge (DeepSpeed: its
    ds_config, via ds_config_for); the options' own lines come first (`StrategyOptions.plan_lines`)."""
    try:
        cls = registry.component(r.strategy)
    except Exception:
        return []
    hook = getattr(cls, "plan_lines", None)
    return list(hook(r)) if hook else []
