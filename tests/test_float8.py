"""performance.float8 (issue 40, item 2): the model's Linear layers compute in float8 through torchao's
float8 training, inside bf16 autocast. torch's CPU has a float8 matmul (`torch._scaled_mm`), so the
runs here use the same torchao code path as a GPU, only slower; what the GPU adds (speed, the
compute-capability check) is the GPU tier's.

Checked: which layers convert (not the output head, not a dimension the float8 kernels cannot take),
the refusals `validate` names, and 2-rank DDP and FSDP runs of the built-in transformer whose losses
follow the bf16 run's within float8's rounding and whose checkpoints resume.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lm_runs import tiny_lm
from run_helpers import write_recipe
from trainkit.recipe.problems import RecipeError
from trainkit.recipe.resolver import resolve
from trainkit.runtime.performance import convert_to_float8, float8_linears

# dims that float8's kernels take (multiples of 16); the tiny LM preset's 32-wide model with a SwiGLU of 96
FLOAT8_LM = {"name": "transformer", "args": {"vocab_size": 320, "dim": 64, "layers": 2, "heads": 4, "seq_len": 32},
             "init": "seeded"}


def test_every_linear_but_the_head_and_odd_sizes_converts_and_keeps_its_parameter_names():
    from trainkit.models.transformer import transformer

    model = transformer(vocab_size=320, dim=64, layers=2, heads=4, seq_len=16)
    before = sorted(n for n, _ in model.named_parameters())
    converted = convert_to_float8(model)
    assert len(converted) == 14 and "output" not in converted  # 7 Linear per block; the head stays
    assert all(type(model.get_submodule(n)).__name__ == "Float8Linear" for n in converted)
    assert type(model.output) is nn.Linear
    assert sorted(n for n, _ in model.named_parameters()) == before  # checkpoints load either way
    odd = nn.Sequential(nn.Linear(48, 64), nn.Linear(64, 20), nn.Linear(20, 64), nn.Linear(64, 4))
    assert float8_linears(odd) == ["0"]  # 20 is no multiple of 16; the last Linear is the head


def _findings(tmp_path, **sections) -> list[str]:
    """What `validate` says of the tiny LM preset with `sections` (an empty list: accepted)."""
    path = write_recipe(tmp_path, "f8", tiny_lm({"files": ["x.txt"], "tokenizer": "t.json"}), **sections)
    try:
        resolve(path)
    except RecipeError as exc:
        return str(exc).splitlines()
    return []


def test_validate_names_what_float8_cannot_combine_with(tmp_path):
    accepted = _findings(tmp_path, precision="bf16", performance={"float8": True})
    assert not [m for m in accepted if "float8" in m], accepted
    fp32 = _findings(tmp_path, performance={"float8": True})
    assert any("float8" in m and "precision is fp32" in m and "precision: bf16" in m for m in fp32), fp32
    zero = _findings(tmp_path, precision="bf16", performance={"float8": True},
                     strategy={"name": "deepspeed", "zero_stage": 2})
    assert any("float8 is not supported by strategy deepspeed" in m for m in zero), zero


@pytest.mark.distributed
def test_ddp_and_fsdp_float8_follow_the_bf16_run_and_resume(tmp_path, corpus):
    """Three 2-rank runs of 6 steps (checkpoint at 3) in one launch (tests/cell_launch.py): bf16 under FSDP,
    bf16 + float8 under DDP and under FSDP. float8 rounds each matmul's inputs to 3 mantissa bits with a
    per-tensor scale, so the losses follow bf16's closely, not exactly (measured: 0.5e-4 to 9e-4 relative;
    bound 1e-2); each run then resumes from step 3 in a model built afresh and redoes steps 4-6 as they
    ran. Under FSDP the float8 linears' weights are all-gathered in float8: the bytes each rank sends
    into FSDP's all-gathers per step, counted in both FSDP runs, fall to about two thirds (the 14 float8
    weights at 1 byte instead of 2; the embedding, the head and the norms stay bf16)."""
    import json

    from cell_launch import train_cells

    preset = {**tiny_lm(corpus), "model": FLOAT8_LM, "precision": "bf16",
              "optimizer": {"name": "adamw", "lr": 3e-3},
              "trainer": {"max_steps": 6, "log_every": 1, "checkpoint": {"every": 3, "keep": 3}}}
    runs = {"bf16": ("fsdp", {}), "f8-ddp": ("ddp", {"float8": True}), "f8-fsdp": ("fsdp", {"float8": True})}
    recipes = {name: {**preset, "strategy": {"name": strategy}, "performance": perf}
               for name, (strategy, perf) in runs.items()}
    counts = tmp_path / "collectives"
    counts.mkdir()
    results = train_cells(tmp_path, recipes, timeout=300, TRAINKIT_FAULT_COUNT_COLLECTIVES=str(counts))
    log = results["bf16"]["log"]
    assert log.count("float8: 14 of 15 Linear layers compute in float8") == 4, log[-3000:]  # 2 runs, each resumed
    trained = {name: [r["losses"][str(step)] for step in range(1, 7)] for name, r in results.items()}
    reference = trained["bf16"]
    for name in ("f8-ddp", "f8-fsdp"):
        got = trained[name]
        assert got != reference  # the matmuls did run in float8
        for step, (a, b) in enumerate(zip(got, reference), 1):
            assert abs(a - b) <= 1e-2 * abs(b), (name, step, got, reference)
        assert got[-1] < got[0]
    for name, result in results.items():
        assert result["resumed_from"] == "step-00000003", result
        again = [result["resumed_losses"][str(step)] for step in range(4, 7)]
        assert again == pytest.approx(trained[name][3:], rel=1e-6), (name, again, trained[name])
    # rank 0's rows, appended run after run; an FSDP run's step 2 (a whole step, forward and backward) comes
    # once, in its training (each resume starts at step 4): bf16, then float8 (DDP's rows count no all-gather)
    rows = [json.loads(line) for line in (counts / "collectives-rank0.jsonl").read_text().splitlines()]
    second = [row["all_gather_bytes"] for row in rows if row["step"] == 2 and "all_gather_bytes" in row]
    assert len(second) == 2, rows
    assert 0.55 < second[1] / second[0] < 0.8, second  # 1.0 when gathered in bf16
    # the float8 weights' checkpoint is plain tensors: `trainkit export` writes what torch.load reads safely
    from trainkit.models.transformer import transformer
    from trainkit.runtime.export import export

    export(results["f8-fsdp"]["run_dir"] / "checkpoints" / "step-00000006", tmp_path / "f8.pt")
    transformer(**FLOAT8_LM["args"]).load_state_dict(torch.load(tmp_path / "f8.pt", weights_only=True))
