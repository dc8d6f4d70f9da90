"""What a written job asks the scheduler for on each node (a pod, a SLURM node), by stated rules.

- CPUs: one per rank and one per DataLoader worker, `nproc_per_node x (1 + data.num_workers)`.
- /dev/shm: twice the DataLoader's shared memory (ranks x workers x prefetch x batch x sample bytes,
  the doctor's `/dev/shm` estimate, which warns under twice it), in whole GiB, at least 1 GiB (NCCL's
  intra-node transport uses it too).
- Memory: `MEMORY_HEADROOM` x (ranks x the memory plan's host memory per rank + ranks x workers x
  `LOADER_WORKER_BYTES` + the launcher's process + /dev/shm), in whole GiB, as request and limit (a
  Slurm job's `--mem`). A memory-backed /dev/shm counts against the pod's memory limit, so it is inside
  the figure. Without a plan (a model that does not build on the meta device) each rank counts
  `DEFAULT_HOST_PER_RANK`, and the job's notes say so.
- RDMA: extended resources (`rdma/hca_shared_devices_a=1`) requested and limited as given, with the
  IPC_LOCK capability (pinning memory for the HCA).

The host memory per rank and the shared-memory need come from the caller (the memory plan and the
doctor's estimate need torch, which this layer does not import).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..recipe.memory_plan import RUNTIME_BYTES

MiB = 1 << 20
GiB = 1 << 30
SHM_MIN = GiB
MEMORY_HEADROOM = 1.25  # the plan is within about 25% (docs/memory.md)
LAUNCHER_BYTES = RUNTIME_BYTES["cpu"]  # `trainkit run` and torchrun's agent: one process with torch imported
DEFAULT_HOST_PER_RANK = 4 * GiB  # a rank's host memory when the plan cannot say
# A DataLoader worker's own memory: the pages it does not share with its rank. A forked worker shares
# the rank's heap until it writes to it, and Python writes to every object it touches (reference
# counts) and the garbage collector to every container's header, so over a long run a worker copies
# what its collections touch. Measured (bench/loader_worker_memory.py, torch 2.14.1, ImageFolder,
# 400-px JPEGs, batch 64, 224-px crops): 126-156 MiB of its own per worker after full collections,
# 35-98 MiB without. The batches it has ready are in /dev/shm, counted there; the dataset's index is
# packed (runtime/packed_samples.py) so that it is not copied into each worker.
LOADER_WORKER_BYTES = 256 * MiB
IPC_LOCK = "IPC_LOCK"
# an extended resource: a domain-prefixed name outside kubernetes.io (Kubernetes' qualified-name rule)
_RESOURCE = re.compile(r"(?P<prefix>[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)/"
                       r"(?P<name>[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)")

# a device plugin's GPUs: nvidia.com/gpu, amd.com/gpu, MIG slices (nvidia.com/mig-1g.10gb)
_GPU_RESOURCE = re.compile(r"[^/]+/(gpu|mig-.+)")


def cpus_per_node(nproc: int, num_workers: int) -> int:
    """One CPU per rank and one per DataLoader worker of each rank (at least one per rank)."""
    return max(1, nproc) * (1 + max(0, num_workers or 0))


def shm_size(need: Optional[int]) -> int:
    """/dev/shm for the node: twice the DataLoader's need in whole GiB, at least `SHM_MIN`."""
    return max(SHM_MIN, _whole_gib(2 * need)) if need else SHM_MIN


def memory_size(nproc: int, host_per_rank: int, shm: int, workers: int = 0) -> int:
    """The node's memory: `MEMORY_HEADROOM` x (ranks' host memory + their DataLoader workers' + the
    launcher + /dev/shm), whole GiB."""
    loaders = nproc * max(0, workers) * LOADER_WORKER_BYTES
    return _whole_gib(MEMORY_HEADROOM * (nproc * host_per_rank + loaders + LAUNCHER_BYTES + shm))


def _whole_gib(n: float) -> int:
    return max(1, math.ceil(n / GiB)) * GiB


def quantity(n: int) -> str:
    """Bytes as a Kubernetes quantity (whole GiB here: "5Gi")."""
    return f"{n // GiB}Gi" if n % GiB == 0 else str(n)


def parse_rdma(values: Sequence[str], error: type[Exception]) -> dict[str, int]:
    """`--rdma-resource NAME[=COUNT]` values as {resource: count} (COUNT 1 when left out); `error` for a
    name Kubernetes would reject as an extended resource or a count that is not a positive integer."""
    out: dict[str, int] = {}
    for value in values:
        name, _, count = value.partition("=")
        m = _RESOURCE.fullmatch(name)
        if not m or len(m["prefix"]) > 253 or len(m["name"]) > 63 or m["prefix"].endswith("kubernetes.io"):
            raise error(f"--rdma-resource {value!r}: the name must be an extended resource, DOMAIN/NAME outside "
                        f"kubernetes.io, as the device plugin advertises it (e.g. rdma/hca_shared_devices_a=1, "
                        f"nvidia.com/hostdev=1)")
        if _GPU_RESOURCE.fullmatch(name):
            raise error(f"--rdma-resource {value!r} names a GPU resource: the pod's GPUs come from --gpus-per-node "
                        f"(a second, different count would make the pod's request and limit disagree, which "
                        f"Kubernetes rejects)")
        if count and not (count.isdigit() and int(count) > 0):
            raise error(f"--rdma-resource {value!r}: the count must be a positive integer")
        out[name] = int(count) if count else 1
    return out


@dataclass(frozen=True)
class NodeResources:
    """One node's (pod's) requests: CPUs, memory (request and limit), /dev/shm's size, RDMA devices."""

    cpus: int
    memory: int
    shm: int
    rdma: dict[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    how: str = ""

    def requirements(self, gpus: int) -> dict:
        """A container's `resources` (Kubernetes ResourceRequirements)."""
        requests: dict = {"cpu": self.cpus, "memory": quantity(self.memory), **self.rdma}
        limits: dict = {"memory": quantity(self.memory), **self.rdma}
        if gpus:
            limits["nvidia.com/gpu"] = gpus
        return {"requests": requests, "limits": limits}

    def security_context(self) -> Optional[dict]:
        """The container's securityContext: IPC_LOCK with RDMA devices, else none."""
        return {"capabilities": {"add": [IPC_LOCK]}} if self.rdma else None


def node_resources(recipe, nproc: int, *, host_per_rank: Optional[int], shm_need: Optional[int],
                   rdma: Optional[dict[str, int]] = None, host_how: str = "the memory plan") -> NodeResources:
    """The node's requests for `nproc` ranks of `recipe` (the rules in the module's docstring).

    Args:
        host_per_rank: host memory per rank, from `host_how` (None: `DEFAULT_HOST_PER_RANK`).
        shm_need: the DataLoader's shared memory on the node (None: unknown, the 1 GiB minimum).
    """
    notes = []
    if host_per_rank is None:
        host_per_rank, host_how = DEFAULT_HOST_PER_RANK, "a default: no memory plan"
        notes.append(f"the memory plan did not size this model (`trainkit plan` says why, e.g. a model that does "
                     f"not build on the meta device): each rank counts {DEFAULT_HOST_PER_RANK // GiB} GiB of host "
                     f"memory; edit the memory request and limit if it needs more")
    if shm_need is None and recipe.data.num_workers:
        notes.append(f"the sample size of data '{recipe.data.name}' is unknown: /dev/shm gets the "
                     f"{SHM_MIN // GiB} GiB minimum; raise its sizeLimit if the DataLoader workers need more")
    workers = recipe.data.num_workers or 0
    cpus, shm = cpus_per_node(nproc, workers), shm_size(shm_need)
    memory = memory_size(nproc, host_per_rank, shm, workers)
    loaders = f"{nproc * workers} DataLoader worker(s) x {_gib(LOADER_WORKER_BYTES)} + " if workers else ""
    how = (f"each node asks for cpu {cpus} = {nproc} rank(s) x (1 + {workers} DataLoader worker(s)); memory "
           f"{quantity(memory)} = {MEMORY_HEADROOM} x ({nproc} rank(s) x {_gib(host_per_rank)} ({host_how}) + "
           f"{loaders}{_gib(LAUNCHER_BYTES)} launcher + {_gib(shm)} /dev/shm); /dev/shm {quantity(shm)} (twice the "
           f"DataLoader's {_gib(shm_need or 0)}, at least {quantity(SHM_MIN)})"
           + (f"; {', '.join(f'{k}: {v}' for k, v in (rdma or {}).items())} with {IPC_LOCK}" if rdma else ""))
    return NodeResources(cpus, memory, shm, dict(rdma or {}), tuple(notes), how)


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB // 4 else f"{n / (1 << 20):.1f} MiB"
