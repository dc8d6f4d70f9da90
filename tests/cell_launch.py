"""A few named recipes trained in one torchrun launch of `trainkit.runtime.cell_runner` (train, resume
from the checkpoint before the last, export each): one import of torch and DeepSpeed for all of them.
Shared by the tests that train several recipes and check what each run left (losses, checkpoints,
counts): one launch instead of one each (~4.5 s of start-up apiece on 2 cores)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from run_helpers import env_for, free_port


def train_cells(folder: Path, recipes: dict[str, dict], *, timeout: float, resume: bool = True, nproc: int = 2,
                **env: str) -> dict[str, dict]:
    """Each recipe (by name) in folder/runs/NAME, all in one launch of `nproc` ranks; name -> its
    cell-result.json (with `run_dir` and the launch's `log` added). Checkpoints are kept for the test to
    inspect. With `resume` False each run is only trained (no resume, no export)."""
    run_dirs = []
    for name, recipe in recipes.items():
        run_dir = folder / "runs" / name
        run_dir.mkdir(parents=True)
        recipe = {**recipe, "name": name, "launch": {**recipe.get("launch", {}), "run_dir": str(folder / "runs")}}
        (run_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
        run_dirs.append(run_dir)
    spec = folder / "cells.json"
    spec.write_text(json.dumps({"run_dirs": [str(p) for p in run_dirs], "keep_checkpoints": True, "resume": resume}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), "-m", "trainkit.runtime.cell_runner", str(spec)]
    log_path = folder / f"cells-{nproc}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=folder, env=env_for(folder, **env), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log = log_path.read_text()
    results = {}
    for run_dir in run_dirs:
        path = run_dir / "cell-result.json"
        assert path.is_file(), f"{run_dir.name}: no result (launch timed out or crashed)\n{log[-4000:]}"
        results[run_dir.name] = {**json.loads(path.read_text()), "run_dir": run_dir, "log": log}
        assert "error" not in results[run_dir.name], results[run_dir.name]["error"] + log[-4000:]
    return results
