"""ZeRO-3's buffers: the lean constant (every size 5e6 elements: trainkit's choice on the CPU) against
the sizes trainkit takes from the model's largest block on GPUs (strategies/deepspeed.py
`zero3_buffers`), memory and step time side by side, alternated pair by pair (issue 37: never trade
speed for memory without measuring both).

    python bench/zero3_buffers.py [--pairs 7] [--steps 8] [--hidden 4096] [--depth 3] [--out results.json]

Each run is a real `trainkit run` (2 ranks, CPU, fp32, AdamW, no checkpoint) of an MLP whose layers
hold hidden x hidden parameters (16.8 M at 4096: above 5e6, so the old live-parameter limit switched
DeepSpeed's prefetch off). Measured per run: the median step time after the warm-up steps
(metrics.jsonl's step_time_s) and each rank's whole-run peak RSS (RUN_DIR/live/memory-rank<R>.json,
VmHWM at the end of the run). The old sizes are the same recipe with strategy.config.zero_optimization
setting all five to 5e6, the model-sized ones the same recipe with the GPU sizes written out. On the CPU's gloo collectives are synchronous, so prefetch cannot overlap
communication here: the CPU figures show the memory cost and the step-time effect of fewer, larger
collectives; the overlap itself needs a GPU (the GPU tier).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from trainkit.run_dir import LIVE, METRICS, RANK_MEMORY, WARMUP_STEPS

OLD = {key: 5_000_000 for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_max_live_parameters",
                                  "stage3_max_reuse_distance", "sub_group_size")}


def recipe(folder: Path, label: str, hidden: int, depth: int, steps: int) -> Path:
    from trainkit.strategies.deepspeed import zero3_buffers

    largest = hidden * hidden + hidden  # one hidden layer of the MLP
    sizes = dict(OLD) if label == "old" else zero3_buffers(largest, "cuda")
    strategy = {"name": "deepspeed", "zero_stage": 3, "config": {"zero_optimization": sizes}}
    data = {"name": f"zero3-{label}", "seed": 0,
            "model": {"name": "mlp", "args": {"in_features": 1024, "hidden": hidden, "num_classes": 10, "depth": depth}},
            "data": {"name": "synthetic", "batch_size": 8, "num_samples": 256, "shape": [1024], "num_classes": 10},
            "strategy": strategy, "precision": "fp32", "optimizer": {"name": "adamw", "lr": 1.0e-4},
            "trainer": {"max_steps": steps, "log_every": 1, "checkpoint": {"every": 10_000}},
            "launch": {"nproc_per_node": 2, "run_dir": str(folder)}, "tracking": {"enabled": False}}
    path = folder / f"{label}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run(path: Path, folder: Path, label: str) -> dict:
    run_dir = folder / f"zero3-{label}"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    proc = subprocess.run([sys.executable, "-m", "trainkit.cli", "run", str(path)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{label} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / METRICS).read_text().splitlines()]
    times = [r["step_time_s"] for r in rows if r.get("step_time_s") is not None and r["step"] > WARMUP_STEPS]
    peaks = [json.loads((run_dir / LIVE / RANK_MEMORY.format(rank=r)).read_text())["peak_bytes"] for r in range(2)]
    return {"step_s": statistics.median(times), "peak_mib": max(peaks) / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="zero3-buffers-"))
    paths = {label: recipe(folder, label, args.hidden, args.depth, args.steps) for label in ("old", "new")}
    results = {"old": [], "new": []}
    for i in range(args.pairs):
        for label in (("old", "new") if i % 2 == 0 else ("new", "old")):  # alternated: drift hits both alike
            results[label].append(run(paths[label], folder, label))
            print(f"pair {i + 1} {label}: {results[label][-1]}", flush=True)
    ratios = [n["step_s"] / o["step_s"] for o, n in zip(results["old"], results["new"])]
    summary = {label: {"step_s_median": statistics.median(r["step_s"] for r in rows),
                       "peak_mib_median": statistics.median(r["peak_mib"] for r in rows)} for label, rows in results.items()}
    summary["step_ratio_new_over_old"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": results, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
