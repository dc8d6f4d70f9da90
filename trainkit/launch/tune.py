"""`trainkit tune`: measured autotuning. Try the bottleneck advice as short real runs, keep only what
is proven faster, write the faster recipe (docs/tune.md).

Every trial is a real `trainkit run` subprocess of the recipe as given plus overrides: same world size,
same launcher, its own run directory and name (`<name>-tNN-<change>` under a `<name>.tune-<stamp>`
folder), so no trial resumes, and no lock or drift check ever sees two trials as one job. Candidate
trials alternate with baseline trials; the decision rule is in `tune_stats`. A trial's run directory is
removed once its tracking records are delivered (kept, and named, if they are not).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from ..analysis.bottleneck import Diagnosis, diagnose
from ..processes import CLI
from ..recipe.problems import did_you_mean
from ..run_dir import (REPORTS, TRACKING, WARMUP_STEPS, measured_step_times, read_evidence, read_metrics,
                       read_summary)
from ..tracking.delivery import deliver
from ..tracking.run import close_parent_run, link_to_parent, open_parent_run
from . import tune_knobs, tune_stats
from .tune_knobs import Knob

MAX_PAIRS = 7  # trials per change before it is called "no significant gain"
MIN_STEPS = WARMUP_STEPS + 3


class TuneError(Exception):
    """A tune that cannot start: the message says why and what would work (exit 2)."""


@dataclass
class Arm:
    """One change to try: a knob at a value (plus the keys it changes alongside), or the baseline."""

    name: str
    changes: dict[str, Any] = field(default_factory=dict)  # recipe key -> value
    knob: Optional[Knob] = None
    value: Any = None
    note: str = ""  # the semantic change, in words
    verdict: Optional[tune_stats.Verdict] = None
    failure: str = ""
    done: bool = False

    def overrides(self) -> list[str]:
        return [tune_knobs.override_text(k, v) for k, v in self.changes.items()]


@dataclass
class Trial:
    arm: str
    name: str
    code: int
    wall_s: float
    samples_per_s: Optional[float] = None
    error: str = ""


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
    if options.out.resolve() == Path(recipe_path).resolve() and not force:
        raise TuneError(f"-o {options.out} would overwrite the input recipe; choose another path or pass --force")
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


class Tuner:
    def __init__(self, resolved, recipe_path: str, overrides: Sequence[str], options: Options):
        self.resolved, self.recipe = resolved, resolved.recipe
        self.recipe_path, self.user_overrides, self.o = recipe_path, list(overrides), options
        self.started = time.monotonic()
        self.workdir = Path(self.recipe.launch.run_dir) / f"{self.recipe.name}.tune-{time.strftime('%Y%m%d-%H%M%S')}"
        self.trials: list[Trial] = []
        self.sequence: list[tuple[str, float]] = []  # (arm, samples/s) in the order measured
        self.arms: list[Arm] = []
        self.skipped: list[tuple[str, str]] = []  # (knob, why)
        self.combination: Optional[Arm] = None
        self.final: Optional[Arm] = None
        self.diagnosis: Optional[Diagnosis] = None
        self.kept_dirs: list[Path] = []
        self.stopped = ""  # why the tune ended early
        self.trial_estimate_s = 0.0
        self.parent: Optional[Path] = None  # the spool folder of the tune's MLflow run
        self.facts = {"cuda": _cuda()}

    # ------------------------------------------------------------------ the procedure
    def run(self) -> int:
        self.workdir.mkdir(parents=True, exist_ok=False)
        self._open_parent()
        interrupted = False
        # SIGINT too, explicitly: a process started in the background by a non-interactive shell (CI
        # scripts, `cmd &`) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt for it
        previous = {s: signal.signal(s, _raise_interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            code = self._tune()
        except KeyboardInterrupt:
            interrupted, code = True, 130
            self.stopped = "interrupted (Ctrl-C): the report shows what was measured until then"
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        if code == 2:
            self._close_parent("FAILED")
            self._cleanup()
            return code
        report = self.report()
        report_path = self.o.out.with_suffix(".report.md")
        report_path.write_text(report)
        if self.final is not None and not interrupted:
            self.o.out.write_text(self.tuned_yaml())
        print(report, end="")
        if self.final is not None and not interrupted:
            print(f"trainkit: tune: wrote {self.o.out} (report: {report_path})")
        else:
            print(f"trainkit: tune: no tuned recipe written (report: {report_path})")
        self._close_parent("KILLED" if interrupted else "FINISHED", report_path)
        self._cleanup()
        return code

    def _tune(self) -> int:
        baseline = Arm("baseline")
        first = self._trial(baseline, timeout=self.o.budget_s, breakdown=True)
        if first.code == 124:
            raise_budget = (f"--budget {self.o.budget_s / 60:g} min is too small: the baseline alone did not finish "
                            f"in it (stopped after {first.wall_s:.0f} s). A tune needs about (1 + 2 x {MAX_PAIRS} x "
                            f"knobs) trials of the baseline's length; try --budget "
                            f"{max(1.0, 11 * first.wall_s / 60):.0f} or more for one knob, or fewer --steps")
            print(f"trainkit: tune: {raise_budget}", file=sys.stderr)
            return 2
        if first.samples_per_s is None:
            self.stopped = f"the baseline trial failed: {first.error}"
            return 1
        self.trial_estimate_s = first.wall_s
        self._plan_arms()
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
        return 0

    def _plan_arms(self) -> None:
        advice = [a.text for a in (self.diagnosis.advice if self.diagnosis else [])]
        known = tune_knobs.all_knobs()
        explicit = self.o.knobs is not None
        for name in (self.o.knobs if explicit else list(known)):
            knob = known[name]
            why = tune_knobs.not_applicable(knob, self.recipe, self.facts)
            if why is None and knob.semantic and knob.semantic not in self.o.allow:
                why = f"changes the training ({knob.semantic}): tried only with --allow {knob.semantic}"
            if why is None and not explicit and not tune_knobs.suggested(knob, advice):
                continue  # not pointed at by the diagnosis: not worth a trial (name it with --knobs to try it)
            values = knob.values(self.recipe, self.facts) if why is None else []
            if why is None and not values:
                why = f"nothing to try: {knob.path} is already {tune_knobs.get(self.recipe, knob.path)}"
            if why:
                self.skipped.append((name, why))
                continue
            for value in values:
                changes = {knob.path: value, **knob.also(self.recipe, value)}
                self.arms.append(Arm(f"{name}={_show(value)}", changes, knob, value, knob.note(self.recipe, value)))
        for name, why in self.skipped:
            print(f"trainkit: tune: skipped {name}: {why}", flush=True)
        print(f"trainkit: tune: trying {', '.join(a.name for a in self.arms) or 'nothing'}", flush=True)

    def _measure(self, arms: list[Arm]) -> None:
        """Rounds of (candidate, baseline) per undecided arm until each is decided or its pairs are spent."""
        noise = lambda: tune_stats.noise([v for n, v in self.sequence if n == "baseline"])  # noqa: E731
        while not self.stopped and any(not a.done for a in arms):
            for arm in [a for a in arms if not a.done]:
                if not self._room():
                    return
                trial = self._trial(arm)
                if trial.samples_per_s is None:
                    arm.failure, arm.done = trial.error, True
                    continue
                if not self._room():
                    arm.verdict = tune_stats.judge(tune_stats.paired_ratios(self.sequence, arm.name), noise(), True)
                    return
                base = self._trial(Arm("baseline"))
                if base.samples_per_s is None:
                    self.stopped = f"a baseline trial failed: {base.error}"
                    return
                ratios = tune_stats.paired_ratios(self.sequence, arm.name)
                final = len(ratios) >= MAX_PAIRS
                arm.verdict = tune_stats.judge(ratios, noise(), final)
                arm.done = arm.verdict.decision != tune_stats.UNDECIDED
                print(f"trainkit: tune: {arm.name}: ratio {ratios[-1]:.3f} vs baseline "
                      f"({len(ratios)} pair(s)){'' if not arm.done else ': ' + arm.verdict.decision}", flush=True)

    def _room(self) -> bool:
        if self._elapsed() + self.trial_estimate_s > self.o.budget_s:
            self.stopped = self.stopped or f"budget of {self.o.budget_s / 60:g} min spent"
            for arm in self.arms + ([self.combination] if self.combination else []):
                if not arm.done:
                    ratios = tune_stats.paired_ratios(self.sequence, arm.name)
                    arm.verdict = tune_stats.judge(ratios, tune_stats.noise(
                        [v for n, v in self.sequence if n == "baseline"]), True)
                    arm.done = True
            return False
        return True

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

    # ------------------------------------------------------------------ one trial
    def _trial(self, arm: Arm, timeout: Optional[float] = None, breakdown: bool = False) -> Trial:
        index = len(self.trials) + 1
        slug = re.sub(r"[^A-Za-z0-9_.\-]+", "_", arm.name)[:40]
        name = f"{self.recipe.name[:50]}-t{index:02d}-{slug}"
        run_root = self.workdir / "trials"
        monitors = list(self.resolved.raw.get("monitors") or [])
        if not any((m if isinstance(m, str) else m.get("name")) == "breakdown" for m in monitors):
            monitors.append("breakdown")  # every trial alike: the baseline's diagnosis needs it
        cmd = [sys.executable, "-m", CLI, "run", self.recipe_path, *self.user_overrides, *arm.overrides(),
               f"name={name}", f"tracking.run_name={name}", f"launch.run_dir={run_root}",
               f"trainer.max_steps={self.o.steps}", "trainer.log_every=1", "trainer.resume=never",
               "trainer.eval_every=null", "trainer.checkpoint.every=null", f"monitors={json.dumps(monitors)}",
               "tracking.close_wait_s=0"]  # tune delivers (or keeps) each trial's records itself, right after
        log = self.workdir / f"{name}.log"
        limit = timeout if timeout is not None else max(60.0, 5 * self.trial_estimate_s)
        print(f"trainkit: tune: trial {index}: {arm.name}", flush=True)
        start = time.monotonic()
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                _stop(proc)
                code = 124
            except BaseException:  # Ctrl-C: stop the trial at once, leave nothing behind
                _stop(proc)
                self._link_child(run_root / name, arm, Trial(arm.name, name, 130, time.monotonic() - start))
                self._discard(run_root / name)
                raise
        trial = Trial(arm.name, name, code, time.monotonic() - start)
        run_dir = run_root / name
        if code == 0:
            trial.samples_per_s, trial.error = _throughput(run_dir)
            if breakdown:
                self.diagnosis = _diagnosis(run_dir, self.recipe)
        else:
            tail = log.read_text(errors="replace").strip().splitlines()[-6:]
            trial.error = (f"timed out after {limit:.0f} s" if code == 124 else f"exit {code}") + \
                (": " + " | ".join(tail) if tail else "")
        if trial.samples_per_s is not None:
            self.sequence.append((arm.name, trial.samples_per_s))
            print(f"trainkit: tune: trial {index}: {arm.name}: {trial.samples_per_s:.1f} samples/s", flush=True)
        else:
            print(f"trainkit: tune: trial {index}: {arm.name}: failed: {trial.error}", file=sys.stderr, flush=True)
        self._link_child(run_dir, arm, trial)
        self.trials.append(trial)
        self._discard(run_dir)
        return trial

    def _discard(self, run_dir: Path) -> None:
        """Remove a trial's run directory, unless tracking records in it are still undelivered."""
        if not run_dir.exists():
            return
        if (run_dir / TRACKING).is_dir():
            pending, error = deliver(run_dir)
            if pending:
                print(f"trainkit: tune: kept {run_dir}: {pending} tracking record(s) undelivered ({error})",
                      file=sys.stderr)
                self.kept_dirs.append(run_dir)
                return
        shutil.rmtree(run_dir, ignore_errors=True)

    # ------------------------------------------------------------------ MLflow: a parent run, a child per trial
    def _open_parent(self) -> None:
        """The tune's own MLflow run, spooled like a training run's (WORKDIR/parent/tracking/spool.jsonl):
        with the server down, it and every link to it wait there for `trainkit sync`."""
        if not self.recipe.tracking.enabled:
            return
        self.parent = self.workdir / "parent"
        pending, error = open_parent_run(
            self.parent, self.resolved, f"{self.recipe.name}-tune",
            tags={"trainkit.tune": "parent", "trainkit.recipe": self.recipe_path},
            params={"tune.steps": str(self.o.steps), "tune.budget_min": f"{self.o.budget_s / 60:g}",
                    "tune.knobs": ",".join(self.o.knobs) if self.o.knobs else "(diagnosis)"})
        if pending:
            print(f"trainkit: tune: MLflow unreachable now ({error}): the tune run and its trials' runs are kept "
                  f"in their spools and delivered later", file=sys.stderr)

    def _link_child(self, run_dir: Path, arm: Arm, trial: Trial) -> None:
        """Spool the trial run's link to the tune run (`_discard` delivers it, or `trainkit sync` later)."""
        if self.parent is not None and (run_dir / TRACKING).is_dir():
            link_to_parent(run_dir, self.parent, {"trainkit.tune.change": arm.name},
                           {} if trial.samples_per_s is None else {"tune/samples_per_s": trial.samples_per_s})

    def _close_parent(self, status: str, report: Optional[Path] = None) -> None:
        if self.parent is None:
            return
        metrics, tags, artifacts = {}, {}, []
        base = self._median("baseline")
        if base:
            metrics["baseline/samples_per_s"] = base
        if self.final is not None and self.final.verdict:
            metrics["tuned/gain"] = self.final.verdict.gain
            tags["trainkit.tune.kept"] = self.final.name
        if report is not None:  # a copy beside the spool: delivered later, it is still there
            kept = self.parent / REPORTS / report.name
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(report, kept)
            artifacts.append(kept)
        close_parent_run(self.parent, status, metrics, tags, artifacts)
        self._discard(self.parent)

    def _cleanup(self) -> None:
        if not self.kept_dirs:
            shutil.rmtree(self.workdir, ignore_errors=True)
        else:
            print(f"trainkit: tune: kept {self.workdir} (undelivered tracking records in it); deliver them with\n"
                  f"  trainkit sync {' '.join(str(d) for d in self.kept_dirs)}", file=sys.stderr)

    # ------------------------------------------------------------------ outputs
    def _values(self, arm: str) -> list[float]:
        return [v for n, v in self.sequence if n == arm]

    def _median(self, arm: str) -> Optional[float]:
        values = self._values(arm)
        return statistics.median(values) if values else None

    def report(self) -> str:
        r = self.recipe
        source = " ".join([self.recipe_path, *self.user_overrides])
        base = self._values("baseline")
        noise = tune_stats.noise(base)
        lines = [f"# trainkit tune: {r.name}", "",
                 f"Recipe `{source}`: {len(self.trials)} trial(s) of {self.o.steps} steps in "
                 f"{self._elapsed() / 60:.1f} min (budget {self.o.budget_s / 60:g} min), {r.world_size} process(es) "
                 f"each; the first {WARMUP_STEPS} steps of each trial are warm-up and not measured.", ""]
        if self.diagnosis is not None:
            lines += [f"Baseline diagnosis: **{self.diagnosis.kind}**: {self.diagnosis.headline}", ""]
        if base:
            lines.append(f"Noise: consecutive baseline trials differ by {noise:.1%} (median)." if noise is not None
                         else "Noise: only one baseline trial (no baseline-vs-baseline pair).")
        lines += [f"Rule: a change is kept when, over at least {tune_stats.MIN_PAIRS} pairs, the bootstrap 95% "
                  f"interval of its paired throughput ratios (each trial against the baseline trials around it) "
                  f"lies above 1 and its median gain is at least {tune_stats.MIN_GAIN:.0%} and "
                  f"{tune_stats.NOISE_FACTOR:g}x the noise (the baseline's, or the spread of its own ratios if "
                  f"larger); at most {MAX_PAIRS} pairs per change.", "",
                  "| change | values tried | samples/s median (min-max, trials) | ratio vs baseline (95% interval) "
                  "| decision |", "|---|---|---|---|---|"]
        lines.append(f"| baseline | as given | {_spread(base)} | 1 | - |")
        for arm in self.arms + ([self.combination] if self.combination else []):
            tried = ", ".join(f"{k}: {_show(tune_knobs.get(r, k))} -> {_show(v)}" for k, v in arm.changes.items())
            v = arm.verdict
            ratio = "-" if not v or v.gain is None else f"{1 + v.gain:.3f} ({v.interval()})"
            decision = "failed: " + arm.failure[:200] if arm.failure else \
                ("kept" if v and v.decision == tune_stats.KEEP else v.decision if v else "not measured")
            if arm is self.combination:
                decision = "combination " + ("verified" if v and v.decision == tune_stats.KEEP else
                                             "not verified: " + (v.decision if v else "not measured"))
                if v and v.decision == tune_stats.KEEP and self.final is not None and self.final is not arm:
                    decision += f", but slower than {self.final.name} alone: not used"
            lines.append(f"| {arm.name} | {tried} | {_spread(self._values(arm.name))} | {ratio} | {decision} |")
        lines.append("")
        if self.skipped:
            lines += ["Not tried:", *[f"- {name}: {why}" for name, why in self.skipped], ""]
        if self.stopped:
            lines += [f"Stopped early: {self.stopped}.", ""]
        if self.final is not None:
            v = self.final.verdict
            lines.append(f"Result: **{self.final.name}** is {v.gain:+.1%} samples/s (95% interval of the ratio "
                         f"{v.interval()}) -> {self.o.out}")
            if self.final.note:
                lines.append(f"Semantic change: {self.final.note}.")
        else:
            lines.append("Result: **no change**: nothing tried was proven faster than the recipe as given "
                         "(no tuned recipe written).")
        if self.kept_dirs:
            lines += ["", "Kept (undelivered tracking records): " + ", ".join(map(str, self.kept_dirs))]
        return "\n".join(lines) + "\n"

    def tuned_yaml(self) -> str:
        """The recipe as given (composed, overrides applied, `${...}` kept) with only the kept changes, each
        with a comment giving its measured gain."""
        import yaml

        assert self.final is not None
        data = copy.deepcopy(self.resolved.raw)
        comments = {}
        parts = self.final.name.split("+")
        for arm in [a for a in self.arms if a.name in parts] or [self.final]:
            v = arm.verdict
            for path, value in arm.changes.items():
                _set(data, path, value)
                comments[path] = (f"tune: was {_show(tune_knobs.get(self.recipe, path))}; {arm.name}: {v.gain:+.1%} "
                                  f"samples/s (95% interval of the ratio {v.interval()}, {v.pairs} pairs)")
        if self.final is self.combination and self.final.verdict:
            comments["__combined__"] = (f"combination {self.final.name}: {self.final.verdict.gain:+.1%} samples/s "
                                        f"(95% interval {self.final.verdict.interval()})")
        lines = yaml.safe_dump(data, sort_keys=False).splitlines()
        stack: list[tuple[int, str]] = []
        for i, line in enumerate(lines):
            m = re.match(r"^( *)([A-Za-z0-9_.\-]+):( |$)", line)
            if not m:
                continue
            indent = len(m.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, m.group(2)))
            path = ".".join(k for _, k in stack)
            if path in comments:
                lines[i] = f"{line}  # {comments[path]}"
        source = " ".join([self.recipe_path, *self.user_overrides])
        header = [f"# Tuned by `trainkit tune` from {self.resolved.redact_text(source)} on {time.strftime('%Y-%m-%d')}: "
                  f"only changes proven faster are applied (report: {self.o.out.with_suffix('.report.md').name})"]
        if "__combined__" in comments:
            header.append(f"# {comments['__combined__']}")
        if self.final.note:
            header.append(f"# semantic change: {self.final.note}")
        return "\n".join(header + lines) + "\n"


# ---------------------------------------------------------------------- helpers
def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _stop(proc: subprocess.Popen) -> None:
    """Stop a trial and every process it started (its own session): SIGTERM, then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _throughput(run_dir: Path) -> tuple[Optional[float], str]:
    """Samples/s of the measured steps: global batch / median step time (warm-up steps excluded: the
    loop writes step_time_s only after them)."""
    try:
        summary = read_summary(run_dir)
        rows = read_metrics(run_dir)
    except (OSError, ValueError) as exc:
        return None, f"no measurements in {run_dir}: {exc}"
    times = measured_step_times(rows)
    if not times:
        return None, f"no measured steps (use --steps {MIN_STEPS} or more)"
    return summary["global_batch"] / statistics.median(times), ""


def _diagnosis(run_dir: Path, recipe) -> Optional[Diagnosis]:
    try:
        evidence = read_evidence(run_dir)
    except (OSError, ValueError):
        return None
    return diagnose(evidence["per_rank"], recipe)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _set(data: dict, path: str, value: Any) -> None:
    parts = path.split(".")
    for part in parts[:-1]:
        data = data.setdefault(part, {})
    data[parts[-1]] = value


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return "null" if value is None else str(value)


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f}, {len(values)})"


def tune(resolved, recipe_path: str, overrides: Sequence[str], options: Options, force: bool = False) -> int:
    """Returns the exit code: 0 tuned (or no change proven), 1 a trial of the baseline failed, 2 refused."""
    try:
        check_options(resolved, recipe_path, options, force)
    except TuneError as err:
        print(f"trainkit: tune: {err}", file=sys.stderr)
        return 2
    return Tuner(resolved, recipe_path, overrides, options).run()
