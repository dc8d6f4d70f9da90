"""One training process: `python -m trainkit.runtime.worker RUN_DIR` (started by torchrun, or
called in-process by the launcher when the world size is 1).

Reads RUN_DIR/recipe.yaml (the composed recipe the launcher wrote, resolving its `${oc.env:...}`
references from the environment this process inherited: secrets never pass through a file), joins
the process group,
builds every component from the recipe, runs the loop, and always leaves the group cleanly.

This module is the composition root of one rank: it builds every collaborator and hands them to
`Loop` at construction. What a rank does besides building has a module of its own beside it:
`resume` (which checkpoint every rank starts from), `accepted_changes` (changed hyperparameters
taking effect on resume), `fatal` (the marker that stops a restart from repeating a failure),
`reports` (summary.json and the bottleneck reports), `error_file` (a failed rank's report, secrets
masked) and `parent_watch` (dying with the launcher).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ..console import survive_closed_output
from ..monitors.base import RunFacts, build_monitors, context
from ..recipe import resolve
from ..recipe.schema import Recipe
from ..run_dir import ADAPTER, CHECKPOINTS, METRICS, RECIPE
from ..tracking.run import MlflowSink
from .accelerator import accelerator_for
from . import accepted_changes, error_file, fatal, memory_watch, progress_record, resume, stop_signals
from .components import build_strategy, build_task
from .checkpoint import Checkpointer, DiskFullError, saved_recipe
from .data import build_datasets, make_loader
from . import host_allocator as host_malloc
from .loop import Loop, TrainState, global_batch, restore_trainer_state
from .metrics import JsonlSink
from .mesh import build_mesh
from .model import build_initial_model
from .nonfinite import NonFiniteError
from .optim import build_optimizer, build_scheduler
from .pretrained import pretrained_source, save_adapter
from .parent_watch import die_with_launcher, stop_when_launcher_falls_silent
from .warnings_once import show_each_warning_once
from .performance import float8_linears, prepare_model, set_backend_flags
from .precision import Precision
from .process_group import init_process_group
from .progress import Progress, StartupPhases, process_start
from .reports import write_reports, write_summary
from .seeding import seed_everything, seed_replica
from .timing import Clock, CommTimer, ForwardMarks


def train(run_dir: Path, recipe: Recipe, recipe_data: dict, device: torch.device) -> dict:
    """Build the components from the recipe and run the loop; returns the summary (rank 0 meaningful).
    `recipe_data` is the resolved recipe with secrets redacted: what checkpoints record for drift checks."""
    rank = dist.get_rank()
    seed = recipe.seed
    seed_everything(seed)  # same initial weights on every rank (and in a 1-process run)
    set_backend_flags(recipe.performance)  # tf32 (MFU's peak), cudnn.benchmark
    precision = Precision(recipe.precision, device, recipe.trainer.loss_scale,
                          scaler=not recipe.strategy.capabilities().owns_loss_scaling)  # DeepSpeed scales the loss itself
    dims = recipe.parallel_dims(dist.get_world_size())
    strategy = build_strategy(recipe, device=device, precision=precision, dims=dims, mesh=build_mesh(dims, device.type))
    phases = StartupPhases(rank == 0, process_start())
    phases.say(f"workers up: {dist.get_world_size()} rank(s) in the process group")
    model, init = build_initial_model(recipe.model, strategy, seed, announce=rank == 0)
    if recipe.performance.float8:
        linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
        phases.say(f"float8: {len(float8_linears(model))} of {linears} Linear layers compute in float8 (the output "
                   f"head and layers with a dimension not divisible by 16 stay bf16)")
    model = prepare_model(model, recipe.performance,  # SyncBatchNorm, channels_last, float8: before wrapping
                          contiguous_parameters=recipe.strategy.capabilities().contiguous_parameters,
                          float8_all_gather=strategy.float8_all_gather)
    if any(type(m).needs_comm_time for m in recipe.monitors):
        strategy.comm_timer = CommTimer()
    pretrained = pretrained_source(model)  # weights the model was built without (runtime.pretrained)
    read_at_build = pretrained is not None and init == "seeded" and \
        strategy.capabilities.pretrained_read_at_materialize
    quantize_base = getattr(model, "quantize_frozen_base", None)  # QLoRA: the base in 4 bits, before wrapping
    quantizes = quantize_base is not None and bool(getattr(model, "quantized_base", None))
    read_before_setup = pretrained is not None and not read_at_build and \
        (strategy.capabilities.pretrained_before_setup or quantizes)  # a base is read before it is quantized
    if read_at_build:
        phases.say(f"weights read from {pretrained.where} (one module gathered at a time)")
    if read_before_setup:  # the engine copies the weights at set-up (a resume's checkpoint replaces them later)
        pretrained.load_into(model)
        phases.say(f"weights read from {pretrained.where}")
    if quantizes:
        phases.say(f"base quantized: {quantize_base()} adapted Linear weights held in 4 bits "
                   f"({model.quantized_base}, torchao)")
    model, optimizer = strategy.setup(model, lambda params: build_optimizer(recipe.optimizer, params))
    if pretrained is not None:
        init = "pretrained"
    scheduler = build_scheduler(recipe.scheduler, optimizer, recipe.trainer.max_steps)
    phases.say(f"model built and placed ({init} weights, strategy {recipe.strategy.name})")
    seed_replica(seed, rank, dims.tp, getattr(strategy, "run_mesh", None))  # augmentation, dropout
    task = build_task(recipe, device)

    train_loader, eval_loader = _data_loaders(recipe, strategy, device)
    phases.say(f"data ready: {len(train_loader.dataset):,} training samples")
    ckpt_dir = run_dir / CHECKPOINTS
    checkpointer = Checkpointer(ckpt_dir, strategy, recipe.trainer.checkpoint.keep, recipe_data)
    monitors = build_monitors(recipe.monitors, context(RunFacts.of(recipe, task), strategy, model, device, run_dir))
    clock = Clock(device, precise=any(type(m).precise_timing for m in recipe.monitors))
    forward_marks = ForwardMarks(model, clock) if any(type(m).needs_forward_time for m in recipe.monitors) else None

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    source = resume.decide_on_ranks(strategy, run_dir, ckpt_dir, recipe.trainer.resume, restart)
    state = TrainState()
    if source is None and pretrained is not None and not (read_before_setup or read_at_build):  # each rank reads
        # its own slices; a resume reads the checkpoint instead
        pretrained.load_into(strategy.unwrap(model))
        phases.say(f"weights read from {pretrained.where}")
    if source is not None:
        state = restore_trainer_state(checkpointer.load(source, model, optimizer), scheduler, precision)
        if rank == 0:
            print(f"trainkit: resumed from {source} (step {state.step}, epoch {state.epoch})", flush=True)
        scheduler = accepted_changes.apply_to_optimizer(saved_recipe(source), recipe_data, recipe, optimizer,
                                                        scheduler, state.step)
    progress, sinks = _rank0_sinks(run_dir, recipe, state.step, strategy.data_parallel_size) if rank == 0 else (None, [])
    loop = Loop(trainer=recipe.trainer, run_name=recipe.name, replica_batch=recipe.global_batch_at(1), model=model,
                optimizer=optimizer, scheduler=scheduler, strategy=strategy,
                precision=precision, task=task, train_loader=train_loader,
                eval_loader=eval_loader, checkpointer=checkpointer, device=device, clock=clock, state=state,
                sinks=sinks, progress=progress, monitors=monitors, forward_marks=forward_marks,
                last_checkpoint=source, process_start=process_start())
    phases.say("first step" + (" (compiling: the first steps take longer)" if recipe.performance.compile_options
                               else ""))
    summary = _run_loop(loop, run_dir, monitors, checkpointer, [sink for sink in sinks if sink is not progress])
    memory_watch.phase("end of run")  # the replica check, summary and reports
    adapter = save_adapter(strategy.unwrap(model), run_dir / ADAPTER, rank)
    if adapter is not None:
        summary["adapter"] = str(adapter)
    if summary["checkpoint"] is None and source is not None:
        summary["checkpoint"] = str(source)
    summary["resumed_from"] = str(source) if source else None
    summary["model_init"] = init  # constructor or seeded (model.init)
    digests = strategy.replica_digests(model)
    summary["replicas_identical"] = strategy.replicas_agree(digests)  # None: no replicas (pipeline)
    summary["replica_digests"] = digests
    strategy.teardown()
    return summary


def _data_loaders(recipe: Recipe, strategy, device: torch.device):
    """The training loader and (when the trainer evaluates) the evaluation loader of this rank's shard:
    ranks that read one batch (a pipeline's stages, a tensor-parallel group) share a shard."""
    train_set, eval_set = build_datasets(recipe.data, recipe.seed)
    pin = recipe.data.pin_memory and device.type == "cuda"
    dp_rank, dp_size = strategy.data_parallel_rank, strategy.data_parallel_size
    train_loader = make_loader(train_set, recipe.data, rank=dp_rank, world_size=dp_size, seed=recipe.seed, train=True,
                               pin_memory=pin)
    eval_loader = None
    if eval_set is not None and recipe.trainer.eval_every:
        eval_loader = make_loader(eval_set, recipe.data, rank=dp_rank, world_size=dp_size, seed=recipe.seed,
                                  train=False, pin_memory=pin, eval_steps=recipe.trainer.eval_steps)
    return train_loader, eval_loader


def _rank0_sinks(run_dir: Path, recipe: Recipe, step: int, dp_size: int):
    """Rank 0's progress bar and metric sinks (metrics.jsonl, the MLflow spool when tracking is on), each
    rewound to `step`: one value per step, so a restart's redone steps replace the dead attempt's."""
    progress = Progress(recipe.trainer.max_steps, step, global_batch(recipe, dp_size), enabled=True)
    sinks = [JsonlSink(run_dir / METRICS)]
    if recipe.tracking.enabled:
        sinks.append(MlflowSink(run_dir))
    for sink in sinks:
        sink.rewind(step)
    return progress, [*sinks, progress]


def _run_loop(loop: Loop, run_dir: Path, monitors, checkpointer: Checkpointer, sinks: list) -> dict:
    """Run the loop; a failure is recorded for the launcher (a deterministic one as a fatal marker, so
    restarts do not repeat it), told to the monitors, and a stop request finishes a background save
    within torchrun's grace period. The sinks are closed either way."""
    try:
        return loop.run()
    except (NonFiniteError, DiskFullError) as exc:
        fatal.record(run_dir, exc)
        monitors.call("on_exception", exc)
        raise
    except BaseException as exc:
        if isinstance(exc, stop_signals.StopRequested):  # torchrun's grace before SIGKILL is 30 s
            progress_record.stopping()  # the bounded wait below is not a hang
            checkpointer.finish_on_stop()
        monitors.call("on_exception", exc)
        raise
    finally:
        _close_sinks(sinks, failing=sys.exc_info()[0] is not None)


def _close_sinks(sinks: list, failing: bool) -> None:
    """Close every sink; while a failure propagates, a sink that cannot flush (a full disk) must not
    replace that failure with its own error."""
    for sink in sinks:
        try:
            sink.close()
        except OSError:
            if not failing:
                raise


@record
def main(argv: Optional[Sequence[str]] = None) -> int:
    survive_closed_output()  # rank 0 prints progress to the launcher's stdout: a closed pipe must not end training
    die_with_launcher()
    show_each_warning_once()
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m trainkit.runtime.worker RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(args[0])
    stop_when_launcher_falls_silent(run_dir)
    resolved = resolve(run_dir / RECIPE)
    recipe = resolved.recipe
    # one decision for device and backend (the same function preflight and doctor use)
    accelerator = accelerator_for(recipe, cuda_available=torch.cuda.is_available(),
                                  local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    device = accelerator.device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    previous = stop_signals.raise_on_stop()
    init_process_group(accelerator.backend, timeout=timedelta(seconds=recipe.launch.timeout_s))
    try:
        memory_watch.start(run_dir, dist.get_rank(), device)  # phase and peak, for an out-of-memory report
        progress_record.start(run_dir, dist.get_rank())  # step and phase, stacks on SIGUSR1: for a hang report
        # before the model, optimizer and data allocate: glibc settings apply to later allocations
        applied_malloc = host_malloc.apply(host_malloc.for_recipe(recipe, device.type))
        summary = train(run_dir, recipe, resolved.redacted(), device)  # what checkpoints record: no secrets
        summary["host_allocator"] = applied_malloc
        summary["intra_op_threads"] = torch.get_num_threads()  # runtime.threads: fewer in the launcher's process
        if dist.get_rank() == 0:
            console = write_reports(run_dir, recipe, summary)
            write_summary(run_dir, summary)
            print(console, flush=True)
        dist.barrier()  # then destroy: gloo may abort at exit otherwise
    except Exception as exc:
        stop_signals.finish_failure_report_first()
        progress_record.failed()  # its exit is a failure, not a hang
        if memory_watch.is_out_of_memory(exc):  # deterministic: the marker stops restarts repeating it
            exc = memory_watch.explained(exc)
            fatal.record(run_dir, exc)
        elif fatal.is_collective_desync(exc):  # the same step desyncs again after a restart
            fatal.record(run_dir, exc)
        error_file.report_and_exit(exc, resolved.redact_text)
    except stop_signals.StopRequested as stop:
        print(f"trainkit: rank {dist.get_rank()} stopping on {stop}", file=sys.stderr, flush=True)
        if argv is None:
            dist.destroy_process_group()
            # at once: a background checkpoint write still running after its bounded wait (finish_on_stop)
            # runs in DCP's non-daemon thread, which sys.exit would join until torchrun's SIGKILL; the
            # unsealed folder it leaves is never taken for a checkpoint
            _exit_without_finalization(128 + stop.signum)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        stop_signals.restore(previous)
    return 0


def _exit_without_finalization(code: int) -> None:
    """Leave a finished worker at once. Every output is written and the process group destroyed by
    now; what is left is interpreter finalization, during which gloo's C++ threads can still release
    Python objects and abort the process ("terminate called without an active exception", SIGABRT:
    seen here now and then under CPU load, and the reason pytorch/pytorch#179291 was opened). A rank
    that aborts there would turn a finished run into a failed one."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit_without_finalization(main())
