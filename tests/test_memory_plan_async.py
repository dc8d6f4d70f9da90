"""The memory plan counts `trainer.checkpoint.async_save`'s staged copy (issue 28).

DCP's default stager copies every tensor of a rank's state dict into new, unpinned host memory and
holds it until the background write is done, through the steps after the save. `trainkit plan` shows
it as its own line, host memory, sized as the rank holds its state: FSDP's shards, DDP's whole copy
(docs/memory.md; measured in docs/benchmarks.md, "Memory plan").
"""

from __future__ import annotations

import re

import pytest

from run_helpers import mlp_recipe

GiB = 1 << 30
MLP = {"name": "mlp", "args": {"in_features": 1024, "hidden": 4096, "depth": 3, "num_classes": 10}}
PARAMS = 1024 * 4096 + 4096 + 2 * (4096 * 4096 + 4096) + 4096 * 10 + 10


def planned(tmp_path, capsys, strategy: str, async_save: bool) -> tuple[str, object]:
    from trainkit.cli import main
    from trainkit.recipe import resolve
    from trainkit.recipe.memory_plan import plan, setting_of
    from trainkit.runtime.memory_trace import model_sizes

    path = mlp_recipe(tmp_path, f"{strategy}-{async_save}", model=MLP, strategy={"name": strategy},
                      optimizer={"name": "adamw", "lr": 1e-3}, data={"shape": [1024], "num_classes": 10},
                      trainer={"max_steps": 4, "checkpoint": {"every": 2, "async_save": async_save}})
    assert main(["plan", str(path)]) == 0
    recipe = resolve(path).recipe
    return capsys.readouterr().out, plan(model_sizes(recipe), setting_of(recipe, "cpu"))


def per_rank_gib(text: str) -> float:
    return float(re.search(r"memory per rank: ([\d.]+) GiB", text).group(1))


@pytest.mark.parametrize("strategy, shards", [("fsdp", 2), ("ddp", 1)])
def test_plan_counts_the_staged_checkpoint_copy_of_async_save(tmp_path, capsys, strategy, shards):
    text, with_staging = planned(tmp_path, capsys, strategy, async_save=True)
    sync_text, without = planned(tmp_path, capsys, strategy, async_save=False)
    state = PARAMS * 4 // shards + PARAMS * 2 * 4 // shards  # parameters + AdamW's two moments, as this rank holds them
    staged = [p for p in with_staging.parts if p.name == "checkpoint staging"]
    assert len(staged) == 1 and staged[0].where == "host", with_staging.parts
    assert staged[0].bytes == state
    assert with_staging.per_rank == without.per_rank + state
    line = next(line for line in text.splitlines() if "checkpoint staging:" in line)
    assert "async_save" in line and "parameters + optimizer state" in line, line
    assert "checkpoint staging" not in sync_text
    assert per_rank_gib(text) == pytest.approx(per_rank_gib(sync_text) + state / GiB, abs=0.011)
