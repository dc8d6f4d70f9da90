"""One `trainkit tune` trial: a real `trainkit run` process of the recipe as given plus overrides.

Same world size, same launcher, its own run directory and name (`<name>-tNN-<change>` under the tune's
`<name>.tune-<stamp>` folder), so no trial resumes and no lock or drift check ever sees two trials as
one job. What the tune needs from a finished trial (its throughput, and for the baseline the evidence
of its bottleneck report) is read before its run directory is removed.

Each trial is its own process in its own session, forked from one multiprocessing forkserver that
imported torch and trainkit's run path once (`set_forkserver_preload`, the standard library's
mechanism): a fresh interpreter per trial spent ~3 s of a 12-step trial importing the same modules
(~0.45 s forked; docs/tune.md). A fork keeps what a subprocess gave: a separate address space, its
own session to stop (SIGTERM, then SIGKILL, to the whole group), its output in its own log file.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from .. import registry
from ..analysis import evidence as evidence_files
from ..analysis.evidence import Evidence
from ..processes import CLI, WORKER
from ..recipe.blocks.monitors import BreakdownMonitorOptions
from ..run_dir import WARMUP_STEPS, measured_step_times, read_metrics, read_summary
from . import trial_process
from .tune_plan import Arm
from .tune_tracking import ParentRun, deliver_or_keep

MIN_STEPS = WARMUP_STEPS + 3


@dataclass
class Trial:
    arm: str
    name: str
    code: int  # the trial process's exit status
    wall_s: float
    samples_per_s: Optional[float] = None  # None: the trial measured nothing (see error)
    error: str = ""
    timed_out: bool = False
    evidence: Optional[Evidence] = None  # the bottleneck report's evidence (reports/breakdown.json)


class TrialRunner:
    """Runs trials in WORKDIR/trials, links each to the tune's MLflow run, and removes its run
    directory once its records are delivered (`kept_dirs`: those that are not)."""

    def __init__(self, resolved, recipe_path: str, overrides: Sequence[str], steps: int, workdir: Path,
                 parent: Optional[ParentRun]):
        self.resolved, self.recipe_path, self.overrides = resolved, recipe_path, list(overrides)
        self.steps, self.workdir, self.parent = steps, workdir, parent
        self.kept_dirs: list[Path] = []
        self.modules: list[str] = []  # what the forkserver imports once, at the first trial

    def command(self, name: str, overrides: Sequence[str]) -> list[str]:
        """The trial as a `trainkit` command line (what its process runs, and what a user can rerun)."""
        return [sys.executable, "-m", CLI, *self.arguments(name, overrides)]

    def arguments(self, name: str, overrides: Sequence[str]) -> list[str]:
        monitors = list(self.resolved.raw.get("monitors") or [])
        if not any(m.writes_evidence for m in self.resolved.recipe.monitors):
            # every trial alike: the baseline's diagnosis needs the evidence
            monitors.append(BreakdownMonitorOptions.plugin_name())
        return ["run", self.recipe_path, *self.overrides, *overrides,
                f"name={name}", f"tracking.run_name={name}", f"launch.run_dir={self.workdir / 'trials'}",
                f"trainer.max_steps={self.steps}", "trainer.log_every=1", "trainer.resume=never",
                "trainer.eval_every=null", "trainer.checkpoint.every=null", f"monitors={json.dumps(monitors)}",
                "tracking.close_wait_s=0"]  # tune delivers (or keeps) each trial's records itself, right after

    def run(self, index: int, change: Arm, timeout: float) -> Trial:
        """Trial number `index`, of `change`; KeyboardInterrupt stops it at once and leaves nothing behind."""
        arm = change.name
        slug = re.sub(r"[^A-Za-z0-9_.\-]+", "_", arm)[:40]
        name = f"{self.resolved.recipe.name[:50]}-t{index:02d}-{slug}"
        run_dir = self.workdir / "trials" / name
        log = self.workdir / f"{name}.log"
        print(f"trainkit: tune: trial {index}: {arm}", flush=True)
        try:
            if not self.modules:  # the forkserver's imports, once: not part of the first trial's time
                self.modules = preload(self.resolved.recipe)
                _wait(_start(trial_process.ready, (), self.modules), timeout)
            start = time.monotonic()
            proc = _start(trial_process.main, (self.arguments(name, change.overrides()), str(log)), self.modules)
        except (OSError, EOFError) as exc:  # the forkserver could not start, or died: a failed trial, said
            trial = Trial(arm, name, 1, 0.0, error=f"could not start the trial's process ({type(exc).__name__}: "
                                                   f"{exc}); a plugin that fails on import stops the forkserver")
            print(f"trainkit: tune: trial {index}: {arm}: failed: {trial.error}", file=sys.stderr, flush=True)
            return trial
        timed_out = False
        try:
            code = _wait(proc, timeout)
            if code is None:
                code, timed_out = _stop(proc), True
        except BaseException:  # Ctrl-C: stop the trial at once, leave nothing behind
            _stop(proc)
            self._finish(run_dir, Trial(arm, name, 130, time.monotonic() - start))
            raise
        trial = Trial(arm, name, code, time.monotonic() - start, timed_out=timed_out)
        if code == 0 and not timed_out:
            trial.samples_per_s, trial.error = _throughput(run_dir)
            trial.evidence = baseline_evidence(run_dir)
        else:
            tail = log.read_text(errors="replace").strip().splitlines()[-6:]
            trial.error = (f"timed out after {timeout:.0f} s" if timed_out else f"exit {code}") + \
                (": " + " | ".join(tail) if tail else "")
        if trial.samples_per_s is not None:
            print(f"trainkit: tune: trial {index}: {arm}: {trial.samples_per_s:.1f} samples/s", flush=True)
        else:
            print(f"trainkit: tune: trial {index}: {arm}: failed: {trial.error}", file=sys.stderr, flush=True)
        self._finish(run_dir, trial)
        return trial

    def _finish(self, run_dir: Path, trial: Trial) -> None:
        if self.parent is not None:
            self.parent.link(run_dir, trial.arm, trial.samples_per_s)
        if not deliver_or_keep(run_dir):
            self.kept_dirs.append(run_dir)


# What every `trainkit run` imports before its first step (torch._dynamo: DDP's and DeviceMesh's
# constructors import it, and it brings sympy); the recipe's own plugins are added by `preload`.
# A module missing here is imported by each trial itself; forkserver skips a preload that fails.
RUN_MODULES = ["trainkit.launch.trial_process", "torch", "torch._dynamo", CLI, "trainkit.launch.launcher", WORKER,
               "trainkit.runtime.memory_trace"]

TRACKING_MODULES = ["trainkit.tracking.delivery", "mlflow.tracking", "mlflow.entities",
                    "mlflow.store.tracking.sqlalchemy_store"]  # ~1.5 s: the default store is a sqlite file


def preload(recipe) -> list[str]:
    """The modules a trial of `recipe` imports: trainkit's run path, its model's and its plugins'."""
    blocks = [recipe.task, recipe.data, recipe.strategy, *recipe.monitors]
    plugins = [type(b).component.partition(":")[0] for b in blocks
               if isinstance(getattr(type(b), "component", None), str)]
    model = registry.module_of("models", recipe.model.name)
    tracking = TRACKING_MODULES if recipe.tracking.enabled else []
    return list(dict.fromkeys([*RUN_MODULES, *plugins, *([model] if model else []), *tracking]))


def _start(target, args: tuple, modules: list[str]) -> multiprocessing.process.BaseProcess:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(modules)  # read when the server starts: the first process of this tune
    proc = context.Process(target=target, args=args, name="trainkit-tune-trial")
    proc.start()
    return proc


def _wait(proc: multiprocessing.process.BaseProcess, timeout: Optional[float]) -> Optional[int]:
    """The trial's exit status (a signal's death as 128 + signal, as a shell shows it); None on timeout."""
    proc.join(timeout)
    code = proc.exitcode
    return None if code is None else 128 - code if code < 0 else code


def _stop(proc: multiprocessing.process.BaseProcess) -> Optional[int]:
    """Stop a trial and every process it started (its own session): SIGTERM, then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # not yet its own group leader, or gone
            try:
                os.kill(proc.pid, sig)
            except ProcessLookupError:
                pass
        code = _wait(proc, wait)
        if code is not None:
            return code
    return None


def baseline_evidence(run_dir: Path) -> Optional[Evidence]:
    """What the trial's own bottleneck report reasoned from (None: the run wrote none)."""
    try:
        return evidence_files.read(run_dir)
    except (OSError, ValueError):
        return None


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
