"""Shared set-up of the per-strategy correctness tests (tests/test_strategies_*.py).

Every strategy is compared with the same single-process run: an MLP (4 Linear layers, so it also
splits into 2 or 4 pipeline stages), 16 samples per optimizer step, SGD with momentum, fp32,
20 steps, checkpoints every 10.

Tolerance (RTOL 1e-5 relative on every step's loss): each strategy computes the same gradients as
one process in exact arithmetic -- DDP/FSDP/ZeRO average per-rank means over 2 ranks, the pipeline
averages per-micro-batch means -- so they differ only in fp32 summation order, ~1e-7 relative per
step. Over 20 SGD-momentum steps that stays two orders of magnitude under 1e-5; a real bug (a
missed gradient reduction, a wrong sample split, a double-counted micro-batch, clipping left on)
moves the loss by 1e-3 or more within a couple of steps.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from run_helpers import MLP, losses, merged, summary, trainkit, write_recipe

RTOL = 1e-5
STEPS = 20
# `init: seeded` everywhere: each parameter from (seed, its module's name), so a sharded strategy that
# fills only its shards (FSDP, ZeRO-3) starts from exactly the one-process weights (runtime/materialize.py)
SEEDED_MLP = merged(MLP, {  # the preset of these tests: write_recipe(tmp, name, SEEDED_MLP, strategy=...)
    "model": {"args": {"in_features": 48, "hidden": 64, "num_classes": 4, "depth": 3}, "init": "seeded"},
    "optimizer": {"lr": 0.05},
    "trainer": {"max_steps": STEPS, "checkpoint": {"every": 10, "keep": 3}},
    "launch": {"timeout_s": 120},
})


def run(tmp: Path, path: Path, *overrides: str, **env: str) -> Path:
    result = trainkit(tmp, "run", str(path), *overrides, **env)
    assert result.returncode == 0, result.output[-6000:]
    return tmp / "runs" / path.stem


def single_process_losses(tmp: Path) -> list[float]:
    """One process, batch 16 (the global batch of 2 ranks x 8, or of a 1-data-parallel pipeline)."""
    path = write_recipe(tmp, "single", SEEDED_MLP, data={"batch_size": 16}, launch={"nproc_per_node": 1})
    out = losses(run(tmp, path))
    assert len(out) == STEPS and out[-1] < out[0]
    return out


def resume_from_step_10(tmp: Path, run_dir: Path, recipe_path: Path, **env: str) -> list[float]:
    """Drop the step-20 checkpoint of a finished run and launch it again: it resumes from step 10.
    Returns the losses of the relaunch (steps 11..20); metrics.jsonl then holds each step once (the
    first launch's steps 11..20 are set aside in metrics.rewound-*.jsonl)."""
    shutil.rmtree(run_dir / "checkpoints" / f"step-{STEPS:08d}")
    result = trainkit(tmp, "run", str(recipe_path), **env)
    assert result.returncode == 0, result.output[-6000:]
    assert Path(summary(run_dir)["resumed_from"]).name == "step-00000010"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return [r["loss"] for r in rows if r["step"] > 10]


def deepspeed_extensions_folder(config) -> Path:
    """The extension folder every DeepSpeed launch of the session uses (pytest's cache, kept across
    sessions; tests/conftest.py builds DeepSpeed's ops into it in the background)."""
    return Path(config.cache.mkdir("torch_extensions"))


def deepspeed_env(request, tmp_path_factory) -> dict:
    """DeepSpeed's CPU accelerator, and one TORCH_EXTENSIONS_DIR for every DeepSpeed launch: it
    JIT-compiles its CPU comm op on first use (~40 s), kept in pytest's cache across sessions."""
    cache = getattr(request.config, "cache", None)  # absent under `-p no:cacheprovider`
    folder = deepspeed_extensions_folder(request.config) if cache is not None else \
        tmp_path_factory.mktemp("torch_extensions")
    return {"TORCH_EXTENSIONS_DIR": str(folder), "DS_ACCELERATOR": "cpu"}
