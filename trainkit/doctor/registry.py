"""The list of checks, which of them `trainkit run` repeats, and the runner.

`quick` is the variant `trainkit run` runs before every launch: a few milliseconds in all, no model
build, no network wait. Checks that preflight already makes for `run` (data layout, CUDA for
nccl/fp16) are doctor-only so a launch never reports a problem twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from . import cluster, data, devices, network, resources, versions, workers
from .check import Check

CheckFn = Callable[[object], Optional[Check]]


@dataclass(frozen=True)
class Entry:
    name: str
    run: CheckFn
    quick: Optional[CheckFn] = None  # the variant `trainkit run` uses; None: doctor only


CHECKS: list[Entry] = [
    Entry("torch", versions.torch_version),
    Entry("CUDA", versions.cuda),
    Entry("NCCL", versions.nccl),
    Entry("DeepSpeed", versions.deepspeed),
    Entry("GPUs", devices.gpus, devices.gpus),
    Entry("cluster", cluster.environment),  # `trainkit run` reports the same detection itself
    Entry("master port", network.master_port, network.master_port),
    Entry("monitor ports", network.monitor_ports, network.monitor_ports),
    Entry("rendezvous", network.rendezvous),  # may wait CONNECT_TIMEOUT_S; nodes start in any order
    Entry("socket ifname", network.socket_ifname, network.socket_ifname),
    Entry("/dev/shm", resources.shm, resources.shm),
    Entry("open files", resources.open_files, resources.open_files),
    Entry("data workers", workers.data_workers),
    Entry("disk", resources.disk, resources.disk_quick),
    Entry("memory", resources.memory, resources.memory),  # the memory plan: milliseconds on the meta device
    Entry("data root", data.data_root),
]


def run_checks(resolved=None, fast_only: bool = False) -> list[Check]:
    """Every applicable check, in table order. A check that crashes becomes a warn row: the doctor
    must report on a broken machine, not die on it."""
    out: list[Check] = []
    resolved = cluster.applied(resolved)  # a PyTorchJob pod or SLURM step decides the rendezvous: check that one
    for entry in CHECKS:
        fn = entry.quick if fast_only else entry.run
        if fn is None:
            continue
        try:
            check = fn(resolved)
        except Exception as exc:
            check = Check(entry.name, "warn", f"the check itself failed: {type(exc).__name__}: {exc}",
                          "please report this with `trainkit doctor --format json` output")
        if check is not None:
            out.append(check)
    return out
