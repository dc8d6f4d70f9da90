"""The steady-state cost of the hang watch's progress record (trainkit.runtime.progress_record) on a
training step, side by side: the same step with and without it, alternated, one process on the CPU.

    python bench/progress_overhead.py --pairs 9 --steps 300

"With" is what a trainkit rank does each optimizer step: the record started (its file opened, the
SIGUSR1 stack handler registered), `phase()` for data, forward and optimizer, and the forward hook
(`watch_backward`) that marks backward: 4 fixed-size pwrites. "Without" is the same step with none of
it, on an identical model. Each pair runs both (their order alternating) for --steps steps after
--warmup; reported per model: the median seconds per step of each side and the per-pair ratio
with / without, median (min-max). Two models: the test suite's tiny MLP (the worst case: the
smallest step) and a wider MLP; also the time the record adds per step (median of the pairs'
differences), to set against a real rank's step (a 2-rank DDP step of the test-suite MLP is 2.7 ms).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from trainkit.runtime import progress_record

MODELS = {  # name: (layer widths, batch)
    "test-suite MLP 48-64-4, batch 8": ([48, 64, 4], 8),
    "MLP 1024-1024x2-10, batch 32": ([1024, 1024, 1024, 10], 32),
}


def mlp(widths: list[int]) -> nn.Module:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(widths) - 2 else [])
    return nn.Sequential(*layers)


def make_side(widths: list[int], batch: int, recorded: bool):
    """One side's step function: its own model, optimizer and data."""
    torch.manual_seed(0)
    model, gen = mlp(widths), torch.Generator().manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(batch, widths[0], generator=gen), torch.randint(0, widths[-1], (batch,), generator=gen)
    loss_fn = nn.CrossEntropyLoss()
    if recorded:
        progress_record.watch_backward(model)
    model.train()

    def step(n: int) -> None:
        if recorded:
            progress_record.phase(n, "data")
        inputs, targets = x.clone(), y  # the "data": a copy, as a loader's batch is a new tensor
        if recorded:
            progress_record.phase(n, "forward")
        loss_fn(model(inputs), targets).backward()
        if recorded:
            progress_record.phase(n, "optimizer")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def seconds_per_step(step, steps: int, warmup: int) -> float:
    for n in range(warmup):
        step(n + 1)
    start = time.perf_counter()
    for n in range(steps):
        step(warmup + n + 1)
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=9)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    progress_record.start(Path(tempfile.mkdtemp(prefix="trainkit-bench-")), 0)
    print(f"progress record: {args.pairs} alternating pairs of {args.steps} steps (after {args.warmup}), "
          f"1 process, 1 thread, CPU, torch {torch.__version__}")
    print(f"{'model':<38} {'without s/step':>15} {'with s/step':>12} {'ratio: median (min-max)':>26} "
          f"{'added us/step':>14}")
    for name, (widths, batch) in MODELS.items():
        sides = {recorded: make_side(widths, batch, recorded) for recorded in (False, True)}
        results: dict[bool, list[float]] = {False: [], True: []}
        for pair in range(args.pairs):
            for recorded in ((False, True) if pair % 2 == 0 else (True, False)):
                results[recorded].append(seconds_per_step(sides[recorded], args.steps, args.warmup))
        ratios = [w / wo for w, wo in zip(results[True], results[False])]
        print(f"{name:<38} {statistics.median(results[False]):>15.6f} {statistics.median(results[True]):>12.6f} "
              f"{statistics.median(ratios):>10.4f} ({min(ratios):.4f}-{max(ratios):.4f}) "
              f"{statistics.median(w - wo for w, wo in zip(results[True], results[False])) * 1e6:>14.1f}")


if __name__ == "__main__":
    main()
