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
    # the 2-D cells, verified by tests/test_parallel_mesh_runs.py's 4-rank launch; not in another precision
    hsdp = verified.lookup("fsdp", "transformer", "fp32", {"dp_replicate": 2, "dp_shard": 4})
    assert hsdp.verified and hsdp.cell == "fsdp__transformer__fp32__none__seeded__dp_replicate-dp_shard"
    assert verified.lookup("fsdp", "transformer", "fp32", {"dp_shard": 2, "tp": 2}).verified
    hsdp_bf16 = verified.lookup("fsdp", "transformer", "bf16", {"dp_replicate": 2, "dp_shard": 4})
    assert hsdp_bf16.status == verified.MISSING and hsdp_bf16.cell.endswith("__bf16__none__seeded__dp_replicate-dp_shard")
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


def test_fsdp_across_nodes_gets_the_verified_hsdp_advice_and_tune_tries_it(tmp_path):
    """FSDP over 2 hosts x 2 ranks whose dp_shard collectives dominate the step: the bottleneck report
    offers HSDP 2 x 2 (shards within a host, replicas across), naming the matrix's verified cell, the
    global batch unchanged; `trainkit tune` tries it as a valid recipe on the new mesh."""
    path, recipe = _recipe(tmp_path, Cell("fsdp", "transformer", "fp32"), launch={"nproc_per_node": 2, "nnodes": 2})
    d = diagnose(_ranks(["node-a", "node-a", "node-b", "node-b"]), recipe, env={"device": "cpu", "backend": "gloo"},
                 mesh_comm=[_dims(dp_shard=45.0)] * 4)
    advice = d.changes()["parallel.dp_replicate"]
    assert advice.changes == {"parallel.dp_replicate": 2, "parallel.dp_shard": 2}  # 4 data-parallel ranks still
    assert advice.was == {"parallel.dp_replicate": 1, "parallel.dp_shard": 4}
    assert "fsdp__transformer__fp32__none__seeded__dp_replicate-dp_shard: verified" in advice.text
    assert "crosses nodes once per step" in advice.mechanism
    assert not any(e.startswith("mesh advice withheld") for e in d.evidence), d.evidence

    plan = tune_plan.advised(recipe, d, frozenset(), {"cuda": False})
    arm = next(a for a in plan.arms if "parallel.dp_replicate" in a.changes)
    trial = resolve(path, arm.overrides()).recipe
    assert (trial.parallel.dp_replicate, trial.parallel.dp_shard, trial.global_batch) == (2, 2, recipe.global_batch)


def test_unverified_mesh_change_is_never_offered_and_the_evidence_names_the_cell(tmp_path):
    # the same FSDP run in bf16: HSDP 2 x 2 in bf16 is accepted by validate but no run verified it
    _, recipe = _recipe(tmp_path, Cell("fsdp", "transformer", "bf16"), launch={"nproc_per_node": 2, "nnodes": 2})
    d = diagnose(_ranks(["node-a", "node-a", "node-b", "node-b"]), recipe, env={"device": "cpu", "backend": "gloo"},
                 mesh_comm=[_dims(dp_shard=45.0)] * 4)
    assert not any(k.startswith("parallel.") for a in d.advice for k in a.changes)
    line = next(e for e in d.evidence if e.startswith("mesh advice withheld: HSDP"))
    assert "fsdp__transformer__bf16__none__seeded__dp_replicate-dp_shard: not in the matrix" in line
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
    it will not fit, and among the changes are FSDP x tp 4 (the matrix's verified fsdp/transformer/fp32
    tp cell) and FSDP x tp 2 (dp_shard 2 x tp 2, the verified 2-D cell) with their figures, the global
    batch kept by accumulation; HSDP is not (one node). The doctor's memory check lists the same."""
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
    tp4 = float(line.split(": ")[1].split(" GiB")[0])
    line = next(line for line in plan.splitlines() if "parallel.tp=2" in line)
    assert "parallel.dp_shard=2" in line and "trainer.grad_accum_steps=2" in line, line
    assert tp4 < float(line.split(": ")[1].split(" GiB")[0]) < predicted, line  # 1/4 of the state each; tp 2 also gathers half a unit
    assert "fsdp__transformer__fp32__none__seeded__dp_shard-tp: verified" in line
    assert "dp_replicate=2" not in plan


def test_the_doctor_lists_fsdp_x_tp_2_where_the_matrix_verifies_it(tmp_path):
    """The doctor's memory check (the same recipe on one node of 4 ranks) offers FSDP x tp 2 on the
    verified 2-D cell; its plan gathers each rank's half of the largest unit (dp_shard 2, three copies: FSDP2), and tp 4's
    (dp_shard 1) gathers nothing."""
    from trainkit.doctor.resources import memory_verdict
    from trainkit.runtime.memory_trace import model_sizes

    _, recipe = _recipe(tmp_path, Cell("ddp", "transformer", "fp32"), launch={"nproc_per_node": 4},
                        model={"args": {"dim": 4096, "layers": 16, "heads": 4}})
    advice = {a.changes.get("parallel.tp"): a for a in memory_verdict(recipe).advice}
    assert "fsdp__transformer__fp32__none__seeded__dp_shard-tp: verified" in advice[2].text, advice[2].text
    assert advice[2].changes["parallel.dp_shard"] == 2 and advice[2].changes["strategy.name"] == "fsdp"
    unit = model_sizes(recipe).largest_unit
    gathered = {p.name: p.bytes for p in advice[2].plan.parts}["gathered unit"]
    assert gathered == 3 * (unit // 2) * 4  # parameters, whole gradients, reduce-scatter input (FSDP2)
    assert "gathered unit" not in {p.name for p in advice[4].plan.parts}


def test_the_plan_of_a_tp_recipe_gathers_each_ranks_slice(tmp_path):
    """`trainkit plan`'s own arithmetic for a recipe with tensor parallel: FSDP x tp 2 over dp_shard 2
    gathers 1/2 of the largest unit, and on dp_shard 1 (tp alone) FSDP gathers nothing (it used to
    count the whole unit in both: the mesh alternatives alone corrected it)."""
    from trainkit.recipe.memory_plan import plan, setting_of
    from trainkit.runtime.memory_trace import model_sizes

    def parts(parallel: dict, ranks: int) -> dict[str, int]:
        _, recipe = _recipe(tmp_path, Cell("fsdp", "transformer", "fp32"), parallel=parallel,
                            launch={"nproc_per_node": ranks}, model={"args": {"dim": 256, "layers": 2, "heads": 4}})
        return {p.name: p.bytes for p in plan(model_sizes(recipe), setting_of(recipe, "cpu")).parts}, recipe

    two_d, recipe = parts({"dp_shard": 2, "tp": 2}, 4)
    assert two_d["gathered unit"] == 3 * (model_sizes(recipe).largest_unit // 2) * 4
    tp_alone, _ = parts({"dp_shard": 1, "tp": 2}, 2)
    assert "gathered unit" not in tp_alone and tp_alone["parameters"] == two_d["parameters"] * 2


def test_the_mesh_alternatives_of_an_offloading_fsdp_recipe_keep_its_offload(tmp_path):
    """An FSDP recipe with cpu_offload keeps it on the proposed mesh (the changes touch only parallel.* and
    accumulation), so the alternative's plan must too: its parameters stay host memory, not device memory
    (before, the alternatives planned FSDP's defaults whatever the recipe's options)."""
    from trainkit.recipe.memory_mesh import mesh_alternatives
    from trainkit.recipe.memory_plan import setting_of
    from trainkit.runtime.memory_trace import model_sizes

    _, recipe = _recipe(tmp_path, Cell("fsdp+cpu_offload", "transformer", "fp32"), launch={"nproc_per_node": 4},
                        model={"args": {"dim": 1024, "layers": 4, "heads": 4}})
    assert recipe.strategy.cpu_offload
    s = setting_of(recipe, "cuda")
    everything_verified = lambda *_: type("V", (), {"verified": True, "text": lambda self: "verified"})()  # noqa: E731
    alternatives = mesh_alternatives(recipe, model_sizes(recipe), s, 1 << 50, verdict=everything_verified)
    assert alternatives, "no mesh alternative was planned"
    for a in alternatives:
        where = {p.name: p.where for p in a.plan.parts}
        assert where["parameters"] == "host", (a.changes, where)


def test_a_recipe_maps_to_the_grid_cell_of_its_option_values(tmp_path):
    """Full checkpointing is the checkpointing-full cell, not also the selective one (both differ from a
    recipe without checkpointing), and compile with full checkpointing is the compile+checkpointing cell:
    each recipe finds its own cell's verdict instead of none."""
    for cell in (Cell("ddp", "transformer", "fp32", "checkpointing-full"),
                 Cell("ddp", "transformer", "fp32", "checkpointing-selective"),
                 Cell("fsdp", "transformer", "fp32", "compile+checkpointing"), Cell("ddp", "mlp", "fp32", "compile"),
                 Cell("ddp", "transformer", "fp32", "none")):
        assert verified.axes_of(_recipe(tmp_path, cell)[1])["option"] == cell.option, cell
    tp = Cell("fsdp", "transformer", "fp32", "compile+checkpointing", mesh="tp")
    assert verified.verdict_for(_recipe(tmp_path, tp)[1], {"tp": 2}).status == verified.VERIFIED
