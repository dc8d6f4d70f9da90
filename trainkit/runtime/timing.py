"""Step timing: where each optimizer step's time goes, cheap enough to always be on.

Host time (perf_counter) everywhere; with CUDA and a monitor that asks for precise phases, CUDA
events bracket the GPU work so forward/backward/optimizer times are the device's, not the launch
queue's. `CommTimer` records when gradient collectives are in flight (DDP comm hooks) and how much
of that the step is left waiting for after its backward compute (exposed communication).

Nothing here synchronizes the device per step: a phase keeps its (start, end) marks and a step's
`StepTimes` is resolved (`resolve()`, one `synchronize` on events long finished) by whoever reads
it, once per log interval (RunStats, the breakdown and stragglers monitors).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

import torch


# --------------------------------------------------------------------------- time sources
class HostTime:
    """perf_counter marks: CPU work runs when it is called, so host time is the work's time."""

    deferred = False

    def mark(self) -> float:
        return time.perf_counter()

    def offsets(self, marks: list) -> list[float]:
        """Seconds from marks[0] to each mark."""
        return [m - marks[0] for m in marks]


class DeviceEvents:
    """CUDA events recorded on the current stream: the device's own time. `offsets` synchronizes on
    the marks, so it is called only when a log interval is resolved, long after they completed.
    `events` is the torch.cuda module (or a fake with `Event` for CPU tests)."""

    deferred = True

    def __init__(self, events: Any = None):
        self.events = events if events is not None else torch.cuda

    def mark(self):
        ev = self.events.Event(enable_timing=True)
        ev.record()  # on the current stream: in a Future.then callback that is a stream after the collective
        return ev

    def offsets(self, marks: list) -> list[float]:
        for m in marks:
            m.synchronize()  # immediate for events that completed long ago
        return [marks[0].elapsed_time(m) / 1000.0 for m in marks]


def time_source(device: torch.device, precise: bool = True) -> Union[HostTime, DeviceEvents]:
    return DeviceEvents() if device.type == "cuda" and precise else HostTime()


# --------------------------------------------------------------------------- lazily resolved values
class Lazy:
    """A number of seconds known only after the device caught up; `resolve()` returns it."""

    def resolve(self) -> float:
        raise NotImplementedError


class Phase(Lazy):
    """Seconds accumulated over (start, end) mark pairs of one source (e.g. the micro-steps' compute)."""

    def __init__(self, source):
        self.source, self.spans, self.value = source, [], 0.0

    def add(self, start, end) -> None:
        self.spans.append((start, end))

    def resolve(self) -> float:
        for start, end in self.spans:
            self.value += self.source.offsets([start, end])[1]
        self.spans = []
        return self.value


@dataclass
class StepTimes:
    """Where one optimizer step of this rank went, in seconds (the loop produces it, monitors read it).

    Device-timed fields may hold `Lazy` values until `resolve()` is called; call it at the end of a
    log interval, not every step (resolving waits for the device). `total` and `data_wait` are host
    time and always plain numbers."""

    data_wait: float  # blocked in the DataLoader
    compute: Any  # forward + backward (with DDP: including the gradient all-reduce it waits for)
    optimizer: Any  # clip + optimizer step + scheduler
    total: float
    forward: Any = None  # set when a forward hook is installed (breakdown)
    comm: Any = None  # time with a gradient collective in flight (DDP comm timer)
    comm_exposed: Any = None  # of which after the last gradient bucket was ready: what the step waits for
    loader: Optional[float] = None  # seconds loader processes spent producing this step's batches

    def resolve(self) -> "StepTimes":
        """Replace lazy values by seconds (in place); returns self."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Lazy):
                setattr(self, f.name, value.resolve())
        return self


class Clock:
    """Marks around the step's phases: CUDA events with a precise monitor on a GPU, else perf_counter."""

    def __init__(self, device: torch.device, precise: bool, source=None):
        self.source = source if source is not None else time_source(device, precise)

    @property
    def cuda(self) -> bool:
        return self.source.deferred

    def mark(self):
        return self.source.mark()

    def phase(self) -> Phase:
        return Phase(self.source)


# --------------------------------------------------------------------------- communication
def comm_seconds(spans: list[tuple[float, float]]) -> tuple[float, float]:
    """(in flight, exposed) for collectives [issued, completed] on one time axis: in flight is the
    length of their union; exposed the part of it after the last one was issued -- the moment the
    last gradient bucket was ready, i.e. backward compute was done -- which nothing overlaps."""
    if not spans:
        return 0.0, 0.0
    last_ready = max(s for s, _ in spans)
    in_flight = exposed = 0.0
    cur_start = cur_end = None
    for s, e in sorted(spans) + [(float("inf"), float("inf"))]:
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                in_flight += cur_end - cur_start
                exposed += max(0.0, cur_end - max(cur_start, last_ready))
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    return in_flight, exposed


class CommSpans:
    """One step's collectives, resolved on first read into `in_flight` and `exposed` seconds."""

    def __init__(self, source, marks: list[tuple[Any, Any]]):
        self.source, self.marks, self._result = source, marks, None
        self.count = len(marks)
        self.in_flight, self.exposed = _Part(self, 0), _Part(self, 1)

    def result(self) -> tuple[float, float]:
        if self._result is None:
            flat = [m for pair in self.marks for m in pair]
            offsets = self.source.offsets(flat) if flat else []
            self._result = comm_seconds(list(zip(offsets[0::2], offsets[1::2])))
            self.marks = []
        return self._result


class _Part(Lazy):
    def __init__(self, spans: CommSpans, index: int):
        self.spans, self.index = spans, index

    def resolve(self) -> float:
        return self.spans.result()[self.index]


class CommTimer:
    """(issued, completed) marks of every gradient collective, per step. On CUDA the marks are
    events: issued = recorded on the backward stream when the hook runs (the bucket's gradients are
    computed there), completed = recorded in the future's callback, whose current stream waits for
    the collective's kernels (a host timestamp there would be taken before they ran)."""

    def __init__(self, source=None):
        self._lock = threading.Lock()
        self._marks: list[tuple[Any, Any]] = []
        self.source = source if source is not None else HostTime()
        self.bound = False  # a strategy times its collectives here (DDP); others leave comm unmeasured

    def bind(self, device: torch.device) -> None:
        """Time on `device`: CUDA events on a GPU (the strategy calls this when it registers the hook)."""
        self.source = time_source(device)
        self.bound = True

    def add(self, start, end) -> None:
        with self._lock:
            self._marks.append((start, end))

    def take(self) -> CommSpans:
        """The collectives since the last call (lazy: nothing is synchronized here)."""
        with self._lock:
            marks, self._marks = self._marks, []
        return CommSpans(self.source, marks)


def timed_hook(hook, timer: Optional[CommTimer]):
    """Wrap a DDP comm hook `hook(state, bucket) -> Future` so its collective is timed."""
    if timer is None:
        return hook

    def wrapped(state, bucket):
        start = timer.source.mark()  # before the collective is issued
        fut = hook(state, bucket)

        def done(f):
            timer.add(start, timer.source.mark())  # CUDA: on the callback's stream, after the collective
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
