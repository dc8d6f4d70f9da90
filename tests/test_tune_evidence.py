"""`trainkit tune` reasons from the same evidence as the run's own report (issue 24): the baseline
trial's files give tune the device, backend, wall times, GPU busy and global batch the worker
diagnosed with, so tune's advice is the report's advice, and the knobs it tries are the recipe
changes that advice proposes. In-process: the worker's report writer on fabricated measurements,
no process is launched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainkit.analysis import evidence
from trainkit.analysis.bottleneck import diagnose_evidence
from trainkit.launch import tune, tune_plan, tune_trials
from trainkit.recipe import resolve
from trainkit.runtime import reports

REPO = Path(__file__).resolve().parent.parent
DDP_MLP = str(REPO / "recipes" / "ddp-mlp.yaml")


def per_rank(n=2, *, total=0.100, data_wait=0.010, forward=0.020, optimizer=0.005, comm=0.050, exposed=0.030):
    """2 ranks: data wait 10% of the step (visible), 30% of it waiting for exposed communication."""
    return [{"rank": r, "host": "node-a", "steps": 20, "total": total, "data_wait": data_wait, "forward": forward,
             "compute": total - data_wait - optimizer, "optimizer": optimizer,
             "backward": total - data_wait - optimizer - forward, "comm": comm, "comm_exposed": exposed}
            for r in range(n)]


class _Wall:
    """What the loop hands the report writer (runtime.loop.WallTimes), reduced to what it reads."""

    loop_end = None
    shutdown_s = 0.0

    def as_dict(self, now):
        return {"wall_s": 10.0, "train_s": 9.0, "eval_s": 0.0, "checkpoint_s": 0.0, "logging_s": 0.2,
                "startup_s": 0.7, "shutdown_s": 0.1, "evals": 0, "checkpoints": 0, "steps": 20}


@pytest.fixture
def gpu_run(tmp_path, monkeypatch):
    """A finished baseline trial's run directory as the worker leaves it, on a CUDA/NCCL machine
    (ddp-mlp with data.num_workers=2, the recipe of the seen defect), and that recipe."""
    monkeypatch.setattr(reports.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(reports.dist, "get_backend", lambda: "nccl")
    recipe = resolve(DDP_MLP, ["data.num_workers=2"]).recipe
    run_dir = tmp_path / "run"
    (run_dir / "reports").mkdir(parents=True)
    (run_dir / "reports" / "gpu.json").write_text(json.dumps({"busy_percent": 91.0}))
    summary = {"per_rank_times": per_rank(), "steps": 20, "world_size": 2, "global_batch": 64, "device": "cuda",
               "wall_times": _Wall()}
    reports.write_reports(run_dir, recipe, summary)
    return run_dir, recipe


def test_tune_diagnoses_the_baseline_from_the_evidence_the_worker_used(gpu_run):
    run_dir, recipe = gpu_run
    seen = tune_trials.baseline_evidence(run_dir)  # what tune reads from its baseline trial
    assert seen == evidence.read(run_dir)  # the worker's report is diagnosed from this same reader
    assert seen.env["device"] == "cuda" and seen.env["backend"] == "nccl"
    assert seen.gpu == {"busy_percent": 91.0} and seen.wall["wall_s"] == 10.0 and seen.global_batch == 64
    worker = json.loads((run_dir / "reports" / "verdict.json").read_text())
    assert diagnose_evidence(seen, recipe).summary() == worker  # same evidence, same recipe: the same advice
    assert {"data.pin_memory", "strategy.comm_hook"} <= {next(iter(a["changes"]), None) for a in worker["advice_data"]}


def test_gpu_evidence_points_tune_at_the_pin_memory_and_comm_hook_knobs(gpu_run):
    run_dir, recipe = gpu_run
    seen = tune_trials.baseline_evidence(run_dir)
    diagnosis, facts = diagnose_evidence(seen, recipe), tune_plan.machine_facts(seen)
    assert facts == {"cuda": True}  # where the trials ran, not where tune runs
    plan = tune_plan.advised(recipe, diagnosis, frozenset({"precision"}), facts)
    arms = {arm.knob.name: arm for arm in plan.arms}
    assert {"pin_memory", "comm_hook"} <= set(arms), (sorted(arms), plan.skipped)
    assert arms["comm_hook"].changes == {"strategy.comm_hook": "bf16_compress"}  # the advised value (NCCL)
    without = tune_plan.advised(recipe, diagnosis, frozenset(), facts)
    assert ("comm_hook", "changes the training (precision): tried only with --allow precision") in without.skipped


def test_knobs_tune_drops_are_listed_in_its_report_with_the_reason(gpu_run, tmp_path, capsys):
    from test_tune_plan import ScriptedRunner

    run_dir, recipe = gpu_run
    overrides = ["data.num_workers=2", f"launch.run_dir={tmp_path / 'runs'}", "tracking.enabled=false"]
    out = tmp_path / "tuned.yaml"
    options = tune.Options(budget_s=600, steps=12, knobs=None, out=out, allow=frozenset())
    runner = ScriptedRunner(DDP_MLP, overrides, {("data.pin_memory", True): 1.2},
                            evidence=tune_trials.baseline_evidence(run_dir))
    assert tune.Tuner(resolve(DDP_MLP, overrides), DDP_MLP, overrides, options, runner=runner).run() == 0
    text = (tmp_path / "tuned.report.md").read_text()
    assert "Baseline diagnosis: **communication-bound**" in text
    assert "| pin_memory=true |" in text and "Result: **pin_memory=true**" in text
    assert "- comm_hook: changes the training (precision): tried only with --allow precision" in text
    assert "- trainer.grad_accum_steps: advised (raise trainer.grad_accum_steps from 1 to 4), but no tune knob " \
           "sets trainer.grad_accum_steps" in text
    assert "Not pointed at by the baseline's advice (name them with --knobs to try them): " in text
    assert "batch_size" in text.split("Not pointed at")[1]
    assert "skipped comm_hook" in capsys.readouterr().out  # and on the console as it happens


def test_a_trial_whose_process_cannot_start_is_a_failed_trial_with_the_reason(tmp_path, monkeypatch):
    """The forkserver the trials fork from can fail to start (a plugin that raises on import) or die: the
    trial is reported failed with the reason, as a trial that exits non-zero is, never a traceback."""
    from types import SimpleNamespace

    from trainkit.launch.tune_plan import Arm

    def cannot_start(*args, **kwargs):
        raise EOFError("the forkserver closed its socket")

    monkeypatch.setattr(tune_trials, "_start", cannot_start)
    recipe = SimpleNamespace(name="r", monitors=[], task=None, data=None, strategy=None,
                             model=SimpleNamespace(name="mlp"), tracking=SimpleNamespace(enabled=False))
    runner = tune_trials.TrialRunner(SimpleNamespace(raw={}, recipe=recipe), "r.yaml", [], 5, tmp_path, None)
    trial = runner.run(1, Arm("baseline"), timeout=10)
    assert trial.samples_per_s is None and trial.code == 1
    assert "could not start the trial's process (EOFError: the forkserver closed its socket)" in trial.error
