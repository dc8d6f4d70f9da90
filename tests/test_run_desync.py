"""Ranks that call different collectives are caught and both sides named, with launch.debug_collectives
(issue 29): real `trainkit run`, 2 ranks, gloo, rank 1's DDP gradient all-reduce of step 6 made to
differ by tests/fault_injection.py (TRAINKIT_FAULT_DESYNC)."""

from __future__ import annotations

import time

import pytest

from run_helpers import mlp_recipe, trainkit
from test_run_hang import _left_running

from trainkit.runtime.checkpoint import newest_valid

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)


COLLECTIVE_TIMEOUT_S = 90
HANG_TIMEOUT_S = 5  # shorter than a failing rank's exit on a loaded machine: that exit is not a hang


@pytest.mark.parametrize("how, rank_1_runs, restarts", [
    ("shape", "rank 1 runs ALLREDUCE #21 of shape [7555], Float", 0),  # one element short
    ("skip", "rank 1 runs ALLREDUCE #21 of shape [2], Float", 1),  # already at the interval's loss all-reduce
])
def test_with_debug_collectives_a_desync_ends_at_once_naming_both_sides(tmp_path, how, rank_1_runs, restarts):
    """Guards launch.debug_collectives: TORCH_DISTRIBUTED_DEBUG=DETAIL for the workers, gloo joined
    under another name (torch 2.14's DDP segfaults on a wrapped group named gloo), and the launcher's
    line naming both sides from the ranks' errors. Rank 1 skips its gradient all-reduce of step 6, or
    all-reduces one element fewer. Without the switch gloo aborts rank 1 and rank 0 fails with
    'Connection reset by peer': nothing names a collective or a side. With it, torch's fingerprint check
    fails both ranks before the collective runs, and trainkit says which rank ran which collective; not
    declared a hang (the failing ranks' exit is not watched), nothing left running, the step-4
    checkpoint intact. With a restart allowed, the restarted ranks stop at once ("not restarting")
    instead of redoing steps 5-6 into the same desync (the fatal marker)."""
    recipe = mlp_recipe(tmp_path, how, trainer={"max_steps": 40, "log_every": 2, "checkpoint": {"every": 4, "keep": 2}},
                        launch={"nproc_per_node": 2, "timeout_s": COLLECTIVE_TIMEOUT_S,
                                "hang_timeout_s": HANG_TIMEOUT_S, "debug_collectives": True,
                                "max_restarts": restarts})
    started = time.monotonic()
    result = trainkit(tmp_path, "run", str(recipe), timeout=COLLECTIVE_TIMEOUT_S + 60,
                      TRAINKIT_FAULT_DESYNC=f"rank=1,step=6,how={how}")
    took = time.monotonic() - started
    assert result.returncode == 1, result.output
    assert took < COLLECTIVE_TIMEOUT_S, f"{took:.0f} s"
    line = next((x for x in result.stderr.splitlines() if x.startswith("trainkit: collective desync")), "")
    assert "rank 0 runs ALLREDUCE #21 of shape [7556], Float" in line and rank_1_runs in line, result.output
    assert "hang:" not in result.stderr and "Segmentation" not in result.output, result.output
    if restarts:
        assert "not restarting (a restart would repeat it" in result.stderr, result.output
    assert not _left_running(tmp_path)
    assert newest_valid(tmp_path / "runs" / how / "checkpoints", warn=False).name == "step-00000004"
