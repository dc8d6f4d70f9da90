"""`tensorboard`: every logged scalar as TensorBoard events in RUN_DIR/tensorboard (rank 0), a second
sink beside MLflow; the profiler's traces are copied to tensorboard/plugins/profile/<run>/ at the end,
the layout TensorBoard's profile plugin reads. `tensorboard --logdir RUN_DIR/tensorboard`."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Optional

from ..run_dir import PROFILER, TENSORBOARD
from .base import Monitor


class TensorBoardMonitor(Monitor):
    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.writer = None
        self.log_dir = Path(options.log_dir) if options.log_dir else ctx.run_dir / TENSORBOARD
        if ctx.rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def on_log(self, step: int, metrics: dict) -> None:
        if self.writer is None:
            return
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key if "/" in key else f"train/{key}", value, step)
        self.writer.flush()

    def finish(self, per_rank: list[dict]) -> Optional[str]:
        if self.writer is None:
            return None
        traces = sorted((self.ctx.run_dir / PROFILER).glob("*.json")) if (self.ctx.run_dir / PROFILER).is_dir() \
            else []
        if traces:  # the profile plugin: <logdir>/plugins/profile/<run>/<host>.<name>.pt.trace.json
            run = self.log_dir / "plugins" / "profile" / time.strftime("%Y_%m_%d_%H_%M_%S")
            run.mkdir(parents=True, exist_ok=True)
            for t in traces:
                name = t.name if t.name.endswith(".pt.trace.json") else t.stem + ".pt.trace.json"
                shutil.copy2(t, run / name)
        return f"## TensorBoard\n\n- `tensorboard --logdir {self.log_dir}`" + \
            (f" ({len(traces)} profiler trace(s) under plugins/profile)" if traces else "") + "\n"

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
