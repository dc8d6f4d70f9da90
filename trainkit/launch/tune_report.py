"""What `trainkit tune` writes: the report (`<out>.report.md`, also printed) and the tuned recipe
(`<out>`: the recipe as given with only the kept changes, each with its measured gain beside it)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..analysis.advice import show
from ..analysis.bottleneck import Diagnosis
from ..run_dir import WARMUP_STEPS
from . import tune_knobs, tune_stats, tune_yaml
from .tune_plan import Arm, Plan


@dataclass
class Result:
    """Everything a tune found, for its report and its tuned recipe."""

    resolved: Any  # the recipe as given (recipe.resolver.Resolved)
    source: str  # the recipe path and overrides as given
    out: Path
    steps: int
    budget_s: float
    trials: int
    elapsed_s: float
    measured: tune_stats.Measurements
    plan: Plan = field(default_factory=Plan)
    diagnosis: Optional[Diagnosis] = None
    combination: Optional[Arm] = None
    final: Optional[Arm] = None
    stopped: str = ""  # why the tune ended early
    kept_dirs: list[Path] = field(default_factory=list)

    @property
    def report_path(self) -> Path:
        return self.out.with_suffix(".report.md")


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f}, {len(values)})"


def _decision(r: Result, arm: Arm) -> str:
    v = arm.verdict
    if arm.failure:
        return "failed: " + arm.failure[:200]
    if arm is not r.combination:
        return "kept" if v and v.decision == tune_stats.KEEP else v.decision if v else "not measured"
    kept = v is not None and v.decision == tune_stats.KEEP
    decision = "combination " + ("verified" if kept else "not verified: " + (v.decision if v else "not measured"))
    if kept and r.final is not None and r.final is not arm:
        decision += f", but slower than {r.final.name} alone: not used"
    return decision


def report(r: Result) -> str:
    recipe = r.resolved.recipe
    base = r.measured.values("baseline")
    noise = r.measured.noise()
    lines = [f"# trainkit tune: {recipe.name}", "",
             f"Recipe `{r.source}`: {r.trials} trial(s) of {r.steps} steps in {r.elapsed_s / 60:.1f} min (budget "
             f"{r.budget_s / 60:g} min), {recipe.world_size} process(es) each; the first {WARMUP_STEPS} steps of each "
             f"trial are warm-up and not measured.", ""]
    if r.diagnosis is not None:
        lines += [f"Baseline diagnosis: **{r.diagnosis.kind}**: {r.diagnosis.headline}", ""]
    if base:
        lines.append(f"Noise: consecutive baseline trials differ by {noise:.1%} (median)." if noise is not None
                     else "Noise: only one baseline trial (no baseline-vs-baseline pair).")
    lines += [f"Rule: a change is kept when, over at least {tune_stats.MIN_PAIRS} pairs, the bootstrap 95% "
              f"interval of its paired throughput ratios (each trial against the baseline trials around it) "
              f"lies above 1 and its median gain is at least {tune_stats.MIN_GAIN:.0%} and "
              f"{tune_stats.NOISE_FACTOR:g}x the noise (the baseline's, or the spread of its own ratios if "
              f"larger); at most {tune_stats.MAX_PAIRS} pairs per change.", "",
              "| change | values tried | samples/s median (min-max, trials) | ratio vs baseline (95% interval) "
              "| decision |", "|---|---|---|---|---|"]
    lines.append(f"| baseline | as given | {_spread(base)} | 1 | - |")
    for arm in r.plan.arms + ([r.combination] if r.combination else []):
        tried = ", ".join(f"{k}: {show(tune_knobs.get(recipe, k))} -> {show(v)}" for k, v in arm.changes.items())
        v = arm.verdict
        ratio = "-" if not v or v.gain is None else f"{1 + v.gain:.3f} ({v.interval()})"
        lines.append(f"| {arm.name} | {tried} | {_spread(r.measured.values(arm.name))} | {ratio} | "
                     f"{_decision(r, arm)} |")
    lines.append("")
    if r.plan.skipped:
        lines += ["Not tried:", *[f"- {name}: {why}" for name, why in r.plan.skipped], ""]
    if r.plan.unpointed:
        lines += [f"Not pointed at by the baseline's advice (name them with --knobs to try them): "
                  f"{', '.join(r.plan.unpointed)}.", ""]
    if r.stopped:
        lines += [f"Stopped early: {r.stopped}.", ""]
    if r.final is not None:
        v = r.final.verdict
        lines.append(f"Result: **{r.final.name}** is {v.gain:+.1%} samples/s (95% interval of the ratio "
                     f"{v.interval()}) -> {r.out}")
        if r.final.note:
            lines.append(f"Semantic change: {r.final.note}.")
    else:
        lines.append("Result: **no change**: nothing tried was proven faster than the recipe as given "
                     "(no tuned recipe written).")
    if r.kept_dirs:
        lines += ["", "Kept (undelivered tracking records): " + ", ".join(map(str, r.kept_dirs))]
    return "\n".join(lines) + "\n"


def tuned_recipe(r: Result) -> str:
    """The recipe as given (composed, overrides applied, `${...}` kept) with only the kept changes, each
    with a comment giving its measured gain."""
    assert r.final is not None
    recipe = r.resolved.recipe
    changes, comments = {}, {}
    parts = r.final.name.split("+")
    for arm in [a for a in r.plan.arms if a.name in parts] or [r.final]:
        v = arm.verdict
        for path, value in arm.changes.items():
            changes[path] = value
            comments[path] = (f"tune: was {show(tune_knobs.get(recipe, path))}; {arm.name}: {v.gain:+.1%} "
                              f"samples/s (95% interval of the ratio {v.interval()}, {v.pairs} pairs)")
    header = [f"Tuned by `trainkit tune` from {r.resolved.redact_text(r.source)} on {time.strftime('%Y-%m-%d')}: "
              f"only changes proven faster are applied (report: {r.report_path.name})"]
    if r.final is r.combination and r.final.verdict:
        header.append(f"combination {r.final.name}: {r.final.verdict.gain:+.1%} samples/s "
                      f"(95% interval {r.final.verdict.interval()})")
    if r.final.note:
        header.append(f"semantic change: {r.final.note}")
    return tune_yaml.with_changes(r.resolved.raw, changes, comments, header)
