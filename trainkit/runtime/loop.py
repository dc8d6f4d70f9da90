"""The training loop: accumulation, clipping, precision, evaluation, checkpoints, metrics.

It talks to its collaborators only through the protocols in `runtime.protocols` — a Strategy
(forward/backward, optimizer step), a Precision, a Task (batch to device, loss, eval metrics),
a Checkpointer, metric sinks and the monitor hooks — all passed at construction, so it has no
branch on any of them and imports none of their implementations.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from ..recipe.blocks import TrainerOptions
from ..recipe.schema import Recipe
from . import memory_watch, progress_record
from .nonfinite import NonFiniteError, NonFiniteGuard, restore_buffers, snapshot_buffers
from .protocols import Checkpointer, MetricSink, MonitorHooks, NoMonitors, Precision, Progress, Strategy, Task
from .loader_timing import Produced
from .stats import RunStats
from .timing import Clock, ForwardMarks, StepTimes


@dataclass
class TrainState:
    """Everything about progress that a checkpoint must restore (besides model/optimizer/RNG)."""

    step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0  # micro-batches of this rank already consumed in `epoch`
    # samples of `epoch` consumed by all data-parallel ranks together: resuming with another data-parallel
    # size (elastic nnodes MIN:MAX, or FSDP resharding) starts every rank at the same global sample
    samples_in_epoch: Optional[int] = None
    samples: int = 0  # global samples trained on
    skipped_images: int = 0  # unreadable images replaced (this rank)
    skipped_steps: int = 0  # optimizer steps discarded for a non-finite value (trainer.on_nonfinite: skip_step)


@dataclass
class WallTimes:
    """Whole-run time accounting of this launch (rank 0's view): where wall time goes besides the
    measured steps. `startup_s` runs from process start to the first step; shutdown is added by the
    worker when it writes the report. Shares are of wall time since process start."""

    process_start: float  # time.time() when this process started
    train_s: float = 0.0
    eval_s: float = 0.0
    checkpoint_s: float = 0.0
    logging_s: float = 0.0
    startup_s: float = 0.0
    shutdown_s: float = 0.0
    evals: int = 0
    checkpoints: int = 0
    steps: int = 0
    loop_end: Optional[float] = None  # time.time() after the last step's work

    def shares(self, now: float) -> dict:
        wall = max(now - self.process_start, 1e-9)
        return {f"time/{p}_share": getattr(self, f"{p}_s") / wall
                for p in ("train", "eval", "checkpoint", "logging", "startup")}

    def as_dict(self, now: float) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("process_start", "loop_end")}
        out["wall_s"] = now - self.process_start
        return out


def global_batch(recipe: Recipe, data_parallel_size: int) -> int:
    """Samples per optimizer step over all data-parallel ranks (pipeline stages share one batch)."""
    return recipe.global_batch_at(data_parallel_size)


def restore_trainer_state(saved: dict, scheduler, precision: Precision) -> TrainState:
    """Apply a checkpoint's trainer state (from `Loop.trainer_state`) and return the progress."""
    scheduler.load_state_dict(saved["scheduler"])
    precision.load_state_dict(saved["scaler"])
    return TrainState(**saved["progress"])


@dataclass(kw_only=True)
class Loop:
    """The training loop of one rank. It receives what it uses: the trainer block (steps, accumulation,
    logging, evaluation and checkpoint intervals, non-finite handling), the run's name and one replica's
    samples per step, not the whole recipe."""

    trainer: TrainerOptions
    run_name: str
    replica_batch: int  # samples per optimizer step of one data-parallel replica: Recipe.global_batch_at(1)
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    strategy: Strategy
    precision: Precision
    task: Task
    train_loader: torch.utils.data.DataLoader
    eval_loader: Optional[torch.utils.data.DataLoader]
    checkpointer: Checkpointer
    device: torch.device
    clock: Clock
    state: TrainState = field(default_factory=TrainState)
    sinks: list[MetricSink] = field(default_factory=list)  # rank 0 only
    progress: Optional[Progress] = None  # rank 0 only; also one of the sinks
    monitors: MonitorHooks = field(default_factory=NoMonitors)  # every rank
    forward_marks: Optional[ForwardMarks] = None  # set when a monitor times the forward separately
    # called with the step number after each optimizer step, once its logging and checkpoint are done
    # (the test suite's fault injection adds its faults here)
    step_hooks: list[Callable[[int], None]] = field(default_factory=list)
    stats: RunStats = field(default_factory=RunStats)
    last_checkpoint: Optional[Path] = None  # the newest checkpoint known good (the resume source at start)
    process_start: Optional[float] = None  # time.time() at process start (the worker's): start-up accounting

    def __post_init__(self):
        self.guard = NonFiniteGuard(self.device)
        self.interval_losses: list[torch.Tensor] = []  # this rank's step losses since the last log, on the device
        self.loader_seconds = 0.0  # production time of the batches taken so far (runtime.loader_timing)
        self.loader_timed = False

    def interval_loss(self) -> dict:
        """`loss` (mean) and `loss_max` over the steps since the previous log step, each step's loss
        being its mean over data-parallel ranks (as `reduce_loss` defines it). The per-step values
        stay on the device until now: one collective of log_every floats per log step, no sync per step."""
        if not self.interval_losses:  # every step of the interval was skipped (skip_step)
            return {}
        per_step = self.strategy.reduce_loss(torch.stack(self.interval_losses)).double()
        self.interval_losses = []
        mean, top = torch.stack([per_step.mean(), per_step.max()]).tolist()  # one device-to-host copy
        return {"loss": mean, "loss_max": top}

    # ------------------------------------------------------------------ data
    def batches(self) -> Iterator:
        """Micro-batches forever, epoch after epoch, starting where `state` says."""
        sampler, dp = self.train_loader.sampler, self.strategy.data_parallel_size
        per_micro_batch = self.train_loader.batch_size * dp
        if self.state.samples_in_epoch is None:  # a checkpoint from before this was recorded
            self.state.samples_in_epoch = self.state.batches_in_epoch * per_micro_batch
        while True:
            sampler.set_epoch(self.state.epoch)
            # the sampler deals the epoch's permutation out round-robin (rank r gets items r, r+dp, ...), so
            # skipping samples_in_epoch / dp on every rank skips exactly the samples already trained on
            sampler.start_at(self.state.samples_in_epoch // dp)
            produced = False
            for batch in self.train_loader:
                produced = True
                if isinstance(batch, Produced):
                    self.loader_seconds += batch.seconds
                    self.loader_timed, batch = True, batch.batch
                self.state.batches_in_epoch += 1
                self.state.samples_in_epoch += per_micro_batch
                yield batch
            if not produced and self.state.batches_in_epoch == 0:
                raise RuntimeError("the training data yields no batches (batch_size larger than each rank's share "
                                   "of the dataset with drop_last)")
            self.state.epoch += 1
            self.state.batches_in_epoch = self.state.samples_in_epoch = 0

    def _to_device(self, batch):
        if len(batch) > 2:  # the dataset's unreadable-image flags
            self.state.skipped_images += int(batch[2].sum())
        return self.task.to_device(batch)

    # ------------------------------------------------------------------ one optimizer step
    def train_step(self, data: Iterator) -> tuple[torch.Tensor, Optional[torch.Tensor], StepTimes]:
        accum = self.trainer.grad_accum_steps
        total = torch.zeros((), device=self.device)
        clock, t_start = self.clock, time.perf_counter()
        data_wait, loader_before = 0.0, self.loader_seconds
        compute = clock.phase()  # device phases stay marks until a log interval resolves them: no sync here
        marks = self.forward_marks
        forward = clock.phase() if marks is not None else None
        # skip_step must be able to undo the forward's side effects: BatchNorm running statistics of a
        # discarded step would otherwise keep its inf/NaN and reach every later checkpoint
        buffers_before = snapshot_buffers(self.model) if self.trainer.on_nonfinite == "skip_step" else []
        step = self.state.step + 1
        for micro in range(accum):
            t0 = time.perf_counter()
            progress_record.phase(step, "data")  # what a hang report names (runtime.progress_record)
            batch = next(data)
            # a batch decoded on the device (runtime.device_decode) is the step's work when it moves, which more
            # loader workers would not speed up; any other batch's move is part of waiting for data
            decodes_on_device = getattr(batch[0], "work_on_device", False)
            if not decodes_on_device:
                x, y = self._to_device(batch)
            data_wait += time.perf_counter() - t0
            if marks:
                marks.clear()  # marks left by evaluate()'s forwards are not this step's
            c0 = clock.mark()
            if decodes_on_device:
                x, y = self._to_device(batch)
            progress_record.phase(step, "forward")  # "backward" when the forward returns (watch_backward)
            total += self.strategy.forward_backward(self.model, x, y, self.task.loss_fn, self.precision,
                                                    grad_accum_steps=accum, last_micro_step=micro == accum - 1)
            compute.add(c0, clock.mark())
            if marks and marks.marks:
                forward.add(c0, marks.marks[0])
                marks.clear()
        o0 = clock.mark()
        progress_record.phase(step, "optimizer")
        self.skipped = False
        if self.trainer.on_nonfinite == "skip_step" and not self.guard.step_is_finite(
                self.strategy, total, self.model.parameters(), device=self.device,
                check_grads=self.precision.scaler is None, buffers=self.model.buffers()):
            self.optimizer.zero_grad(set_to_none=True)  # discard the step: no update
            restore_buffers(buffers_before)  # ... and none of what its forward did (BatchNorm statistics)
            grad_norm, self.skipped = None, True
        else:
            grad_norm = self.strategy.optimizer_step(self.model, self.optimizer, self.precision,
                                                     self.trainer.grad_clip)
        self.scheduler.step()  # the schedule follows the step count, skipped steps included
        optimizer = clock.phase()
        optimizer.add(o0, clock.mark())
        timer = self.strategy.comm_timer
        comm = timer.take() if timer is not None and timer.bound else None  # FSDP & co.: not 0, unmeasured
        times = StepTimes(data_wait=data_wait, compute=compute, optimizer=optimizer,
                          total=time.perf_counter() - t_start, forward=forward,
                          comm=comm.in_flight if comm else None, comm_exposed=comm.exposed if comm else None,
                          loader=self.loader_seconds - loader_before if self.loader_timed else None)
        return total, grad_norm, times

    @property
    def global_batch(self) -> int:
        return self.replica_batch * self.strategy.data_parallel_size

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Metrics over the eval loader's samples (its sampler picks the subset and each rank's share,
        see runtime.data.EvalSampler), from float64 sums added over batches and ranks."""
        self.model.eval()
        sums = torch.zeros(self.task.num_eval_sums, dtype=torch.float64, device=self.device)
        for batch in self.eval_loader:
            x, y = self.task.to_device(batch)
            out = self.strategy.eval_forward(self.model, x, self.precision)
            sums += self.task.eval_sums(out, y)
        self.model.train()
        return self.task.eval_metrics(self.strategy.all_reduce_sum(sums))

    # ------------------------------------------------------------------ non-finite values
    def _count_skip(self, step: int) -> None:
        self.state.skipped_steps += 1
        limit = self.trainer.max_skipped_steps
        if self.strategy.rank == 0:
            print(f"trainkit: warning: step {step}: non-finite loss or gradient; optimizer step skipped "
                  f"({self.state.skipped_steps} of at most {limit})", flush=True)
        if self.state.skipped_steps > limit:
            raise NonFiniteError(f"{self.state.skipped_steps} optimizer steps skipped for non-finite values, more "
                                 f"than trainer.max_skipped_steps {limit} (last at step {step}); "
                                 f"{self._last_good()}. Lower optimizer.lr or set trainer.grad_clip")

    def _last_good(self) -> str:
        return (f"last good checkpoint: {self.last_checkpoint} (resume: auto continues from it)"
                if self.last_checkpoint else "no checkpoint was written")

    def _stop_if_nonfinite(self, step: int, *, weights: bool) -> None:
        """trainer.on_nonfinite: stop — end the run (FAILED) at the first log step or checkpoint after
        a NaN/inf, without writing a checkpoint. One small collective, no per-step sync."""
        bad = self.guard.first_bad(self.strategy)
        what = f"non-finite {bad[1]} at step {bad[0]}" if bad else None
        if what is None and weights and not self.guard.weights_finite(
                self.strategy, itertools.chain(self.strategy.local_tensors(self.model), self.model.buffers()),
                self.device):
            what = (f"non-finite weights or buffers at step {step} (an inf/NaN gradient reached the optimizer, or "
                    f"a BatchNorm saw an inf/NaN input)")
        if what:
            raise NonFiniteError(f"{what}; stopped at step {step} without writing a checkpoint; "
                                 f"{self._last_good()}. Lower optimizer.lr, set trainer.grad_clip, or "
                                 f"trainer.on_nonfinite: skip_step to discard such steps")

    # ------------------------------------------------------------------ the loop
    def trainer_state(self) -> dict:
        return {"progress": asdict(self.state), "scheduler": self.scheduler.state_dict(),
                "scaler": self.precision.state_dict()}

    def run(self) -> dict:
        t = self.trainer
        global_batch = self.global_batch
        start_step, t0 = self.state.step, time.perf_counter()
        last_ckpt: Optional[Path] = None
        metrics: dict = {}
        data = self.batches()
        self.model.train()
        progress_record.watch_backward(self.model)
        self.monitors.call("on_run_start")
        first_step_at = None
        self.wall = wall = WallTimes(self.process_start or time.time())
        while self.state.step < t.max_steps:
            i0 = time.perf_counter()
            if first_step_at is None:
                wall.startup_s = time.time() - wall.process_start
            side = 0.0  # this iteration's evaluation, logging and checkpoint time
            self.monitors.call("on_step_start", self.state.step + 1)
            memory_watch.phase(f"step {self.state.step + 1}")  # what an out-of-memory report names
            loss, grad_norm, times = self.train_step(data)
            if not self.skipped:  # a discarded step's NaN would make the interval's mean NaN
                self.interval_losses.append(loss.detach().float().reshape(()))
            self.state.step += 1
            self.stats.add(times)
            if first_step_at is None:
                first_step_at = time.time()  # wall clock: `trainkit run` to first step, for the overhead bench
            self.monitors.call("on_step_end", self.state.step, times)
            self.state.samples += global_batch
            step = self.state.step
            overflow = None if self.skipped else self.strategy.loss_scale_overflow()
            if self.skipped:
                self._count_skip(step)
            else:
                self.guard.observe(step, loss, grad_norm, overflow)
            if self.progress and self.progress.due(step):  # .item() syncs the device: a live bar, rate-limited
                self.progress.update(step, loss.item())
            last = step == t.max_steps
            if step % t.log_every == 0 or last or (t.eval_every and step % t.eval_every == 0):
                l0, e_s = time.perf_counter(), 0.0
                metrics = {**self.interval_loss(),
                           "lr": self.optimizer.param_groups[0]["lr"], "epoch": self.state.epoch,
                           "samples_per_s": self.progress.rate(step) if self.progress else 0.0}
                if grad_norm is not None and not (overflow is not None and bool(overflow)):
                    metrics["grad_norm"] = float(grad_norm)  # a loss-scaling overflow step's norm is inf
                metrics.update(self.task.log_metrics(metrics))  # e.g. perplexity, tokens/s
                metrics.update(self.stats.interval_means())  # step_time_s, data_wait_s (this rank)
                if self.eval_loader is not None and t.eval_every and (step % t.eval_every == 0 or last):
                    e0 = time.perf_counter()
                    memory_watch.phase(f"evaluation at step {step}")
                    progress_record.phase(step, "eval")
                    evaluated = self.evaluate()
                    e_s = time.perf_counter() - e0
                    wall.eval_s += e_s
                    wall.evals += 1
                    self.monitors.call("on_eval", step, evaluated)
                    metrics.update(evaluated)
                if t.on_nonfinite == "skip_step":
                    metrics["skipped_steps"] = self.state.skipped_steps
                metrics.update(self.monitors.log_step(step))
                metrics.update(wall.shares(time.time()))
                self.monitors.call("on_log", step, metrics)
                for sink in self.sinks:
                    sink.log(metrics, step)
                self._stop_if_nonfinite(step, weights=False)
                logged = time.perf_counter() - l0
                wall.logging_s += logged - e_s
                side += logged
            if (t.checkpoint.every and step % t.checkpoint.every == 0) or last:
                c0 = time.perf_counter()
                self._stop_if_nonfinite(step, weights=True)  # a NaN never reaches a checkpoint
                memory_watch.phase(f"checkpoint at step {step}")
                progress_record.phase(step, "checkpoint")
                last_ckpt = self.checkpointer.save(step, self.model, self.optimizer, self.trainer_state())
                for sealed_step, sealed in self.checkpointer.take_sealed():  # a background save: once written
                    self.last_checkpoint = sealed
                    self.monitors.call("on_checkpoint", sealed_step, sealed)
                saved = time.perf_counter() - c0
                wall.checkpoint_s += saved
                wall.checkpoints += 1
                side += saved
            for hook in self.step_hooks:
                hook(step)
            wall.train_s += time.perf_counter() - i0 - side
            wall.steps += 1
        wall.loop_end = time.time()
        progress_record.phase(self.state.step, progress_record.END)
        if self.progress:
            self.progress.close()
        elapsed = time.perf_counter() - t0
        per_rank_stats = self.stats.gather(self.strategy.world_size)
        report_sections = self.monitors.finish()
        # on the run's device (an nccl group has no CPU backend); all_reduce_sum adds over the data-parallel
        # ranks only, so the tp and pp ranks that read the same batches count each image once
        skipped = int(self.strategy.all_reduce_sum(torch.tensor(self.state.skipped_images, device=self.device))
                      .item())
        done = self.state.step - start_step
        return {
            "name": self.run_name, "steps": self.state.step, "steps_this_launch": done,
            "final_loss": metrics.get("loss"),
            "eval": {k: v for k, v in metrics.items() if k.startswith("eval_")},
            "samples_per_s": done * global_batch / elapsed if elapsed > 0 and done else 0.0,
            # the loop's seconds (samples_per_s is over them); the process's are wall_times.wall_s
            "loop_s": elapsed, "global_batch": global_batch, "world_size": self.strategy.world_size,
            "skipped_images": skipped,
            "checkpoint": str(last_ckpt) if last_ckpt else None,
            "first_step_at": first_step_at, "per_rank_times": per_rank_stats, "report_sections": report_sections,
            "wall_times": wall, "device": self.device.type,
        }
