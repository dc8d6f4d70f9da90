"""Test-only fault injection for `trainkit run` workers. Never part of a real run: trainkit itself
knows nothing of it.

A test asks for faults by passing TRAINKIT_FAULT_* variables to `run_helpers.trainkit`; `env` then
puts tests/fault_hooks/ (and tests/) on the run's PYTHONPATH. Its `sitecustomize.py`, which Python
runs at start-up in every process of the run, calls `attach_on_import`: once `trainkit.runtime.loop`
is imported, every `Loop` installs the faults below on its model when it starts running, and appends
their per-step callbacks to its documented `step_hooks` (called after each optimizer step, after that
step's logging and checkpoint). Every variable starts with TRAINKIT_FAULT_ (`owns`), so one test's
faults never leak into another's run.

- TRAINKIT_FAULT_INJECT="rank=1,step=7": that rank `os._exit(1)`s right after that optimizer step,
  on the first attempt only (TORCHELASTIC_RESTART_COUNT == 0), so tests can check that torchrun
  restarts and that resume loses nothing. ",saved=wait": first wait (up to 120 s, else fail loudly) for
  this rank's checkpoint writes still running in the background (`async_save`): its part of the last
  save is written before the crash, and rank 0, alive, seals it (without it, a crash may lose the save
  in flight, as it should, and the restart begins elsewhere).
- TRAINKIT_FAULT_DELAY="rank=1,ms=40": that rank sleeps before every forward (a straggler).
- TRAINKIT_FAULT_HANG="rank=1,step=4,where=backward,how=sleep": that rank stops making progress in that
  optimizer step, in its forward (where=forward) or its backward (where=backward, a gradient hook), by
  sleeping for an hour (how=sleep) or by sending itself SIGSTOP (how=stop); on every attempt.
  where=data: that rank's DataLoader worker sleeps for an hour in the dataset's __getitem__ of the
  first sample of that step's batch (needs data.num_workers 1 and grad_accum_steps 1).
- TRAINKIT_FAULT_DESYNC="rank=1,step=6,how=skip|shape": in that optimizer step that rank's first DDP
  gradient all-reduce is skipped (how=skip: the bucket is left local, no collective) or all-reduces
  one element fewer (how=shape); on every attempt.
- TRAINKIT_FAULT_NAN="rank=1,step=5": that rank's forward output is NaN during that step
  (",where=input": its input is +inf instead, so a BatchNorm sees it).
- TRAINKIT_FAULT_RECORD_SAMPLES=DIR: every rank records a hash of each training sample it sees.
- TRAINKIT_FAULT_COUNT_COLLECTIVES=DIR: count gradient reductions (DDP: comm-hook calls, through a
  counting all-reduce hook; FSDP2: `dist.reduce_scatter_single` calls) and append one line per
  optimizer step to DIR/collectives-rank<R>.jsonl: {"step", "calls", "rounds", "all_gather_bytes"}
  (rounds: DDP calls for bucket 0, i.e. how many times the gradients were all-reduced;
  all_gather_bytes: what this rank sent into FSDP2's parameter all-gathers, `dist.all_gather_single`).
- TRAINKIT_FAULT_PROBE_FSDP=DIR: for every FSDP unit below the root, record per optimizer step how
  many times its forward ran in training (activation checkpointing reruns it in backward), the
  dtype of its output, its parameters' device and its offload policy, as lines of
  DIR/fsdp-rank<R>.jsonl.
- TRAINKIT_FAULT_PROBE_PERF=DIR: the performance options in effect, per optimizer step, as lines of
  DIR/perf-rank<R>.jsonl: forwards per module of the classes in TRAINKIT_FAULT_PROBE_BLOCKS (counted on
  entry, so recomputations in backward count too), BatchNorm / SyncBatchNorm layers, memory format of
  the 4-D parameters and of the first 4-D module input, and torch._dynamo's compile counters.
- TRAINKIT_FAULT_COLLECTIVE_LATENCY="ms=0.5": every DDP gradient all-reduce call pays a fixed delay
  before it is issued, on every rank: a network's per-message cost, which gloo on one host lacks
  (there, many small buckets cost no more than a few big ones; on a real link each one pays it).
- TRAINKIT_FAULT_SLOW_LINK="ms=4": a slow network link, on every rank: each DDP gradient all-reduce,
  once gloo has finished it, holds one shared link for that long before its future completes, and the
  next one queues behind it. Backward is not blocked (the collective is in flight meanwhile), so a
  step with many buckets waits for the queue after backward: exposed communication, which gloo on
  one host barely has.
- TRAINKIT_FAULT_DIVERGE="rank=1,step=6,what=param|buffer": after that optimizer step (after its
  checkpoint) that rank alone adds 1e-3 to its first parameter's local tensor (param), or gets a
  buffer the other ranks hold with another value (buffer: like unsynchronised BatchNorm statistics).
- TRAINKIT_FAULT_SLOW_CHECKPOINT="step=4,s=600,marks=DIR": every rank's checkpoint write of that step
  sleeps (tests/fault_checkpoint_write.py).
- TRAINKIT_FAULT_HEARTBEAT="s=2": the launch lock's heartbeat (trainkit.launch.lock, 10 s) and the
  silence its ranks wait for (runtime.parent_watch, 3 beats) on a faster clock, in every process of
  the run, so a test of the silence rule waits 6 s instead of 30.
- TRAINKIT_FAULT_STOP_GRACE="s=5": on a stop, a background checkpoint write gets 5 s to finish
  (runtime.checkpoint STOP_SAVE_WAIT_S, 20 s) before the rank leaves it.
- TRAINKIT_FAULT_PROBE_MEMORY=DIR: each rank writes DIR/memory-rank<R>.json as it leaves (`os._exit`,
  after the end-of-run checks): {"baseline": VmRSS once torch, trainkit's loop, FSDP, DCP and (with
  DS_ACCELERATOR set) DeepSpeed are imported, before the process group, model or data exist;
  "after_step_2": VmHWM after the second optimizer step (build, setup and two steps: the optimizer's
  state is filled in); "peak": VmHWM as it exits, the resident high-water mark over its whole life}, in bytes.
- TRAINKIT_FAULT_PROBE_GPU_MEMORY=DIR: after every optimizer step each rank rewrites DIR/gpu-rank<R>.json:
  {"step", "reserved": torch's caching allocator's reserved bytes, "device_used": its GPU's used bytes
  (cudaMemGetInfo: total - free), "process_used": what nvidia-smi lists for this process's pid, or null
  where it does not list it (a container's pid namespace)}, in bytes; what the process holds outside
  torch's allocator (the CUDA context, NCCL's buffers) is used - reserved.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import queue
import sys
import threading
import time
from pathlib import Path

PREFIX = "TRAINKIT_FAULT_"
TESTS = Path(__file__).resolve().parent
HOOKS = TESTS / "fault_hooks"  # holds the sitecustomize.py that calls attach_on_import
LOOP_MODULE = "trainkit.runtime.loop"


def owns(key: str) -> bool:
    """Whether an environment variable belongs to the fault injection (a test sets it for one run)."""
    return key.startswith(PREFIX)


def env(environ: dict) -> dict:
    """`environ` for a `trainkit` subprocess: with the hooks on PYTHONPATH if it asks for any fault."""
    if not any(owns(key) for key in environ):
        return environ
    paths = (str(HOOKS), str(TESTS), environ.get("PYTHONPATH", ""))
    return {**environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def attach(loop_cls) -> None:
    """Make every `loop_cls` (trainkit's Loop) install the faults on its model as it starts running."""
    run = loop_cls.run

    def run_with_faults(self):
        self.step_hooks = [*self.step_hooks, *install(model=self.model, rank=self.strategy.rank)]
        install_loader_hang(loader=self.train_loader, rank=self.strategy.rank)
        return run(self)

    loop_cls.run = run_with_faults


class _AttachAfterImport(importlib.abc.MetaPathFinder):
    """Finds each module of `after` like the rest of sys.meta_path would, and calls its function on
    the module right after it runs: start-up imports nothing (no torch) in processes that never train
    (the launcher's helpers, compile workers)."""

    def __init__(self, after: dict):
        self.after = dict(after)

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.after:
            return None
        then = self.after.pop(fullname)  # once; and so that find_spec below asks the other finders
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            if self.after:
                sys.meta_path.insert(0, self)
        exec_module = spec.loader.exec_module

        def exec_and_attach(module):
            exec_module(module)
            then(module)

        spec.loader.exec_module = exec_and_attach
        return spec


def _attach_loop(module) -> None:
    attach(module.Loop)
    install_memory_probe()


def _shorter_stop_grace(module) -> None:
    """TRAINKIT_FAULT_STOP_GRACE="s=5": a stop gives a background checkpoint write 5 s, not 20."""
    module.STOP_SAVE_WAIT_S = float(_fields(os.environ["TRAINKIT_FAULT_STOP_GRACE"])["s"])


def _heartbeat_seconds() -> float:
    return float(_fields(os.environ["TRAINKIT_FAULT_HEARTBEAT"])["s"])


def _faster_lock(module) -> None:
    """TRAINKIT_FAULT_HEARTBEAT="s=2": the launcher beats every 2 s instead of 10 s ..."""
    module.HEARTBEAT_S = _heartbeat_seconds()


def _faster_silence(module) -> None:
    """... and its ranks take it as silent after 3 beats of that: the same rule on a faster clock."""
    module.LOCK_HEARTBEAT_S = _heartbeat_seconds()
    module.SILENT_AFTER_S = 3 * module.LOCK_HEARTBEAT_S


def attach_on_import() -> None:
    """Called by tests/fault_hooks/sitecustomize.py at the start of every process of a faulty run."""
    after = {LOOP_MODULE: _attach_loop}
    if os.environ.get("TRAINKIT_FAULT_STOP_GRACE"):
        after["trainkit.runtime.checkpoint"] = _shorter_stop_grace
    if os.environ.get("TRAINKIT_FAULT_HEARTBEAT"):
        after.update({"trainkit.launch.lock": _faster_lock, "trainkit.runtime.parent_watch": _faster_silence})
    sys.meta_path.insert(0, _AttachAfterImport(after))


def _fields(spec: str) -> dict:
    return dict(part.split("=", 1) for part in spec.split(",") if "=" in part)


def install(*, model, rank: int) -> list:
    """Install the faults the environment asks for on this rank; returns step hooks for the loop."""
    hooks = []
    spec = os.environ.get("TRAINKIT_FAULT_INJECT")
    if spec and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        fields = _fields(spec)
        if int(fields.get("rank", -1)) == rank:
            at = int(fields["step"])
            writes = _track_background_writes() if fields.get("saved") == "wait" else []

            def exit_at(step: int) -> None:
                if step == at:
                    for write in writes:
                        if not write.wait(120):
                            raise RuntimeError("TRAINKIT_FAULT_INJECT saved=wait: a background checkpoint write "
                                               "did not finish in 120 s")
                    print(f"trainkit: TRAINKIT_FAULT_INJECT: rank {rank} exits at step {step}", file=sys.stderr,
                          flush=True)
                    os._exit(1)

            hooks.append(exit_at)
    spec = os.environ.get("TRAINKIT_FAULT_DELAY")
    if spec and int(_fields(spec).get("rank", -1)) == rank:
        seconds = float(_fields(spec).get("ms", "50")) / 1000
        model.register_forward_pre_hook(lambda module, args: time.sleep(seconds))
    install_collective_latency(model)
    install_slow_link(model)
    from fault_checkpoint_write import install_slow_checkpoint_write  # tests/ is on the run's path

    install_slow_checkpoint_write(rank=rank)
    return (hooks + install_hang(model=model, rank=rank) + install_nan(model=model, rank=rank) + install_collective_count(model=model, rank=rank)
            + install_divergence(model=model, rank=rank) + install_desync(model=model, rank=rank) + install_fsdp_probe(model=model, rank=rank)
            + install_sample_recorder(model=model, rank=rank) + install_perf_probe(model=model, rank=rank)
            + install_memory_step_probe() + install_gpu_memory_probe(rank=rank))


def _track_background_writes() -> list:
    """The BackgroundWrite of every `async_save` this process starts, as they start."""
    from trainkit.runtime import checkpoint_async

    started, start = [], checkpoint_async.start

    def tracked_start(*args, **kwargs):
        started.append(start(*args, **kwargs))
        return started[-1]

    checkpoint_async.start = tracked_start
    return started


def install_hang(*, model, rank: int) -> list:
    """TRAINKIT_FAULT_HANG (see the module's docstring)."""
    spec = os.environ.get("TRAINKIT_FAULT_HANG")
    if not spec or int(_fields(spec).get("rank", -1)) != rank:
        return []
    import signal

    fields = _fields(spec)
    if fields.get("where") == "data":
        return []  # install_loader_hang
    at, current = int(fields["step"]), [1]

    def hang(*_) -> None:
        if current[0] != at:
            return
        print(f"trainkit: TRAINKIT_FAULT_HANG: rank {rank} hangs in step {at}", file=sys.stderr, flush=True)
        if fields.get("how", "sleep") == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            time.sleep(3600)

    def in_backward(module, args, output):
        if module.training and output.requires_grad:
            output.register_hook(hang)

    if fields.get("where", "backward") == "forward":
        model.register_forward_pre_hook(lambda module, args: hang() if module.training else None)
    else:
        model.register_forward_hook(in_backward)

    def advance(step: int) -> None:
        current[0] = step + 1

    return [advance]


def install_loader_hang(*, loader, rank: int) -> None:
    """TRAINKIT_FAULT_HANG with where=data (see the module's docstring): the dataset's class is patched
    before the loader forks its worker, which counts the samples it serves."""
    spec = os.environ.get("TRAINKIT_FAULT_HANG")
    fields = _fields(spec or "")
    if fields.get("where") != "data" or int(fields.get("rank", -1)) != rank:
        return
    from torch.utils.data import get_worker_info

    first = (int(fields["step"]) - 1) * loader.batch_size + 1  # the first sample of that step's batch
    cls, served = type(loader.dataset), [0]
    getitem = cls.__getitem__

    def hanging_getitem(self, index):
        if get_worker_info() is not None:
            served[0] += 1
            if served[0] == first:
                print(f"trainkit: TRAINKIT_FAULT_HANG: rank {rank}'s loader worker hangs in step {fields['step']}",
                      file=sys.stderr, flush=True)
                time.sleep(3600)
        return getitem(self, index)

    cls.__getitem__ = hanging_getitem


def install_desync(*, model, rank: int) -> list:
    """TRAINKIT_FAULT_DESYNC (see the module's docstring), through torch's `_allreduce_fut` as
    install_collective_latency does."""
    spec = os.environ.get("TRAINKIT_FAULT_DESYNC")
    if not spec or int(_fields(spec).get("rank", -1)) != rank:
        return []
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    fields = _fields(spec)
    at, current, done = int(fields["step"]), [1], [False]
    original = default_hooks._allreduce_fut

    def desync_allreduce_fut(process_group, tensor):
        if current[0] != at or done[0]:
            return original(process_group, tensor)
        done[0] = True
        print(f"trainkit: TRAINKIT_FAULT_DESYNC: rank {rank} {fields['how']} in step {at}", file=sys.stderr, flush=True)
        if fields["how"] == "skip":
            skipped = torch.futures.Future()
            skipped.set_result(tensor)
            return skipped
        return original(process_group, tensor[:-1]).then(lambda _: tensor)

    default_hooks._allreduce_fut = desync_allreduce_fut
    try:
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    except RuntimeError:  # a hook is registered already, and it calls _allreduce_fut
        pass

    def advance(step: int) -> None:
        current[0] = step + 1

    return [advance]


def count_class_forward(module, wrap) -> None:
    """Count where the forward and its recomputation both pass: the class's forward. Activation
    checkpointing replaces the instance's forward and recomputes through the class's (bypassing module
    hooks and the instance attribute), so MODULE gets a subclass of its own class (same name) whose
    forward runs `wrap(bound forward of the class)`."""
    import functools

    base = type(module)

    def forward(self, *args, **kwargs):
        return wrap(functools.partial(base.forward, self))(*args, **kwargs)

    module.__class__ = type(base.__name__, (base,), {"forward": forward})


def install_fsdp_probe(*, model, rank: int) -> list:
    folder = os.environ.get("TRAINKIT_FAULT_PROBE_FSDP")
    if not folder:
        return []
    import json

    from torch.distributed.fsdp import FSDPModule

    units = {name: m for name, m in model.named_modules() if isinstance(m, FSDPModule) and m is not model}
    forwards = {name: 0 for name in units}
    dtypes: dict = {}

    def counted(name, forward):
        def run(*args, **kwargs):
            # counted on entry: non-reentrant checkpointing stops a recomputation (early stop: an
            # exception raised inside the forward) as soon as the tensors backward needs exist, so
            # a recomputed forward never returns here
            if units[name].training:
                forwards[name] += 1
            output = forward(*args, **kwargs)
            if units[name].training:
                dtypes[name] = str(output.dtype)
            return output
        return run

    for name, m in units.items():
        count_class_forward(m, lambda forward, name=name: counted(name, forward))
    path = os.path.join(folder, f"fsdp-rank{rank}.jsonl")

    def record(step: int) -> None:
        facts = {name: {"forwards": forwards[name], "output_dtype": dtypes.get(name),
                        "param_devices": sorted({str(p.device) for p in m.parameters()}),
                        "offload_policy": type(m._get_fsdp_state()._fsdp_param_group.offload_policy).__name__}
                 for name, m in units.items()}
        with open(path, "a") as fh:
            fh.write(json.dumps({"step": step, "units": facts}) + "\n")
        forwards.update({name: 0 for name in units})

    return [record]


def install_divergence(*, model, rank: int) -> list:
    spec = os.environ.get("TRAINKIT_FAULT_DIVERGE")
    if not spec:
        return []
    import torch

    fields = _fields(spec)
    at, culprit, what = int(fields["step"]), int(fields["rank"]), fields.get("what", "param")

    def diverge(step: int) -> None:
        if step != at:
            return
        if what == "buffer":
            model.register_buffer("diverged_probe", torch.full((4,), float(rank == culprit)))
        elif rank == culprit:
            with torch.no_grad():
                p = next(model.parameters())
                (p.to_local() if hasattr(p, "to_local") else p).add_(1e-3)

    return [diverge]


def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(field + ":"))


MEMORY: dict = {}  # TRAINKIT_FAULT_PROBE_MEMORY's figures in this process


def install_gpu_memory_probe(*, rank: int) -> list:
    """TRAINKIT_FAULT_PROBE_GPU_MEMORY (see the module's docstring)."""
    folder = os.environ.get("TRAINKIT_FAULT_PROBE_GPU_MEMORY")
    if not folder:
        return []
    import json
    import subprocess

    import torch

    def process_used() -> "tuple[int | None, list[str]]":
        """This process's memory on its own GPU per nvidia-smi (one line per GPU and pid: matched by the
        GPU's UUID), and the other GPUs it holds a context on (a stray context is what the test catches)."""
        own_gpu = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        used, elsewhere = None, []
        if own_gpu.startswith("MIG"):  # nvidia-smi lists a MIG instance's processes under its parent GPU
            return used, elsewhere
        try:
            out = subprocess.run(["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,used_memory",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30).stdout
            for line in out.splitlines():
                gpu, pid, mib = (field.strip() for field in line.split(","))
                if pid != str(os.getpid()):
                    continue
                if gpu.removeprefix("GPU-") == own_gpu.removeprefix("GPU-"):
                    used = int(mib) * 2**20
                else:
                    elsewhere.append(gpu)
        except (OSError, ValueError, subprocess.SubprocessError):  # no nvidia-smi, "[N/A]" (MIG): the device's figure
            pass
        return used, elsewhere

    def record(step: int) -> None:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        used, elsewhere = process_used()
        Path(folder, f"gpu-rank{rank}.json").write_text(json.dumps({
            "step": step, "reserved": torch.cuda.memory_reserved(), "device_used": total - free,
            "process_used": used, "contexts_on_other_gpus": elsewhere}))

    return [record]


def install_memory_step_probe() -> list:
    if not os.environ.get("TRAINKIT_FAULT_PROBE_MEMORY"):
        return []

    def record(step: int) -> None:
        if step == 2:
            MEMORY["after_step_2"] = _proc_status_bytes("VmHWM")

    return [record]


def install_memory_probe() -> None:
    """TRAINKIT_FAULT_PROBE_MEMORY: a worker's baseline now, its whole-life peak as it exits."""
    folder = os.environ.get("TRAINKIT_FAULT_PROBE_MEMORY")
    if not folder or "RANK" not in os.environ:
        return
    import json

    import torch._dynamo  # noqa: F401  (before DeepSpeed, as trainkit imports them)
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    if os.environ.get("DS_ACCELERATOR"):
        import deepspeed  # noqa: F401
    # the code the run will load is in the baseline: the peak above it is data
    MEMORY["baseline"], leave = _proc_status_bytes("VmRSS"), os._exit

    def exit_with_record(code: int) -> None:
        record = dict(MEMORY, peak=_proc_status_bytes("VmHWM"), exit_code=code)
        Path(folder, f"memory-rank{os.environ['RANK']}.json").write_text(json.dumps(record))
        leave(code)

    os._exit = exit_with_record


def install_collective_latency(model) -> None:
    """Delays torch's `_allreduce_fut`, which every Python DDP all-reduce hook calls (trainkit's timed
    hook included); with no hook registered (DDP's C++ all-reduce), registers the plain one."""
    spec = os.environ.get("TRAINKIT_FAULT_COLLECTIVE_LATENCY")
    if not spec:
        return
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    seconds = float(_fields(spec).get("ms", "0.5")) / 1000
    original = default_hooks._allreduce_fut

    def slow_allreduce_fut(process_group, tensor):
        time.sleep(seconds)
        return original(process_group, tensor)

    default_hooks._allreduce_fut = slow_allreduce_fut
    try:
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    except RuntimeError:  # a hook is registered already, and it calls _allreduce_fut
        pass


def install_slow_link(model) -> None:
    """Wraps torch's `_allreduce_fut` (see install_collective_latency) so its future completes only
    after one link thread per process has spent `ms` on it, in issue order."""
    spec = os.environ.get("TRAINKIT_FAULT_SLOW_LINK")
    if not spec:
        return
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    seconds = float(_fields(spec).get("ms", "4")) / 1000
    original = default_hooks._allreduce_fut
    link: queue.Queue = queue.Queue()

    def carry() -> None:  # the link: one collective at a time
        while True:
            finished, delayed = link.get()
            time.sleep(seconds)
            delayed.set_result(finished.value())

    threading.Thread(target=carry, name="slow-link", daemon=True).start()

    def slow_allreduce_fut(process_group, tensor):
        delayed = torch.futures.Future()
        original(process_group, tensor).add_done_callback(lambda finished: link.put((finished, delayed)))
        return delayed

    default_hooks._allreduce_fut = slow_allreduce_fut
    try:
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    except RuntimeError:  # a hook is registered already, and it calls _allreduce_fut
        pass


def install_collective_count(*, model, rank: int) -> list:
    folder = os.environ.get("TRAINKIT_FAULT_COUNT_COLLECTIVES")
    if not folder:
        return []
    import json

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    counts = {"calls": 0, "rounds": 0}
    if isinstance(model, DistributedDataParallel):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        def counting_allreduce(state, bucket):
            counts["calls"] += 1
            counts["rounds"] += bucket.index() == 0
            return default_hooks.allreduce_hook(state, bucket)

        model.register_comm_hook(None, counting_allreduce)
    else:
        original = dist.reduce_scatter_single
        all_gather = dist.all_gather_single
        counts["all_gather_bytes"] = 0

        def counting_reduce_scatter(*args, **kwargs):
            counts["calls"] += 1
            return original(*args, **kwargs)

        def counting_all_gather(output_tensor, input_tensor, *args, **kwargs):
            counts["all_gather_bytes"] += input_tensor.numel() * input_tensor.element_size()
            return all_gather(output_tensor, input_tensor, *args, **kwargs)

        dist.reduce_scatter_single = counting_reduce_scatter
        dist.all_gather_single = counting_all_gather
    path = os.path.join(folder, f"collectives-rank{rank}.jsonl")

    def record(step: int) -> None:
        with open(path, "a") as fh:
            fh.write(json.dumps({"step": step, **counts}) + "\n")
        counts.update({key: 0 for key in counts})

    return [record]


def install_nan(*, model, rank: int) -> list:
    """TRAINKIT_FAULT_NAN="rank=1,step=5": that rank's forward output is NaN during that optimizer step;
    with ",where=input" its *input* is +inf instead (a BatchNorm then sees an infinite value)."""
    spec = os.environ.get("TRAINKIT_FAULT_NAN")
    if not spec or int(_fields(spec).get("rank", -1)) != rank:
        return []
    at, current = int(_fields(spec)["step"]), [1]

    def poison(module, args, output):
        if module.training and current[0] == at:
            return output * float("nan")
        return output

    def infinite_input(module, args):
        if module.training and current[0] == at:
            return (args[0].new_full(args[0].shape, float("inf")), *args[1:])
        return None

    if _fields(spec).get("where") == "input":
        model.register_forward_pre_hook(infinite_input)
    else:
        model.register_forward_hook(poison)

    def advance(step: int) -> None:
        current[0] = step + 1

    return [advance]


def install_sample_recorder(*, model, rank: int) -> list:
    """TRAINKIT_FAULT_RECORD_SAMPLES=DIR: append the sha1 of every training input row this rank sees to
    DIR/rank<r>.txt, so tests can check which samples a run (and its resume) trained on."""
    import hashlib

    folder = os.environ.get("TRAINKIT_FAULT_RECORD_SAMPLES")
    if not folder:
        return []
    path = os.path.join(folder, f"rank{rank}.txt")

    def record(module, args):
        if module.training:
            with open(path, "a") as fh:
                for row in args[0]:
                    fh.write(hashlib.sha1(row.detach().cpu().numpy().tobytes()).hexdigest() + "\n")

    model.register_forward_pre_hook(record)
    return []


def install_perf_probe(*, model, rank: int) -> list:
    folder = os.environ.get("TRAINKIT_FAULT_PROBE_PERF")
    if not folder:
        return []
    import json

    import torch

    classes = set(filter(None, os.environ.get("TRAINKIT_FAULT_PROBE_BLOCKS", "").split(",")))
    blocks = {name: m for name, m in model.named_modules() if type(m).__name__ in classes}
    forwards = {name: 0 for name in blocks}
    seen: dict = {}

    def counted(name, forward):  # on entry: an early-stopped recomputation never returns
        def run(*args, **kwargs):
            if blocks[name].training:
                forwards[name] += 1
            return forward(*args, **kwargs)
        return run

    for name, m in blocks.items():
        count_class_forward(m, lambda forward, name=name: counted(name, forward))

    def first_input(module, args):
        x = args[0] if args else None
        if "input_channels_last" not in seen and isinstance(x, torch.Tensor) and x.dim() == 4:
            seen["input_channels_last"] = x.is_contiguous(memory_format=torch.channels_last) and x.shape[1] > 1
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    if convs:
        convs[0].register_forward_pre_hook(first_input)
    path = os.path.join(folder, f"perf-rank{rank}.jsonl")

    def record(step: int) -> None:
        from torch._dynamo.utils import counters

        weights = [p for p in model.parameters() if p.dim() == 4]
        facts = {"step": step, "forwards": dict(forwards),
                 "batchnorm": sum(isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                                  and not isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules()),
                 "sync_batchnorm": sum(isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules()),
                 "weights_channels_last": [p.is_contiguous(memory_format=torch.channels_last) for p in weights],
                 "input_channels_last": seen.get("input_channels_last"),
                 "dynamo": {k: dict(v) for k, v in counters.items() if k in ("stats", "inductor", "graph_break")}}
        with open(path, "a") as fh:
            fh.write(json.dumps(facts, default=str) + "\n")
        forwards.update({name: 0 for name in blocks})

    return [record]
