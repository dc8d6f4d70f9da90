"""Where each rank is (build, step N, checkpoint at step N, end of run) and how much memory it has
held, kept in RUN_DIR/live/memory-rank<R>.json for the out-of-memory report.

Why a file: a rank the kernel's OOM killer ends (SIGKILL) says nothing more, so what it was doing
and how close it was to its limit must already be on disk. The record is rewritten in place at
each phase (one `pwrite` of a fixed-size record to a file opened once: microseconds, no fsync) and
read by the launcher (`trainkit.launch.oom`). A rank that fails with an exception instead
(`MemoryError` from an address-space limit, `torch.OutOfMemoryError` on a GPU, or GPU memory running
out outside the caching allocator: CUDA, NCCL, cuBLAS, cuDNN; `out_of_memory_kind`) is explained here
too (`explained`), and on CUDA leaves the allocator's recent history for https://pytorch.org/memory_viz
(torchtitan's memory snapshot on OOM; with the allocations' stacks when the memory monitor records
them).
"""

from __future__ import annotations

import json
import os
import re
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
CUDA_OUT_OF_MEMORY = 2  # cudaErrorMemoryAllocation: AcceleratorError.error_code, "CUDA error: out of memory"
# NCCL's own words for an allocation it could not make. torch's DistBackendError carries NCCL's last
# WARN after "Last error:", and NCCL keeps one such text, each WARN overwriting it (src/debug.cc), so
# it is the allocation helper's closing WARN where one ran (src/include/alloc.h: after the failing
# CUDA call's "Cuda failure 2 'out of memory'", ncclCudaCalloc / ncclCudaCallocAsync / ncclCudaMalloc
# warn "Failed to CUDA calloc [async] / malloc N bytes"), else the CUDA call's own: CUDACHECK "Cuda
# failure 'out of memory'", CUCHECK "Cuda failure 2 'out of memory'", NVLS multicast buffers "... CUDA
# error 2 'out of memory'". Host memory: ncclCalloc "Failed to malloc N bytes" (ncclSystemError) and
# ncclCudaHostCalloc "Failed to CUDA host alloc N bytes" (pinned). All these texts are in the
# libnccl.so.2 torch 2.14.1 ships (2.30.7). A failed CUDA call other than an allocation inside
# ncclCudaCalloc (its memset, after an earlier sticky error) leaves the same closing WARN: the one case
# read as out of memory that may not be.
_NCCL_GPU = re.compile(r"Cuda failure (2 )?'out of memory'|Failed to CUDA (calloc|calloc async|malloc) \d+ bytes"
                       r"|CUDA error 2 'out of memory'")
_NCCL_HOST = re.compile(r"Failed to (malloc|CUDA host alloc) \d+ bytes")
# any CUDA call torch checks, outside the caching allocator, that failed with cudaErrorMemoryAllocation:
# C10_CUDA_CHECK (an AcceleratorError), cuSPARSE's check (which spells the status with
# cusparseGetErrorString: "CUDA error: out of memory when calling `cusparseCreate(handle)`", a plain
# RuntimeError) and the driver API's ("CUDA driver error: out of memory")
_CUDA_OUT_OF_MEMORY = re.compile(r"\bCUDA (driver )?error: out of memory\b")
# the caching allocator's own message, rewrapped by a library into a plain RuntimeError (torchvision's
# batched JPEG decoder: "Error while decoding JPEG images: CUDA out of memory. Tried to allocate ...")
_ALLOCATOR_REWRAPPED = re.compile(r"\bCUDA out of memory\. Tried to allocate\b")
# the CUDA math libraries' handles and workspaces are allocated outside the caching allocator; torch
# raises their status as a RuntimeError ("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling
# `cublasCreate(handle)`", "cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED")
_LIBRARY = [
    (re.compile(r"\bCUBLAS_STATUS_ALLOC_FAILED\b"), "cuBLAS could not allocate GPU memory for its handle or "
                                                    "workspace"),
    (re.compile(r"\bCUSOLVER_STATUS_ALLOC_FAILED\b"), "cuSOLVER could not allocate GPU memory"),
    (re.compile(r"\bCUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED\b"), "cuDNN could not allocate GPU memory"),
    (re.compile(r"\bCUDNN_STATUS_(INTERNAL_ERROR_HOST_ALLOCATION_FAILED|ALLOC_FAILED)\b"),
     "cuDNN could not allocate memory"),
]
# cuBLAS creating its handle with no GPU memory left mostly says NOT_INITIALIZED, not ALLOC_FAILED
# (cublasCreate allocates before it can report the finer status); a broken CUDA context says the same,
# so it is read as out of memory only when the device has next to nothing free at that moment
_CUBLAS_CREATE_NOT_INITIALIZED = re.compile(r"CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate")
NEARLY_FULL = 256 << 20  # bytes free on the device below which a failed cublasCreate is out of memory
_GPU_OR_PINNED = ("a CUDA call outside the caching allocator ran out of memory (CUDA error: out of memory): GPU "
                  "memory, or page-locked host memory where the call pins it (a DataLoader's pin_memory)")


def out_of_memory_kind(exc: BaseException) -> Optional[str]:
    """What ran out, in words, when `exc` is an out-of-memory failure; None when it is not one.

    - Python's `MemoryError`; torch's CPU allocator refusing (a RuntimeError, under an address-space
      limit, `ulimit -v`, or strict overcommit); `torch.OutOfMemoryError` (the CUDA caching allocator).
    - A CUDA call outside the caching allocator failing with cudaErrorMemoryAllocation:
      `torch.AcceleratorError` ("CUDA error: out of memory", `error_code` 2), or a plain RuntimeError
      saying "CUDA error: out of memory" (cuSPARSE's check) or "CUDA driver error: out of memory".
    - The caching allocator's message rewrapped by a library ("CUDA out of memory. Tried to allocate").
    - NCCL failing to allocate while it sets up a communicator or its buffers: a
      `torch.distributed.DistBackendError` whose message carries NCCL's last warning: "Failed to CUDA
      calloc / calloc async / malloc N bytes", "Cuda failure ... 'out of memory'", NVLS's "CUDA error 2
      'out of memory'" (GPU), or "Failed to malloc / CUDA host alloc N bytes" (host). Other NCCL failures
      (a timeout, a peer gone, a network error) are not out of memory.
    - cuBLAS, cuSOLVER or cuDNN reporting an allocation failure (their handle or workspace); cuBLAS
      failing to create its handle (NOT_INITIALIZED) with the device nearly full."""
    if isinstance(exc, MemoryError):
        return "host memory ran out (MemoryError)"
    if not isinstance(exc, RuntimeError):
        return None
    text = str(exc)
    if CPU_ALLOCATOR_FAILED in text:
        return "torch's CPU allocator could not allocate host memory"
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None
    if isinstance(exc, torch.OutOfMemoryError):
        return "the CUDA caching allocator ran out of GPU memory"
    if isinstance(exc, getattr(torch, "AcceleratorError", ())):  # torch 2.8+
        if getattr(exc, "error_code", None) == CUDA_OUT_OF_MEMORY or _CUDA_OUT_OF_MEMORY.search(text):
            return _GPU_OR_PINNED
        return None
    if isinstance(exc, getattr(dist, "DistBackendError", ())):
        if _NCCL_GPU.search(text):
            return ("NCCL communicator set-up ran out of GPU memory (NCCL allocates its buffers outside "
                    "torch's caching allocator)")
        if _NCCL_HOST.search(text):
            return "NCCL communicator set-up ran out of host memory"
        return None
    if _CUDA_OUT_OF_MEMORY.search(text):
        return _GPU_OR_PINNED
    if _ALLOCATOR_REWRAPPED.search(text):
        return "the CUDA caching allocator ran out of GPU memory (inside a library call, which rewrapped its error)"
    if _CUBLAS_CREATE_NOT_INITIALIZED.search(text) and _device_nearly_full():
        return "cuBLAS could not create its handle with the GPU nearly full (CUBLAS_STATUS_NOT_INITIALIZED)"
    return next((kind for pattern, kind in _LIBRARY if pattern.search(text)), None)


def _device_nearly_full() -> bool:
    """Whether this rank's GPU has less than NEARLY_FULL bytes free now (cudaMemGetInfo: the rank holds
    a context already); False where that cannot be read (no CUDA, a broken context)."""
    try:
        import torch
        free, _ = torch.cuda.mem_get_info()
    except Exception:
        return False
    return free < NEARLY_FULL


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is an out-of-memory failure of any kind `out_of_memory_kind` knows: a restart
    repeats it (the worker records the fatal marker)."""
    return out_of_memory_kind(exc) is not None


def explained(exc: BaseException) -> OutOfMemory:
    """The OOM as the report says it: rank, phase, peak, limit, what ran out, the original error, and on
    CUDA the snapshot written to RUN_DIR/reports/."""
    kind = out_of_memory_kind(exc) or "out of memory"
    w = _watch
    if w is None:
        return OutOfMemory(f"out of memory: {kind}; {type(exc).__name__}: {exc}")
    snapshot = _dump_cuda_snapshot(w)
    first = str(exc).splitlines()[0] if str(exc) else ""
    text = (f"out of memory on rank {w.rank} during {w.current}: peak {_gib(w.peak())} of {_gib(w.limit)} "
            f"({w.limit_source}); {kind}; {type(exc).__name__}: {first}")
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
