"""One training process: `python -m trainkit.runtime.worker RUN_DIR` (started by torchrun, or
called in-process by the launcher when the world size is 1).

Reads RUN_DIR/recipe.yaml (the composed recipe the launcher wrote, resolving its `${oc.env:...}`
references from the environment this process inherited: secrets never pass through a file), joins
the process group,
builds every component from the recipe, runs the loop, and always leaves the group cleanly.

Test-only fault injection: TRAINKIT_FAULT_INJECT="rank=1,step=7" makes that rank `os._exit(1)`
right after that optimizer step, on the first attempt only (TORCHELASTIC_RESTART_COUNT == 0), so
tests can check that torchrun restarts and resume lose nothing. Never set it in real runs.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from .. import registry
from ..recipe import resolve
from ..recipe.schema import Recipe


class StopRequested(KeyboardInterrupt):
    """SIGTERM/SIGINT arrived: unwind (discarding a half-written checkpoint) and exit non-zero."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _on_signal(signum, frame):
    raise StopRequested(signum)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


def backend_for(recipe: Recipe) -> str:
    if recipe.launch.backend != "auto":
        return recipe.launch.backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def fault_hook(rank: int) -> Optional[callable]:
    """The TRAINKIT_FAULT_INJECT test hook for this rank, or None."""
    spec = os.environ.get("TRAINKIT_FAULT_INJECT")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    fields = dict(part.split("=", 1) for part in spec.split(",") if "=" in part)
    if int(fields.get("rank", -1)) != rank:
        return None
    at = int(fields["step"])

    def hook(step: int) -> None:
        if step == at:
            print(f"trainkit: TRAINKIT_FAULT_INJECT: rank {rank} exits at step {step}", file=sys.stderr, flush=True)
            os._exit(1)

    return hook


def fault_delay(rank: int):
    """Test-only: TRAINKIT_FAULT_DELAY="rank=1,ms=40" slows that rank's every forward (a straggler)."""
    spec = os.environ.get("TRAINKIT_FAULT_DELAY")
    if not spec:
        return None
    fields = dict(part.split("=", 1) for part in spec.split(",") if "=" in part)
    if int(fields.get("rank", -1)) != rank:
        return None
    import time

    seconds = float(fields.get("ms", "50")) / 1000

    def delay(module, args):
        time.sleep(seconds)

    return delay


def write_reports(run_dir: Path, recipe: Recipe, summary: dict) -> str:
    """reports/breakdown.json (the evidence) and reports/bottleneck.md; returns the console lines."""
    from ..monitors.bottleneck import diagnose

    reports = run_dir / "reports"
    reports.mkdir(exist_ok=True)
    evidence = {"name": recipe.name, "per_rank": summary.pop("per_rank_times"),
                "steps": summary["steps"], "world_size": summary["world_size"]}
    (reports / "breakdown.json").write_text(json.dumps(evidence, indent=2) + "\n")
    diagnosis = diagnose(evidence["per_rank"], recipe)
    sections = summary.pop("report_sections", [])
    (reports / "bottleneck.md").write_text(diagnosis.markdown(recipe.name) + "".join("\n" + s for s in sections))
    summary["bottleneck"] = diagnosis.kind
    return diagnosis.console()


def train(run_dir: Path, recipe: Recipe, recipe_data: dict, device: torch.device) -> dict:
    """Build the components from the recipe and run the loop; returns the summary (rank 0 meaningful)."""
    from .checkpoint import Checkpointer, recipe_hash, resume_source
    from .data import build_datasets, make_loader
    from .loop import Loop
    from .metrics import JsonlSink
    from .model import build_model
    from .optim import build_optimizer, build_scheduler
    from .precision import Precision
    from .progress import Progress

    rank = dist.get_rank()
    seed = recipe.seed
    seed_everything(seed)  # same initial weights on every rank (and in a 1-process run)
    model = build_model(recipe.model)
    precision = Precision(recipe.precision, device, recipe.trainer.loss_scale)
    strategy = registry.component(recipe.strategy)(recipe.strategy, device=device, precision=precision,
                                                   recipe=recipe)
    if any(type(m).needs_comm_time for m in recipe.monitors):
        from .timing import CommTimer

        strategy.comm_timer = CommTimer()
    model, optimizer = strategy.setup(model, lambda params: build_optimizer(recipe.optimizer, params))
    scheduler = build_scheduler(recipe.scheduler, optimizer, recipe.trainer.max_steps)
    seed_everything(seed + rank)  # per-rank randomness (augmentation, dropout)

    train_set, eval_set = build_datasets(recipe.data, seed)
    pin = recipe.data.pin_memory and device.type == "cuda"
    dp_rank, dp_size = strategy.data_parallel_rank, strategy.data_parallel_size  # pipeline: every stage, one batch
    train_loader = make_loader(train_set, recipe.data, rank=dp_rank, world_size=dp_size, seed=seed, train=True,
                               pin_memory=pin)
    eval_loader = None
    if eval_set is not None and recipe.trainer.eval_every:
        eval_loader = make_loader(eval_set, recipe.data, rank=dp_rank, world_size=dp_size, seed=seed, train=False,
                                  pin_memory=pin)

    ckpt_dir = run_dir / "checkpoints"
    checkpointer = Checkpointer(ckpt_dir, strategy, recipe.trainer.checkpoint.keep, recipe_hash(recipe_data))
    from ..monitors.base import build_monitors, context

    monitors = build_monitors(recipe, context(recipe, strategy, model, device, run_dir))
    loop = Loop(recipe=recipe, model=model, optimizer=optimizer, scheduler=scheduler, strategy=strategy,
                precision=precision, train_loader=train_loader, eval_loader=eval_loader,
                checkpointer=checkpointer, device=device, monitors=monitors)
    loop.enable_timing(forward=any(type(m).needs_forward_time for m in recipe.monitors),
                       precise=any(type(m).precise_timing for m in recipe.monitors))
    delay = fault_delay(rank)
    if delay:
        model.register_forward_pre_hook(delay)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    source = resume_source(recipe.trainer.resume, ckpt_dir, restart, warn=rank == 0)
    if source is not None:
        loop.load_trainer_state(checkpointer.load(source, model, optimizer))
        if rank == 0:
            print(f"trainkit: resumed from {source} (step {loop.state.step}, epoch {loop.state.epoch})",
                  flush=True)
    if rank == 0:
        loop.progress = Progress(recipe.trainer.max_steps, loop.state.step, loop.global_batch, enabled=True)
        loop.sinks = [JsonlSink(run_dir / "metrics.jsonl"), loop.progress]
        if recipe.tracking.enabled:
            from ..tracking.run import MlflowSink

            loop.sinks.append(MlflowSink(run_dir))
    hook = fault_hook(rank)
    if hook:
        loop.step_hooks.append(hook)
    try:
        summary = loop.run()
    except BaseException as exc:
        monitors.call("on_exception", exc)
        raise
    finally:
        for sink in loop.sinks:
            if sink is not loop.progress:
                sink.close()
    if summary["checkpoint"] is None and source is not None:
        summary["checkpoint"] = str(source)
    summary["resumed_from"] = str(source) if source else None
    digests = strategy.replica_digests(model)
    summary["replicas_identical"] = len(set(digests)) == 1
    summary["replica_digests"] = digests
    strategy.teardown()
    return summary


def report(run_dir: Path, summary: dict) -> None:
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if not summary.get("replicas_identical", True):
        print("trainkit: warning: model replicas differ across ranks at the end of training", file=sys.stderr)
    loss = summary["final_loss"]
    acc = summary["eval"].get("eval_accuracy")
    print(f"trainkit: done: {summary['steps']} steps, final loss "
          f"{'n/a' if loss is None else f'{loss:.4f}'}"
          + (f", eval accuracy {acc:.3f}" if acc is not None else "")
          + f", {summary['samples_per_s']:.1f} samples/s"
          + (f", {summary['skipped_images']} unreadable images skipped" if summary["skipped_images"] else "")
          + f"\ntrainkit: checkpoint: {summary['checkpoint']}\ntrainkit: summary: {run_dir / 'summary.json'}",
          flush=True)


def _fail(exc: Exception) -> None:
    """Record the exception in torchelastic's error file (what the launcher's report reads), then
    exit 1. Local rank 0 shares the user's console: one line there instead of a traceback."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        get_error_handler().record_exception(exc)
    if os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("TORCHELASTIC_ERROR_FILE"):
        rank = os.environ.get("RANK", "0")
        print(f"trainkit: rank {rank} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
              file=sys.stderr, flush=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(1)
    raise exc


@record
def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m trainkit.runtime.worker RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(args[0])
    resolved = resolve(run_dir / "recipe.yaml")
    recipe = resolved.recipe
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    dist.init_process_group(backend_for(recipe), timeout=timedelta(seconds=recipe.launch.timeout_s))
    try:
        summary = train(run_dir, recipe, resolved.data, device)
        if dist.get_rank() == 0:
            console = write_reports(run_dir, recipe, summary)
            report(run_dir, summary)
            print(console, flush=True)
        dist.barrier()  # then destroy: gloo may abort at exit otherwise
    except Exception as exc:
        _fail(exc)
    except StopRequested as stop:
        print(f"trainkit: rank {dist.get_rank()} stopping on {stop}", file=sys.stderr, flush=True)
        if argv is None:
            dist.destroy_process_group()
            sys.exit(128 + stop.signum)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0

if __name__ == "__main__":
    sys.exit(main())
