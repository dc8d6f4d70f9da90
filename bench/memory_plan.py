"""The memory plan's prediction against real runs: per strategy, the predicted memory per rank
(`trainkit plan`'s figure) and the peak RSS each rank actually reached (VmHWM).

    python bench/memory_plan.py [--steps 3] [--depth 7] [--only ddp,fsdp] [--out results.json]
    python bench/memory_plan.py --only fsdp,ddp --steps 4 --checkpoint-every 2 [--async-save]

Each configuration is a real `trainkit run` (2 ranks, CPU, fp32, AdamW, a checkpoint at the last
step) of bench/strategies_memory.py's model (an MLP 1024 -> 4096 x depth -> 10, ~105M parameters at
depth 7). The measured figure is each rank's VmHWM as its own record says at the end-of-run phase
(RUN_DIR/live/memory-rank<R>.json): the peak over build, every step and the checkpoint. The
prediction comes from the same code `trainkit plan` and `doctor` use, before anything runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from trainkit.run_dir import rank_memory_path

GiB = 1 << 30
CONFIGS = {
    "ddp": {"name": "ddp"},
    "fsdp": {"name": "fsdp"},
    "zero2": {"name": "deepspeed", "zero_stage": 2},
    "zero3": {"name": "deepspeed", "zero_stage": 3},
    "pipeline-1f1b": {"name": "pipeline", "schedule": "1f1b", "microbatches": 4},
}
BATCH_PER_RANK = 8


def splits_model(strategy: dict) -> bool:
    """The strategy block's ranks hold different layers (the pipeline's stages): they read one batch."""
    from trainkit import registry

    return registry.load("strategies", strategy["name"]).model_validate(strategy).capabilities().splits_model


def write_recipe(folder: Path, label: str, strategy: dict, depth: int, steps: int, checkpoint: dict) -> Path:
    pipeline = splits_model(strategy)
    recipe = {
        "name": f"plan-{label}", "seed": 0,
        "model": {"name": "mlp", "args": {"in_features": 1024, "hidden": 4096, "num_classes": 10, "depth": depth}},
        "data": {"name": "synthetic", "batch_size": BATCH_PER_RANK * (2 if pipeline else 1), "num_samples": 64,
                 "shape": [1024], "num_classes": 10},
        "strategy": strategy, "precision": "fp32", "optimizer": {"name": "adamw", "lr": 1.0e-4},
        "trainer": {"max_steps": steps, "log_every": steps, "checkpoint": checkpoint},
        "launch": {"nproc_per_node": 2, "run_dir": str(folder)},
        "tracking": {"enabled": False},
    }
    path = folder / f"{label}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def predicted(path: Path):
    from trainkit.recipe import resolve
    from trainkit.recipe.memory_plan import plan, setting_of
    from trainkit.runtime.memory_trace import model_sizes

    recipe = resolve(path).recipe
    return plan(model_sizes(recipe), setting_of(recipe, "cpu"))


def measured(path: Path, folder: Path, label: str) -> tuple[list[int], float]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "trainkit.cli", "run", str(path)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{label} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    every_rank = rank_memory_path(folder / f"plan-{label}", "*")  # RUN_DIR/live/memory-rank*.json
    records = sorted(every_rank.parent.glob(every_rank.name))
    data = [json.loads(p.read_text()) for p in records]
    assert all(d["phase"] == "end of run" for d in data), data
    return [d["peak_bytes"] for d in sorted(data, key=lambda d: d["rank"])], time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--depth", type=int, default=7)
    ap.add_argument("--only", default="", help="comma-separated labels (default: all)")
    ap.add_argument("--out", default="")
    ap.add_argument("--checkpoint-every", type=int, default=0,
                    help="a checkpoint every N steps as well as at the last (its write then overlaps the next steps)")
    ap.add_argument("--async-save", action="store_true", help="trainer.checkpoint.async_save: true")
    args = ap.parse_args()
    labels = [x for x in args.only.split(",") if x] or list(CONFIGS)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for label in labels:
            checkpoint = {"every": args.checkpoint_every or None, "async_save": args.async_save}
            path = write_recipe(folder, label, CONFIGS[label], args.depth, args.steps, checkpoint)
            plan = predicted(path)
            peaks, wall = measured(path, folder, label)
            worst = max(peaks)
            rows.append({"strategy": label, "predicted": plan.per_rank, "measured": peaks,
                         "error": plan.per_rank / worst - 1, "wall_s": wall,
                         "parts": {p.name: p.bytes for p in plan.parts}})
            print(f"{label}: predicted {plan.per_rank / GiB:.2f} GiB, measured {[round(p / GiB, 2) for p in peaks]} "
                  f"GiB ({rows[-1]['error']:+.0%}), {wall:.0f} s", flush=True)
    print("\n| strategy | predicted per rank (GiB) | measured peak RSS rank 0 / rank 1 (GiB) | predicted vs largest |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['strategy']} | {r['predicted'] / GiB:.2f} | "
              f"{' / '.join(f'{p / GiB:.2f}' for p in r['measured'])} | {r['error']:+.0%} |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
