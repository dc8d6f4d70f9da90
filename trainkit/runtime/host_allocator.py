"""How the training process's malloc treats large host blocks (`performance.host_allocator`).

Why: on the CPU every tensor lives in malloc'd host memory, and glibc's defaults hand a large freed
block back to the kernel (blocks from mmap, and a heap top over the trim threshold). A training step
frees and re-allocates the same large tensors every step -- gradients (`zero_grad(set_to_none=True)`
after the optimizer step), the optimizer's temporaries, activations -- so each step faults every page
of them in again, zero-filled by the kernel. Measured on the overhead bench's 14M-parameter MLP (2
ranks on this machine's 2 cores): about 110k minor page faults per second per rank, a third of the
workers' CPU time in the kernel; keeping the memory made trainkit's step 19% faster
(docs/benchmarks.md, "Host allocator").

`retain` tells glibc (mallopt) to serve blocks up to `RETAIN_BYTES` from its heap and to keep up to
`RETAIN_BYTES` of freed heap instead of trimming it: a freed block is reused by the next step's
allocation of the same size without a page fault. The cost is that memory freed inside the process is
not returned to the kernel: resident memory stays near the run's high-water mark.

`release` is the opposite trade: every block of `RELEASE_BYTES` or more is mmap'd and returned to the
kernel when freed (glibc's dynamic threshold would otherwise rise and keep mid-sized blocks in the
heap, where they fragment it). Lowest resident memory, a page fault per page of each re-allocation.

`auto` takes the strategy's own choice on the CPU (`Capabilities.host_memory_on_cpu` of its options), measured per
strategy with bench/strategies_memory.py (docs/benchmarks.md): DDP and the pipeline re-allocate the
same tensors each step and get `retain` (a 105M-parameter MLP under DDP: 1.4-1.7x faster steps for 1-5%
more peak memory); FSDP and DeepSpeed keep their own flat and bucket buffers, which fragment a retained
heap (peak +1.1 to +1.8 GiB under `retain`), and get `release` (their lowest peak; FSDP's step time
unchanged, ZeRO-2's within +10% on a noisy host). On a GPU
the tensors live in CUDA's caching allocator (which already reuses its blocks) and host memory is left
as the system sets it.

Hand-written over ctypes because the only alternatives are process-wide environment settings that
must exist before the interpreter starts (`GLIBC_TUNABLES`, `MALLOC_*_` variables) or preloading
another allocator (jemalloc/tcmalloc through LD_PRELOAD, what torch.backends.xeon.run_cpu does) that
the machine may not have. mallopt is glibc's documented API and takes effect for later allocations;
forked DataLoader workers inherit it. It cannot be undone: a later run in the same process (world size
1 runs inside the launcher) keeps what the first one set, and its summary says so.
"""

from __future__ import annotations

import ctypes
import os
from typing import Optional


# mallopt(3) parameter numbers (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

# Blocks up to this size come from the heap; this much freed heap is kept. 1 GiB: above any single
# tensor a step of the models trainkit trains on a CPU frees and re-allocates, below mallopt's int limit.
RETAIN_BYTES = 1 << 30
# blocks this large or larger are returned to the kernel at free under `release`
RELEASE_BYTES = 1 << 20
# glibc's own default trim threshold (heap top kept before trimming), set explicitly under `release`
GLIBC_TRIM_BYTES = 128 << 10
# if a glibc refuses 1 GiB as the mmap threshold (older releases capped it), the largest value it always took
FALLBACK_MMAP_BYTES = 32 << 20

POLICIES = ("auto", "retain", "release", "system")
# allocators that replace glibc's malloc when preloaded: mallopt would then set nothing that is used
REPLACEMENT_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")

_applied: Optional[str] = None  # what this process set (mallopt cannot be undone: glibc has no "reset")


def resolve(option: str, device_type: str, *, cpu_default: str = "retain") -> str:
    """The policy a run gets: `auto` is the strategy's `cpu_default` on the CPU, `system` elsewhere."""
    if option not in POLICIES:
        raise ValueError(f"performance.host_allocator: {option!r} is not one of {', '.join(POLICIES)}")
    if option != "auto":
        return option
    return cpu_default if device_type == "cpu" else "system"


def for_recipe(recipe, device_type: str) -> str:
    """The policy a recipe's run gets on `device_type` (the worker, the memory bench and tune ask here).
    `auto` on the CPU is the strategy options' `capabilities().host_memory_on_cpu` (retain unless the
    strategy declares otherwise)."""
    cpu_default = recipe.strategy.capabilities().host_memory_on_cpu
    return resolve(recipe.performance.host_allocator, device_type, cpu_default=cpu_default)


def _glibc() -> Optional[ctypes.CDLL]:
    """This process's C library when it is glibc (mallopt's parameters are glibc's), else None."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
    except (ValueError, OSError, AttributeError):  # not a glibc system (musl, macOS, Windows)
        return None
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "mallopt") else None


def is_glibc() -> bool:
    """Whether `retain` and `release` can take effect in this process."""
    return _glibc() is not None


def apply(policy: str) -> str:
    """Set this process's malloc for `policy` (`retain`, `release` or `system`); returns what is in
    effect, as the run's summary records it: the policy's name, or "<name> (<why not as asked>)"."""
    global _applied
    if policy not in ("retain", "release", "system"):
        raise ValueError(f"host allocator policy {policy!r}: expected retain, release or system")
    if _applied is not None and _applied != policy:  # an earlier run in this process (world size 1)
        return f"{_applied} (set earlier in this process; glibc cannot restore its defaults)"
    if policy == "system":
        return "system"  # nothing to set: a process starts with the system's settings
    preloaded = [name for name in REPLACEMENT_ALLOCATORS if name in os.environ.get("LD_PRELOAD", "")]
    if preloaded:
        return f"system ({preloaded[0]} is preloaded and replaces glibc's malloc; {policy} not set)"
    libc = _glibc()
    if libc is None:
        return f"system ({policy} needs glibc's mallopt; this C library is not glibc)"
    if policy == "release":
        # a fixed value also turns glibc's dynamic threshold adjustment off
        if not (libc.mallopt(M_MMAP_THRESHOLD, RELEASE_BYTES) and libc.mallopt(M_TRIM_THRESHOLD, GLIBC_TRIM_BYTES)):
            return "system (glibc refused mallopt)"
        _applied = "release"
        return _applied
    mmap_bytes = RETAIN_BYTES if libc.mallopt(M_MMAP_THRESHOLD, RETAIN_BYTES) else FALLBACK_MMAP_BYTES
    if mmap_bytes == FALLBACK_MMAP_BYTES and not libc.mallopt(M_MMAP_THRESHOLD, FALLBACK_MMAP_BYTES):
        return "system (glibc refused mallopt(M_MMAP_THRESHOLD))"
    _applied = "retain"
    if not libc.mallopt(M_TRIM_THRESHOLD, RETAIN_BYTES):
        return "retain (mmap threshold only: glibc refused mallopt(M_TRIM_THRESHOLD))"
    return "retain" if mmap_bytes == RETAIN_BYTES else f"retain (blocks up to {mmap_bytes >> 20} MiB)"


def minor_faults() -> int:
    """This process's minor page faults so far (pages the kernel had to map and zero on first touch)."""
    import resource  # POSIX only: imported where it is used, so the module imports on every platform

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
