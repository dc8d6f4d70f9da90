"""`profiler`: torch.profiler on a wait/warmup/active schedule on selected ranks. Each active cycle
writes a Chrome trace (RUN_DIR/profiler/rank{R}-step{S}.json, open in chrome://tracing or Perfetto)
and a top-ops table; both become MLflow artifacts at the end of the run."""

from __future__ import annotations

from typing import Optional

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from ..run_dir import PROFILER
from .base import Monitor


class ProfilerMonitor(Monitor):
    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.prof = None
        self.written: list[str] = []
        self.folder = ctx.run_dir / PROFILER
        if ctx.rank not in options.ranks:
            return
        self.folder.mkdir(exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
        self.prof = profile(activities=activities, record_shapes=True, with_stack=False,
                            schedule=schedule(wait=options.wait, warmup=options.warmup, active=options.active,
                                              repeat=options.repeat),
                            on_trace_ready=self._ready)
        self.step = 0

    def _ready(self, prof) -> None:
        stem = self.folder / f"rank{self.ctx.rank}-step{self.step}"
        prof.export_chrome_trace(f"{stem}.json")
        sort = "cuda_time_total" if self.ctx.device.type == "cuda" else "cpu_time_total"
        (self.folder / f"{stem.name}-top-ops.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=25))
        self.written.append(f"{stem.name}.json")

    def on_run_start(self) -> None:
        if self.prof is not None:
            self.prof.start()

    def on_step_end(self, step, times) -> None:
        if self.prof is not None:
            self.step = step
            self.prof.step()

    def collect(self, step: int) -> dict:
        return {"traces": list(self.written)}

    def finish(self, per_rank: list[dict]) -> Optional[str]:
        traces = [t for r in per_rank for t in r["traces"]]
        if not traces:
            return None
        return "## Profiler traces\n\n" + "\n".join(f"- profiler/{t}" for t in traces) + "\n"

    def close(self) -> None:
        if self.prof is not None:
            self.prof.stop()
            self.prof = None
