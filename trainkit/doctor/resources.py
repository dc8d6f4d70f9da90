"""Node resources a run consumes: shared memory for DataLoader batches, file descriptors, disk
for checkpoints, and memory for the ranks (the memory plan against this machine). Each compares a measured amount with a stated estimate of the need."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..recipe.launch_plan import run_dir_for
from ..recipe.memory_plan import MemoryAdvice, MemoryPlan, fitting_changes, setting_of
from ..recipe.memory_mesh import mesh_alternatives
from ..recipe.model_facts import builds_seeded
from ..recipe.memory_plan import plan as plan_memory
from ..runtime import memory_limits
from ..run_dir import CHECKPOINT_PREFIX, CHECKPOINTS
from .check import Check, failed, human_bytes, passed, warned

SHM = "/dev/shm"
SHM_MACHINE_MIN = 1 << 30  # without a recipe: below 1 GiB (Docker's default is 64 MiB) DataLoader workers die
NOFILE_RECOMMENDED = 4096
DISK_FLOOR = 1 << 30  # the quick check, without a model to estimate from
OPTIMIZER_STATE = {"sgd": 1, "adam": 2, "adamw": 2}  # fp32 tensors per parameter (sgd: momentum buffer)


# --------------------------------------------------------------------------- shared memory
def sample_bytes(data) -> Optional[int]:
    """Bytes of one collated float32 sample plus its int64 label, from the data block's shape."""
    shape = data.sample_shape() or getattr(data, "shape", None)  # a plugin's own `shape` field counts too
    return math.prod(shape) * 4 + 8 if shape else None


def shm_need(recipe, nproc: Optional[int] = None) -> Optional[tuple[int, str]]:
    """Shared memory the node's DataLoader workers hold (batches in flight), and how it was found:
    ranks x workers x prefetch x batch x sample bytes; 0 without workers, None where the sample size
    is unknown. `nproc`: ranks on the node (default launch.nproc_per_node)."""
    d, nproc = recipe.data, nproc or recipe.launch.nproc_per_node
    if d.num_workers == 0:
        return 0, "data.num_workers 0: batches do not use shared memory"
    per_sample = sample_bytes(d)
    if per_sample is None:
        return None
    prefetch = d.prefetch_factor or 2
    need = nproc * d.num_workers * prefetch * d.batch_size * per_sample
    return need, (f"{human_bytes(need)} = {nproc} rank(s) x {d.num_workers} worker(s) x prefetch {prefetch} "
                  f"x batch {d.batch_size} x {human_bytes(per_sample)}/sample")


def shm(resolved) -> Check:
    name = "/dev/shm"
    if not os.path.isdir(SHM):
        return warned(name, f"{SHM} does not exist: DataLoader workers pass batches through shared memory",
                      "use data.num_workers: 0, or mount a tmpfs on /dev/shm")
    free = shutil.disk_usage(SHM).free
    docker = "docker run --shm-size=<size> (or --ipc=host)"
    if resolved is None:
        if free < SHM_MACHINE_MIN:
            return warned(name, f"{human_bytes(free)} free: too little for DataLoader workers",
                          f"{docker}, e.g. --shm-size=8g")
        return passed(name, f"{human_bytes(free)} free")
    d = resolved.recipe.data
    if d.num_workers == 0:
        return passed(name, f"{human_bytes(free)} free; data.num_workers 0: batches do not use shared memory")
    estimate = shm_need(resolved.recipe)
    if estimate is None:
        return passed(name, f"{human_bytes(free)} free (sample size of data '{d.name}' unknown: no estimate)")
    need, how = estimate
    how = f"estimate {how}"
    if free < need:
        size = max(1, math.ceil(2 * need / (1 << 30)))
        return failed(name, f"{human_bytes(free)} free < {how}",
                      f"{docker.replace('<size>', f'{size}g')}, or lower data.num_workers / prefetch_factor / batch_size")
    if free < 2 * need:
        return warned(name, f"{human_bytes(free)} free, under twice the {how}",
                      "give /dev/shm more room (docker --shm-size) or lower data.num_workers")
    return passed(name, f"{human_bytes(free)} free >= {how}")


# --------------------------------------------------------------------------- file descriptors
def fd_need(resolved) -> tuple[int, str]:
    """A rough per-node need: each rank ~64 (libraries, logs) + 4 sockets per peer, and each
    DataLoader worker ~16 + 2 shared-memory handles per batch in flight; the agent ~64."""
    r = resolved.recipe
    nproc, world = r.launch.nproc_per_node, r.world_size or r.launch.nproc_per_node
    workers, prefetch = r.data.num_workers, r.data.prefetch_factor or 2
    per_rank = 64 + 4 * world + workers * (16 + 2 * prefetch)
    return 64 + nproc * per_rank, f"{nproc} rank(s) x (64 + 4 x {world} peers + {workers} worker(s) x {16 + 2 * prefetch})"


def open_files(resolved) -> Check:
    import resource

    name = "open files"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
    if resolved is None:
        need, how = NOFILE_RECOMMENDED, "recommended minimum"
    else:
        need, how = fd_need(resolved)
        how = f"estimated need {need} = 64 + {how}"
    if soft == resource.RLIM_INFINITY or soft >= need:
        return passed(name, f"ulimit -n {limit} (hard {hard if hard != resource.RLIM_INFINITY else 'unlimited'}) "
                      f">= {how}" if resolved else f"ulimit -n {limit} >= {need} ({how})")
    target = max(need * 2, NOFILE_RECOMMENDED)
    if hard == resource.RLIM_INFINITY or hard >= target:
        fix = f"ulimit -n {target} in the shell that launches"
    else:
        fix = (f"raise the hard limit ({hard}): nofile in /etc/security/limits.conf, LimitNOFILE= for systemd, "
               f"or docker --ulimit nofile={target}:{target}")
    check = warned if resolved is None else failed
    return check(name, f"ulimit -n {limit} < {how}", fix)


# --------------------------------------------------------------------------- disk
def _existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def parameter_count(spec) -> int:
    """Parameters + buffers of the recipe's model, built on the meta device (no memory, ~ms)."""
    import torch

    from ..runtime.model import factory

    with torch.device("meta"):
        model = factory(spec.name)(**spec.args)
    return sum(t.numel() for t in model.state_dict().values())


def checkpoint_estimate(recipe) -> tuple[int, str]:
    """Peak bytes of checkpoints: `keep` + the one being written, each fp32 weights + optimizer state."""
    params = parameter_count(recipe.model)
    state = OPTIMIZER_STATE.get(recipe.optimizer.name, 2)
    if recipe.optimizer.name == "sgd" and not recipe.optimizer.momentum:
        state = 0
    copies = recipe.trainer.checkpoint.keep + 1
    need = params * 4 * (1 + state) * copies
    return need, (f"estimate {human_bytes(need)} = {params:,} params x 4 B x (1 + {state} {recipe.optimizer.name} "
                  f"state) x {copies} checkpoints (keep {copies - 1} + 1 being written)")


def _previous_checkpoint(run_dir: Path) -> int:
    folders = sorted((run_dir / CHECKPOINTS).glob(CHECKPOINT_PREFIX + "*"))
    if not folders:
        return 0
    return sum(f.stat().st_size for f in folders[-1].rglob("*") if f.is_file())


def _disk(resolved, quick: bool) -> Check:
    name = "disk"
    if resolved is None:
        run_dir = Path("runs")
    else:
        run_dir = run_dir_for(resolved.recipe)
    base = _existing(run_dir)
    setting = "launch.run_dir" + (f" ({resolved.locate(('launch', 'run_dir'))})" if resolved else "")
    if not os.access(base, os.W_OK | os.X_OK):
        return failed(name, f"cannot create {run_dir}: {base} is not writable", f"set {setting} to a writable folder")
    free = shutil.disk_usage(base).free
    if resolved is None or quick:
        previous = _previous_checkpoint(run_dir) if resolved else 0
        if previous:
            need = previous * (resolved.recipe.trainer.checkpoint.keep + 1)
            how = f"estimate {human_bytes(need)} = last checkpoint {human_bytes(previous)} x (keep + 1)"
        else:
            need, how = DISK_FLOOR, "a 1 GiB floor (`trainkit doctor RECIPE` estimates from the model)"
            if resolved is not None:
                try:  # the model on the meta device: milliseconds, and a real figure to refuse on
                    need, how = checkpoint_estimate(resolved.recipe)
                except Exception:  # a model that does not build is reported by the preflight checks
                    pass
    else:
        try:
            need, how = checkpoint_estimate(resolved.recipe)
        except Exception as exc:  # a model that does not build is reported by `validate --deep`
            return warned(name, f"{human_bytes(free)} free at {base}; no estimate: the model does not build on "
                          f"the meta device ({type(exc).__name__}: {exc})", "trainkit validate --deep RECIPE")
    detail = f"{human_bytes(free)} free at {base}"
    fix = f"free space there, lower trainer.checkpoint.keep, or set {setting} to a bigger disk"
    if free < need:
        return (warned if need == DISK_FLOOR else failed)(name, f"{detail} < {how}", fix)
    if free < 2 * need and need != DISK_FLOOR:
        return warned(name, f"{detail}, under twice the {how}", fix)
    return passed(name, f"{detail} >= {how}")


def disk(resolved) -> Check:
    return _disk(resolved, quick=False)


def disk_quick(resolved) -> Check:
    return _disk(resolved, quick=True)


# --------------------------------------------------------------------------- memory
HEADROOM = 0.8  # a plan above this share of the memory it may use is a warning (the estimate is +-25%)


@dataclass(frozen=True)
class MemoryVerdict:
    """The recipe's memory plan against this machine, and the changes that would make it fit."""

    plan: MemoryPlan
    budget: int  # bytes one rank may use
    budget_how: str
    advice: list[MemoryAdvice]

    @property
    def fits(self) -> bool:
        return self.plan.per_rank <= self.budget

    def advice_lines(self) -> list[str]:
        return [f"  {a.text}" for a in self.advice]


def cuda_budget(nproc: int) -> tuple[int, str]:
    """The GPU memory a rank may use, and how it was found ("X free of Y on NAME"): what is free at
    launch on the GPUs this node's ranks take (one each, cuda:0 .. cuda:nproc-1), the least of them,
    since another process (or a rank of an earlier job still exiting) may hold part of a device.

    Free is the device's total less what NVML says is used (`torch.cuda.device_memory_used`): that
    creates no CUDA context in the launcher, which would hold one for the whole run once made
    (hundreds of MiB of every GPU it touched, and on a GPU in exclusive-process mode the rank could
    not start). Where NVML cannot speak for the device alone (no NVML; a MIG instance, which NVML
    cannot map from CUDA_VISIBLE_DEVICES; a GPU in MIG mode, whose NVML figures are every tenant's),
    `torch.cuda.mem_get_info` (cudaMemGetInfo) answers in a short-lived process of its own, whose
    context goes with it."""
    import torch

    count = max(1, min(nproc, torch.cuda.device_count()))
    totals = [torch.cuda.get_device_properties(i).total_memory for i in range(count)]
    used = [_nvml_used(i) for i in range(count)]
    readable = [u is not None and 0 <= u <= t for u, t in zip(used, totals)]  # above the total: another device
    asked = mem_get_info_in_a_process_of_its_own([i for i in range(count) if not readable[i]]) \
        if not all(readable) else {}
    readings = [(totals[i] - used[i] if readable[i] else asked.get(i, (None,))[0], totals[i], i) for i in range(count)]
    free, total, index = min(readings, key=lambda r: (r[1] if r[0] is None else r[0], r[2]))
    if free is None:  # neither NVML nor cudaMemGetInfo could say: the device's total, said as such
        return total, f"{human_bytes(total)} on {torch.cuda.get_device_name(index)} (free memory unknown)"
    where = f" (cuda:{index}, the least free of the {count} this node's ranks take)" if count > 1 else ""
    return free, f"{human_bytes(free)} free of {human_bytes(total)} on {torch.cuda.get_device_name(index)}{where}"


def _nvml_used(index: int) -> Optional[int]:
    """NVML's used bytes of CUDA device `index`, or None where NVML cannot speak for it alone."""
    import torch

    try:
        used = torch.cuda.device_memory_used(index)
    except Exception:  # no NVML (nvidia-ml-py, the driver's library), or a device it cannot map (MIG)
        return None
    return None if _in_mig_mode(index) else used


def _in_mig_mode(index: int) -> bool:
    """Whether the GPU NVML maps CUDA device `index` to is split into MIG instances: then its used
    memory is every instance's, and the device this process sees is one of them."""
    try:
        import pynvml
        import torch

        # torch's own CUDA-ordinal -> NVML-index map (CUDA_VISIBLE_DEVICES, UUIDs), the one its public
        # device_memory_used uses; no public function exposes it
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(index))
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
        return current == pynvml.NVML_DEVICE_MIG_ENABLE
    except Exception:  # NVML_ERROR_NOT_SUPPORTED: a GPU without MIG
        return False


MEM_GET_INFO = ("import sys, torch\nfor i in sys.argv[1:]:\n    try:\n        print(i, *torch.cuda.mem_get_info(int(i)))\n"
                "    except Exception:\n        pass")
MEM_GET_INFO_TIMEOUT_S = 120


def mem_get_info_in_a_process_of_its_own(indices) -> dict[int, tuple[int, int]]:
    """cudaMemGetInfo's (free, total) for each CUDA device of `indices`, asked by one child process (the
    same CUDA_VISIBLE_DEVICES), so that the CUDA contexts it makes end with it; a device it cannot read
    is left out."""
    try:
        done = subprocess.run([sys.executable, "-c", MEM_GET_INFO, *map(str, indices)], capture_output=True,
                              text=True, timeout=MEM_GET_INFO_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return {}
    answers = {}
    for line in done.stdout.splitlines():
        try:
            index, free, total = (int(x) for x in line.split())
        except ValueError:
            continue
        answers[index] = (free, total)
    return answers


def memory_verdict(recipe) -> Optional[MemoryVerdict]:
    """The plan for this machine: one rank's share of host memory on the CPU (every rank of the node
    shares it; cgroup limits included), on CUDA the GPU memory free at launch (`cuda_budget`). None
    where the model does not build on the meta device or the device is not decided (preflight reports
    both)."""
    import torch

    from ..runtime.accelerator import AcceleratorError, accelerator_for
    from ..runtime.memory_trace import model_sizes

    try:
        device_type = accelerator_for(recipe, cuda_available=torch.cuda.is_available()).device_type
        sizes = model_sizes(recipe)
    except (AcceleratorError, Exception):
        return None
    setting = setting_of(recipe, device_type)
    planned = plan_memory(sizes, setting)
    nproc = recipe.launch.nproc_per_node
    host = memory_limits.limit()
    if device_type == "cpu":
        budget = host.available // nproc
        how = f"{human_bytes(host.available)} available ({host.source}) / {nproc} rank(s) on this host"
    else:
        budget, how = cuda_budget(nproc)
    advice = fitting_changes(sizes, setting, budget) + [  # mesh changes only where the matrix verifies them
        a for a in mesh_alternatives(recipe, sizes, setting, budget) if a.plan.per_rank < planned.per_rank]
    return MemoryVerdict(planned, budget, how, sorted(advice, key=lambda a: (not a.fits, a.plan.per_rank)))


# A CUDA rank's own process on the host: torch, and the CUDA driver's, runtime's and math libraries'
# host allocations and code. An upper estimate, not measured here (no GPU): a CPU rank's process is 560
# MiB (memory_plan.RUNTIME_BYTES), and CUDA's libraries add their mapped code (cuBLAS, cuDNN: hundreds of
# MiB each, loaded lazily) and the context's pinned staging. The GPU tier checks it
# (tests/test_gpu.py, test_a_cuda_ranks_host_memory_is_within_the_figure_jobs_ask_for).
CUDA_PROCESS_HOST_BYTES = 2 << 30


def host_memory_per_rank(recipe, device_type: str) -> Optional[tuple[int, str]]:
    """Host memory one rank of this recipe holds at its peak, from the memory plan, and how: on the CPU
    the plan's whole figure; on a GPU the plan's host parts (offloaded state, a staged checkpoint, the
    pipeline's whole-model build) plus the rank's process itself (the plan counts its CUDA context on
    the device; on the host it is `CUDA_PROCESS_HOST_BYTES`) plus, where the
    rank builds the whole model on the host before moving it (`model.init` constructor), its fp32
    copy. None where the model does not build on the meta device."""
    from ..runtime.memory_trace import model_sizes

    try:
        sizes = model_sizes(recipe)
        planned = plan_memory(sizes, setting_of(recipe, device_type))
    except Exception:  # preflight reports a model that does not build, or a mesh the ranks do not make
        return None
    if device_type == "cpu":
        return planned.per_rank, "the memory plan's figure per rank"
    parts = [("the plan's host parts", planned.total("host")), ("the process with CUDA", CUDA_PROCESS_HOST_BYTES)]
    built_on_host = not _built_sharded(recipe) and not any(p.name == "whole model at build" for p in planned.parts)
    if built_on_host:
        parts.append(("the model built on the host", sizes.parameters * 4))
    need = sum(n for _, n in parts)
    return need, " + ".join(f"{what} {human_bytes(n)}" for what, n in parts)


def _built_sharded(recipe) -> bool:
    """Whether ranks build the model on the meta device and fill only their part (`model.init` seeded,
    or auto under a strategy that shards parameters; a weights file is then read into the shards), not
    whole on the host."""
    return builds_seeded(recipe.model, recipe.strategy.capabilities().shards_parameters)


def memory(resolved) -> Optional[Check]:
    name = "memory"
    if resolved is None:
        host = memory_limits.limit()
        return passed(name, f"{human_bytes(host.available)} available ({host.source}); "
                            f"`trainkit doctor RECIPE` predicts a run's need")
    verdict = memory_verdict(resolved.recipe)
    if verdict is None:
        return None
    need = verdict.plan.per_rank
    detail = f"predicted {human_bytes(need)} per rank (trainkit plan shows the parts) vs {human_bytes(verdict.budget)} " \
             f"per rank = {verdict.budget_how}"
    fits = [a for a in verdict.advice if a.fits]
    fix = ("; ".join(a.text for a in (fits or verdict.advice)) or "a machine with more memory") \
        + " (docs/memory.md)"
    host_need = verdict.plan.total("host") * resolved.recipe.launch.nproc_per_node
    if verdict.plan.setting.device_type != "cpu" and host_need > memory_limits.limit().available:
        host = memory_limits.limit()
        return failed(name, f"host memory will not fit: {human_bytes(host_need)} on the host for "
                            f"{resolved.recipe.launch.nproc_per_node} rank(s) (offloaded state, the runtime) > "
                            f"{human_bytes(host.available)} available ({host.source})",
                      "offload less (strategy.offload_optimizer / offload_param / cpu_offload), or fewer ranks "
                      "per node (docs/memory.md)")
    nccl = sum(p.bytes for p in verdict.plan.parts if p.name == "NCCL buffers")
    if need > verdict.budget >= need - nccl:  # only NCCL's upper estimate (an NVSwitch node's) tips it over
        return warned(name, f"may not fit: {detail}; it fits without the plan's NCCL buffers "
                            f"({human_bytes(nccl)}), an upper estimate for an NVSwitch node of H100/H200 class -- "
                            f"far less on PCIe (docs/memory.md, \"NCCL's buffers\")",
                      f"to leave room: {fix}; or fewer channels (NCCL_MAX_NCHANNELS), no NVLS (NCCL_NVLS_ENABLE=0)")
    if need > verdict.budget:
        return failed(name, f"will not fit: {detail}", f"changes that would fit: {fix}" if fits else
                      f"nothing single fits; closest: {fix}")
    if need > HEADROOM * verdict.budget:
        return warned(name, f"tight (the estimate is +-25%): {detail}", f"to leave room: {fix}")
    return passed(name, detail)
