"""Running compatibility-grid cells (trainkit.recipe.compatibility) for the tests: every cell that
`validate` accepts, and the reference each one's losses must follow, trained in as few launches as
possible -- one 2-rank torchrun launch for every 2-rank run and one plain process for every 1-process
reference, at the same time -- by `trainkit.runtime.cell_runner` (each run: train, resume, export).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

from run_helpers import env_for
from trainkit.recipe.compatibility.grid import LM_DATA, WORLD, Cell

RUNNER = "trainkit.runtime.cell_runner"


@dataclass
class Outcome:
    cell: Cell
    result: dict  # the cell's cell-result.json (or {"error": ...} when its launch left none)
    reference: Optional[dict]  # the reference run's result; None: the cell is its own reference


def run_grid(folder: Path, cells: list[Cell], *, timeout: float, device_env: Optional[dict] = None,
             nproc: int = WORLD) -> list[Outcome]:
    """Train `cells` and their references under `folder`; one Outcome per cell."""
    _write_corpus(folder)
    by_ranks: dict[int, list[Path]] = {1: [], nproc: []}
    references: dict[str, Path] = {}
    plan = []
    for cell in cells:
        run_dir = _write_run(folder / "cells" / cell.id, cell.recipe())
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


def _launch_all(folder: Path, by_ranks: dict[int, list[Path]], timeout: float, device_env: dict) -> None:
    env = env_for(folder, **device_env)
    procs = []
    for ranks, run_dirs in by_ranks.items():
        if not run_dirs:
            continue
        spec = folder / f"cells-{ranks}.json"
        spec.write_text(json.dumps({"run_dirs": [str(p) for p in run_dirs]}))
        head = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                "--master_port", str(_free_port()), "-m"] if ranks > 1 else [sys.executable, "-m"]
        log = open(folder / f"cells-{ranks}.log", "w")
        procs.append((subprocess.Popen([*head, RUNNER, str(spec)], cwd=folder, env=env, stdout=log,
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
