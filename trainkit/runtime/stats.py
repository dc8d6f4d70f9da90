"""Per-rank statistics of the step phases: the evidence the bottleneck report reasons from.

The report uses each rank's *median* per phase: one step that the OS descheduled (common on a busy
host) would move a mean enough to make a healthy rank look like a straggler.

Steps arrive with device phases unresolved (CUDA events); they are kept until the end of the log
interval and resolved then, so the device is never synchronized per step for these statistics."""

from __future__ import annotations

import socket
import statistics
from collections import deque
from dataclasses import dataclass, field

import torch.distributed as dist

from ..run_dir import WARMUP_STEPS  # the first steps of a launch: allocation, autotuning, worker start-up
from .timing import StepTimes

FIELDS = ("data_wait", "compute", "forward", "optimizer", "total", "comm", "comm_exposed", "loader")
KEPT_STEPS = 100_000  # per-step values kept for the medians (7 floats a step)


@dataclass
class RunStats:
    seen: int = 0
    run: dict = field(default_factory=dict)
    interval: dict = field(default_factory=dict)
    pending: list = field(default_factory=list)  # this interval's steps, device phases not yet resolved
    values: dict = field(default_factory=dict)  # field -> the run's per-step values (for medians)

    def add(self, times: StepTimes) -> None:
        self.seen += 1
        if self.seen > WARMUP_STEPS:
            self.pending.append(times)

    def _resolve(self) -> None:
        """Resolve the interval's steps (the one wait for the device per log interval) and add them up."""
        pending, self.pending = self.pending, []
        for times in pending:
            self._sum(times.resolve())

    def _sum(self, times: StepTimes) -> None:
        for name in FIELDS:
            value = getattr(times, name)
            if value is not None:
                self.values.setdefault(name, deque(maxlen=KEPT_STEPS)).append(value)
        for bucket in (self.run, self.interval):
            bucket["steps"] = bucket.get("steps", 0) + 1
            for name in FIELDS:
                value = getattr(times, name)
                if value is not None:
                    bucket[name] = bucket.get(name, 0.0) + value

    def interval_means(self) -> dict:
        """Mean step time and data wait since the last call (this rank), for the metric log."""
        self._resolve()
        n = self.interval.get("steps", 0)
        out = {} if not n else {"step_time_s": self.interval["total"] / n, "data_wait_s": self.interval["data_wait"] / n}
        self.interval = {}
        return out

    def means(self) -> dict:
        self._resolve()
        n = self.run.get("steps", 0)
        out = {"steps": n, "host": socket.gethostname(), "rank": dist.get_rank() if dist.is_initialized() else 0}
        for name in FIELDS:
            if n and name in self.run:
                out[name] = self.run[name] / n
        if "forward" in out:
            out["backward"] = out["compute"] - out["forward"]
        return out

    def medians(self) -> dict:
        """This rank's median per phase over the run's measured steps (`backward` = compute - forward)."""
        self._resolve()
        out = {"steps": self.run.get("steps", 0), "host": socket.gethostname(),
               "rank": dist.get_rank() if dist.is_initialized() else 0}
        for name, values in self.values.items():
            out[name] = statistics.median(values)
        if "forward" in out and "compute" in out:
            out["backward"] = statistics.median(c - f for c, f in zip(self.values["compute"], self.values["forward"]))
        return out

    def gather(self, world_size: int) -> list[dict]:
        """Every rank's medians, on every rank (one collective at the end of the run)."""
        mine = self.medians()
        if world_size == 1 or not dist.is_initialized():
            return [mine]
        out: list = [None] * world_size
        dist.all_gather_object(out, mine)
        return out
