"""The logged `loss` summarizes every step of the log interval, not only the log step."""

from __future__ import annotations

import json

import pytest

from run_helpers import MLP, losses, merged

pytestmark = pytest.mark.distributed


def rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_logged_loss_is_the_interval_mean_and_loss_max_its_largest_step(tmp_path):
    """Guards the interval accumulator: with log_every 4 the logged `loss` is the mean and
    `loss_max` the max of the 4 step losses (each the mean over the 2 ranks), which a log_every 1
    run of the same seed records one by one (CPU gloo runs are deterministic, so the step losses
    are the same floats). 1e-6 relative: the mean is taken in float64 of the same fp32 values,
    only the order of additions can differ; logging only the log step's loss misses it by ~1e-2."""
    from cell_launch import train_cells

    trainer = {"max_steps": 12, "checkpoint": {"every": 100}}
    runs = train_cells(tmp_path, {f"log{n}": merged(MLP, {"trainer": {**trainer, "log_every": n}}) for n in (1, 4)},
                       timeout=240, resume=False)  # both in one launch
    every = {n: rows(runs[f"log{n}"]["run_dir"]) for n in (1, 4)}
    per_step = [r["loss"] for r in every[1]]
    assert [r["step"] for r in every[4]] == [4, 8, 12]
    for row in every[4]:
        window = per_step[row["step"] - 4:row["step"]]
        assert row["loss"] == pytest.approx(sum(window) / 4, rel=1e-6)
        assert row["loss_max"] == pytest.approx(max(window), rel=1e-6)
    assert all(r["loss_max"] == r["loss"] for r in every[1])  # one step: mean == max == the step's loss
    assert losses(runs["log1"]["run_dir"])[-1] < per_step[0]
