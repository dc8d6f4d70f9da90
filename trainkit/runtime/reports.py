"""What rank 0 leaves behind when training ends: summary.json, the bottleneck reports, and the
console lines that point to them.

Its own module because writing the result is not building the rank: the worker builds and trains,
this turns the loop's summary and `trainkit.analysis`' diagnosis into the run's files.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch.distributed as dist

from ..analysis import evidence
from ..analysis.bottleneck import diagnose_run
from ..recipe.schema import Recipe
from ..run_dir import BOTTLENECK, GPU, MESH_COMM, REPORTS, VERDICT, read_json, summary_path, write_json


def write_reports(run_dir: Path, recipe: Recipe, summary: dict) -> str:
    """reports/breakdown.json (the evidence), reports/bottleneck.md and reports/verdict.json (what
    tracking turns into run tags); returns the console lines. Shutdown time (last step to now) is
    recorded here, the last thing a run does before it exits."""
    reports = run_dir / REPORTS
    reports.mkdir(exist_ok=True)
    wall = summary.pop("wall_times", None)
    now = time.time()
    if wall is not None:
        wall.shutdown_s = now - (wall.loop_end or now)
        wall = wall.as_dict(now)
        summary["wall_times"] = wall
    gpu_file = reports / GPU  # the gpu monitor's utilisation over the run
    gpu = read_json(gpu_file) if gpu_file.is_file() else None
    mesh_file = reports / MESH_COMM  # the breakdown monitor's communication per mesh dimension
    mesh_comm = read_json(mesh_file)["per_rank"] if mesh_file.is_file() else None
    env = evidence.describe_env(summary.pop("device", "cpu"), dist.get_backend() if dist.is_initialized() else None)
    evidence.write(run_dir, evidence.Evidence(
        per_rank=summary.pop("per_rank_times"), env=env, wall=wall, gpu=gpu, mesh_comm=mesh_comm,
        global_batch=summary.get("global_batch"), steps=summary["steps"], world_size=summary["world_size"],
        name=recipe.name))
    diagnosis = diagnose_run(run_dir, recipe)  # from the files, as `trainkit report` and `trainkit tune` read them
    sections = summary.pop("report_sections", [])
    (reports / BOTTLENECK).write_text(diagnosis.markdown(recipe.name) + "".join("\n" + s for s in sections))
    write_json(reports / VERDICT, diagnosis.summary())
    summary["bottleneck"] = diagnosis.kind
    return diagnosis.console()


def write_summary(run_dir: Path, summary: dict) -> None:
    """summary.json (written last: the launcher reads it as "training completed"), then the
    `trainkit: done: ...` lines."""
    write_json(summary_path(run_dir), summary)
    if summary.get("replicas_identical") is False:
        print("trainkit: warning: model replicas differ across ranks at the end of training", file=sys.stderr)
    loss = summary["final_loss"]
    acc = summary["eval"].get("eval_accuracy")
    print(f"trainkit: done: {summary['steps']} steps, final loss "
          f"{'n/a' if loss is None else f'{loss:.4f}'}"
          + (f", eval accuracy {acc:.3f}" if acc is not None else "")
          + f", {summary['samples_per_s']:.1f} samples/s"
          + (f", {summary['skipped_images']} unreadable images skipped" if summary["skipped_images"] else "")
          + f"\ntrainkit: checkpoint: {summary['checkpoint']}\ntrainkit: summary: {summary_path(run_dir)}",
          flush=True)
