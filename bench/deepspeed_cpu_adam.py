"""Step time of DeepSpeed optimizer offload with DeepSpeed's CPU Adam vs torch's AdamW (issue 28,
item 4), side by side: launches alternate, so both see the same machine load.

    python bench/deepspeed_cpu_adam.py [--pairs 7] [--steps 6] [--hidden 2048 --depth 4] [--stage 2]

Each launch is one 2-rank `torchrun` group training an MLP (`in_features 1024`, --hidden, --depth)
under ZeRO-`--stage` with `offload_optimizer: cpu`, AdamW, fp32, batch 8 per rank, through
trainkit's own DeepSpeed strategy (the calls the training loop makes). "cpu_adam" is trainkit's
default for this recipe; "torch_adamw" is the same recipe with `strategy.config:
{zero_force_ds_cpu_optimizer: false}`, which keeps torch's AdamW (trainkit's behaviour before).
Per launch: the median of --steps steps after one warm-up step, of the whole step and of its
optimizer part (engine.step: clipping, the offloaded Adam update, the copy back). CPU Adam must
already be built (a first run builds it: ~60 s on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BATCH_PER_RANK = 8
KINDS = {"cpu_adam": {}, "torch_adamw": {"config": {"zero_force_ds_cpu_optimizer": False}}}


def write_recipe(folder: Path, kind: str, hidden: int, depth: int, stage: int) -> Path:
    import yaml

    recipe = {
        "name": f"bench-{kind}", "seed": 0,
        "model": {"name": "mlp", "args": {"in_features": 1024, "hidden": hidden, "depth": depth, "num_classes": 10}},
        "data": {"name": "synthetic", "batch_size": BATCH_PER_RANK, "num_samples": 64, "shape": [1024],
                 "num_classes": 10},
        "strategy": {"name": "deepspeed", "zero_stage": stage, "offload_optimizer": "cpu", **KINDS[kind]},
        "precision": "fp32", "optimizer": {"name": "adamw", "lr": 1.0e-4, "weight_decay": 0.01},
        "trainer": {"max_steps": 10}, "launch": {"nproc_per_node": 2}, "tracking": {"enabled": False},
    }
    path = folder / f"{kind}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def worker(recipe_path: str, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from trainkit import registry
    from trainkit.recipe import resolve
    from trainkit.runtime.model import build_initial_model
    from trainkit.runtime.optim import build_optimizer
    from trainkit.runtime.precision import Precision

    recipe = resolve(recipe_path).recipe
    device = torch.device("cpu")
    dist.init_process_group("gloo")
    precision = Precision(recipe.precision, device)
    strategy_cls = registry.component(recipe.strategy)
    strategy = strategy_cls(recipe.strategy, device=device, precision=precision, **strategy_cls.run_inputs(recipe))
    model, _ = build_initial_model(recipe.model, strategy, recipe.seed)
    n_params = sum(p.numel() for p in model.parameters())
    model, optimizer = strategy.setup(model, lambda params: build_optimizer(recipe.optimizer, params))
    loss_fn = torch.nn.CrossEntropyLoss()
    x, y = torch.randn(BATCH_PER_RANK, 1024), torch.randint(0, 10, (BATCH_PER_RANK,))
    step_s, optimizer_s = [], []
    for i in range(steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        strategy.forward_backward(model, x, y, loss_fn, precision, grad_accum_steps=1, last_micro_step=True)
        t1 = time.perf_counter()
        strategy.optimizer_step(model, optimizer, precision, None)
        dist.barrier()
        t2 = time.perf_counter()
        if i:  # the first step allocates the optimizer state
            step_s.append(t2 - t0)
            optimizer_s.append(t2 - t1)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"optimizer": type(optimizer).__name__, "params": n_params,
                                         "step_s": statistics.median(step_s),
                                         "optimizer_s": statistics.median(optimizer_s)}))
    dist.barrier()
    dist.destroy_process_group()


def launch(recipe: Path, steps: int, out: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), DS_ACCELERATOR="cpu")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
           "--steps", str(steps), "--worker", str(recipe), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{recipe.stem} failed:\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    parser.add_argument("--worker", nargs=2, metavar=("RECIPE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.steps, args.worker[1])
        return 0
    results: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        recipes = {kind: write_recipe(folder, kind, args.hidden, args.depth, args.stage) for kind in KINDS}
        for pair in range(args.pairs):
            order = list(KINDS) if pair % 2 == 0 else list(reversed(KINDS))  # alternate who goes first
            for kind in order:
                results[kind].append(launch(recipes[kind], args.steps, folder / f"{kind}-{pair}.json"))
                print(f"  pair {pair + 1} {kind}: {results[kind][-1]}", file=sys.stderr, flush=True)
    params = results["cpu_adam"][0]["params"]
    print(f"ZeRO-{args.stage} + offload_optimizer cpu, 2 ranks, {params / 1e6:.1f}M parameters, AdamW fp32, "
          f"{args.pairs} alternated pairs (median of the per-launch medians):")
    print("| optimizer | step | of which optimizer step |")
    print("|---|---|---|")
    medians = {}
    for kind, rows in results.items():
        medians[kind] = {key: statistics.median(r[key] for r in rows) for key in ("step_s", "optimizer_s")}
        print(f"| {kind} ({rows[0]['optimizer']}) | {medians[kind]['step_s'] * 1e3:.0f} ms | "
              f"{medians[kind]['optimizer_s'] * 1e3:.0f} ms |")
    ratios = [t["step_s"] / c["step_s"] for c, t in zip(results["cpu_adam"], results["torch_adamw"])]
    print(f"per pair, torch_adamw / cpu_adam step time: {', '.join(f'{r:.2f}' for r in ratios)} "
          f"(median {statistics.median(ratios):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
