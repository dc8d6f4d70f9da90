"""Train many small recipes in one launch: `python -m trainkit.runtime.cell_runner CELLS.json`
(under torchrun for several ranks, or plainly for one process).

Why: a 2-rank launch spends ~10-15 s importing torch, DeepSpeed and the rest on 2 CPU cores, and a
grid cell trains for about a second. Each rank here imports once, joins the process group once (a
group destroyed and joined again under one torchrun reads the first incarnation's stale gloo
addresses from the agent's store), and then runs each listed run directory as a launched worker
would: `worker.train`, the worker's composition root (build every component from the recipe, resume
if a checkpoint is there, run the loop), one after another. Per run directory (its `recipe.yaml`
written by the caller) it checks:

0. preflight: what `trainkit run` checks on this machine before it launches (an error there is
   recorded as the cell's refusal on this device, and nothing trains);
1. train: `worker.train` to the recipe's max_steps;
2. resume: the last checkpoint removed, `worker.train` again resumes from the one before and redoes
   the last steps (the resumed losses are what metrics.jsonl holds afterwards);
3. export (rank 0): the final checkpoint consolidated by `trainkit export`'s own function loads,
   strict, into the plain model the recipe names.

Rank 0 writes RUN_DIR/cell-result.json (losses of each pass, export outcome, or the error), then
removes the run's checkpoints unless the list says `keep_checkpoints`. With `reports` in the list,
each training pass also writes the run's reports (reports/breakdown.json, bottleneck.md), as a
launched worker does. A
failing cell is recorded and the next one runs: the other ranks leave the failed collective at the
recipe's launch.timeout_s at worst, and every rank meets again at the next cell's rendezvous.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

from ..run_dir import CHECKPOINT_PREFIX, CHECKPOINTS, METRICS, RECIPE

RESULT = "cell-result.json"


def run_cells(run_dirs: list[Path], *, resume: bool, keep_checkpoints: bool = False, reports: bool = False) -> None:
    import torch.distributed as dist

    for run_dir in run_dirs:
        _freeze_what_survived()
        dist.barrier()
        result: dict = {"run_dir": str(run_dir), "process_groups_at_start": _live_process_groups()}
        start = time.monotonic()
        try:
            refusals = _refused_here(run_dir)
            if refusals:
                result["refused"] = refusals
                raise _Refused()
            try:
                _check(run_dir, result, resume, reports)
            except Exception as exc:  # noqa: BLE001 -- once more from scratch, the first error kept
                result["retried_after"] = "".join(traceback.format_exception_only(type(exc), exc)).strip()[-500:]
                _start_over(run_dir)
                _check(run_dir, result, resume, reports)
        except _Refused:
            pass
        except BaseException as exc:  # noqa: BLE001 -- recorded, and the next cell runs
            result["error"] = "".join(traceback.format_exception_only(type(exc), exc)).strip()[-2000:]
            result["traceback"] = traceback.format_exc()[-4000:]  # where it failed, for whoever reads the result
            if isinstance(exc, KeyboardInterrupt):
                raise
        result["seconds"] = round(time.monotonic() - start, 2)
        if _rank() == 0:
            (run_dir / RESULT).write_text(json.dumps(result, indent=1))
            if not keep_checkpoints:  # a grid of ResNets writes gigabytes of them otherwise
                shutil.rmtree(run_dir / CHECKPOINTS, ignore_errors=True)


def _live_process_groups() -> int:
    """How many process groups this rank holds (torch's registry): the grid test checks they stay few
    over a whole grid -- each run reuses the process's device mesh (runtime/mesh.py)."""
    from torch.distributed import distributed_c10d

    return len(distributed_c10d._world.pg_map)


def _freeze_what_survived() -> None:
    """What the cells so far left alive (torch's, transformers' and DeepSpeed's module state, compiled
    graphs: a million objects after a grid's first hundred cells) moved out of the garbage collector's
    reach: each full collection otherwise walks all of it again, and later cells ran 2-5x slower than
    the same cell in a fresh process. A cell's own garbage is still collected."""
    import gc

    gc.collect()
    gc.freeze()


class _Refused(Exception):
    """`trainkit run`'s preflight refuses the cell on this machine (e.g. fp16 under DeepSpeed's CPU
    accelerator): recorded as refused here, not trained."""


def _refused_here(run_dir: Path) -> list[str]:
    """The errors `trainkit run`'s preflight would stop this recipe with on this machine (every rank
    decides the same)."""
    from ..recipe import resolve
    from .preflight import check

    return [f"{p.path}: {p.message}" for p in check(resolve(run_dir / RECIPE)) if p.severity == "error"]


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _train(run_dir: Path, reports: bool = False) -> dict[int, float]:
    import torch.distributed as dist

    from ..recipe import resolve
    from .reports import write_reports
    from .worker import train

    resolved = resolve(run_dir / RECIPE)
    dist.barrier()  # rank 0 has set the checkpoints up for this pass
    summary = train(run_dir, resolved.recipe, resolved.redacted(), _device())
    if _rank() != 0:
        return {}
    if reports:
        write_reports(run_dir, resolved.recipe, summary)
    rows = [json.loads(line) for line in (run_dir / METRICS).read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _check(run_dir: Path, result: dict, resume: bool, reports: bool = False) -> None:
    result["losses"] = _train(run_dir, reports)
    if resume:
        result["resumed_from"] = _drop_last_checkpoint(run_dir) if _rank() == 0 else None
        result["resumed_losses"] = _train(run_dir, reports)
        result["export"] = _export(run_dir) if _rank() == 0 else None


def _start_over(run_dir: Path) -> None:
    """A failed cell is trained once more from scratch: in a process that has trained other cells
    before, a bf16 ResNet now and then stops on the non-finite check, which a fresh process running
    the same recipe never showed (issue 26, open); the result keeps the first error (`retried_after`)."""
    import torch.distributed as dist

    dist.barrier()
    if _rank() == 0:
        for name in (CHECKPOINTS, METRICS):
            path = run_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def _checkpoints(run_dir: Path) -> list[Path]:
    return sorted(p for p in (run_dir / CHECKPOINTS).iterdir()
                  if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX))


def _drop_last_checkpoint(run_dir: Path) -> str:
    """Remove the newest checkpoint so the next launch resumes from the one before (rank 0 does it
    before it joins the next rendezvous, so no rank decides on a resume before it is gone)."""
    *earlier, last = _checkpoints(run_dir)
    shutil.rmtree(last)
    return earlier[-1].name


def _export(run_dir: Path) -> dict:
    """The final checkpoint as `trainkit export` writes it, loaded strict into the plain model."""
    import torch

    from ..recipe import resolve
    from .export import consolidated_state_dict
    from .model import build_model

    recipe = resolve(run_dir / RECIPE).recipe
    folder = _checkpoints(run_dir)[-1]
    strategy, state = consolidated_state_dict(folder)
    model = build_model(recipe.model)
    model.load_state_dict(state, strict=True)
    finite = all(torch.isfinite(v).all() for v in model.state_dict().values() if v.is_floating_point())
    return {"checkpoint": folder.name, "strategy": strategy, "tensors": len(state), "finite": bool(finite)}


def _device():
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def main(argv: list[str]) -> int:
    """Join the group once (nccl with CUDA, else gloo), run every listed cell, leave."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from .process_group import init_process_group
    from .warnings_once import show_each_warning_once

    show_each_warning_once()
    spec = json.loads(Path(argv[0]).read_text())
    if torch.cuda.is_available():
        torch.cuda.set_device(_device())
    init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timedelta(seconds=120))
    try:
        run_cells([Path(p) for p in spec["run_dirs"]], resume=spec.get("resume", True),
                  keep_checkpoints=spec.get("keep_checkpoints", False), reports=spec.get("reports", False))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as the worker: no interpreter finalization racing gloo's threads
