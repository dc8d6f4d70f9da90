"""`trainkit tune`: measured autotuning. Try the recipe changes the bottleneck advice proposes as short
real runs, keep only what is proven faster, write the faster recipe (docs/tune.md).

The procedure is here: a baseline trial (its bottleneck evidence chooses what to try: `tune_plan`),
then rounds of candidate trials alternating with baseline trials until each change is decided
(`tune_stats`), then the kept changes combined and verified. Each trial is a real `trainkit run`
(`tune_trials`), linked to the tune's MLflow run (`tune_tracking`); the report and the tuned recipe
are written by `tune_report`.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from ..analysis.bottleneck import Diagnosis, diagnose_evidence
from ..recipe.problems import did_you_mean
from ..run_dir import WARMUP_STEPS
from . import tune_knobs, tune_plan, tune_stats
from .tune_plan import Arm, Plan
from .tune_report import Result, report, tuned_recipe
from .tune_tracking import ParentRun
from .tune_trials import MIN_STEPS, Trial, TrialRunner

__all__ = ["Options", "TuneError", "Tuner", "Arm", "Trial", "check_options", "tune"]


class TuneError(Exception):
    """A tune that cannot start: the message says why and what would work (exit 2)."""


class BaselineFailed(Exception):
    """The baseline trial measured nothing: there is nothing to compare a change with (exit 1)."""


@dataclass
class Options:
    budget_s: float
    steps: int
    knobs: Optional[list[str]]  # None: what the diagnosis points at
    out: Path
    allow: frozenset[str]


def check_options(resolved, recipe_path: str, options: Options, force: bool) -> None:
    """Everything that can be refused before the first trial (TuneError)."""
    recipe = resolved.recipe
    if _same_file(options.out, Path(recipe_path)) and not force:
        raise TuneError(f"-o {options.out} would overwrite the input recipe {recipe_path} (the same file, or a "
                        f"link to it); choose another path or pass --force")
    if recipe.launch.nnodes not in (1, "1", "1:1"):
        raise TuneError(f"launch.nnodes is {recipe.launch.nnodes}: tune runs its trials on this node only "
                        f"(launch.nnodes=1); tune on one node, then use the tuned recipe everywhere")
    if options.steps < MIN_STEPS:
        raise TuneError(f"--steps {options.steps}: at least {MIN_STEPS} (the first {WARMUP_STEPS} steps of each "
                        f"trial are warm-up and not measured)")
    known = tune_knobs.all_knobs()
    for name in options.knobs or []:
        if name not in known:
            hint = did_you_mean(name, known)
            raise TuneError(f"--knobs: unknown knob {name!r}{hint}; known: {', '.join(known)}")
    unknown = options.allow - {"batch", "precision"}
    if unknown:
        raise TuneError(f"--allow: unknown {', '.join(sorted(unknown))}; accepted: batch, precision")


def _same_file(a: Path, b: Path) -> bool:
    """Whether writing `a` would write `b`: the same path, a symlink to it, or a hard link (one inode)."""
    try:
        return a.resolve() == b.resolve() or os.path.samefile(a, b)
    except (OSError, RuntimeError):  # `a` does not exist yet (only its path can name `b`), or a symlink loop
        return False


class Tuner:
    """One tune: `run()` measures, writes the report (and the tuned recipe when a change was proven)
    and returns the exit status. `runner` runs the trials (tests give a scripted one)."""

    def __init__(self, resolved, recipe_path: str, overrides: Sequence[str], options: Options,
                 runner: Optional[TrialRunner] = None):
        self.resolved, self.recipe = resolved, resolved.recipe
        self.recipe_path, self.user_overrides, self.o = recipe_path, list(overrides), options
        self.started = time.monotonic()
        self.workdir = Path(self.recipe.launch.run_dir) / f"{self.recipe.name}.tune-{time.strftime('%Y%m%d-%H%M%S')}"
        self.runner = runner
        self.parent: Optional[ParentRun] = None
        self.trials: list[Trial] = []
        self.measured = tune_stats.Measurements()
        self.plan = Plan()
        self.diagnosis: Optional[Diagnosis] = None
        self.combination: Optional[Arm] = None
        self.final: Optional[Arm] = None
        self.stopped = ""  # why the tune ended early
        self.interrupted = self.baseline_failed = False
        self.trial_estimate_s = 0.0

    @property
    def arms(self) -> list[Arm]:
        return self.plan.arms

    @property
    def skipped(self) -> list[tuple[str, str]]:
        return self.plan.skipped

    # ------------------------------------------------------------------ the procedure
    def run(self) -> int:
        """0: tuned, or no change proven; 1: the baseline trial failed; 130: interrupted. A tune that
        cannot go on (the budget does not fit one baseline trial) raises TuneError."""
        self.workdir.mkdir(parents=True, exist_ok=False)
        self.parent = ParentRun.open(self.workdir, self.resolved, self.recipe_path, {
            "tune.steps": str(self.o.steps), "tune.budget_min": f"{self.o.budget_s / 60:g}",
            "tune.knobs": ",".join(self.o.knobs) if self.o.knobs else "(diagnosis)"})
        if self.runner is None:
            self.runner = TrialRunner(self.resolved, self.recipe_path, self.user_overrides, self.o.steps,
                                      self.workdir, self.parent)
        # SIGINT too, explicitly: a process started in the background by a non-interactive shell (CI
        # scripts, `cmd &`) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt for it
        previous = {s: signal.signal(s, _raise_interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._tune()
        except KeyboardInterrupt:
            self.interrupted = True
            self.stopped = "interrupted (Ctrl-C): the report shows what was measured until then"
        except BaselineFailed as err:
            self.baseline_failed = True
            self.stopped = f"the baseline trial failed: {err}"
        except TuneError:
            self._close("FAILED")
            raise
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        self._write_outputs()
        return 130 if self.interrupted else 1 if self.baseline_failed else 0

    def _tune(self) -> None:
        first = self._trial(Arm("baseline"), timeout=self.o.budget_s)
        if first.timed_out:
            raise TuneError(f"--budget {self.o.budget_s / 60:g} min is too small: the baseline alone did not finish "
                            f"in it (stopped after {first.wall_s:.0f} s). A tune needs about (1 + 2 x "
                            f"{tune_stats.MAX_PAIRS} x knobs) trials of the baseline's length; try --budget "
                            f"{max(1.0, 11 * first.wall_s / 60):.0f} or more for one knob, or fewer --steps")
        if first.samples_per_s is None:
            raise BaselineFailed(first.error)
        self.trial_estimate_s = first.wall_s
        self._plan(first)
        needed = self.trial_estimate_s * (1 + 2 * tune_stats.MIN_PAIRS)
        if self.arms and self._elapsed() + 2 * self.trial_estimate_s > self.o.budget_s:  # not even one pair fits
            self.stopped = (f"--budget {self.o.budget_s / 60:g} min leaves no room to measure a change: one trial "
                            f"takes about {self.trial_estimate_s:.0f} s, and a change needs {tune_stats.MIN_PAIRS} "
                            f"trials of it alternating with the baseline (about {needed / 60:.1f} min with the "
                            f"baseline; {len(self.arms)} change(s) to try: about "
                            f"{self.trial_estimate_s * (1 + 2 * tune_stats.MIN_PAIRS * len(self.arms)) / 60:.1f} min)")
        else:
            self._measure(self.arms)
        kept = self._best_per_knob()
        if len(kept) > 1 and not self.stopped:
            changes: dict[str, Any] = {}
            for arm in kept:
                changes.update(arm.changes)
            self.combination = Arm("+".join(a.name for a in kept), changes,
                                   note="; ".join(a.note for a in kept if a.note))
            self._measure([self.combination])
            best = max(kept, key=lambda a: a.verdict.gain)
            combo = self.combination.verdict
            self.final = self.combination if combo and combo.decision == tune_stats.KEEP and \
                combo.gain >= best.verdict.gain else best
        elif kept:
            self.final = kept[0]

    def _plan(self, baseline: Trial) -> None:
        """The arms to try: from the baseline's own evidence (the same files its run's report read)."""
        if baseline.evidence is not None:
            self.diagnosis = diagnose_evidence(baseline.evidence, self.recipe)
        facts = tune_plan.machine_facts(baseline.evidence)
        if self.o.knobs is not None:
            self.plan = tune_plan.named(self.recipe, self.o.knobs, self.o.allow, facts)
        else:
            self.plan = tune_plan.advised(self.recipe, self.diagnosis, self.o.allow, facts)
        for name, why in self.plan.skipped:
            print(f"trainkit: tune: skipped {name}: {why}", flush=True)
        if self.plan.unpointed:
            print(f"trainkit: tune: not pointed at by the advice (try with --knobs): {', '.join(self.plan.unpointed)}",
                  flush=True)
        print(f"trainkit: tune: trying {', '.join(a.name for a in self.arms) or 'nothing'}", flush=True)

    def _measure(self, arms: list[Arm]) -> None:
        """Rounds of (candidate, baseline) per undecided arm until each is decided or its pairs are spent."""
        while not self.stopped and any(not a.done for a in arms):
            for arm in [a for a in arms if not a.done]:
                if not self._room():
                    return
                trial = self._trial(arm)
                if trial.samples_per_s is None:
                    arm.failure, arm.done = trial.error, True
                    continue
                if not self._room():
                    arm.verdict = self.measured.verdict(arm.name, final=True)
                    return
                base = self._trial(Arm("baseline"))
                if base.samples_per_s is None:
                    self.stopped = f"a baseline trial failed: {base.error}"
                    return
                ratios = self.measured.ratios(arm.name)
                arm.verdict = self.measured.verdict(arm.name, final=len(ratios) >= tune_stats.MAX_PAIRS)
                arm.done = arm.verdict.decision != tune_stats.UNDECIDED
                print(f"trainkit: tune: {arm.name}: ratio {ratios[-1]:.3f} vs baseline "
                      f"({len(ratios)} pair(s)){'' if not arm.done else ': ' + arm.verdict.decision}", flush=True)

    def _room(self) -> bool:
        """Is there budget for one more trial? If not, every undecided arm gets its final verdict."""
        if self._elapsed() + self.trial_estimate_s <= self.o.budget_s:
            return True
        self.stopped = self.stopped or f"budget of {self.o.budget_s / 60:g} min spent"
        for arm in self.arms + ([self.combination] if self.combination else []):
            if not arm.done:
                arm.verdict, arm.done = self.measured.verdict(arm.name, final=True), True
        return False

    def _best_per_knob(self) -> list[Arm]:
        best: dict[str, Arm] = {}
        for arm in self.arms:
            v = arm.verdict
            if v and v.decision == tune_stats.KEEP and arm.knob and \
                    (arm.knob.name not in best or v.gain > best[arm.knob.name].verdict.gain):
                best[arm.knob.name] = arm
        return list(best.values())

    def _elapsed(self) -> float:
        return time.monotonic() - self.started

    def _trial(self, arm: Arm, timeout: Optional[float] = None) -> Trial:
        limit = timeout if timeout is not None else max(60.0, 5 * self.trial_estimate_s)
        trial = self.runner.run(len(self.trials) + 1, arm, limit)
        self.trials.append(trial)
        if trial.samples_per_s is not None:
            self.measured.add(arm.name, trial.samples_per_s)
        return trial

    # ------------------------------------------------------------------ outputs
    def result(self) -> Result:
        return Result(resolved=self.resolved, source=" ".join([self.recipe_path, *self.user_overrides]),
                      out=self.o.out, steps=self.o.steps, budget_s=self.o.budget_s, trials=len(self.trials),
                      elapsed_s=self._elapsed(), measured=self.measured, plan=self.plan, diagnosis=self.diagnosis,
                      combination=self.combination, final=self.final, stopped=self.stopped,
                      kept_dirs=list(self.runner.kept_dirs if self.runner else []))

    def _write_outputs(self) -> None:
        result = self.result()
        text = report(result)
        result.report_path.write_text(text)
        written = self.final is not None and not self.interrupted
        if written:
            self.o.out.write_text(tuned_recipe(result))
        print(text, end="")
        print(f"trainkit: tune: wrote {self.o.out} (report: {result.report_path})" if written else
              f"trainkit: tune: no tuned recipe written (report: {result.report_path})")
        self._close("KILLED" if self.interrupted else "FINISHED", result.report_path)

    def _close(self, status: str, report_path: Optional[Path] = None) -> None:
        """End the tune's MLflow run; remove the work folder unless tracking records in it are undelivered."""
        kept = list(self.runner.kept_dirs if self.runner else [])
        if self.parent is not None:
            metrics, tags = {}, {}
            base = self.measured.median("baseline")
            if base:
                metrics["baseline/samples_per_s"] = base
            if self.final is not None and self.final.verdict:
                metrics["tuned/gain"] = self.final.verdict.gain
                tags["trainkit.tune.kept"] = self.final.name
            if not self.parent.close(status, metrics, tags, report_path):
                kept.append(self.parent.folder)
        if not kept:
            shutil.rmtree(self.workdir, ignore_errors=True)
        else:
            print(f"trainkit: tune: kept {self.workdir} (undelivered tracking records in it); deliver them with\n"
                  f"  trainkit sync {' '.join(str(d) for d in kept)}", file=sys.stderr)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def tune(resolved, recipe_path: str, overrides: Sequence[str], options: Options, force: bool = False) -> int:
    """Returns the exit code: 0 tuned (or no change proven), 1 a trial of the baseline failed, 2 refused,
    130 interrupted."""
    try:
        check_options(resolved, recipe_path, options, force)
        return Tuner(resolved, recipe_path, overrides, options).run()
    except TuneError as err:
        print(f"trainkit: tune: {err}", file=sys.stderr)
        return 2
