"""`trainkit tune`'s procedure around the trials, in-process: the trials are scripted (a machine whose
throughput each change multiplies by a known factor, with ±1% jitter), everything else is the real
Tuner. What a real trial would do first is done for real: every candidate's overrides must resolve to a
valid recipe. Covers what the real-run tests (test_tune.py) are too slow for in CI: the combination of
kept changes and its verification, the batch rule (learning rate scaled and stated), precision only
with --allow, and the FSDP/DeepSpeed knobs."""

from __future__ import annotations

import random
from pathlib import Path

import yaml

from run_helpers import mlp_recipe

from trainkit.launch import tune
from trainkit.recipe import resolve


class ScriptedRunner:
    """Trials drawn from `factors` ({(key, value): throughput factor}) instead of run; the baseline's
    evidence, when given, is what its run's report would have reasoned from."""

    def __init__(self, recipe_path: str, overrides: list[str], factors: dict, evidence=None):
        self.recipe_path, self.overrides, self.factors, self.evidence = recipe_path, overrides, factors, evidence
        self.jitter, self.resolved_trials, self.kept_dirs = random.Random(0), [], []

    def run(self, index, arm, timeout):
        recipe = resolve(self.recipe_path, [*self.overrides, *arm.overrides()]).recipe  # as a real trial starts
        self.resolved_trials.append((arm.name, recipe))
        value = 100.0 * (1 + self.jitter.uniform(-0.01, 0.01))
        key = tuple(sorted(arm.changes.items()))
        if key in self.factors:  # the machine's answer for this exact set of changes (a combination)
            value *= self.factors[key]
        else:
            for change in arm.changes.items():
                value *= self.factors.get(change, 1.0)
        return tune.Trial(arm.name, f"t{index}", 0, 0.01, value, evidence=self.evidence if index == 1 else None)


def _tune(tmp_path: Path, recipe: Path, knobs, factors: dict, allow: str = "", overrides=(), evidence=None):
    out = tmp_path / "tuned.yaml"
    options = tune.Options(budget_s=600, steps=12, knobs=knobs.split(",") if knobs is not None else None, out=out,
                           allow=frozenset(a for a in allow.split(",") if a))
    runner = ScriptedRunner(str(recipe), list(overrides), factors, evidence)
    tuner = tune.Tuner(resolve(str(recipe), list(overrides)), str(recipe), list(overrides), options, runner=runner)
    assert tuner.run() == 0
    tuner.resolved_trials = runner.resolved_trials
    return tuner, out


def _differences(a: dict, b: dict, prefix: str = "") -> dict:
    keys = set(a) | set(b)
    found = {}
    for k in keys:
        if isinstance(a.get(k), dict) and isinstance(b.get(k), dict):
            found.update(_differences(a[k], b[k], f"{prefix}{k}."))
        elif a.get(k) != b.get(k):
            found[prefix + k] = (a.get(k), b.get(k))
    return found


def test_two_kept_changes_are_combined_verified_and_written_together(tmp_path, capsys):
    recipe = mlp_recipe(tmp_path, "two", data={"num_workers": 0}, strategy={"name": "ddp", "bucket_cap_mb": 0.05})
    tuner, out = _tune(tmp_path, recipe, "num_workers,bucket_cap_mb",
                       {("data.num_workers", 1): 1.5, ("strategy.bucket_cap_mb", 25.0): 1.3})
    assert tuner.combination is not None and tuner.final is tuner.combination
    combo_trials = [r for name, r in tuner.resolved_trials if name == "num_workers=1+bucket_cap_mb=25"]
    assert len(combo_trials) >= 5  # verified by its own pairs, like every change
    assert all(r.data.num_workers == 1 and r.strategy.bucket_cap_mb == 25.0 for r in combo_trials)
    assert 0.9 < tuner.combination.verdict.gain / 0.95 < 1.1  # 1.5 x 1.3

    text = out.read_text()
    tuned = yaml.safe_load(text)
    assert _differences(yaml.safe_load(recipe.read_text()), tuned) == {
        "data.num_workers": (0, 1), "strategy.bucket_cap_mb": (0.05, 25.0)}
    assert "# combination num_workers=1+bucket_cap_mb=25: +9" in text
    assert "num_workers: 1  # tune: was 0; num_workers=1: +5" in text
    assert "bucket_cap_mb: 25.0  # tune: was 0.05; bucket_cap_mb=25: +2" in text
    tuned_recipe = resolve(str(out), []).recipe  # the written recipe is valid as it stands
    assert (tuned_recipe.data.num_workers, tuned_recipe.strategy.bucket_cap_mb) == (1, 25.0)
    report = capsys.readouterr().out
    assert "| num_workers=1+bucket_cap_mb=25 |" in report and "combination verified" in report


def test_a_combination_slower_than_its_best_part_is_not_used(tmp_path, capsys):
    recipe = mlp_recipe(tmp_path, "clash", data={"num_workers": 0}, strategy={"name": "ddp", "bucket_cap_mb": 0.05})
    both = tuple(sorted({"data.num_workers": 1, "strategy.bucket_cap_mb": 25.0}.items()))
    tuner, out = _tune(tmp_path, recipe, "num_workers,bucket_cap_mb",
                       {("data.num_workers", 1): 1.5, ("strategy.bucket_cap_mb", 25.0): 1.3, both: 1.2})
    assert tuner.final.name == "num_workers=1"
    tuned = yaml.safe_load(out.read_text())
    assert _differences(yaml.safe_load(recipe.read_text()), tuned) == {"data.num_workers": (0, 1)}
    report = capsys.readouterr().out
    assert "Result: **num_workers=1**" in report
    assert "slower than num_workers=1 alone" in report  # why the verified combination was not used


def test_a_bigger_batch_is_tried_only_when_allowed_and_scales_the_learning_rate(tmp_path, capsys):
    recipe = mlp_recipe(tmp_path, "batch")
    factors = {("data.batch_size", 16): 1.4, ("data.batch_size", 32): 1.6}
    tuner, out = _tune(tmp_path, recipe, "batch_size", factors)
    assert tuner.final is None and not tuner.arms
    assert "skipped batch_size: changes the training (batch): tried only with --allow batch" in capsys.readouterr().out

    tuner, out = _tune(tmp_path, recipe, "batch_size", factors, allow="batch")
    tried = {name: (r.data.batch_size, r.optimizer.lr) for name, r in tuner.resolved_trials if name != "baseline"}
    assert tried == {"batch_size=16": (16, 0.2), "batch_size=32": (32, 0.4)}  # the linear scaling rule
    assert tuner.final.name == "batch_size=32"
    text = out.read_text()
    assert _differences(yaml.safe_load(recipe.read_text()), yaml.safe_load(text)) == {
        "data.batch_size": (8, 32), "optimizer.lr": (0.1, 0.4)}
    assert "# semantic change: global batch 16 -> 64, optimizer.lr 0.1 -> 0.4 (linear scaling rule" in text
    assert "Semantic change: global batch 16 -> 64" in capsys.readouterr().out


def test_precision_needs_allow_and_the_change_is_stated(tmp_path, capsys):
    recipe = mlp_recipe(tmp_path, "precision")
    tuner, out = _tune(tmp_path, recipe, "precision,comm_hook",
                       {("precision", "bf16"): 1.3, ("strategy.comm_hook", "bf16_compress"): 1.0}, allow="precision")
    assert {name for name, _ in tuner.resolved_trials} == {"baseline", "precision=bf16", "comm_hook=bf16_compress"}
    assert tuner.final.name == "precision=bf16"
    assert yaml.safe_load(out.read_text())["precision"] == "bf16"
    assert "# semantic change: precision fp32 -> bf16" in out.read_text()
    report = capsys.readouterr().out
    assert "| comm_hook=bf16_compress |" in report and "no significant gain" in report


def test_sharded_strategies_get_their_own_knobs(tmp_path):
    fsdp = mlp_recipe(tmp_path, "fsdp", strategy={"name": "fsdp"})
    tuner, out = _tune(tmp_path, fsdp, "reshard_after_forward,bucket_cap_mb",
                       {("strategy.reshard_after_forward", False): 1.25})
    assert [s[0] for s in tuner.skipped] == ["bucket_cap_mb"]
    assert yaml.safe_load(out.read_text())["strategy"]["reshard_after_forward"] is False
    assert any(name == "reshard_after_forward=false" and r.strategy.reshard_after_forward is False
               for name, r in tuner.resolved_trials)

    zero = mlp_recipe(tmp_path, "zero", strategy={"name": "deepspeed", "zero_stage": 3})
    tuner, out = _tune(tmp_path, zero, "zero_stage", {("strategy.zero_stage", 2): 1.2})
    assert [(name, r.strategy.zero_stage) for name, r in tuner.resolved_trials if name != "baseline"][0] == \
        ("zero_stage=2", 2)
    assert yaml.safe_load(out.read_text())["strategy"]["zero_stage"] == 2


def test_the_host_allocator_is_tried_against_the_strategys_own_choice(tmp_path):
    """`auto` is each strategy's measured policy on the CPU (retain for DDP, release for FSDP): tune tries
    the other one, and writes it only when it measured faster."""
    ddp = mlp_recipe(tmp_path, "ddp")
    cpu = ("launch.backend=gloo",)  # a CPU run on any machine (the knob is for CPU runs)
    tuner, out = _tune(tmp_path, ddp, "host_allocator", {("performance.host_allocator", "release"): 0.7},
                       overrides=cpu)
    tried = [(name, r.performance.host_allocator) for name, r in tuner.resolved_trials if name != "baseline"]
    assert tried and all(t == ("host_allocator=release", "release") for t in tried)  # one arm, in pairs
    assert not out.exists()  # nothing proven faster: no tuned recipe

    fsdp = mlp_recipe(tmp_path, "fsdp", strategy={"name": "fsdp"})
    tuner, out = _tune(tmp_path, fsdp, "host_allocator", {("performance.host_allocator", "retain"): 1.2},
                       overrides=cpu)
    assert [name for name, _ in tuner.resolved_trials if name != "baseline"][0] == "host_allocator=retain"
    assert yaml.safe_load(out.read_text())["performance"]["host_allocator"] == "retain"

    from trainkit.launch import tune_knobs
    knob = tune_knobs.all_knobs()["host_allocator"]
    gpu_recipe = resolve(str(ddp)).recipe
    assert "CUDA's caching allocator" in tune_knobs.not_applicable(knob, gpu_recipe, {"cuda": True})


def test_the_tuned_recipe_comments_each_changed_key_by_its_place_in_the_document():
    """Comments go beside the key found by its path (not by matching text), and beside no value that
    spans lines: a multi-line value's comment goes on top, and the document still loads as written."""
    from trainkit.launch import tune_yaml

    raw = {"data": {"batch_size": 8, "num_workers": 0}, "notes": {"num_workers": "a\nb"}, "name": "x"}
    text = tune_yaml.with_changes(raw, {"data.num_workers": 2, "notes.num_workers": "c\nd"},
                                  {"data.num_workers": "was 0", "notes.num_workers": "was a b"}, ["header"])
    assert text.startswith("# header\n# notes.num_workers: was a b\n")
    assert "  num_workers: 2  # was 0\n" in text and text.count("# was 0") == 1
    assert yaml.safe_load(text) == {"data": {"batch_size": 8, "num_workers": 2}, "notes": {"num_workers": "c\nd"},
                                    "name": "x"}
    assert raw["data"]["num_workers"] == 0  # the recipe as given is not changed
