"""`memory`: peak allocated/reserved device memory per rank on GPU (optionally a CUDA memory
snapshot for https://pytorch.org/memory_viz), peak RSS per rank on CPU."""

from __future__ import annotations

from typing import Optional

import psutil
import torch

from ..run_dir import CUDA_MEMORY_SNAPSHOT, report_path
from .base import Monitor

MB = 1024 * 1024


class MemoryMonitor(Monitor):
    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.cuda = ctx.device.type == "cuda"
        self.process = psutil.Process()
        self.peak_rss = 0
        if self.cuda and options.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    def on_step_end(self, step, times) -> None:
        if not self.cuda:
            self.peak_rss = max(self.peak_rss, self.process.memory_info().rss)

    def collect(self, step: int) -> dict:
        if self.cuda:
            return {"allocated_mb": torch.cuda.max_memory_allocated(self.ctx.device) / MB,
                    "reserved_mb": torch.cuda.max_memory_reserved(self.ctx.device) / MB}
        return {"rss_mb": self.peak_rss / MB}

    def report(self, step: int, per_rank: list[dict]) -> dict:
        out = {}
        for rank, values in enumerate(per_rank):
            for k, v in values.items():
                out[f"memory/rank{rank}/peak_{k}"] = v
        return out

    def finish(self, per_rank: list[dict]) -> Optional[str]:
        rows = "\n".join(f"| {r} | " + " | ".join(f"{v:.0f}" for v in d.values()) + " |" for r, d in enumerate(per_rank))
        head = " | ".join(f"peak {k}" for k in per_rank[0])
        return f"## Memory\n\n| rank | {head} |\n|---|" + "---|" * len(per_rank[0]) + f"\n{rows}\n"

    def close(self) -> None:
        if self.cuda and self.options.snapshot:
            path = report_path(self.ctx.run_dir, CUDA_MEMORY_SNAPSHOT.format(rank=self.ctx.rank))
            path.parent.mkdir(exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(path))
            torch.cuda.memory._record_memory_history(enabled=None)
