"""TRAINKIT_FAULT_SLOW_CHECKPOINT="step=4,s=600,marks=DIR" (installed by fault_injection.install): DCP's
file writer, on every rank, first touches DIR/writing-step<N>-rank<R> and then sleeps `s` seconds before
it writes the files of the checkpoint of step N (under `trainer.checkpoint.async_save` in DCP's
background thread, otherwise on the training thread). A test then knows a write is under way, and
has time to kill the run during it or to see whether the run's end waits for it."""

from __future__ import annotations

import os
import time
from pathlib import Path

ENV = "TRAINKIT_FAULT_SLOW_CHECKPOINT"


def install_slow_checkpoint_write(*, rank: int) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    if getattr(_FileSystemWriter.write_data, "slowed", False):  # one process may run many loops
        return
    fields = dict(part.split("=", 1) for part in spec.split(","))
    folder_tag, seconds = f"step-{int(fields['step']):08d}", float(fields["s"])
    marks = Path(fields["marks"]) if "marks" in fields else None
    write_data = _FileSystemWriter.write_data

    def slow_write_data(self, plan, planner):
        if str(self.path).endswith(folder_tag):  # the .tmp-step-N folder a checkpoint is written into
            if marks is not None:
                marks.mkdir(parents=True, exist_ok=True)
                (marks / f"writing-{folder_tag}-rank{rank}").touch()
            time.sleep(seconds)
        return write_data(self, plan, planner)

    slow_write_data.slowed = True
    _FileSystemWriter.write_data = slow_write_data
