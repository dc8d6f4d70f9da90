"""Where each rank is (build, step N, checkpoint at step N, end of run) and how much memory it has
held, kept in RUN_DIR/live/memory-rank<R>.json for the out-of-memory report.

Why a file: a rank the kernel's OOM killer ends (SIGKILL) says nothing more, so what it was doing
and how close it was to its limit must already be on disk. The record is rewritten in place at
each phase (one `pwrite` of a fixed-size record to a file opened once: microseconds, no fsync) and
read by the launcher (`trainkit.launch.oom`). A rank that fails with an exception instead
(`MemoryError` from an address-space limit, `torch.OutOfMemoryError` on a GPU) is explained here too
(`explained`), and on CUDA leaves the allocator's recent history for https://pytorch.org/memory_viz
(torchtitan's memory snapshot on OOM; with the allocations' stacks when the memory monitor records
them).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

from ..run_dir import CUDA_OOM_SNAPSHOT, rank_memory_path, report_path
from . import memory_limits

RECORD_BYTES = 512
PEAK_EVERY_S = 1.0  # steps refresh the recorded peak at most this often (other phases always do)


class OutOfMemory(RuntimeError):
    """A rank ran out of memory; the message says where, its peak and its limit."""


class _Watch:
    def __init__(self, run_dir: Path, rank: int, cuda_device=None):
        self.run_dir, self.rank, self.cuda_device = Path(run_dir), rank, cuda_device
        self.limit, self.limit_source = memory_limits.process_limit()
        path = rank_memory_path(run_dir, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.current = ""
        self.local_rank, self.pid = int(os.environ.get("LOCAL_RANK", "0")), os.getpid()
        self.last_peak, self.peak_read_at = None, -PEAK_EVERY_S

    def phase(self, name: str) -> None:
        self.current = name
        now = time.monotonic()
        if now - self.peak_read_at >= PEAK_EVERY_S or not name.startswith("step "):  # /proc read: ~30 us
            self.last_peak, self.peak_read_at = self.peak(), now
        record = {"rank": self.rank, "local_rank": self.local_rank, "pid": self.pid, "phase": name,
                  "peak_bytes": self.last_peak, "limit_bytes": self.limit, "limit": self.limit_source}
        data = json.dumps(record).encode()[:RECORD_BYTES]
        try:
            os.pwrite(self.fd, data + b" " * (RECORD_BYTES - len(data)), 0)  # JSON then spaces: one JSON value
        except OSError:  # a full disk: the OOM report is the lesser loss
            pass

    def peak(self) -> Optional[int]:
        """Host: VmHWM; GPU: the device's peak allocated bytes (what ran out)."""
        if self.cuda_device is not None:
            import torch

            return int(torch.cuda.max_memory_allocated(self.cuda_device))
        return memory_limits.peak_rss()


_watch: Optional[_Watch] = None


def start(run_dir: Path, rank: int, device) -> None:
    """Begin this rank's record (phase `build`); on CUDA also the allocator history an OOM dumps."""
    global _watch
    cuda = device if getattr(device, "type", "cpu") == "cuda" else None
    if _watch is not None:  # an earlier in-process run (world size 1) of this process
        os.close(_watch.fd)
    _watch = _Watch(run_dir, rank, cuda)
    if cuda is not None:
        import torch

        # No allocator history here: recording one (a Python traceback per allocation and free) costs
        # host memory and time on every step of every run. The OOM snapshot below holds the allocator's
        # segments and blocks at the failure either way, and the allocations' stacks too when the memory
        # monitor records them (`monitors: [{name: memory, snapshot: true}]`).
        _watch.limit = torch.cuda.get_device_properties(cuda).total_memory
        _watch.limit_source = f"{torch.cuda.get_device_name(cuda)}'s memory"
    _watch.phase("build")


def phase(name: str) -> None:
    """Record that this rank now does `name` (no-op outside a worker)."""
    if _watch is not None:
        _watch.phase(name)


CPU_ALLOCATOR_FAILED = "DefaultCPUAllocator: can't allocate memory"  # torch's CPU OOM: a RuntimeError


def is_out_of_memory(exc: BaseException) -> bool:
    """Python's MemoryError, torch's CUDA OutOfMemoryError, or torch's CPU allocator refused (under an
    address-space limit, `ulimit -v`, or strict overcommit), which torch raises as a RuntimeError."""
    if isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError) and CPU_ALLOCATOR_FAILED in str(exc)):
        return True
    try:
        import torch

        return isinstance(exc, torch.OutOfMemoryError)
    except (ImportError, AttributeError):
        return False


def explained(exc: BaseException) -> OutOfMemory:
    """The OOM as the report says it: rank, phase, peak, limit, the original error, and on CUDA the
    snapshot written to RUN_DIR/reports/."""
    w = _watch
    if w is None:
        return OutOfMemory(f"out of memory: {type(exc).__name__}: {exc}")
    snapshot = _dump_cuda_snapshot(w)
    first = str(exc).splitlines()[0] if str(exc) else ""
    text = (f"out of memory on rank {w.rank} during {w.current}: peak {_gib(w.peak())} of {_gib(w.limit)} "
            f"({w.limit_source}); {type(exc).__name__}: {first}")
    if snapshot is not None:
        text += f"; GPU memory history: {snapshot} (open it at https://pytorch.org/memory_viz)"
    return OutOfMemory(text)


def _dump_cuda_snapshot(w: _Watch) -> Optional[Path]:
    if w.cuda_device is None:
        return None
    import torch

    path = report_path(w.run_dir, CUDA_OOM_SNAPSHOT.format(rank=w.rank))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
    except Exception:  # the report matters more than the snapshot
        return None
    return path


def _gib(n: Optional[int]) -> str:
    return "unknown" if n is None else f"{n / (1 << 30):.2f} GiB"
