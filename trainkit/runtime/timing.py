"""Step timing: where each optimizer step's time goes, cheap enough to always be on.

Host time (perf_counter) everywhere; with CUDA and a monitor that asks for precise phases, CUDA
events bracket the GPU work so forward/backward/optimizer times are the device's, not the launch
queue's. `CommTimer` records when gradient collectives are in flight (DDP comm hooks).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class StepTimes:
    """Where one optimizer step of this rank went, in seconds (the loop produces it, monitors read it)."""

    data_wait: float  # blocked in the DataLoader
    compute: float  # forward + backward (with DDP: including the gradient all-reduce it waits for)
    optimizer: float  # clip + optimizer step + scheduler
    total: float
    forward: Optional[float] = None  # set when a forward hook is installed (breakdown)
    comm: Optional[float] = None  # wall time with a gradient collective in flight (DDP comm timer)


class Clock:
    def __init__(self, device: torch.device, precise: bool):
        self.cuda = device.type == "cuda" and precise

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        return end - start


class CommTimer:
    """Union of the wall-time intervals during which a gradient collective was in flight."""

    def __init__(self):
        self._lock = threading.Lock()
        self._intervals: list[tuple[float, float]] = []
        self.buckets = 0

    def add(self, start: float, end: float) -> None:
        with self._lock:
            self._intervals.append((start, end))
            self.buckets += 1

    def take(self) -> tuple[float, int]:
        """(seconds with communication in flight, collectives) since the last call."""
        with self._lock:
            spans, self._intervals = sorted(self._intervals), []
            n, self.buckets = self.buckets, 0
        total, cur_start, cur_end = 0.0, None, None
        for s, e in spans:
            if cur_end is None or s > cur_end:
                if cur_end is not None:
                    total += cur_end - cur_start
                cur_start, cur_end = s, e
            else:
                cur_end = max(cur_end, e)
        if cur_end is not None:
            total += cur_end - cur_start
        return total, n


def timed_hook(hook, timer: Optional[CommTimer]):
    """Wrap a DDP comm hook `hook(state, bucket) -> Future` so its collective is timed."""
    if timer is None:
        return hook

    def wrapped(state, bucket):
        start = time.perf_counter()
        fut = hook(state, bucket)

        def done(f):
            timer.add(start, time.perf_counter())
            return f.value()[0] if isinstance(f.value(), list) else f.value()

        return fut.then(done)

    return wrapped


class ForwardMarks:
    """Clock marks taken when the model's forward returns (a forward hook), so a step's forward
    time can be told apart from its backward. Installed only when a monitor asks for it."""

    def __init__(self, model: torch.nn.Module, clock: Clock):
        self.clock, self.marks = clock, []
        model.register_forward_hook(lambda *_: self.marks.append(self.clock.mark()))

    def clear(self) -> None:
        self.marks.clear()
