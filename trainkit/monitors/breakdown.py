"""`breakdown`: per step, data wait / forward / backward (incl. gradient communication) / optimizer,
communication in flight and exposed, gathered from every rank. On CUDA the phases are timed with CUDA
events (see runtime.timing), kept unresolved and resolved once per log interval in `collect()`.

With a device mesh it also times each mesh dimension's collectives (runtime.mesh_comm): logged as
`breakdown/comm_<dim>_s`, and the run-long means per rank written to reports/mesh-comm.json, which
the bottleneck report reads."""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Optional

from ..run_dir import BREAKDOWN, LIVE, MESH_COMM, WARMUP_STEPS, report_path, write_json
from ..runtime import mesh_comm
from .base import Monitor, StepTimes

PHASES = ("data_wait", "forward", "backward", "optimizer", "comm", "comm_exposed", "total")


class BreakdownMonitor(Monitor):
    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.window: dict = {}
        self.pending: list[StepTimes] = []
        self.mesh_timer: Optional[mesh_comm.MeshCommTimer] = None
        self.mesh_pending: list = []  # (this launch's step count, MeshCommStep), resolved at the log step
        self.mesh_seen = 0
        self.mesh_window: dict = {}  # per-dimension sums since the last log step, and "steps"
        self.mesh_run: dict = {}  # per-dimension sums over the run's measured steps, and "steps"

    def on_run_start(self) -> None:
        self.mesh_timer = mesh_comm.build(getattr(self.ctx.strategy, "device_mesh", None), self.ctx.device,
                                          self.ctx.world_size)

    def on_step_start(self, step: int) -> None:
        if self.mesh_timer is not None:
            self.mesh_timer.take(settle=False)  # what ran between steps (evaluation, checkpoints, logging) is not a step's

    def on_step_end(self, step: int, times: StepTimes) -> None:
        self.pending.append(times)  # resolved at the log step: no device sync per step
        if self.mesh_timer is not None:
            self.mesh_seen += 1
            self.mesh_pending.append((self.mesh_seen, self.mesh_timer.take()))

    def _add_mesh(self) -> None:
        pending, self.mesh_pending = self.mesh_pending, []
        for seen, taken in pending:
            values = taken.resolve()
            buckets = [self.mesh_window] + ([self.mesh_run] if seen > WARMUP_STEPS else [])  # as RunStats
            for bucket in buckets:
                bucket["steps"] = bucket.get("steps", 0) + 1
                mesh_comm.add_up(bucket.setdefault("dims", {}), values)

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
        out = {"host": socket.gethostname(),  # each rank's own: `trainkit top` shows which machine is slow
               **{k: window[k] / n for k in PHASES if n and k in window}}
        if self.mesh_timer is not None:
            self._add_mesh()
            mesh, self.mesh_window = self.mesh_window, {}
            out["mesh_comm"] = mesh_comm.per_step(mesh.get("dims", {}), mesh.get("steps", 0))
            if step < 0:  # the end of the run: the run-long means for the bottleneck report
                out["mesh_comm_run"] = mesh_comm.per_step(self.mesh_run.get("dims", {}), self.mesh_run.get("steps", 0))
        return out

    def report(self, step: int, per_rank: list[dict]) -> dict:
        self._write_live(step, per_rank)
        out = {}
        for phase in PHASES:
            values = [r[phase] for r in per_rank if phase in r]
            if values:
                out[f"breakdown/{phase}_s"] = sum(values) / len(values)
                if len(values) > 1:
                    out[f"breakdown/{phase}_max_s"] = max(values)
        for dim in sorted({d for r in per_rank for d in r.get("mesh_comm", {})}):
            values = [r["mesh_comm"][dim]["s"] for r in per_rank if dim in r.get("mesh_comm", {})]
            out[f"breakdown/comm_{dim}_s"] = sum(values) / len(values)
            out[f"breakdown/comm_{dim}_max_s"] = max(values)
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
        """reports/mesh-comm.json: every rank's run-long communication per mesh dimension (the
        bottleneck report's table); the phases' table comes from the loop's own run-long statistics."""
        if any("mesh_comm_run" in r for r in per_rank):
            report_path(self.ctx.run_dir, MESH_COMM).parent.mkdir(exist_ok=True)
            write_json(report_path(self.ctx.run_dir, MESH_COMM),
                       {"per_rank": [r.get("mesh_comm_run", {}) for r in per_rank]}, indent=None)
        return None

    def close(self) -> None:
        if self.mesh_timer is not None:
            self.mesh_timer.close()
            self.mesh_timer = None
