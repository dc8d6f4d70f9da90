"""A strategy plugin that subclasses a built-in strategy inherits everything its parent can do: its
rules, its `trainkit tune` knobs, its communication advice and its lines in `trainkit plan`.

The plugin is the documented example of docs/plugins.md (`MyDdpOptions(DDPOptions)` registered as
`my_ddp`), plus a pipeline subclass, installed as a real distribution (dist-info with entry points)
in a throwaway folder; one child process answers every question for the parent and the subclass,
and the answers must be the same (a name check anywhere makes the subclass lose one)."""

from __future__ import annotations

import pytest
import json
import os
import subprocess
import sys
import textwrap

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)


OPTIONS = '''
from typing import ClassVar, Literal

from trainkit.recipe.blocks import DDPOptions, PipelineOptions


class MyDdpOptions(DDPOptions):
    component: ClassVar[str] = "trainkit_my_ddp.strategy:MyDdpStrategy"
    name: Literal["my_ddp"]


class MyPipelineOptions(PipelineOptions):
    component: ClassVar[str] = "trainkit_my_ddp.strategy:MyPipelineStrategy"
    name: Literal["my_pipeline"]
'''

STRATEGY = '''
from trainkit.strategies.ddp import DDPStrategy
from trainkit.strategies.pipeline import PipelineStrategy


class MyDdpStrategy(DDPStrategy):
    def setup(self, model, optimizer_factory):
        model, optimizer = super().setup(model, optimizer_factory)
        return model, optimizer


class MyPipelineStrategy(PipelineStrategy):
    pass
'''

ENTRY_POINTS = '''
[trainkit.strategies]
my_ddp = trainkit_my_ddp.options:MyDdpOptions
my_pipeline = trainkit_my_ddp.options:MyPipelineOptions
'''

# Everything asked of one strategy name; printed as JSON with the strategy's name replaced by "S".
PROBE = '''
import json, sys, tempfile
from pathlib import Path

import yaml

from trainkit.launch import tune_knobs
from trainkit.analysis.bottleneck import diagnose
from trainkit.recipe import RecipeError, resolve
from trainkit.recipe.plan import describe


def recipe_file(name, strategy=None, **extra):
    data = {"name": "plugin-probe", "model": {"name": "mlp"},
            "data": {"name": "synthetic", "batch_size": 6, "shape": [3, 8, 8]},
            "strategy": {"name": name, **(strategy or {})},
            "trainer": {"max_steps": 100}, "launch": {"nproc_per_node": 4}, **extra}
    path = Path(tempfile.mkdtemp()) / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def problems(path):
    try:
        resolve(path)
    except RecipeError as exc:
        return sorted(f"{p.path}: {p.message}" for p in exc.problems)
    return []


def comm_bound_ranks():
    return [{"rank": r, "host": "node-a", "steps": 50, "total": 0.1, "data_wait": 0.002, "forward": 0.02,
             "backward": 0.073, "optimizer": 0.005, "comm": 0.06, "comm_exposed": 0.04} for r in range(4)]


out = {}
for name in sys.argv[1:]:
    if "pipeline" in name:
        out[name] = {
            "rules": problems(recipe_file(name, strategy={"microbatches": 4})),
            "plan": [line for line in describe(resolve(recipe_file(name, strategy={"microbatches": 2})),
                                                "recipe.yaml", []).splitlines() if line.startswith("pipeline:")],
        }
        continue
    gpu = {"cuda": True}
    recipe = resolve(recipe_file(name, strategy={"bucket_cap_mb": 5})).recipe
    applicable = sorted(k for k, knob in tune_knobs.all_knobs().items()
                        if knob.owner is not None and tune_knobs.not_applicable(knob, recipe, gpu) is None)
    d = diagnose(comm_bound_ranks(), recipe, env={"device": "cuda", "backend": "nccl", "bf16": True})
    out[name] = {
        "rules": problems(recipe_file(name, performance={"sync_batchnorm": True})),
        "strategy_knobs": applicable,
        "advice": [a.text for a in d.ranked()],
        "verdict": d.kind,
    }
print(json.dumps(out))
'''


def install_plugin(site):
    package = site / "trainkit_my_ddp"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "options.py").write_text(textwrap.dedent(OPTIONS))
    (package / "strategy.py").write_text(textwrap.dedent(STRATEGY))
    info = site / "trainkit_my_ddp-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: trainkit-my-ddp\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)


def test_a_subclass_of_a_builtin_strategy_gets_its_rules_knobs_advice_and_plan_lines(tmp_path):
    site = tmp_path / "site"
    install_plugin(site)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", PROBE, "ddp", "my_ddp", "pipeline", "my_pipeline"],
                          capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    ddp, mine = seen["ddp"], seen["my_ddp"]

    # the parent's behaviour, as the subclass must inherit it
    assert ddp["rules"] == []  # sync_batchnorm is a DDP option: allowed
    assert {"bucket_cap_mb", "comm_hook", "static_graph", "gradient_as_bucket_view"} <= set(ddp["strategy_knobs"])
    assert "zero_stage" not in ddp["strategy_knobs"] and "reshard_after_forward" not in ddp["strategy_knobs"]
    assert ddp["verdict"] == "communication-bound"
    assert any("strategy.comm_hook" in text for text in ddp["advice"])
    assert any("strategy.bucket_cap_mb" in text for text in ddp["advice"])

    assert mine == ddp  # rules, knobs, advice and verdict: identical for the subclass

    pipe, my_pipe = seen["pipeline"], seen["my_pipeline"]
    assert any("not divisible by strategy.microbatches 4" in p for p in pipe["rules"]), pipe
    assert pipe["plan"] and "4 stages" in pipe["plan"][0], pipe
    assert my_pipe == pipe


def test_a_strategy_that_does_not_support_an_option_says_which_and_why(tmp_path):
    """The refusal names the option and the strategy, and the reason comes from the strategy."""
    import yaml

    from trainkit.recipe import RecipeError, resolve

    path = tmp_path / "fsdp.yaml"
    path.write_text(yaml.safe_dump({
        "name": "fsdp-sbn", "model": {"name": "mlp"}, "data": {"name": "synthetic", "batch_size": 4},
        "strategy": {"name": "fsdp"}, "trainer": {"max_steps": 2}, "launch": {"nproc_per_node": 2},
        "performance": {"sync_batchnorm": True}}))
    try:
        resolve(path)
    except RecipeError as exc:
        messages = [p.message for p in exc.problems if p.path == "performance.sync_batchnorm"]
    else:
        messages = []
    assert len(messages) == 1, messages
    assert "not supported by strategy fsdp" in messages[0] and "FSDP2 does not synchronise" in messages[0]


def test_a_precision_the_strategy_does_not_train_in_is_refused_by_validate(tmp_path):
    """The pipeline declares fp32 and bf16 only (no fp16 loss scaling across stages): validate refuses
    fp16 at its line, before anything imports torch."""
    import yaml

    from trainkit.recipe import RecipeError, resolve

    path = tmp_path / "pipe.yaml"
    path.write_text(yaml.safe_dump({"name": "p", "model": {"name": "mlp"}, "data": {"name": "synthetic",
                    "batch_size": 4}, "strategy": {"name": "pipeline", "microbatches": 2}, "precision": "fp16",
                    "trainer": {"max_steps": 2}, "launch": {"nproc_per_node": 2}}))
    try:
        resolve(path)
    except RecipeError as exc:
        found = [p.message for p in exc.problems if p.path == "precision"]
    else:
        found = []
    assert found and "strategy pipeline does not train in fp16" in found[0], found
