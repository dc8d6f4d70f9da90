"""Mesh advice (issue 30): the bottleneck report, `trainkit tune` and the doctor's memory plan offer a
`parallel.*` change only where the compatibility matrix verifies the resulting combination
(trainkit/recipe/compatibility/verified.py, the real docs/compatibility-results.json); otherwise the
evidence names the missing cell. In-process: advice from recorded evidence dicts, tune's plan from it."""

from __future__ import annotations

from pathlib import Path

import yaml

from trainkit.analysis.bottleneck import diagnose
from trainkit.analysis.mesh_advice import mesh_advice
from trainkit.launch import tune_plan
from trainkit.recipe import resolve
from trainkit.recipe.compatibility import verified
from trainkit.recipe.compatibility.grid import Cell, merge


def _recipe(tmp_path: Path, cell: Cell, **extra):
    path = tmp_path / f"{cell.id.replace('+', '-')}.yaml"
    path.write_text(yaml.safe_dump(merge(cell.recipe(), extra), sort_keys=False))
    return path, resolve(path).recipe


def _ranks(hosts: list[str]) -> list[dict]:
    return [{"rank": r, "host": h, "steps": 20, "total": 0.100, "data_wait": 0.002, "forward": 0.030,
             "backward": 0.040, "optimizer": 0.005} for r, h in enumerate(hosts)]


def _dims(**ms) -> list[dict]:
    return {d: {"s": v / 1000, "bytes": 1e6, "count": 10, "untimed": 0} for d, v in ms.items()}


def test_the_matrix_answers_verified_refused_or_missing():
    tp = verified.lookup("fsdp", "transformer", "fp32", {"dp_shard": 1, "tp": 2})
    assert tp.verified and tp.cell == "fsdp__transformer__fp32__none__seeded__tp"
    refused = verified.lookup("ddp", "transformer", "fp32", {"dp_shard": 1, "tp": 2})
    assert refused.status == verified.REFUSED and "does not lay ranks out on tp" in refused.reason
    hsdp = verified.lookup("fsdp", "transformer", "fp32", {"dp_replicate": 2, "dp_shard": 4})
    assert hsdp.status == verified.MISSING and hsdp.cell.endswith("__dp_replicate-dp_shard")
    # numbers do not make a cell: tp 4 is the tp cell; dp_shard alone is the strategy's own layout
    assert verified.mesh_name({"dp_shard": 1, "tp": 4}) == "tp" and verified.mesh_name({"dp_shard": 8}) == "none"


def test_tp_costliest_gets_verified_mesh_advice_and_tune_tries_it(tmp_path):
    path, recipe = _recipe(tmp_path, Cell("fsdp", "transformer", "fp32", mesh="tp"))  # tp 2 on 2 ranks
    d = diagnose(_ranks(["node-a", "node-a"]), recipe, env={"device": "cpu", "backend": "gloo"},
                 mesh_comm=[_dims(tp=40.0, dp_shard=2.0)] * 2)
    advice = d.changes()["parallel.tp"]
    assert advice.changes == {"parallel.tp": 1, "parallel.dp_shard": 2, "data.batch_size": 2}  # same global batch
    assert advice.was["parallel.tp"] == 2 and advice.evidence["comm_tp_ms"] == 40.0
    assert "fsdp__transformer__fp32__none__seeded: verified" in advice.text
    assert "nothing to overlap them" in advice.mechanism

    plan = tune_plan.advised(recipe, d, frozenset(), {"cuda": False})
    arm = next(a for a in plan.arms if "parallel.tp" in a.changes)
    trial = resolve(path, arm.overrides()).recipe  # what the trial runs: a valid recipe on the new mesh
    assert (trial.parallel.tp, trial.parallel.dp_shard, trial.global_batch) == (1, 2, recipe.global_batch)


def test_unverified_mesh_change_is_never_offered_and_the_evidence_names_the_cell(tmp_path):
    # FSDP over 2 nodes x 2 ranks, dp_shard's collectives dominate: HSDP 2 x 2 is not a matrix cell
    _, recipe = _recipe(tmp_path, Cell("fsdp", "transformer", "fp32"), launch={"nproc_per_node": 2, "nnodes": 2})
    d = diagnose(_ranks(["node-a", "node-a", "node-b", "node-b"]), recipe, env={"device": "cpu", "backend": "gloo"},
                 mesh_comm=[_dims(dp_shard=45.0)] * 4)
    assert not any(k.startswith("parallel.") for a in d.advice for k in a.changes)
    line = next(e for e in d.evidence if e.startswith("mesh advice withheld: HSDP"))
    assert "fsdp__transformer__fp32__none__seeded__dp_replicate-dp_shard: not in the matrix" in line
    plan = tune_plan.advised(recipe, d, frozenset(), {"cuda": False})
    assert not any(k.startswith("parallel.") for a in plan.arms for k in a.changes)


def test_hsdp_advice_shape_where_the_matrix_verifies_it(tmp_path):
    _, recipe = _recipe(tmp_path, Cell("fsdp", "transformer", "fp32"), launch={"nproc_per_node": 4, "nnodes": 2})
    facts = {"comm_costliest_dim": "dp_shard", "comm_dp_shard_ms": 50.0}
    asked = []

    def matrix(r, degrees):
        asked.append(degrees)
        return verified.Verdict(verified.VERIFIED, "hsdp-cell", "verified on cpu")

    (advice,), withheld = mesh_advice(recipe, _ranks(["a"] * 4 + ["b"] * 4), facts, 0.1, verdict=matrix)
    assert advice.changes == {"parallel.dp_replicate": 2, "parallel.dp_shard": 4} and not withheld
    assert asked == [{"pp": 1, "dp_replicate": 2, "dp_shard": 4, "tp": 1}]
    assert "crosses nodes once per step" in advice.mechanism


def test_a_recipe_that_does_not_fit_gets_verified_mesh_alternatives_with_figures(tmp_path, capsys):
    """`trainkit plan` of a 3.2 B-parameter transformer under DDP on 4 ranks (traced on the meta device):
    it will not fit, and among the changes is FSDP x tp 4 (the matrix's verified fsdp/transformer/fp32
    tp cell) with its figure, the global batch kept by accumulation; tp 2 (dp_shard 2 x tp 2, a mesh no
    cell verifies) is not offered."""
    from trainkit.cli import main

    path, _ = _recipe(tmp_path, Cell("ddp", "transformer", "fp32"), launch={"nproc_per_node": 4},
                      model={"args": {"dim": 4096, "layers": 16, "heads": 4}})
    assert main(["plan", str(path)]) == 0
    plan = capsys.readouterr().out
    assert "WILL NOT FIT" in plan, plan
    predicted = float(plan.split("memory per rank: ")[1].split(" GiB")[0])
    line = next(line for line in plan.splitlines() if "parallel.tp=4" in line)
    assert "strategy.name=fsdp" in line and "parallel.dp_shard=1" in line and "trainer.grad_accum_steps=4" in line
    assert float(line.split(": ")[1].split(" GiB")[0]) < predicted / 3, line  # each rank holds 1/4 of every layer
    assert "fsdp__transformer__fp32__none__seeded__tp: verified" in line
    assert "parallel.tp=2" not in plan and "dp_replicate=2" not in plan
