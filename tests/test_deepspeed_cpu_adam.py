"""`offload_optimizer: cpu` steps in DeepSpeed's CPU Adam (docs/strategies.md, "Optimizer offload").

One 2-rank launch of the cell runner trains ZeRO-2 with optimizer offload five ways -- adamw and
adam (weight decay on) in DeepSpeed's CPU Adam, each in torch's optimizer as before
(`strategy.config: {zero_force_ds_cpu_optimizer: false}`), and sgd (torch's, with the reason
printed) -- each trained, resumed from its step-4 checkpoint and exported. The sgd run accumulates 2 micro-steps
and follows the one-process trajectory (ZeRO-2 with optimizer offload and accumulation). The first run on a machine JIT-builds CPU Adam (~60 s on 2 cores): the
launch shares `strategy_runs.deepspeed_env`'s extension folder, so CI builds it once.

Tolerance (TOLERANCE, relative, every step's loss): CPU Adam computes torch's update in fp32 with
vectorised arithmetic, so the losses agree to rounding. Measured over the 6 steps (2026-11-26): adamw
1.3e-7, adam 0 (bitwise equal); resumed steps equal bitwise. A wrong mapping moves them far more:
adam run in adamw mode differs by 1e-2 from step 2 (checked by breaking the mapping).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cell_launch import train_cells
from run_helpers import merged
from strategy_runs import SEEDED_MLP, deepspeed_env

pytestmark = pytest.mark.distributed

STEPS = 6
TOLERANCE = 1e-5
OFFLOAD = merged(SEEDED_MLP, {
    "strategy": {"name": "deepspeed", "zero_stage": 2, "offload_optimizer": "cpu"},
    "optimizer": {"name": "adamw", "lr": 0.01, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1},
    "trainer": {"max_steps": STEPS, "log_every": 1, "checkpoint": {"every": 2, "keep": 3}},
})
TORCH_OPTIMIZER = {"config": {"zero_force_ds_cpu_optimizer": False}}


@pytest.fixture(scope="module")
def cells(request, tmp_path_factory) -> dict[str, dict]:
    recipes = {}
    for name in ("adamw", "adam"):
        recipe = merged(OFFLOAD, {"optimizer": {**OFFLOAD["optimizer"], "name": name}})
        recipes[f"cpu-{name}"] = recipe
        recipes[f"torch-{name}"] = merged(recipe, {"strategy": TORCH_OPTIMIZER})
    # sgd, with 2 accumulation micro-steps of 4 per rank (DeepSpeed's gradient_accumulation_steps): the seeded
    # MLP's global batch of 16, so it also follows the one-process run of strategy_runs (`single`)
    recipes["sgd"] = merged(OFFLOAD, {"optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
                                      "data": {"batch_size": 4}, "trainer": {"grad_accum_steps": 2}})
    env = deepspeed_env(request, tmp_path_factory)
    results = train_cells(tmp_path_factory.mktemp("cpu-adam"), recipes, timeout=420, **env)
    return {name: {**result, "extensions": env["TORCH_EXTENSIONS_DIR"]} for name, result in results.items()}


def steps(losses: dict) -> list[float]:
    return [losses[str(s)] for s in range(1, STEPS + 1)]


@pytest.mark.parametrize("name", ["adamw", "adam"])
def test_cpu_adam_trains_like_torchs_optimizer_and_resumes_exactly(cells, name):
    """Guards the mapping of the recipe's optimizer onto CPU Adam (lr, betas, eps, weight decay; adam's
    L2 term vs adamw's decoupled decay) and its checkpointed state: the run equals the torch-optimizer
    offload run within TOLERANCE, its resume from step 4 redoes steps 5-6 to rounding, it exports."""
    cpu, torch_run = cells[f"cpu-{name}"], cells[f"torch-{name}"]
    assert steps(cpu["losses"]) == pytest.approx(steps(torch_run["losses"]), rel=TOLERANCE)
    assert steps(cpu["losses"])[-1] < steps(cpu["losses"])[0]
    assert cpu["resumed_from"] == "step-00000004"
    assert steps(cpu["resumed_losses"]) == pytest.approx(steps(cpu["losses"]), rel=1e-6)
    assert cpu["export"]["finite"], cpu["export"]


def test_offload_runs_deepspeeds_cpu_adam_and_says_when_it_cannot(cells):
    """Guards that CPU Adam is what steps and that the console says which optimizer does: CPU Adam's
    op is built in the extension folder, each CPU Adam pass (2 runs x train and resume) says so, and
    a run kept on torch's optimizer prints why (asked for by the config; sgd, which CPU Adam cannot
    run, still trains)."""
    log = cells["cpu-adamw"]["log"]
    for name in ("adamw", "adam"):
        assert log.count(f"trainkit: optimizer offload steps in DeepSpeed's CPU Adam ({name})\n") == 2, log[-4000:]
    note = ("trainkit: note: optimizer offload steps in torch's adamw, not DeepSpeed's CPU Adam: strategy.config "
            "sets zero_force_ds_cpu_optimizer: false")
    assert log.count(note) == 2, log[-4000:]
    sgd = ("trainkit: note: optimizer offload steps in torch's sgd, not DeepSpeed's CPU Adam: DeepSpeed's CPU "
           "optimizer is Adam/AdamW only; optimizer sgd has none")
    assert log.count(sgd) == 2 and steps(cells["sgd"]["losses"])[-1] < steps(cells["sgd"]["losses"])[0], log[-4000:]
    assert list(Path(cells["cpu-adamw"]["extensions"]).glob("cpu_adam/cpu_adam*.so")), "CPU Adam was not built"


def test_preflight_refuses_offload_when_cpu_adam_cannot_be_compiled(tmp_path, monkeypatch):
    """Guards the refusal before launch: with CPU Adam not yet built (an empty extension folder) and no
    C++ compiler, `trainkit run`'s preflight names strategy.offload_optimizer and what to install,
    instead of a compiler error from inside the first step."""
    from run_helpers import write_recipe

    from trainkit.recipe import resolve
    from trainkit.runtime.preflight import check

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("CXX", "no-such-c++")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    problems = check(resolve(write_recipe(tmp_path, "offload", OFFLOAD)))
    found = [p for p in problems if "offload_optimizer" in str(p.path)]
    assert found and found[0].severity == "error", problems
    assert "CPU Adam" in found[0].message and "g++" in found[0].message


def test_zero2_with_optimizer_offload_and_accumulation_follows_the_one_process_trajectory(cells, single):
    """ZeRO-2, optimizer state offloaded to the CPU (torch's sgd: no CPU Adam), 2 accumulation micro-steps
    of 4 per rank (DeepSpeed's gradient_accumulation_steps): the one process's losses at batch 16, its 6
    steps (the removed launch of tests/test_strategies_deepspeed.py compared 20)."""
    from strategy_runs import RTOL

    assert steps(cells["sgd"]["losses"]) == pytest.approx(single[:STEPS], rel=RTOL)
