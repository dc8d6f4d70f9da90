"""Communication per mesh dimension: how long each dimension's collectives are in flight per step.

Why process-group hooks: torch calls a group's pre-hook when a collective is issued (op, input
tensors) and its post-hook with the collective's `Work`, whatever the caller -- DTensor's
all-reduces inside tensor-parallel layers, FSDP2's all-gathers and reduce-scatters, HSDP's
all-reduce, a pipeline's send/recv -- and each mesh dimension has its own group (DeviceMesh names
them "mesh_tp", "mesh_dp_shard", ...). So hooking each dimension's group attributes every collective
to its dimension without knowing who issued it. A collective is in flight from the pre-hook to the
completion of its Work's future (a callback on the backend's thread); on CUDA both marks are events
on the streams involved (as `timing.CommTimer`'s), so the device's time is measured, resolved once
per log interval.

A Work without a future (gloo's reduce-scatter and point-to-point ops) is waited for in the post-hook
when its caller blocks on it anyway (async_op=False), else polled (`is_completed()`, every 0.5 ms
while one is in flight) by a thread of the timer; on CUDA such an asynchronous one is counted with its
bytes but not timed (`untimed`). The Python marks need the GIL, so on a CPU backend a completion is
seen up to the interpreter's switch interval (5 ms) late when the training thread holds it. Whether
a dimension's time overlapped compute (exposed vs in flight) is not measured: only DDP's buckets give
a moment when compute is done.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections import defaultdict
from typing import Any, Optional

import torch

from . import process_groups
from .timing import CommSpans, time_source

HOOK_ID = 0x6D657368  # "mesh": this module's hooks among other hooks on the same groups (Flight Recorder)
POLL_S = 0.0005  # how often the timer looks at asynchronous collectives without a future (gloo's)
SETTLE_S = 0.5  # at most this long at a step's end for the completion records of its last collectives


def mesh_groups(mesh) -> dict[str, Any]:
    """Dimension name -> process group of this rank, for each dimension of more than one rank: the
    mesh's own ("tp", "dp_shard", ...) and those flattened from them so far (e.g. "dp_shard_tp",
    where DTensor reduces a gradient norm over both at once)."""
    if mesh is None:
        return {}
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    sizes = dict(zip(root.mesh_dim_names or (), root.shape))  # no slicing: a slice builds state of its own
    groups = {name: root.get_group(name) for name, size in sizes.items() if size > 1}
    for name, flat in (getattr(root, "_flatten_mapping", None) or {}).items():
        if flat.size() > 1:
            groups[name] = flat.get_group()
    return groups


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class MeshCommTimer:
    """Hooks on the mesh's groups recording each collective's (issued, completed) marks per dimension."""

    def __init__(self, groups: dict[str, Any], device: torch.device, mesh=None):
        self.source = time_source(device)
        self._lock = threading.Condition()
        self._open = 0  # collectives issued whose completion is not recorded yet
        # CUDA futures run their callbacks when the collective is queued: nothing to wait for there
        self.settle_s = 0.0 if self.source.deferred else SETTLE_S
        self._spans: dict[str, list] = defaultdict(list)
        self._bytes: dict[str, int] = defaultdict(int)
        self._count: dict[str, int] = defaultdict(int)
        self._untimed: dict[str, int] = defaultdict(int)
        self._waiting: queue.SimpleQueue = queue.SimpleQueue()
        self._watcher: Optional[threading.Thread] = None
        self.groups: dict[str, Any] = {}
        self._hook(groups)
        # a dimension flattened after the timer started is a new group: it is timed from the step after it
        # appears (`take` asks runtime.process_groups whether one did). FSDP x TP flattens "dp_shard_tp"
        # while it is set up, before the timer: measured here, so that case needs no rescan.
        self.mesh = mesh
        self._seen = process_groups.generation() if mesh is not None and process_groups.watch() else None

    def _hook(self, groups: dict[str, Any]) -> None:
        for name, group in groups.items():
            if name in self.groups:
                continue
            started: dict[int, Any] = {}
            group.register_pre_hook(HOOK_ID, self._pre(name, started))
            group.register_post_hook(HOOK_ID, self._post(name, started))
            self.groups[name] = group

    def _pre(self, dim: str, started: dict):
        def pre(args) -> None:
            started[args.op_id] = self.source.mark()
            with self._lock:
                self._open += 1
                self._count[dim] += 1
                self._bytes[dim] += _nbytes(args.input_tensors)
        return pre

    def _post(self, dim: str, started: dict):
        def post(args) -> None:
            start = started.pop(args.op_id, None)
            if start is None:  # issued before the hooks were registered
                return
            if args.work is None:
                self._close_one()
                return
            try:
                future = args.work.get_future()
            except RuntimeError:  # gloo's reduce-scatter and send/recv: no completion callback
                if args.async_op:
                    self._watch(dim, start, args.work)
                else:  # a blocking call: its caller waits for it right after this hook, on this thread
                    args.work.wait()
                    self._add(dim, start, self.source.mark())
                return
            future.then(lambda _: self._add(dim, start, self.source.mark()))
        return post

    def _watch(self, dim: str, start, work) -> None:
        """An asynchronous Work without a future: a thread of this timer polls `is_completed()` and
        marks its completion. Not `wait()`: a second waiter on another thread would run the work's
        own completion steps (a copy into the caller's output) a second time, perhaps after the
        caller has moved on. Host time only: a CUDA mark taken on another thread would be on the
        wrong stream, so on CUDA such a collective stays untimed."""
        if self.source.deferred:
            with self._lock:
                self._untimed[dim] += 1
            self._close_one()
            return
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._poll, name="trainkit-mesh-comm", daemon=True)
            self._watcher.start()
        self._waiting.put((dim, start, work))

    def _poll(self) -> None:
        pending: list = []
        while True:
            try:  # block while nothing is in flight; poll every POLL_S while something is
                item = self._waiting.get(timeout=POLL_S) if pending else self._waiting.get()
            except queue.Empty:
                item = ()
            if item is None:
                return
            if item:
                pending.append(item)
            still = []
            for dim, start, work in pending:
                try:
                    done = work.is_completed()
                except Exception:  # noqa: BLE001 -- the caller sees the failure; a timing is just lost
                    self._close_one()
                    continue
                if done:
                    self._add(dim, start, self.source.mark())
                else:
                    still.append((dim, start, work))
            pending = still

    def _add(self, dim: str, start, end) -> None:
        with self._lock:
            self._spans[dim].append((start, end))
        self._close_one()

    def _close_one(self) -> None:
        with self._lock:
            self._open -= 1
            self._lock.notify_all()

    def take(self, settle: bool = True) -> "MeshCommStep":
        """The collectives since the last call, per dimension (lazy: nothing is synchronized here).
        A step has waited for its collectives when it ends, but their completion is recorded by
        another thread (the future's callback, the waiting thread), which needs the GIL: wait up to
        `settle_s` for those records, so that a step's last collectives are not counted in the next
        window (or dropped with the time between steps). If that wait ever times out, something
        stays in flight across steps, and later calls do not wait: it counts when it completes.
        `settle=False`: no wait, for a call that only clears what ran between steps."""
        if self._seen is not None and process_groups.generation() != self._seen:
            self._seen = process_groups.generation()
            self._hook(mesh_groups(self.mesh))
        with self._lock:
            if settle and self._open > 0 and self.settle_s > 0 and not self._lock.wait_for(lambda: self._open <= 0,
                                                                              timeout=self.settle_s):
                self.settle_s = 0.0
            step = MeshCommStep(self.source, dict(self._spans), dict(self._bytes), dict(self._count),
                                dict(self._untimed))
            self._spans, self._bytes = defaultdict(list), defaultdict(int)
            self._count, self._untimed = defaultdict(int), defaultdict(int)
        return step

    def close(self) -> None:
        for group in self.groups.values():
            group.unregister_pre_hook(HOOK_ID)
            group.unregister_post_hook(HOOK_ID)
        self.groups = {}
        self._waiting.put(None)


class MeshCommStep:
    """One step's collectives per dimension; `resolve()` -> {dim: {"s", "bytes", "count", "untimed"}}
    where "s" is the length of the union of the dimension's in-flight spans."""

    def __init__(self, source, spans: dict, nbytes: dict, count: dict, untimed: dict):
        self.source, self.spans, self.nbytes, self.count, self.untimed = source, spans, nbytes, count, untimed

    def resolve(self) -> dict[str, dict]:
        out = {}
        for dim in sorted(set(self.count) | set(self.spans)):
            seconds = CommSpans(self.source, self.spans.get(dim, [])).in_flight.resolve()
            out[dim] = {"s": seconds, "bytes": self.nbytes.get(dim, 0), "count": self.count.get(dim, 0),
                        "untimed": self.untimed.get(dim, 0)}
        return out


def add_up(total: dict, step: dict) -> dict:
    """Per-dimension sums of resolved steps (`MeshCommStep.resolve()` values), in place."""
    for dim, values in step.items():
        into = total.setdefault(dim, {})
        for key, value in values.items():
            into[key] = into.get(key, 0) + value
    return total


def per_step(total: dict, steps: int) -> dict:
    """Sums over `steps` steps -> means per step."""
    return {dim: {k: v / steps for k, v in values.items()} for dim, values in total.items()} if steps else {}


def build(mesh, device: torch.device, world_size: int) -> Optional[MeshCommTimer]:
    """A timer on the mesh's groups, or None when there is nothing to time (one rank, no mesh)."""
    groups = mesh_groups(mesh) if world_size > 1 else {}
    if groups and not all(hasattr(g, "register_pre_hook") for g in groups.values()):
        print("trainkit: warning: breakdown: communication per mesh dimension needs process-group hooks "
              "(ProcessGroup.register_pre_hook, torch 2.14); this torch has none, so it is not measured",
              file=sys.stderr)
        return None
    return MeshCommTimer(groups, device, mesh) if groups else None
