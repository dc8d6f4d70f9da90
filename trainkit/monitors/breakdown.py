"""`breakdown`: per step, data wait / forward / backward (incl. gradient communication) / optimizer,
communication in flight and exposed, gathered from every rank. On CUDA the phases are timed with CUDA
events (see runtime.timing), kept unresolved and resolved once per log interval in `collect()`."""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Optional

from ..run_dir import BREAKDOWN, LIVE
from .base import Monitor, StepTimes

PHASES = ("data_wait", "forward", "backward", "optimizer", "comm", "comm_exposed", "total")


class BreakdownMonitor(Monitor):
    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.window: dict = {}
        self.pending: list[StepTimes] = []

    def on_step_end(self, step: int, times: StepTimes) -> None:
        self.pending.append(times)  # resolved at the log step: no device sync per step

    def _add(self, times: StepTimes) -> None:
        values = {"data_wait": times.data_wait, "optimizer": times.optimizer, "total": times.total}
        if times.forward is not None:
            values["forward"] = times.forward
            values["backward"] = times.compute - times.forward
        if times.comm is not None:
            values["comm"] = times.comm
        if times.comm_exposed is not None:
            values["comm_exposed"] = times.comm_exposed
        self.window["steps"] = self.window.get("steps", 0) + 1
        for k, v in values.items():
            self.window[k] = self.window.get(k, 0.0) + v

    def collect(self, step: int) -> dict:
        pending, self.pending = self.pending, []
        for times in pending:
            self._add(times.resolve())
        n, window = self.window.get("steps", 0), self.window
        self.window = {}
        return {"host": socket.gethostname(),  # each rank's own: `trainkit top` shows which machine is slow
                **{k: window[k] / n for k in PHASES if n and k in window}}

    def report(self, step: int, per_rank: list[dict]) -> dict:
        self._write_live(step, per_rank)
        out = {}
        for phase in PHASES:
            values = [r[phase] for r in per_rank if phase in r]
            if values:
                out[f"breakdown/{phase}_s"] = sum(values) / len(values)
                if len(values) > 1:
                    out[f"breakdown/{phase}_max_s"] = max(values)
        return out

    def _write_live(self, step: int, per_rank: list[dict]) -> None:
        """RUN_DIR/live/breakdown.json: every rank's phases of the last interval, for `trainkit top`."""
        live = self.ctx.run_dir / LIVE
        try:
            live.mkdir(exist_ok=True)
            tmp = live / f"{BREAKDOWN}.tmp"
            tmp.write_text(json.dumps({"step": step, "time": time.time(),
                                       "per_rank": [dict(r, rank=i) for i, r in enumerate(per_rank)]}))
            os.replace(tmp, live / BREAKDOWN)
        except OSError:  # a live view is not worth failing a run over
            pass

    def finish(self, per_rank: list[dict]) -> Optional[str]:
        return None  # the run report's table comes from the loop's own run-long statistics
