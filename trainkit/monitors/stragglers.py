"""`stragglers`: every N steps, gather each rank's pre-collective time (data wait + forward) and flag
ranks slower than the median by `margin`. Total step time would hide them: with DDP the all-reduce
makes every rank wait for the slowest, so all ranks report the same step time. On a GPU the forward
is device time (CUDA events, resolved once per check, not per step): host time there is only how
long it took to queue the kernels."""

from __future__ import annotations

import statistics
import sys
from typing import Optional

import torch.distributed as dist

from .base import Monitor, StepTimes


class StragglersMonitor(Monitor):
    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.pre: list[StepTimes] = []
        self.flags: dict[int, int] = {}  # rank -> times flagged
        self.checks = 0

    def on_step_end(self, step: int, times: StepTimes) -> None:
        if self.ctx.world_size == 1:
            return
        self.pre.append(times)
        if step % self.options.every == 0 and self.ctx.world_size > 1:
            self._check(step)

    def _check(self, step: int) -> None:
        pre = [t.resolve().data_wait + (t.forward or 0.0) for t in self.pre]
        mine = (statistics.median(pre), self.ctx.hostname)
        self.pre = []
        gathered: list = [None] * self.ctx.world_size
        dist.all_gather_object(gathered, mine)
        self.checks += 1
        typical = statistics.median(v for v, _ in gathered)
        for rank, (value, host) in enumerate(gathered):
            if value > typical * (1 + self.options.margin) and value - typical > 1e-3:
                self.flags[rank] = self.flags.get(rank, 0) + 1
                if self.ctx.rank == 0:
                    print(f"trainkit: straggler: rank {rank} on {host} at step {step}: {value * 1000:.1f} ms before "
                          f"the gradient collective vs median {typical * 1000:.1f} ms", file=sys.stderr, flush=True)

    def collect(self, step: int) -> dict:
        return {"flags": dict(self.flags), "checks": self.checks}

    def report(self, step: int, per_rank: list[dict]) -> dict:
        flags = per_rank[0]["flags"]
        return {"stragglers/flagged_ranks": float(len(flags))}

    def finish(self, per_rank: list[dict]) -> Optional[str]:
        flags, checks = per_rank[0]["flags"], per_rank[0]["checks"]
        if not checks:
            return None
        if not flags:
            return f"## Stragglers\n\nNo rank was slower than the median by {self.options.margin:.0%} in {checks} checks.\n"
        rows = "\n".join(f"- rank {r}: flagged in {n} of {checks} checks" for r, n in sorted(flags.items()))
        return f"## Stragglers\n\n{rows}\n"
