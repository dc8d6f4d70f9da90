"""How long a checkpoint save stops training: synchronous vs `trainer.checkpoint.async_save: true`
(issue 28, item 5), side by side in one 2-rank group, through trainkit's own Checkpointer.

    python bench/checkpoint_blocking.py [--strategy fsdp|ddp] [--pairs 5] [--hidden 4096 --depth 6]
                                        [--device cuda --nproc 1]   # on a GPU node: staging is a device-to-host copy

The model is the issue's ~100M-parameter MLP (`in_features 4096, hidden 4096, depth 6`) with AdamW
state filled by one step, built and wrapped as the training worker does. Each pair saves once
synchronously and once in the background (order alternating), with a training step before each;
per save it records the blocking time -- what the training loop waits for: the whole write when
synchronous, the copy into host memory (staging) when in the background -- and, for the background
save, how long after that the write was finished and sealed, while training steps run beside it as
in a run: each of those steps is timed, and so are as many steps right after with nothing written,
so the write's slowdown of the steps it overlaps is measured too. Medians over the pairs, rank 0's view
after a barrier (every rank waits for the slowest). Checkpoints go to --folder (default: a temporary
folder; keep 1 of each kind): about 1.2 GB per save at 100M parameters.
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

from trainkit.run_dir import CHECKPOINTS

BATCH_PER_RANK = 8


def write_recipe(folder: Path, strategy: str, hidden: int, depth: int, nproc: int = 2) -> Path:
    import yaml

    recipe = {
        "name": f"bench-ckpt-{strategy}", "seed": 0,
        "model": {"name": "mlp", "args": {"in_features": 4096, "hidden": hidden, "depth": depth, "num_classes": 10}},
        "data": {"name": "synthetic", "batch_size": BATCH_PER_RANK, "num_samples": 64, "shape": [4096],
                 "num_classes": 10},
        "strategy": {"name": strategy}, "precision": "fp32", "optimizer": {"name": "adamw", "lr": 1.0e-4},
        "trainer": {"max_steps": 10}, "launch": {"nproc_per_node": nproc}, "tracking": {"enabled": False},
    }
    path = folder / f"{strategy}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def worker(recipe_path: str, pairs: int, folder: str, out: str, device_type: str = "cpu") -> None:
    import torch
    import torch.distributed as dist

    from trainkit import registry
    from trainkit.recipe import resolve
    from trainkit.runtime.checkpoint import Checkpointer
    from trainkit.runtime.model import build_initial_model
    from trainkit.runtime.optim import build_optimizer
    from trainkit.runtime.precision import Precision

    recipe = resolve(recipe_path).recipe
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    precision = Precision(recipe.precision, device)
    strategy_cls = registry.component(recipe.strategy)
    strategy = strategy_cls(recipe.strategy, device=device, precision=precision, **strategy_cls.run_inputs(recipe))
    model, _ = build_initial_model(recipe.model, strategy, recipe.seed)
    n_params = sum(p.numel() for p in model.parameters())
    model, optimizer = strategy.setup(model, lambda params: build_optimizer(recipe.optimizer, params))
    loss_fn = torch.nn.CrossEntropyLoss()
    x, y = torch.randn(BATCH_PER_RANK, 4096, device=device), torch.randint(0, 10, (BATCH_PER_RANK,), device=device)

    def step() -> None:
        strategy.forward_backward(model, x, y, loss_fn, precision, grad_accum_steps=1, last_micro_step=True)
        strategy.optimizer_step(model, optimizer, precision, None)

    def timed_step() -> float:
        t = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t

    def writing(saver: Checkpointer) -> bool:
        """Whether any rank's background write is still in flight (every rank gets the same answer)."""
        busy = torch.tensor([0.0 if saver.pending is None or saver.pending[0].done() else 1.0], device=device)
        dist.all_reduce(busy)
        return bool(busy.item())

    def checkpointer(in_background: bool) -> Checkpointer:
        data = {"trainer": {"max_steps": 10**9, "checkpoint": {"async_save": in_background}}}
        kind = "async" if in_background else "sync"
        return Checkpointer(Path(folder) / kind, strategy, keep=1, recipe_data=data)

    savers = {"sync": checkpointer(False), "async": checkpointer(True)}
    rows = []
    for i in range(1, 2 * pairs + 1):
        pair, second = divmod(i - 1, 2)
        kind = ("sync", "async")[(pair + second) % 2]  # sync, async, async, sync, sync, async, ...
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        savers[kind].save(i, model, optimizer, {"step": i})
        dist.barrier()
        blocked = time.perf_counter() - t0
        overlapped = []  # training goes on while the write is in flight, as in a run: what it costs those steps
        while kind == "async" and writing(savers[kind]):
            overlapped.append(timed_step())
        savers[kind].wait()  # the background write and its seal (nothing to wait for when synchronous)
        dist.barrier()
        finished = time.perf_counter() - t0
        alone = [timed_step() for _ in range(max(3, len(overlapped)))]  # the same steps with nothing written
        rows.append({"kind": kind, "blocked_s": blocked, "finished_s": finished, "overlapped_steps_s": overlapped,
                     "alone_steps_s": alone})
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"params": n_params, "strategy": recipe.strategy.name, "rows": rows}))
    dist.barrier()
    dist.destroy_process_group()


def background_savers() -> list[str]:
    """The built-in strategies whose checkpoint `async_save` writes in the background
    (their options' Capabilities.background_save_refusal is empty)."""
    from trainkit import registry

    return [name for name in registry.names("strategies", builtin_only=True)
            if not registry.load("strategies", name)(name=name).capabilities().background_save_refusal]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="fsdp", choices=background_savers())
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--nproc", type=int, default=2, help="ranks (one per GPU with --device cuda)")
    parser.add_argument("--folder", default=None, help="where the checkpoints go (default: a temporary folder)")
    parser.add_argument("--worker", nargs=3, metavar=("RECIPE", "FOLDER", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.pairs, args.worker[1], args.worker[2], args.device)
        return 0
    with tempfile.TemporaryDirectory(dir=args.folder) as tmp:
        folder = Path(tmp)
        recipe = write_recipe(folder, args.strategy, args.hidden, args.depth, args.nproc)
        out = folder / "result.json"
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
               __file__, "--pairs", str(args.pairs), "--device", args.device, "--worker", str(recipe), str(folder / CHECKPOINTS), str(out)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr)
            return 1
        result = json.loads(out.read_text())
    rows = result["rows"]

    def median(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["kind"] == kind)

    sync, blocked, finished = median("sync", "blocked_s"), median("async", "blocked_s"), median("async", "finished_s")
    print(f"{result['strategy']}, {args.nproc} rank(s) on {args.device}, {result['params'] / 1e6:.0f}M parameters + AdamW state, "
          f"{args.pairs} pairs (medians):")
    print("| save | training blocked per save | written and sealed after |")
    print("|---|---|---|")
    print(f"| synchronous | {sync:.2f} s | {median('sync', 'finished_s'):.2f} s |")
    print(f"| async_save | {blocked:.2f} s | {finished:.2f} s |")
    print(f"blocking time: {sync / blocked:.1f}x less in the background")
    # the write's cost to the steps that overlap it: each async save's overlapped steps against as many steps
    # with nothing written, taken right after it
    extra, ratios, counts = [], [], []
    for r in rows:
        if r["kind"] == "async" and r["overlapped_steps_s"]:
            alone = statistics.median(r["alone_steps_s"])
            extra.append(sum(r["overlapped_steps_s"]) - alone * len(r["overlapped_steps_s"]))
            ratios.append(statistics.median(r["overlapped_steps_s"]) / alone)
            counts.append(len(r["overlapped_steps_s"]))
    if extra:
        cost = blocked + statistics.median(extra)
        print(f"steps overlapping a background write: {statistics.median(counts):.0f} per save, each "
              f"{statistics.median(ratios):.2f}x a step with nothing written (median; {min(ratios):.2f}-"
              f"{max(ratios):.2f}); {statistics.median(extra):.2f} s slower in all per save")
        print(f"a save's whole cost to training: synchronous {sync:.2f} s, async_save {cost:.2f} s "
              f"(blocking + the overlapped steps' slowdown): {sync / cost:.1f}x less")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
