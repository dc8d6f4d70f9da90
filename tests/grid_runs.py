"""Running compatibility-grid cells (trainkit.recipe.compatibility) for the tests: every cell that
`validate` accepts, and the reference each one's losses must follow, trained in as few launches as
possible -- one 2-rank torchrun launch for every 2-rank run and one plain process for every 1-process
reference, at the same time -- by `trainkit.runtime.cell_runner` (each run: train, resume, export).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

from run_helpers import env_for
from trainkit.recipe.compatibility.grid import LM_DATA, MODELS, STEPS, WORLD, Cell, tolerance
from trainkit.recipe.compatibility import declared_cells, statuses
from trainkit.recipe.compatibility.page import RESULTS, load_results

RUNNER = "trainkit.runtime.cell_runner"
RESUME_RTOL = 1e-6  # a resumed step redoes the same arithmetic on the same state: equal up to rounding


@dataclass
class Outcome:
    cell: Cell
    result: dict  # the cell's cell-result.json (or {"error": ...} when its launch left none)
    reference: Optional[dict]  # the reference run's result; None: the cell is its own reference


def run_grid(folder: Path, cells: list[Cell], *, timeout: float, device_env: Optional[dict] = None,
             nproc: int = WORLD) -> list[Outcome]:
    """Train `cells` and their references under `folder`; one Outcome per cell."""
    _write_corpus(folder)
    # one process trains many cells, so state one leaves behind meets the next: after a transformers
    # Llama bf16 step, a channels_last bf16 ResNet in the same process tripped the non-finite check
    # (not in a fresh process; torch 2.14.1 / transformers 5.24, unexplained). The Hugging Face family
    # runs last, where it meets no other family.
    cells = sorted(cells, key=lambda c: list(MODELS).index(c.model))
    by_ranks: dict[int, list[Path]] = {1: [], nproc: []}
    references: dict[str, Path] = {}
    plan = []
    for cell in cells:
        run_dir = _write_run(folder / "cells" / cell.recipe()["name"], cell.recipe())
        by_ranks[nproc].append(run_dir)
        recipe, ranks = cell.reference()
        ref_dir = None
        if _comparable(recipe) != _comparable(cell.recipe()):
            key = json.dumps(_comparable(recipe), sort_keys=True)
            if key not in references:
                references[key] = _write_run(folder / "references" / f"ref-{len(references):03d}", recipe)
                by_ranks[ranks].append(references[key])
            ref_dir = references[key]
        plan.append((cell, run_dir, ref_dir))
    _launch_all(folder, by_ranks, timeout, device_env or {})
    return [Outcome(cell, _result(run_dir), _result(ref_dir) if ref_dir else None) for cell, run_dir, ref_dir in plan]


def run_alone(folder: Path, cells: list[Cell], *, timeout: float, device_env: Optional[dict] = None) -> list[Outcome]:
    """Train `cells` each in one process (world size 1: a machine with one GPU) and check each on its
    own -- finite losses, no divergence, exact resume, export -- without a reference: one process
    exercises the device's kernels, precisions and options, not the collectives. Compile cells run
    last (each one compiles for tens of seconds), so a timeout cuts them first."""
    _write_corpus(folder)
    cells = sorted(cells, key=lambda c: (c.option == "compile", list(MODELS).index(c.model)))
    plan = [(cell, _write_run(folder / "cells" / cell.recipe()["name"],
                              {**cell.recipe(), "launch": {**cell.recipe()["launch"], "nproc_per_node": 1}}))
            for cell in cells]
    # DeepSpeed reads LOCAL_RANK, which only torchrun sets (a world of one runs without it)
    _launch_all(folder, {1: [run_dir for _, run_dir in plan]}, timeout, {"LOCAL_RANK": "0", **(device_env or {})})
    return [Outcome(cell, _result(run_dir), None) for cell, run_dir in plan]


def _comparable(recipe: dict) -> dict:
    return {k: v for k, v in recipe.items() if k != "name"}


def _write_run(run_dir: Path, recipe: dict) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "recipe.yaml").write_text(yaml.safe_dump({**recipe, "name": run_dir.name}, sort_keys=False))
    return run_dir


def _write_corpus(folder: Path) -> None:
    """The language models' corpus, written once here (both launches read it)."""
    from trainkit.recipe.blocks import TextData
    from trainkit.runtime.text_data import prepare

    cwd = os.getcwd()
    os.chdir(folder)
    try:
        prepare(TextData(**LM_DATA))
    finally:
        os.chdir(cwd)


def _launch_all(folder: Path, by_ranks: dict[int, list[Path]], timeout: float, device_env: dict,
                **spec: bool) -> None:
    """One launch per rank count, side by side; `spec`: the cell runner's options (resume, keep_checkpoints)."""
    env = env_for(folder, **device_env)
    procs = []
    for ranks, run_dirs in by_ranks.items():
        if not run_dirs:
            continue
        path = folder / f"cells-{ranks}.json"
        path.write_text(json.dumps({"run_dirs": [str(p) for p in run_dirs], **spec}))
        head = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                "--master_port", str(_free_port()), "-m"] if ranks > 1 else [sys.executable, "-m"]
        log = open(folder / f"cells-{ranks}.log", "w")
        procs.append((subprocess.Popen([*head, RUNNER, str(path)], cwd=folder, env=env, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True), log))
    for proc, log in procs:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        finally:
            log.close()


def _free_port() -> int:
    from run_helpers import free_port

    return free_port()


def _result(run_dir: Path) -> dict:
    path = run_dir / "cell-result.json"
    if not path.is_file():
        log = "\n".join(p.read_text()[-3000:] for p in sorted(run_dir.parent.parent.glob("cells-*.log")))
        return {"error": f"no result (its launch ended before it)\n{log}"}
    return json.loads(path.read_text())


def problems_of(outcome: Outcome) -> list[str]:
    """What is wrong with one cell's run (empty: verified)."""
    result, reference = outcome.result, outcome.reference
    if "refused" in result:  # by `trainkit run`'s preflight on this machine: a clear refusal, not a crash
        return []
    if "error" in result:
        return [result["error"]]
    losses = {int(k): v for k, v in result["losses"].items()}
    out = []
    if sorted(losses) != list(range(1, STEPS + 1)) or not all(math.isfinite(v) for v in losses.values()):
        return [f"losses {losses}"]
    if max(losses.values()) > 3 * losses[1]:
        out.append(f"diverges: {losses}")
    if reference is not None:
        if "error" in reference:
            return [f"its reference failed: {reference['error']}"]
        first, later, _ = tolerance(outcome.cell)
        ref = {int(k): v for k, v in reference["losses"].items()}
        for step in ref:
            tol = first if step == 1 else later
            off = abs(losses[step] - ref[step]) / abs(ref[step])
            if tol is not None and off > tol:
                out.append(f"loss {losses} differs from the reference's {ref} at step {step} by {off:.2e} relative "
                           f"(> {tol:g})")
                break
    resumed = {int(k): v for k, v in result["resumed_losses"].items()}
    if result["resumed_from"] != "step-00000002" or \
            any(abs(resumed[s] - losses[s]) > RESUME_RTOL * abs(losses[s]) for s in losses):
        out.append(f"resumed from {result['resumed_from']}: {resumed} instead of {losses}")
    if not (result["export"]["finite"] and result["export"]["checkpoint"] == f"step-{STEPS:08d}"):
        out.append(f"export: {result['export']}")
    return out


def record(outcomes: list[Outcome], failures: dict, *, kind: str, device: str, command: str) -> None:
    """Write each passing cell's outcome on this `kind` of device to docs/compatibility-results.json."""
    results = load_results()
    stamp = {"device": device, "date": datetime.date.today().isoformat(), "command": command}
    accepted = {s.cell.id for s in statuses(declared_cells()) if not s.refused}
    ran = {o.cell.id for o in outcomes}
    for cell in list(results):  # cells run again, or no longer declared or accepted, lose this kind's record
        if cell in ran or cell not in accepted:
            results[cell].pop(kind, None)
    for o in outcomes:
        if o.cell.id not in failures:
            outcome = {"result": "refused", "why": o.result["refused"]} if "refused" in o.result else \
                {"result": "verified", **({"retried_after": o.result["retried_after"]}
                                          if "retried_after" in o.result else {})}
            results.setdefault(o.cell.id, {})[kind] = {**outcome, **stamp}
    results = {cell: kinds for cell, kinds in sorted(results.items()) if kinds}
    RESULTS.write_text(json.dumps({"cells": results}, indent=1, sort_keys=True) + "\n")
