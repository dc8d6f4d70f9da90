"""The training loop (runtime/loop.py) in-process, without torchrun: a real recipe's `trainer:` block,
a one-weight linear model, and fakes of the strategy, task, precision and checkpointer that record
what the loop asks of them. Each test pins one piece of loop logic a launch test would take a
minute to reach: the accumulation call pattern, where training stops, the logging and checkpoint
cadence, what the logged loss averages, non-finite values (stop / skip_step), the step hooks,
evaluation, and where a resumed run starts reading its data.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from run_helpers import MLP, write_recipe
from trainkit.recipe import resolve
from trainkit.runtime.data import ResumableDistributedSampler
from trainkit.runtime.loop import Loop, TrainState
from trainkit.runtime.nonfinite import NonFiniteError
from trainkit.runtime.timing import Clock

SAMPLES = 8  # x = 0..7, y = 2x: 4 micro-batches of 2 per epoch, in order


class FakeStrategy:
    """One process. Records every call; `nan_at` = {forward call number (1-based): ...} poisons that
    micro-batch's loss."""

    comm_timer = None
    rank, world_size, data_parallel_size = 0, 1, 1

    def __init__(self, nan_at=()):
        self.calls: list[tuple] = []
        self.inputs: list[list[float]] = []  # the x of every micro-batch, in order
        self.nan_at = set(nan_at)

    def forward_backward(self, model, x, y, loss_fn, precision, *, grad_accum_steps, last_micro_step):
        self.calls.append(("forward_backward", grad_accum_steps, last_micro_step))
        self.inputs.append(x.flatten().tolist())
        loss = loss_fn(model(x), y) / grad_accum_steps
        if sum(c[0] == "forward_backward" for c in self.calls) in self.nan_at:
            loss = loss * float("nan")
        loss.backward()
        return loss.detach().float()

    def optimizer_step(self, model, optimizer, precision, max_norm):
        self.calls.append(("optimizer_step", max_norm))
        norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm) if max_norm else None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm

    def loss_scale_overflow(self):
        return None

    def eval_forward(self, model, x, precision):
        self.calls.append(("eval_forward",))
        return model(x)

    def reduce_loss(self, loss):
        return loss

    def all_reduce_sum(self, value):
        return value

    def all_reduce_max(self, value):
        return value

    def local_tensors(self, model):
        return list(model.parameters())

    def steps(self) -> list[str]:
        return [c[0] for c in self.calls]


class FakeTask:
    num_eval_sums = 2

    @staticmethod
    def loss_fn(out, y):
        return F.mse_loss(out, y)

    def to_device(self, batch):
        return batch[0], batch[1]

    def eval_sums(self, out, y):
        return torch.stack([F.mse_loss(out, y, reduction="sum").double(), torch.tensor(float(len(y)),
                                                                                        dtype=torch.float64)])

    def eval_metrics(self, sums):
        return {"eval_loss": float(sums[0] / sums[1]), "eval_samples": int(sums[1])}

    def log_metrics(self, metrics):
        return {}

    def flops_per_microbatch(self):
        return None


class FakePrecision:
    scaler = None

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class FakeCheckpointer:
    def __init__(self):
        self.saved: list[int] = []

    def save(self, step, model, optimizer, trainer_state):
        self.saved.append(step)
        return Path(f"checkpoints/step-{step:08d}")

    def take_sealed(self):
        return [(self.saved[-1], Path(f"checkpoints/step-{self.saved[-1]:08d}"))] if self.saved else []


class ListSink:
    def __init__(self):
        self.rows: list[tuple[int, dict]] = []

    def log(self, metrics, step):
        self.rows.append((step, dict(metrics)))

    def rewind(self, step):
        pass

    def close(self):
        pass

    def steps(self) -> list[int]:
        return [step for step, _ in self.rows]


def loader() -> torch.utils.data.DataLoader:
    x = torch.arange(SAMPLES, dtype=torch.float32).reshape(-1, 1)
    data = torch.utils.data.TensorDataset(x, 2 * x)
    sampler = ResumableDistributedSampler(data, num_replicas=1, rank=0, shuffle=False)
    return torch.utils.data.DataLoader(data, batch_size=2, sampler=sampler, drop_last=True)


def make_loop(tmp_path: Path, *, strategy=None, state=None, eval_loader=None, step_hooks=(), **trainer) -> Loop:
    """A Loop over the fakes; `trainer` updates the recipe's trainer block (MLP preset, batch 2)."""
    recipe = resolve(write_recipe(tmp_path, "loop", MLP, data={"batch_size": 2}, launch={"nproc_per_node": 1},
                                  trainer={"log_every": 1, "checkpoint": {"every": 100}, **trainer})).recipe
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return Loop(trainer=recipe.trainer, run_name=recipe.name, replica_batch=recipe.global_batch_at(1), model=model,
                optimizer=optimizer,
                scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
                strategy=strategy or FakeStrategy(), precision=FakePrecision(), task=FakeTask(),
                train_loader=loader(), eval_loader=eval_loader, checkpointer=FakeCheckpointer(),
                device=torch.device("cpu"), clock=Clock(torch.device("cpu"), precise=False),
                state=state or TrainState(), sinks=[ListSink()], step_hooks=list(step_hooks))


# --------------------------------------------------------------------------- the optimizer step
def test_each_optimizer_step_runs_grad_accum_steps_micro_batches_and_syncs_only_the_last(tmp_path):
    loop = make_loop(tmp_path, max_steps=2, grad_accum_steps=3)
    loop.run()
    micro = [c for c in loop.strategy.calls if c[0] == "forward_backward"]
    assert micro == [("forward_backward", 3, False), ("forward_backward", 3, False), ("forward_backward", 3, True)] * 2
    assert loop.strategy.steps() == ["forward_backward"] * 3 + ["optimizer_step"] + ["forward_backward"] * 3 + \
        ["optimizer_step"]


def test_the_optimizer_step_gets_the_recipe_grad_clip_and_the_logged_grad_norm_is_the_pre_clip_norm(tmp_path):
    loop = make_loop(tmp_path, max_steps=1, grad_clip=0.5)
    loop.run()
    assert ("optimizer_step", 0.5) in loop.strategy.calls
    _, metrics = loop.sinks[0].rows[-1]
    assert metrics["grad_norm"] > 0.5  # the first step's gradient of this model is far larger than the clip


def test_training_stops_at_max_steps_and_a_resumed_run_does_only_the_remaining_steps(tmp_path):
    loop = make_loop(tmp_path, max_steps=5)
    summary = loop.run()
    assert loop.strategy.steps().count("optimizer_step") == 5
    assert summary["steps"] == 5 and summary["steps_this_launch"] == 5 and loop.state.samples == 5 * 2

    resumed = make_loop(tmp_path, max_steps=5, state=TrainState(step=3, batches_in_epoch=3, samples_in_epoch=6))
    summary = resumed.run()
    assert resumed.strategy.steps().count("optimizer_step") == 2
    assert summary["steps"] == 5 and summary["steps_this_launch"] == 2


# --------------------------------------------------------------------------- data
def test_batches_run_epoch_after_epoch_and_a_resume_continues_with_the_next_unseen_batch(tmp_path):
    loop = make_loop(tmp_path, max_steps=6)
    loop.run()
    assert loop.strategy.inputs == [[0, 1], [2, 3], [4, 5], [6, 7], [0, 1], [2, 3]]
    assert (loop.state.epoch, loop.state.batches_in_epoch) == (1, 2)

    resumed = make_loop(tmp_path, max_steps=3, state=TrainState(step=1, batches_in_epoch=1, samples_in_epoch=2))
    resumed.run()
    assert resumed.strategy.inputs == [[2, 3], [4, 5]]


# --------------------------------------------------------------------------- logging and checkpoints
def test_metrics_are_logged_every_log_every_steps_and_at_the_last_step(tmp_path):
    loop = make_loop(tmp_path, max_steps=7, log_every=3)
    loop.run()
    assert loop.sinks[0].steps() == [3, 6, 7]


def test_the_logged_loss_is_the_mean_and_max_of_the_interval_step_losses(tmp_path):
    strategy = FakeStrategy()
    step_losses = []
    original = strategy.forward_backward

    def recorded(*args, **kwargs):
        loss = original(*args, **kwargs)
        step_losses.append(float(loss))
        return loss

    strategy.forward_backward = recorded
    loop = make_loop(tmp_path, strategy=strategy, max_steps=4, log_every=2)
    loop.run()
    (_, first), (_, second) = loop.sinks[0].rows
    assert first["loss"] == pytest.approx(sum(step_losses[:2]) / 2) and first["loss_max"] == max(step_losses[:2])
    assert second["loss"] == pytest.approx(sum(step_losses[2:]) / 2) and second["loss_max"] == max(step_losses[2:])


def test_checkpoints_are_written_every_checkpoint_every_steps_and_at_the_end(tmp_path):
    loop = make_loop(tmp_path, max_steps=10, checkpoint={"every": 4})
    summary = loop.run()
    assert loop.checkpointer.saved == [4, 8, 10]
    assert summary["checkpoint"] == str(Path("checkpoints/step-00000010"))


def test_step_hooks_run_after_every_step_once_its_log_and_checkpoint_are_written(tmp_path):
    seen = []
    loop = None

    def hook(step):
        seen.append((step, list(loop.checkpointer.saved), loop.sinks[0].steps()[-1]))

    loop = make_loop(tmp_path, max_steps=3, checkpoint={"every": 2}, step_hooks=[hook])
    loop.run()
    assert seen == [(1, [], 1), (2, [2], 2), (3, [2, 3], 3)]


def test_evaluation_runs_every_eval_every_steps_and_at_the_end_and_its_metrics_are_logged(tmp_path):
    loop = make_loop(tmp_path, max_steps=5, eval_every=2, eval_loader=loader())
    loop.run()
    assert [step for step, m in loop.sinks[0].rows if "eval_loss" in m] == [2, 4, 5]
    assert all(m["eval_samples"] == SAMPLES for _, m in loop.sinks[0].rows if "eval_loss" in m)
    assert loop.model.training  # evaluation hands the model back in training mode


# --------------------------------------------------------------------------- non-finite values
def test_a_nan_loss_stops_the_run_at_the_next_log_step(tmp_path):
    loop = make_loop(tmp_path, max_steps=6, log_every=2, strategy=FakeStrategy(nan_at={3}))
    with pytest.raises(NonFiniteError, match="non-finite loss at step 3; stopped at step 4"):
        loop.run()
    assert loop.sinks[0].steps() == [2, 4] and loop.checkpointer.saved == []


def test_a_nan_loss_never_reaches_a_checkpoint(tmp_path):
    loop = make_loop(tmp_path, max_steps=6, log_every=100, checkpoint={"every": 2}, strategy=FakeStrategy(nan_at={3}))
    with pytest.raises(NonFiniteError, match=r"non-finite loss at step 3; stopped at step 4 .*"
                                             r"last good checkpoint: checkpoints/step-00000002"):
        loop.run()
    assert loop.checkpointer.saved == [2]


def test_skip_step_discards_the_nan_step_and_counts_it(tmp_path):
    loop = make_loop(tmp_path, max_steps=4, on_nonfinite="skip_step", strategy=FakeStrategy(nan_at={2}))
    summary = loop.run()
    assert loop.strategy.steps() == ["forward_backward", "optimizer_step", "forward_backward",
                                     "forward_backward", "optimizer_step", "forward_backward", "optimizer_step"]
    assert loop.state.skipped_steps == 1 and summary["steps"] == 4
    assert all(torch.isfinite(p).all() for p in loop.model.parameters())
    rows = dict(loop.sinks[0].rows)
    assert "loss" not in rows[2] and rows[2]["skipped_steps"] == 1  # a skipped step's NaN is not averaged in
    assert rows[4]["skipped_steps"] == 1 and math.isfinite(rows[4]["loss"])


def test_skip_step_stops_after_max_skipped_steps(tmp_path):
    loop = make_loop(tmp_path, max_steps=6, on_nonfinite="skip_step", max_skipped_steps=1,
                     strategy=FakeStrategy(nan_at={2, 4}))
    with pytest.raises(NonFiniteError, match="2 optimizer steps skipped .* more than trainer.max_skipped_steps 1"):
        loop.run()
    assert loop.state.step == 4
