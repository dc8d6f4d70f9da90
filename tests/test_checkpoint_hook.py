"""Monitors' `on_checkpoint(step, path)` gets a checkpoint that exists, also under
`trainer.checkpoint.async_save` (issue 28): a background save is written into `.tmp-step-N` and renamed
to `step-N` only when sealed, so the hook is called once it is sealed (the next save's wait, or the
run's last save) with the final folder. Before, it was called as the write began, with a path that did
not exist yet.

A plugin monitor, installed as a real distribution (dist-info with its entry point), records each
call's step, path and whether the path was a complete checkpoint at that moment; the step-2 write is
made 1 s slow so that it is still in flight when the loop goes on.
"""

from __future__ import annotations

import json
import os

import pytest

from run_helpers import mlp_recipe, trainkit

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)


MONITOR = '''
import json
from typing import ClassVar, Literal
from trainkit.monitors.base import Monitor
from trainkit.recipe.blocks import MonitorOptions


class CheckpointSeenOptions(MonitorOptions):
    component: ClassVar[str] = "checkpoint_seen:CheckpointSeen"
    name: Literal["checkpoint_seen"]


class CheckpointSeen(Monitor):
    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.calls = []

    def on_checkpoint(self, step, path):
        self.calls.append({"step": step, "path": str(path), "sealed": (path / "meta.json").is_file()})

    def close(self):
        out = self.ctx.run_dir / f"checkpoint-calls-rank{self.ctx.rank}.json"
        out.write_text(json.dumps(self.calls))
'''


@pytest.fixture
def site(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "checkpoint_seen.py").write_text(MONITOR)
    info = site / "trainkit_checkpoint_seen-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: trainkit-checkpoint-seen\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[trainkit.monitors]\ncheckpoint_seen = checkpoint_seen:CheckpointSeenOptions\n")
    return site


@pytest.mark.parametrize("async_save", [True, False], ids=["background", "synchronous"])
def test_on_checkpoint_gets_the_sealed_folder(tmp_path, site, async_save):
    recipe = mlp_recipe(tmp_path, "hooked", strategy={"name": "ddp"}, launch={"nproc_per_node": 1},
                        trainer={"max_steps": 4, "log_every": 1,
                                 "checkpoint": {"every": 2, "keep": 3, "async_save": async_save}},
                        monitors=[{"name": "checkpoint_seen"}])
    result = trainkit(tmp_path, "run", str(recipe), TRAINKIT_FAULT_SLOW_CHECKPOINT="step=2,s=1",
                      PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    assert result.returncode == 0, result.output[-4000:]
    run_dir = tmp_path / "runs" / "hooked"
    calls = json.loads((run_dir / "checkpoint-calls-rank0.json").read_text())
    folders = [run_dir / "checkpoints" / f"step-{s:08d}" for s in (2, 4)]
    assert calls == [{"step": s, "path": str(f), "sealed": True} for s, f in zip((2, 4), folders)], calls
    assert all(f.is_dir() for f in folders)
